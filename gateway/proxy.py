"""Upstream dispatch with retries, and the SSE relay.

Retries happen only while nothing has reached the client: a connect error, a 5xx, or a timeout
before the first SSE event moves the request to the next-best worker. Once the first byte is out,
a failure becomes an in-band SSE error event followed by `[DONE]`, exactly as vLLM ends a stream
that failed, so clients see one well-formed stream either way.

The relay forwards the worker's bytes untouched. It looks at the bytes only to find event
boundaries, `[DONE]`, and the final usage chunk (a substring test, no JSON per event); the usage
chunk is parsed once, and removed again when the client did not ask for it (we force
`include_usage` upstream so every stream can be accounted).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.client_socket import AckProbe
from gateway.config import Settings, TimeoutSettings
from gateway.errors import APIError, no_capacity, sse_error_event
from gateway.ids import echo_headers
from gateway.metrics import BatchedHistogram, GatewayMetrics
from gateway.upstream import (
    UpstreamClient,
    UpstreamConnectError,
    UpstreamResponse,
    UpstreamStreamError,
)
from scoring.policy import Decision, Policy, RouteRequest
from workers.registry import Registry, Worker

log = logging.getLogger("kvgate.proxy")
reqlog = logging.getLogger("kvgate.request")

_SSE_HEADERS_PASSTHROUGH = ("content-type",)
_USAGE_MARK = b'"usage"'
_DONE = b"data: [DONE]\n\n"
_STREAM_ERRORS = {
    "idle_timeout": "The worker sent nothing for too long; the gateway ended the stream.",
    "upstream_broken": "The worker's stream ended unexpectedly; the response is incomplete.",
}


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @classmethod
    def from_json(cls, u: Any) -> Usage | None:
        if not isinstance(u, dict):
            return None
        details = u.get("prompt_tokens_details") or {}
        return cls(
            prompt_tokens=int(u.get("prompt_tokens") or 0),
            completion_tokens=int(u.get("completion_tokens") or 0),
            cached_tokens=int(details.get("cached_tokens") or 0)
            if isinstance(details, dict)
            else 0,
        )


@dataclass(slots=True)
class Call:
    """One client request on its way through the proxy."""

    request_id: str  # the gateway's own (gateway.ids): unique, names the request everywhere
    model: str
    path: str
    body: bytes
    stream: bool
    client_wants_usage: bool
    route: RouteRequest
    route_debug: Decision | None = None
    t_start: float = field(default_factory=time.perf_counter)
    worker: str = ""
    attempts: int = 0
    status: int = 0
    ttft: float | None = None
    events: int = 0
    usage: Usage | None = None
    outcome: str = ""  # ok | upstream_4xx | client_disconnect | upstream_broken | idle_timeout
    # Workers this request may use (a canary split), or None for any; ignored when none qualify.
    pool_ok: Callable[[Worker], bool] | None = None
    pool: str = ""  # the chosen worker's `pool` label, for per-pool metrics
    prefill_tokens: int = 0  # the routing decision's estimate, held on the worker until 1st byte
    prefill_reported: bool = False  # this attempt's on_prefill_done was called
    ctx: Any = None  # the gateway's own per-request state (tenant, quota ticket)
    client_request_id: str | None = None  # the client's x-request-id: a label, echoed, forwarded
    # The request went to a worker that may be generating it (non-streaming: nothing tells how
    # far it got until the whole answer arrives); cleared when the attempt was refused.
    upstream_sent: bool = False


class Proxy:
    def __init__(
        self,
        registry: Registry,
        client: UpstreamClient,
        metrics: GatewayMetrics,
        *,
        policy: Callable[[], Policy],
        settings: Callable[[], Settings],
        on_passive_failure: Callable[[str], None] = lambda name: None,
        on_finish: Callable[[Call], Awaitable[None]] | None = None,
        room: Callable[[Worker], int] | None = None,
        on_release: Callable[[str], None] | None = None,
    ) -> None:
        self.registry = registry
        self.client = client
        self.metrics = metrics
        self._policy = policy
        self._settings = settings
        self._on_passive_failure = on_passive_failure
        self._on_finish = on_finish
        self._room = room  # a worker's free slots; full workers are passed over while any has room
        self._on_release = on_release  # a slot was freed for this model (admission wakes a waiter)
        self._streams: dict[asyncio.Task[Any], RelayResponse] = {}  # live relays (drain cuts them)

    # -- dispatch --------------------------------------------------------------------------------
    async def forward(self, call: Call) -> Response:
        settings = self._settings()
        t = settings.timeouts
        deadline = call.t_start + t.total_s
        tried: set[str] = set()
        last_error: APIError | None = None
        max_attempts = settings.retries.max_attempts
        policy = self._policy()
        while call.attempts < max_attempts:
            cands = [w for w in self.registry.candidates(call.model) if w.name not in tried]
            if call.pool_ok is not None:
                cands = [w for w in cands if call.pool_ok(w)] or cands
            if self._room is not None:
                room = self._room
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
                    self._release(worker, call)
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
        nxt = _reader(resp)
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
        if resp.status == 200 and _USAGE_MARK in body:
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
                m.prefix_match.observe(min(1.0, d.matched_blocks / len(call.route.chain)))
        q = d.scores.get("queue")
        if q is not None:
            m.child(m.queue_delay, d.worker.name).set(q)
        policy.on_dispatch(d.worker.name, call.route)
        call.route_debug = d

    def cut_streams(self, message: str) -> int:
        """End every live stream with an SSE error event (graceful shutdown); returns how many."""
        n = 0
        for task, relay in list(self._streams.items()):
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
        m.child(m.cached_prediction_error, source).observe(abs(diff))

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
            self._policy().on_prefill_done(worker.name, call.route)

    def _release(self, worker: Worker, call: Call) -> None:
        self.prefill_done(worker, call)
        worker.in_flight -= 1
        self.metrics.child(self.metrics.in_flight, worker.name).set(worker.in_flight)
        if self._on_release is not None:
            self._on_release(call.model)

    def _fail(self, worker: Worker, error: str) -> None:
        log.warning("worker %s failed before first byte: %s", worker.name, error)
        self.registry.passive_failure(worker.name, error)
        self._on_passive_failure(worker.name)

    async def finish(self, call: Call) -> None:
        """Record one finished request: settlement (the gateway's hook), metrics, the log line."""
        e2e = time.perf_counter() - call.t_start
        if self._on_finish is not None:
            await self._on_finish(call)
        m = self.metrics
        m.child(m.requests, call.model, call.worker or "-", str(call.status)).inc()
        m.child(m.e2e, call.model).observe(e2e)
        if call.status == 200:
            u = call.usage
            if call.ttft is not None:  # streams only: a whole response has no first token
                m.child(m.ttft, call.model, call.pool).observe(call.ttft)
                if u is not None and u.completion_tokens > 1:
                    tpot = (e2e - call.ttft) / (u.completion_tokens - 1)
                    m.child(m.tpot, call.model, call.pool).observe(tpot)
            if u is not None and call.route_debug is not None and call.route.chain:
                self._record_prediction(call, call.route_debug, u.cached_tokens)
        if self._settings().logging.requests and reqlog.isEnabledFor(logging.INFO):
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


class RelayResponse(Response):
    """Streams one upstream SSE response to the client.

    Runs the pump and a disconnect watcher side by side: the moment the client goes away the pump
    is cancelled and the upstream connection closed, so the worker aborts the request and frees
    its KV blocks. Cleanup sits in `finally` of `__call__`, so it runs even if the response is
    cancelled before its first byte.
    """

    def __init__(
        self,
        proxy: Proxy,
        call: Call,
        worker: Worker,
        resp: UpstreamResponse,
        first: tuple[Callable[[], Awaitable[bytes]], bytes],
        headers: dict[str, str],
        timeouts: TimeoutSettings,
        deadline: float,
    ) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers(headers)  # before any `body` attribute exists: no content-length
        self._proxy = proxy
        self._call = call
        self._worker = worker
        self._resp = resp
        self._next, self._first = first
        self._t = timeouts
        self._deadline = deadline
        self._done = False
        self._finished = False  # _complete ran: slot, lease and settlement are already settled
        self.cut: str | None = None  # set (then the task cancelled) to end the stream: shutdown
        self.stalled = False  # set (then the task cancelled) by _check_stall
        self._sending = 0.0  # perf_counter when the send in progress started; 0 = none
        # One timer per stream watches both ends: the client's reading (stall) and the worker's
        # silence (idle_s) and the total deadline, instead of a timeout context per SSE read
        # (asyncio.timeout enter/exit/reschedule was ~5% of the loop's time under load).
        self._stall_every = max(0.05, min(1.0, timeouts.client_stall_s / 4, timeouts.idle_s / 4))
        self._awaiting_worker = False  # the pump is waiting for the worker's next chunk
        self._last_chunk = 0.0  # perf_counter of the worker's last chunk (or the stream start)
        self._idle_cut = False  # set (then the task cancelled) by _check_stall: worker silent
        self._stall_timer: asyncio.TimerHandle | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._settling = False  # _complete is running: the stall check must not cancel it
        self._acks: AckProbe | None = None  # the client's TCP progress, where the kernel says
        self._acked = -1  # bytes the client had acked at the last stall check
        self._progress_at = 0.0  # perf_counter of the last stall check that saw progress
        # What the byte scan (`_feed`) keeps between chunks.
        self._pending = b""  # an event not yet complete
        self._out: list[bytes] = []  # complete events not yet written to the client
        self._strip = not call.client_wants_usage
        self._inter: BatchedHistogram | None = None
        self._cycle: Any = None  # uvicorn's request cycle when chunks may be written directly
        self._ended = False  # the client has its whole response (the final chunk is out)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        call = self._call
        me = asyncio.current_task()
        assert me is not None
        gone = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            me.cancel()

        # One helper task per stream (not two plus asyncio.wait): the pump runs in this task and
        # the watcher cancels it the moment the client leaves.
        watcher = self._watcher = asyncio.get_running_loop().create_task(watch())
        streams = self._proxy._streams
        streams[me] = self
        try:
            # Inside the try: whatever happens from here, the cleanup below settles the call.
            self._acks = AckProbe.of(send)
            self._progress_at = self._last_chunk = time.perf_counter()
            self._stall_timer = asyncio.get_running_loop().call_later(
                self._stall_every, self._check_stall, me
            )
            await self._pump(send)
        except asyncio.CancelledError:
            if self.stalled and not gone:
                me.uncancel()
                self._client_stalled(call)
            elif self.cut is not None and not gone:
                me.uncancel()
                if not self._ended:  # else [DONE] is out: only the upstream's tail was left
                    call.outcome = "gateway_shutdown"
                    self._proxy.metrics.stream_errors.labels("gateway_shutdown").inc()
                    with contextlib.suppress(OSError):
                        await self._send(send, sse_error_event(self.cut, "server_error", 503))
                        await self._end(send)
            elif not gone:
                raise
            else:
                me.uncancel()
        except OSError:  # the socket died under a send
            gone = True
        finally:
            if self._stall_timer is not None:
                self._stall_timer.cancel()
            streams.pop(me, None)
            watcher.cancel()
            if gone:
                call.outcome = "client_disconnect"
                self._proxy.metrics.client_disconnects.inc()
            if self._done:
                await self._resp.release()
            else:
                await self._resp.abort()
            if not self._finished:
                if not call.outcome:
                    call.outcome = "client_disconnect"
                await self._complete()

    async def _settle_before_done(self) -> None:
        """Nothing may cancel a settlement half way (a lease would leak until its TTL): the
        disconnect watcher stops and the stall check holds off first, and a cancel either
        already requested is taken now, so the cleanup in ``__call__`` settles instead."""
        if self._watcher is not None:
            self._watcher.cancel()
        me = asyncio.current_task()
        if me is not None and me.cancelling():
            await asyncio.sleep(0)  # delivers the pending CancelledError
        self._settling = True
        try:
            await self._complete()
        finally:
            self._settling = False

    async def _complete(self) -> None:
        """Free the worker slot, settle and record the request; once, at [DONE] or at the end."""
        if self._finished:
            return
        self._finished = True
        call = self._call
        self._proxy._release(self._worker, call)
        if self._done and not call.outcome:
            call.outcome = "ok"
        if call.outcome == "ok":
            self._proxy.registry.passive_success(self._worker.name)
        await self._proxy.finish(call)

    async def _pump(self, send: Send) -> None:
        """Relay until [DONE]: settle, then end the response with it and read the worker's
        stream to its end (so its connection can be reused).

        With kvgate's own upstream client under uvicorn, chunks are spliced: the upstream
        connection's ``data_received`` scans them (`_on_chunk`) and writes complete events to the
        client's transport itself, and this task sleeps until [DONE], the end, an error or a
        client that cannot take more (then it sends the backlog with flow control, as the
        generic path does for every chunk). That removes a task wake-up, an async iterator step
        and an ASGI message per chunk: most of the relay's cost per SSE event.
        """
        call = self._call
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        m = self._proxy.metrics
        self._inter = BatchedHistogram(m.child(m.inter_event, call.model))
        self._last_chunk = time.perf_counter()
        splice = getattr(self._resp, "splice", None)
        if splice is not None:
            self._cycle = _direct_cycle(send)
            if self._cycle is None:
                splice = None
        try:
            self._feed(self._first)
            ended = False
            while True:
                if self._out:
                    await self._flush(send)
                if self._done or ended:
                    break
                if time.perf_counter() > self._deadline:
                    raise TimeoutError
                self._awaiting_worker = True
                try:
                    if splice is not None:
                        ended = await splice(self._on_chunk)
                    else:
                        chunk = await self._next()
                        if chunk:
                            self._took(chunk)
                        else:
                            ended = True
                except asyncio.CancelledError:
                    if not self._idle_cut:
                        raise
                    self._idle_cut = False
                    asyncio.current_task().uncancel()  # type: ignore[union-attr]
                    raise TimeoutError from None
                finally:
                    self._awaiting_worker = False
            if not self._done:
                if self._pending:
                    await self._send(send, self._pending)
                raise UpstreamStreamError("worker closed the stream without [DONE]")
        except (UpstreamStreamError, TimeoutError) as e:
            reason = "idle_timeout" if isinstance(e, TimeoutError) else "upstream_broken"
            # A stable message per reason: clients branch on it, and the transport's own words
            # (aiohttp internals, addresses) belong in the log, not in a tenant's stream.
            msg = _STREAM_ERRORS[reason]
            call.outcome = reason
            self._proxy.metrics.stream_errors.labels(reason).inc()
            log.warning(
                "request %s on %s: %s (%s)", call.request_id, call.worker, reason, e or type(e)
            )
            if self._out:  # complete events the client had no room for yet
                await self._flush(send)
            # An event may have been cut in half; end it before the error event.
            tail = b"\n\n" if self._pending else b""
            await self._send(
                send,
                tail
                + sse_error_event(msg, "upstream_error", 504 if reason == "idle_timeout" else 502),
            )
            await self._end(send)
            return
        finally:
            self._inter.flush()
        # Everything is settled before the client sees the end: a client that starts its next
        # request on [DONE] must find its concurrency lease and the worker's slot already free
        # (else a false 429 at max_concurrent).
        await self._settle_before_done()
        call.outcome = "ok"
        await self._end(send, _DONE)
        await self._drain_upstream(ended)

    async def _drain_upstream(self, ended: bool) -> None:
        """After [DONE]: read the worker's stream to its end (its terminating chunk usually came
        with [DONE]) so the connection goes back to the pool; bounded like any read."""
        self._awaiting_worker = True
        try:
            while not ended:
                ended = not await self._next()
        except asyncio.CancelledError:
            if not self._idle_cut:
                raise
            self._idle_cut = False
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            self._done = False  # not read to the end: the connection is closed, not reused
        except UpstreamStreamError:
            self._done = False
        finally:
            self._awaiting_worker = False

    def _took(self, chunk: bytes) -> None:
        prev = self._last_chunk
        self._last_chunk = now = time.perf_counter()
        assert self._inter is not None
        self._inter.observe(now - prev)
        self._feed(chunk)

    def _feed(self, chunk: bytes) -> None:
        """Scan one chunk from the worker: complete events go to ``_out``; [DONE] ends it."""
        if self._done:
            return  # nothing after [DONE] reaches the client
        if not self._pending and chunk.endswith(b"\n\n"):
            out = chunk  # the usual case: the worker's writes are whole events
        else:
            data = self._pending + chunk if self._pending else chunk
            cut = data.rfind(b"\n\n") + 2
            if cut < 2:
                self._pending = data
                return
            out, self._pending = data[:cut], data[cut:]
        if _USAGE_MARK in out:
            out = self._take_usage(out, self._strip)
        self._call.events += out.count(b"\n\n")
        if out.endswith(_DONE):
            self._done = True
            out = out[: -len(_DONE)]
        if out:
            self._out.append(out)

    def _on_chunk(self, chunk: bytes) -> bool:
        """The splice's sink, called from the upstream connection's ``data_received``: scan,
        write to the client if it can take it, and say whether the task may keep sleeping."""
        self._took(chunk)
        if self._out and not self._write_now():
            return False
        return not self._done and self._last_chunk <= self._deadline

    def _write_now(self) -> bool:
        """Write the backlog as one chunk straight to the client's transport, as uvicorn's send
        would frame it; False when the client is not taking data (flow control, gone)."""
        cy = self._cycle
        if cy.flow.write_paused or cy.disconnected:
            return False
        out = self._out
        body = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        cy.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        return True

    async def _flush(self, send: Send) -> None:
        if self._cycle is not None and self._write_now():
            return
        out = self._out
        body = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        await self._send(send, body)

    async def _end(self, send: Send, body: bytes = b"") -> None:
        """The response's last chunk (with the terminator in the same write)."""
        self._sending = time.perf_counter()
        await send({"type": "http.response.body", "body": body, "more_body": False})
        self._sending = 0.0
        self._ended = True

    async def _send(self, send: Send, body: bytes) -> None:
        """Send, marking when: a stall check (``_check_stall``) cuts off a client that stops
        reading (window full, socket open), which must not hold the worker slot, lease and
        upstream stream past the total deadline or ``client_stall_s``. A timer per stream
        instead of a timeout per send: the relay sends once per SSE read (measured with
        bench/overhead.py: a timeout context per send cost 10% of relay capacity)."""
        self._sending = time.perf_counter()
        await send({"type": "http.response.body", "body": body, "more_body": True})
        self._sending = 0.0

    def _client_stalled(self, call: Call) -> None:
        # Cut off: the response stays unfinished, so the server closes the connection.
        call.outcome = "client_stalled"
        self._proxy.metrics.stream_errors.labels("client_stalled").inc()
        log.warning("request %s: client stopped reading; stream cut off", call.request_id)

    def _check_stall(self, task: asyncio.Task[Any]) -> None:
        """Cut off a client that stopped reading within ``client_stall_s`` of the last byte its
        TCP stack accepted (``AckProbe``), however much the buffers between could still absorb;
        a send blocked past that window (no probe) or past the total deadline cuts it too."""
        now = time.perf_counter()
        if self._awaiting_worker and (
            now - self._last_chunk > self._t.idle_s or now > self._deadline
        ):
            self._idle_cut = True  # the pump turns this cancel into the idle-timeout error
            task.cancel()
            return
        started = self._sending
        stalled = bool(started) and now > self._deadline and not self._settling
        acks = self._acks
        if acks is not None and not stalled:
            try:
                acked, queued = acks.read()
            except OSError:  # the socket is gone: the disconnect watcher takes it from here
                self._acks = acks = None
            else:
                if queued == 0 or acked != self._acked:
                    self._acked, self._progress_at = acked, now
                else:
                    stalled = now - self._progress_at > self._t.client_stall_s
        if acks is None and started and now - started > self._t.client_stall_s:
            stalled = True
        if stalled and not self._settling:
            self.stalled = True
            task.cancel()
            return
        self._stall_timer = asyncio.get_running_loop().call_later(
            self._stall_every, self._check_stall, task
        )

    def _take_usage(self, out: bytes, strip: bool) -> bytes:
        """Find the usage chunk among complete events; parse it once; drop it if unrequested."""
        events = out.split(b"\n\n")
        kept = []
        for ev in events:
            if _USAGE_MARK in ev and ev.startswith(b"data: {") and b'"choices":[]' in ev:
                with contextlib.suppress(orjson.JSONDecodeError, ValueError):
                    self._call.usage = Usage.from_json(orjson.loads(ev[6:]).get("usage"))
                if strip:
                    continue
            kept.append(ev)
        return b"\n\n".join(kept)


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


def _reader(resp: UpstreamResponse) -> Callable[[], Awaitable[bytes]]:
    """A response's next-chunk call: its own where it has one (no async generator per stream),
    else a step of ``chunks()``."""
    nxt = getattr(resp, "next_chunk", None)
    if nxt is not None:
        return nxt  # type: ignore[no-any-return]
    it = resp.chunks()
    return lambda: anext(it, b"")


def _direct_cycle(send: Send) -> Any:
    """uvicorn's request cycle behind ``send`` when the relay may write body chunks to its
    transport itself: a chunked response already started, the flow control and disconnect flags
    it keeps. Any other server (or a wrapped ``send``) gets None: every chunk goes through
    ``send``."""
    cy = getattr(send, "__self__", None)
    if (
        getattr(cy, "chunked_encoding", None) is True
        and getattr(cy, "response_started", False)
        and hasattr(getattr(cy, "flow", None), "write_paused")
        and hasattr(cy, "disconnected")
        and getattr(cy, "transport", None) is not None
    ):
        return cy
    return None
