"""A dispatched request's life on its worker: dispatched, first byte, released, finished.

The proxy (gateway/proxy.py) picks a worker and the relay (gateway/relay.py) streams its answer;
both report what happened here, and nothing here calls back into either or into the walk
(gateway/app.py). One object owns what a dispatch changes: the worker's in-flight count and
queued-prefill estimate (what routing reads), the policy's own learning (`on_dispatch`,
`on_prefill_done`), the worker's passive health, the slot admission waits for, the settlement,
and the request's metrics and log line. `Gateway.start` builds it with those parts;
`Gateway.apply` reconfigures it on a reload.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from gateway.call import Call
from gateway.logs import log_fields
from gateway.metrics import GatewayMetrics
from gateway.settlement import Settlement
from scoring.policy import Policy
from scoring.views import Decision
from workers.probe import Prober
from workers.registry import Registry
from workers.worker import Health, Worker

if TYPE_CHECKING:
    from gateway.admission import AdmissionController
    from gateway.relay import RelayResponse

log = logging.getLogger("kvgate.proxy")
reqlog = logging.getLogger("kvgate.request")

REJECTED = "rejected"  # the request line's outcome for a request refused before any worker
_MODEL_LOGGED = 256  # a refused request's model is the client's string, unchecked: capped


class Refused:
    """A request refused before any worker was picked for it, as the request line reads it (the
    fields of a `Call` that `request_line` reads): built only on refusals."""

    __slots__ = ("client_request_id", "model", "path", "request_id", "status", "stream")
    worker = None
    outcome = REJECTED
    attempts = 0
    ttft = None
    t_sent = 0.0
    t_start = 0.0
    usage = None

    def __init__(
        self,
        request_id: str,
        client_request_id: str | None,
        model: str | None,
        path: str,
        status: int,
        stream: bool | None,
    ) -> None:
        if model is not None and len(model) > _MODEL_LOGGED:  # the client's, unchecked
            model = model[:_MODEL_LOGGED]
        self.request_id = request_id
        self.client_request_id = client_request_id
        self.model = model
        self.path = path
        self.status = status
        self.stream = stream


def request_line(call: Call | Refused, e2e: float, error: str | None) -> dict[str, object]:
    """The request log line's fields (README "Logs"), one schema for every request: finished
    (`Lifecycle.finish`) or refused (`Lifecycle.rejected`, from the walk and the edge)."""
    u = call.usage
    line = {
        "request_id": call.request_id,
        "client_request_id": call.client_request_id,
        "model": call.model,
        "path": call.path,
        "worker": call.worker,
        "status": call.status,
        "outcome": call.outcome,
        "attempts": call.attempts,
        "stream": call.stream,
        "ttft_ms": round(call.ttft * 1000, 3) if call.ttft is not None else None,
        # From the request head to the worker: where a slow TTFT was spent, in the gateway
        # (sent_ms) or at the worker and on the way back (the rest).
        "sent_ms": round((call.t_sent - call.t_start) * 1000, 3) if call.t_sent else None,
        "e2e_ms": round(e2e * 1000, 3),
        "prompt_tokens": u.prompt_tokens if u else None,
        "completion_tokens": u.completion_tokens if u else None,
        "cached_tokens": u.cached_tokens if u else None,
    }
    if error is not None:  # why the gateway answered as it did; absent on a worker's answers
        line["error"] = error
    return line


class Lifecycle:
    """What every dispatch changes, from the worker's pick to the request's log line."""

    def __init__(
        self,
        registry: Registry,
        metrics: GatewayMetrics,
        admission: AdmissionController,
        settlement: Settlement,
        prober: Prober | None = None,
        log_requests: bool = True,
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        self.admission = admission
        self.settlement = settlement
        self.prober = prober
        self.log_requests = log_requests
        self.streams: dict[asyncio.Task[Any], RelayResponse] = {}  # live relays (drain cuts them)

    # -- on the worker ---------------------------------------------------------------------------
    def dispatched(self, policy: Policy, call: Call, d: Decision, worker: Worker) -> None:
        """``policy`` sends ``call`` to ``worker``: it counts there (in flight, queued prefill, KV
        it will fill) until released. The policy learns where its prefix now lives in
        ``learned``, once the request is on its way (the upstream client's ``sent``)."""
        m = self.metrics
        if call.attempts == 1:
            m.child(m.routing_decisions, policy.name, d.reason).inc()
            if call.route.chain:
                m.batched(m.prefix_match).observe(
                    min(1.0, d.matched_blocks / len(call.route.chain))
                )
        q = d.scores.get("queue")
        if q is not None:
            m.child(m.queue_delay, worker.name).set(q)
        call.route_debug = d
        call.policy = policy
        worker.dispatched(d.prefill_tokens)
        call.prefill_reported = False
        call.prefill_tokens = d.prefill_tokens
        call.pool = worker.spec.labels.get("pool", "default")
        # The worker it is on from now: a client that leaves during the prefill, or a drain or
        # timeout that cuts it there, is counted and logged on this worker, not on "-".
        call.worker = worker.name
        m.child(m.in_flight, worker.name).set(worker.in_flight)

    def learned(self, call: Call, worker: Worker) -> None:
        """The request is on its way to ``worker``: its policy records the prompt's prefix
        there (the prefix index, the session). Called before anything else can be routed."""
        assert call.policy is not None
        call.learned = call.policy.on_dispatch(worker.name, call.route)

    def _current(self, worker: Worker) -> bool:
        """``worker`` is still the registry's record under its name: a reload that moved the
        name to a new URL (or removed it) left this request on the old server, whose outcomes
        must not eject (or readmit) the new one."""
        return self.registry.workers.get(worker.name) is worker

    def first_byte(self, worker: Worker, call: Call, seconds: float) -> None:
        """The worker answered ``seconds`` after this attempt's dispatch: its own TTFT (outlier
        ejection; admission waits and earlier attempts are not its doing), and its queued-prefill
        estimate drops this call."""
        if self._current(worker):
            self.registry.observe_ttft(worker.name, seconds)
        self.prefill_done(worker, call)

    def prefill_done(self, worker: Worker, call: Call) -> None:
        worker.prefill_done(call.prefill_tokens)
        call.prefill_tokens = 0
        if call.route.block_chain and not call.prefill_reported and call.policy is not None:
            call.prefill_reported = True
            call.policy.on_prefill_done(worker.name, call.route)

    def released(self, worker: Worker, call: Call) -> None:
        """The attempt on ``worker`` is over (ended, failed or handed back): its slot is free."""
        self.prefill_done(worker, call)
        worker.released()
        if self._current(worker):  # a removed record must not bring its series back
            self.metrics.child(self.metrics.in_flight, worker.name).set(worker.in_flight)
        models = worker.models
        # A base model and its adapters: any of their queues may take it, the highest tier first.
        self.admission.kick(models if len(models) > 1 else call.model)

    def refused(self, worker: Worker, call: Call) -> None:
        """The worker answered this attempt without working on it (a 4xx, a 5xx, no
        connection): the policy forgets what it learned from the dispatch, so a prompt the
        worker rejects (over the model's context, say) credits it with no cache and pins no
        session there."""
        if call.policy is not None:
            call.policy.on_refused(worker.name, call.route, call.learned)
        call.learned = None

    def failed(self, worker: Worker, error: str, *, logged: bool = False) -> None:
        """The worker failed a request (before its first byte, or with an answer that could not
        be relayed: ``logged``, the caller said what was wrong): passive health, and a probe now
        when that left it less than healthy (it may have died)."""
        if not logged:
            log.warning("worker %s failed before first byte: %s", worker.name, error)
        if not self._current(worker):
            return
        self.registry.passive_failure(worker.name, error)
        if self.prober is not None and worker.health is not Health.HEALTHY:
            self.prober.poke(worker.name)

    def succeeded(self, worker: Worker) -> None:
        """A whole answer or a stream that ended well (a half-open worker's trial passes)."""
        if self._current(worker):
            self.registry.passive_success(worker.name)

    # -- the request -----------------------------------------------------------------------------
    async def finish(self, call: Call, error: str | None = None, settle: bool = True) -> None:
        """Record one request a worker was picked for: settlement, metrics, the log line; once
        (a whole response whose client left during its settlement reaches here again from the
        walk). ``settle`` False: the walk refunded it (the workers refused or failed it, or the
        client left before one had it), ``error`` the message it was answered with."""
        if call.finished:
            return
        call.finished = True
        e2e = time.perf_counter() - call.t_start
        if settle:
            await self.settlement.settle(call)
        m = self.metrics
        m.child(m.requests, call.model, call.worker or "-", str(call.status)).inc()
        m.batched(m.e2e, call.model).observe(e2e)
        if call.status == 200:
            u = call.usage
            if call.ttft is not None:  # streams only: a whole response has no first token
                m.batched(m.ttft, call.model, call.pool).observe(call.ttft)
                if u is not None and u.completion_tokens > 1:
                    tpot = (e2e - call.ttft) / (u.completion_tokens - 1)
                    m.batched(m.tpot, call.model, call.pool).observe(tpot)
            if u is not None and call.route_debug is not None and call.route.chain:
                self._record_prediction(call, call.route_debug, u.cached_tokens)
        if self.log_requests and reqlog.isEnabledFor(logging.INFO):
            log_fields(reqlog, "request", request_line(call, e2e, error))

    def rejected(
        self,
        request_id: str,
        client_request_id: str | None,
        model: str | None,
        path: str,
        status: int,
        t_start: float,
        error: str | None = None,
        stream: bool | None = None,
        log: bool = True,
    ) -> None:
        """Count and log a request the gateway refused before any worker was picked for it
        (authentication, limits, validation, quota, admission, a drain, the edge's caps): in
        kvgate_rejected_requests_total{reason=<status>} alone, and one request line (outcome
        `rejected`, attempts 0, `error` the refusal's message), as a finished request's;
        ``log`` False counts it only (the edge's refusals past their lines per second)."""
        m = self.metrics
        m.child(m.rejected, str(status)).inc()
        if log and self.log_requests and reqlog.isEnabledFor(logging.INFO):
            line = request_line(
                Refused(request_id, client_request_id, model, path, status, stream),
                time.perf_counter() - t_start,
                error[:200] if error is not None else None,
            )
            log_fields(reqlog, "request", line)

    def _record_prediction(self, call: Call, d: Decision, actual: int) -> None:
        """How well routing knew the worker's cache: predicted vs reported cached tokens.

        The worker never reuses the prompt's last token, so a full match predicts one token less
        than the prompt; within one block of the report is agreement (vLLM caches whole blocks).
        """
        r = call.route
        predicted = int(r.matched_tokens(d.matched_blocks))
        if r.prompt_tokens:
            predicted = min(predicted, r.prompt_tokens - 1)
        diff = predicted - actual
        outcome = "agree" if abs(diff) <= r.block_tokens else ("over" if diff > 0 else "under")
        source = d.match_source or "none"
        m = self.metrics
        m.child(m.cached_prediction, source, outcome).inc()
        m.batched(m.cached_prediction_error, source).observe(abs(diff))

    def cut_streams(self, message: str) -> int:
        """End every live stream with an SSE error event (graceful shutdown); returns how many."""
        n = 0
        for task, relay in list(self.streams.items()):
            if not task.done():
                relay.cut = message
                task.cancel()
                n += 1
        return n
