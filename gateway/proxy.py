"""Upstream dispatch with retries: pick a worker, send, wait for the first byte, hand the stream
to the relay (gateway/relay.py).

Retries happen only while nothing has reached the client: a connect error, a 5xx, or a timeout
before the first SSE event moves the request to the next-best worker. Once the first byte is out,
the relay owns the stream and a failure becomes an in-band SSE error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import orjson
from starlette.responses import Response

from gateway.call import USAGE_MARK, Call, Usage
from gateway.config import Settings, TimeoutSettings
from gateway.errors import APIError, no_capacity
from gateway.ids import echo_headers
from gateway.metrics import GatewayMetrics
from gateway.relay import RelayResponse, reader
from gateway.upstream import (
    UpstreamClient,
    UpstreamConnectError,
    UpstreamResponse,
    UpstreamStreamError,
)
from scoring.policy import Policy
from scoring.views import Decision
from workers.registry import Registry
from workers.worker import Worker

log = logging.getLogger("kvgate.proxy")
reqlog = logging.getLogger("kvgate.request")


class ProxyHost(Protocol):
    """What the proxy needs from the gateway that owns it: the live config and policy (a reload
    swaps them), and the walk's steps around a dispatch. One typed interface instead of a
    callback per step."""

    settings: Settings
    policy: Policy

    def worker_room(self, w: Worker) -> int:
        """``w``'s free slots now; full workers are passed over while any has room."""

    def on_slot_freed(self, model: str) -> None:
        """A worker slot for ``model`` was freed (admission wakes a waiter)."""

    def on_passive_failure(self, name: str) -> None:
        """A worker failed a request before its first byte (health bookkeeping)."""

    async def settle(self, call: Call) -> None:
        """Charge what ``call`` used, once (gateway/settlement.py)."""


class Proxy:
    def __init__(
        self, registry: Registry, client: UpstreamClient, metrics: GatewayMetrics, host: ProxyHost
    ) -> None:
        self.registry = registry
        self.client = client
        self.metrics = metrics
        self.host = host
        self.streams: dict[asyncio.Task[Any], RelayResponse] = {}  # live relays (drain cuts them)

    # -- dispatch --------------------------------------------------------------------------------
    async def forward(self, call: Call) -> Response:
        settings = self.host.settings
        t = settings.timeouts
        deadline = call.t_start + t.total_s
        tried: set[str] = set()
        last_error: APIError | None = None
        max_attempts = settings.retries.max_attempts
        policy = self.host.policy
        while call.attempts < max_attempts:
            cands = [w for w in self.registry.candidates(call.model) if w.name not in tried]
            if call.pool_ok is not None:
                cands = [w for w in cands if call.pool_ok(w)] or cands
            room = self.host.worker_room
            cands = [w for w in cands if room(w) > 0] or cands
            if not cands:
                break
            decision = policy.choose([w.view() for w in cands], call.route)
            worker = self.registry.workers[decision.worker.name]
            tried.add(worker.name)
            call.attempts += 1
            if call.attempts > 1:
                self.metrics.child(
                    self.metrics.retries, last_error.code if last_error else "unknown"
                ).inc()
            self._record_decision(policy, call, decision)
            self._acquire(worker, call, decision.prefill_tokens)
            handed_off = False
            t_sent = time.perf_counter()
            try:
                # A non-streaming response starts only when generation ends: its wait is the
                # whole generation, bounded by the total deadline, not a first byte.
                wait = min(t.first_byte_s, deadline - _now()) if call.stream else deadline - _now()
                resp = await self._send(call, worker, wait)
                if resp.status >= 500:
                    call.upstream_sent = False  # refused: nothing was generated
                    body = await _read_bounded(resp, t.idle_s)
                    last_error = _upstream_error(resp.status, body)
                    self._fail(worker, f"HTTP {resp.status}")
                    continue
                call.worker = worker.name
                call.status = resp.status
                headers = self._headers(call, worker.name, decision.reason, settings)
                if resp.status != 200 or not call.stream:
                    return await self._whole(call, worker, resp, headers, t, deadline)
                first = await self._first_chunk(resp, min(t.first_byte_s, deadline - _now()))
                if first is None:
                    last_error = APIError(
                        502,
                        "worker closed the stream before sending anything",
                        "upstream_error",
                        code="upstream_empty_stream",
                    )
                    self._fail(worker, "empty stream")
                    continue
                now = time.perf_counter()
                call.ttft = now - call.t_start
                # The worker's own TTFT (outlier ejection): from this attempt's dispatch, not
                # counting admission waits and earlier attempts that are not its doing.
                self.registry.observe_ttft(worker.name, now - t_sent)
                self.prefill_done(worker, call)
                headers["content-type"] = resp.headers.get(
                    "content-type", "text/event-stream; charset=utf-8"
                )
                handed_off = True
                return RelayResponse(self, call, worker, resp, first, headers, t, deadline)
            except UpstreamConnectError as e:
                call.upstream_sent = False
                # Clients get a stable message; what the socket said goes to the log (_fail).
                last_error = APIError(
                    502,
                    "A worker could not be reached.",
                    "upstream_error",
                    code="upstream_connect_error",
                )
                self._fail(worker, f"connect: {e}")
            except (TimeoutError, UpstreamStreamError) as e:
                timeout = isinstance(e, TimeoutError)
                if timeout and not call.stream and call.upstream_sent:
                    # The worker took the request and was generating: another attempt would
                    # generate it all again (and a client could burn fleet compute for free).
                    # No retry; the walk charges the reservation (gateway.app).
                    call.worker, call.status, call.outcome = worker.name, 504, "upstream_timeout"
                    log.warning(
                        "request %s on %s: no response within timeouts.total_s",
                        call.request_id,
                        worker.name,
                    )
                    raise APIError(
                        504,
                        "The worker did not finish this request within the gateway's total "
                        "timeout; stream the response to receive tokens as they are generated.",
                        "upstream_error",
                        code="upstream_timeout",
                    ) from None
                call.upstream_sent = False
                last_error = APIError(
                    504 if timeout else 502,
                    "The worker sent nothing before the first-byte timeout."
                    if timeout
                    else "The worker's response broke off before it started.",
                    "upstream_error",
                    code="upstream_timeout" if timeout else "upstream_error",
                )
                self._fail(worker, "first-byte timeout" if timeout else str(e))
            finally:
                if not handed_off:
                    self.release(worker, call)
        if last_error is not None:
            raise last_error
        raise no_capacity(f"no healthy worker is serving model `{call.model}`")

    async def _send(self, call: Call, worker: Worker, timeout: float) -> UpstreamResponse:
        headers = {
            "content-type": "application/json",
            # vLLM keys its own request by this header: ours is unique, a client's may not be.
            "x-request-id": call.request_id,
        }
        if call.client_request_id is not None:
            headers["x-client-request-id"] = call.client_request_id
        if worker.spec.api_key:
            headers["authorization"] = f"Bearer {worker.spec.api_key}"
        if timeout <= 0:
            raise TimeoutError
        call.upstream_sent = True
        async with asyncio.timeout(timeout):
            return await self.client.post(worker.url + call.path, call.body, headers)

    async def _first_chunk(
        self, resp: UpstreamResponse, timeout: float
    ) -> tuple[Callable[[], Awaitable[bytes]], bytes] | None:
        """The first body bytes, and how to read the next ones (b"" at the end)."""
        nxt = reader(resp)
        try:
            async with asyncio.timeout(max(timeout, 0.0)):
                first = await nxt()
        except BaseException:
            await resp.abort()
            raise
        if not first:
            await resp.abort()
            return None
        return nxt, first

    async def _whole(
        self,
        call: Call,
        worker: Worker,
        resp: UpstreamResponse,
        headers: dict[str, str],
        t: TimeoutSettings,
        deadline: float,
    ) -> Response:
        try:
            async with asyncio.timeout(max(0.0, deadline - _now())):
                body = await resp.read()
        except BaseException:
            await resp.abort()
            raise
        await resp.release()
        # No call.ttft: a whole response has no first token, and its duration would pollute the
        # TTFT histogram and the autoscaler's TTFT p95; it is recorded as e2e only.
        if resp.status == 200 and USAGE_MARK in body:
            with contextlib.suppress(orjson.JSONDecodeError, TypeError, ValueError):
                call.usage = Usage.from_json(orjson.loads(body).get("usage"))
        call.outcome = "ok" if resp.status == 200 else "upstream_4xx"
        self.registry.passive_success(worker.name)
        await self.finish(call)
        headers["content-type"] = resp.headers.get("content-type", "application/json")
        return Response(body, resp.status, headers=headers)

    def _headers(self, call: Call, worker: str, reason: str, settings: Settings) -> dict[str, str]:
        h = echo_headers(call.request_id, call.client_request_id)
        h["x-kvgate-worker"] = worker
        if settings.server.debug_headers:
            d = call.route_debug
            scores = ";".join(f"{k}={v:.3f}" for k, v in (d.scores if d else {}).items())
            h["x-kvgate-route"] = (
                f"reason={reason};attempts={call.attempts};matched_blocks="
                f"{d.matched_blocks if d else 0}" + (f";{scores}" if scores else "")
            )
        return h

    def _record_decision(self, policy: Policy, call: Call, d: Decision) -> None:
        m = self.metrics
        if call.attempts == 1:
            m.child(m.routing_decisions, policy.name, d.reason).inc()
            if call.route.chain:
                m.batched(m.prefix_match).observe(
                    min(1.0, d.matched_blocks / len(call.route.chain))
                )
        q = d.scores.get("queue")
        if q is not None:
            m.child(m.queue_delay, d.worker.name).set(q)
        policy.on_dispatch(d.worker.name, call.route)
        call.route_debug = d

    def cut_streams(self, message: str) -> int:
        """End every live stream with an SSE error event (graceful shutdown); returns how many."""
        n = 0
        for task, relay in list(self.streams.items()):
            if not task.done():
                relay.cut = message
                task.cancel()
                n += 1
        return n

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

    def _acquire(self, worker: Worker, call: Call, prefill_tokens: int) -> None:
        worker.in_flight += 1
        call.prefill_reported = False
        call.prefill_tokens = prefill_tokens
        worker.prefill_tokens += prefill_tokens
        worker.sent_tokens_since_scrape += prefill_tokens
        call.pool = worker.spec.labels.get("pool", "default")
        self.metrics.child(self.metrics.in_flight, worker.name).set(worker.in_flight)

    def prefill_done(self, worker: Worker, call: Call) -> None:
        """The worker has produced its first byte: its queued-prefill estimate drops this call."""
        worker.prefill_tokens = max(0, worker.prefill_tokens - call.prefill_tokens)
        call.prefill_tokens = 0
        if call.route.block_chain and not call.prefill_reported:
            call.prefill_reported = True
            self.host.policy.on_prefill_done(worker.name, call.route)

    def release(self, worker: Worker, call: Call) -> None:
        self.prefill_done(worker, call)
        worker.in_flight -= 1
        self.metrics.child(self.metrics.in_flight, worker.name).set(worker.in_flight)
        self.host.on_slot_freed(call.model)

    def _fail(self, worker: Worker, error: str) -> None:
        log.warning("worker %s failed before first byte: %s", worker.name, error)
        self.registry.passive_failure(worker.name, error)
        self.host.on_passive_failure(worker.name)

    async def finish(self, call: Call) -> None:
        """Record one finished request: settlement (the gateway's hook), metrics, the log line."""
        e2e = time.perf_counter() - call.t_start
        await self.host.settle(call)
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
        if self.host.settings.logging.requests and reqlog.isEnabledFor(logging.INFO):
            u = call.usage
            reqlog.info(
                "request",
                extra={
                    "fields": {
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
                        "e2e_ms": round(e2e * 1000, 3),
                        "prompt_tokens": u.prompt_tokens if u else None,
                        "completion_tokens": u.completion_tokens if u else None,
                        "cached_tokens": u.cached_tokens if u else None,
                    }
                },
            )


async def _read_bounded(resp: UpstreamResponse, timeout: float) -> bytes:
    try:
        async with asyncio.timeout(timeout):
            body = await resp.read()
    except (TimeoutError, UpstreamStreamError):
        await resp.abort()
        return b""
    await resp.release()
    return body[:65536]


def _upstream_error(status: int, body: bytes) -> APIError:
    """Keep the worker's own error envelope when there is one: it says what really went wrong."""
    message, type_, code = f"worker returned HTTP {status}", "upstream_error", None
    with contextlib.suppress(orjson.JSONDecodeError, TypeError, AttributeError, ValueError):
        err = orjson.loads(body).get("error")
        if isinstance(err, dict):
            message = str(err.get("message") or message)
            type_ = str(err.get("type") or type_)
            code = err.get("code")
        elif isinstance(err, str):
            message = err
    return APIError(status, message, type_, code=code if isinstance(code, str) else None)


def _now() -> float:
    return time.perf_counter()
