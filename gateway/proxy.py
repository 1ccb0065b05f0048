"""Upstream dispatch with retries: pick a worker, send, wait for the first byte, hand the stream
to the relay (gateway/relay.py).

Retries happen only while nothing has reached the client: a connect error, a 5xx, or a timeout
before the first SSE event moves the request to the next-best worker. Once the first byte is out,
the relay owns the stream and a failure becomes an in-band SSE error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Collection, Mapping

import orjson
from starlette.responses import Response

from gateway.call import USAGE_MARK, Call, Usage
from gateway.config import Settings, TimeoutSettings
from gateway.errors import JSON, APIError, error_body, no_capacity
from gateway.ids import echo_headers
from gateway.lifecycle import Lifecycle
from gateway.metrics import GatewayMetrics
from gateway.relay import RelayResponse, reader
from gateway.slots import Slots
from gateway.upstream import (
    UpstreamClient,
    UpstreamConnectError,
    UpstreamPoolFull,
    UpstreamResponse,
    UpstreamStreamError,
    ended_pool_wait,
)
from scoring.policy import Policy
from workers.deadlines import Deadlines
from workers.registry import Registry
from workers.worker import Worker

log = logging.getLogger("kvgate.proxy")
# Bytes of a worker's 5xx body kept (and, give or take one read, read) for the client's error.
ERROR_BODY_MAX = 64 * 1024
# The most a whole answer may hold, read into memory before the client gets any of it: a worker
# sending a body that never ends grew the gateway by 200+ MiB in half a second. A 200 bounds what
# a tenant may ask for (`prompt_logprobs` answers run to tens of MB: 46 MB measured, so well
# above); any other status is an error or a refusal (vLLM's are a few hundred bytes; the bound
# leaves room for a long validation report). Past it the read stops and the client gets a 502.
WHOLE_BODY_MAX = 256 * 1024 * 1024
WHOLE_ERROR_MAX = 1024 * 1024
# vLLM's (and OpenAI's) error envelope: a worker that answers in it is up and answering.
_ERROR_ENVELOPE = b'"error"'

# Settlements of whole responses whose client left mid-way, kept referenced until they end.
_SETTLING: set[asyncio.Future[None]] = set()
# A whole response up to this size is parsed whole for its usage (exact; ~0.15 ms of loop at
# most, and ordinary answers are 1-20 kB); a bigger one (`prompt_logprobs`, `echo` + `logprobs`:
# tens of MB that a tenant asks for) has its usage located by bytes and only that object parsed
# (`_usage_of`: 9 ms for 46 MB, where parsing it whole held the loop 0.53 s).
WHOLE_PARSE_MAX = 32 * 1024
# The key that opens vLLM's top-level usage object, and how far its closing brace may be.
_USAGE_OBJ = USAGE_MARK + b":{"
_USAGE_SPAN = 4096
# JSON's whitespace, before a big whole answer's first byte (`_whole_answer`).
_JSON_SPACE = re.compile(rb"[ \t\r\n]*")
# The most of a worker's `retry-after` (its 503 or 429) passed on to the client: a worker's
# "come back in a day" must not park every client of the gateway for a day.
RETRY_AFTER_MAX_S = 60.0


class Proxy:
    """Picks a worker for a call and sends it there, retrying on another before the first byte.

    What a dispatch changes (counts, learning, health, slots, settlement) is the lifecycle's
    (gateway/lifecycle.py), which the relay reports to as well; the proxy only decides and sends.
    """

    def __init__(
        self,
        registry: Registry,
        client: UpstreamClient,
        metrics: GatewayMetrics,
        slots: Slots,
        life: Lifecycle,
    ) -> None:
        self.registry = registry
        self.client = client
        self.metrics = metrics
        self.slots = slots
        self.life = life
        # The worker's head, a stream's first event, a whole response's body: no timer per wait.
        # Also the registry of every request waiting on its worker, which a drain cuts.
        self.deadlines = Deadlines()
        # Set when a drain's grace ends (`cut_waiting`): the 503 message; no wait, no retry.
        self.closing: str | None = None
        # Every retry is admitted here (the app's admission queue, counting only the workers it
        # has not tried, with what is left of the request's deadline), at once when there is
        # room; None: no admission, it goes wherever `Slots.eligible` points.
        self.wait_room: Callable[[Call, Collection[str], float], Awaitable[object]] | None = None

    # -- dispatch --------------------------------------------------------------------------------
    async def forward(self, call: Call, settings: Settings, policy: Policy) -> Response:
        t = settings.timeouts
        deadline = call.t_start + t.total_s
        tried: set[str] = set()
        last_error: APIError | None = None
        max_attempts = settings.retries.max_attempts
        life = self.life
        # Workers that answered this request's attempt with their own 500 error envelope: the
        # engine may have failed on the request, not the worker. Blamed (passive failure) only
        # once another worker served it (`served`): that is the one proof the request was
        # servable. Any other way out of the loop proves nothing: another worker answering it
        # alike makes it the request's doing; no other candidate (a model's only worker), a
        # client gone, a drain's cut or another worker's timeout leave it undecided, and blaming
        # then let one tenant's poison request (a malformed extension field vLLM raises on)
        # eject a model's only worker for every tenant. A worker that 500s everything is still
        # caught: by its deep probes and by the requests other workers serve.
        suspects: list[Worker] = []
        served = False
        eligible = self.slots.eligible
        try:
            while call.attempts < max_attempts:
                cands = eligible(call.model, tried, call.pool_ok)
                if not cands:
                    break
                if call.attempts and self.wait_room is not None:
                    # A retry: admission counted the refusing worker's slot, not one of the
                    # others'. Sent on to a full worker, one capped at 1 ran 6 at once beside one
                    # that refused everything; so it is admitted again, as a new request is,
                    # within its own deadline (a drain or a lost client ends the wait). Always,
                    # not only when the untried workers look full: a free slot may be granted to
                    # a waiter that has not dispatched yet, or be the priority reserve its tier
                    # may not take (review: both taken by a retry that read `worker_room` alone).
                    # Admission's no-wait path is the same few comparisons (`Slots.free`).
                    await self.wait_room(call, tried, deadline)
                    if self.closing is not None:
                        raise self._shut_down(call, None)
                    cands = eligible(call.model, tried, call.pool_ok)
                    if not cands:
                        break
                decision = policy.choose([w.view() for w in cands], call.route)
                worker = self.registry.workers[decision.worker.name]
                tried.add(worker.name)
                call.attempts += 1
                if call.attempts > 1:
                    if self.closing is not None:  # between two attempts when the drain cut
                        raise self._shut_down(call, None)
                    self.metrics.child(self.metrics.retries, _retry_reason(last_error)).inc()
                life.dispatched(policy, call, decision, worker)
                handed_off = False
                whole = 0  # the status of an answer being read whole: a failure is in its body
                t_sent = time.perf_counter()
                try:
                    # A non-streaming response starts only when generation ends: its wait is the
                    # whole generation, bounded by the total deadline, not a first byte.
                    wait = (
                        min(t.first_byte_s, deadline - _now()) if call.stream else deadline - _now()
                    )
                    resp = await self._send(call, worker, wait)
                    if resp.status < 200:
                        # A 1xx as the final answer (aiohttp hands a worker's `101 Switching
                        # Protocols` over; the h1 client fails it itself): no answer to a POST.
                        # Relayed, the client got a bodiless 101; it is a malformed response,
                        # treated as the h1 client's connect error is: retried elsewhere.
                        await resp.abort()
                        raise UpstreamConnectError(f"malformed response: HTTP {resp.status}")
                    if 300 <= resp.status < 400:
                        # A redirect: the worker's URL is wrong (a path, a proxy in front), the
                        # request was not served. Followed, the tenant's prompt went wherever the
                        # worker pointed; relayed, the client got a bodiless 3xx to a POST. The
                        # gateway's paths are its own, never the tenant's: the worker's doing.
                        await resp.abort()
                        call.upstream_sent = False
                        last_error = APIError(
                            502,
                            f"A worker answered with a redirect (HTTP {resp.status}), which the "
                            "gateway does not follow.",
                            "upstream_error",
                            code="upstream_redirect",
                        )
                        life.refused(worker, call)
                        life.failed(worker, f"HTTP {resp.status} redirect")
                        continue
                    if (resp.status >= 500 and resp.status != 501) or resp.status == 429:
                        # A 501 is vLLM's answer to a request it does not implement (chat to a
                        # model with no generate runner): the request's doing, answered as a
                        # 4xx is. Blamed and retried, one client's such requests ejected every
                        # worker of the model (review).
                        # A 429 is a worker (or a proxy in front of it) too busy to take the
                        # request: nothing was generated, as with its 503, and it is handled
                        # the same. Relayed, the client read it as its own rate limit, no other
                        # worker was tried, and the tenant's rpm was spent on it (review).
                        call.upstream_sent = False  # refused: nothing was generated
                        retry_after = _retry_after(resp.headers)
                        body = await _read_bounded(resp, t.idle_s)
                        last_error = _upstream_error(resp.status, body, retry_after)
                        life.refused(worker, call)
                        if resp.status == 500 and _ERROR_ENVELOPE in body:
                            suspects.append(worker)
                            if len(suspects) > 1:  # answered alike twice: the request's doing
                                suspects.clear()
                                break
                            continue
                        life.failed(worker, f"HTTP {resp.status}")
                        continue
                    call.worker = worker.name
                    call.status = resp.status
                    headers = self._headers(call, worker.name, decision.reason, settings)
                    if resp.status != 200:
                        if resp.status < 300:
                            # A 2xx other than 200: no vLLM answers so, the worker is broken (or
                            # not vLLM). Bodiless (204, 205, content-length 0) it generated
                            # nothing: a failure, retried elsewhere and refunded, as a 5xx is.
                            # With a body it may be a whole answer (a 201 carrying the
                            # completion): the conservative rule, as for any answer that may
                            # have been generated, is no retry (it would run twice), a 502
                            # that the walk charges the reservation for (`_unrelayable`).
                            await resp.abort()
                            if resp.status in (204, 205) or (
                                resp.headers.get("content-length", "").strip() == "0"
                            ):
                                call.upstream_sent = False
                                last_error = APIError(
                                    502,
                                    f"A worker answered HTTP {resp.status} without an answer.",
                                    "upstream_error",
                                    code="upstream_invalid_response",
                                )
                                life.refused(worker, call)
                                life.failed(worker, f"HTTP {resp.status} without a body")
                                continue
                            return await self._unrelayable(
                                call,
                                worker,
                                headers,
                                f"HTTP {resp.status} answer",
                                f"The worker answered HTTP {resp.status}, not 200.",
                            )
                        life.refused(worker, call)  # the request itself was turned down
                    if resp.status != 200 or not call.stream:
                        whole = resp.status
                        answer = await self._whole(call, worker, resp, headers, t, deadline)
                        # Served here (a 200 relayed): a suspect's 500 was its own. A 4xx is no
                        # proof: a worker turning the request down says nothing for its
                        # servability, nor does an answer that could not be relayed.
                        served = call.outcome == "ok"
                        return answer
                    ctype = resp.headers.get("content-type")
                    first = await self._first_chunk(resp, min(t.first_byte_s, deadline - _now()))
                    if first is None:
                        last_error = APIError(
                            502,
                            "worker closed the stream before sending anything",
                            "upstream_error",
                            code="upstream_empty_stream",
                        )
                        life.failed(worker, "empty stream")
                        continue
                    if (
                        ctype is not None
                        and not ctype.startswith("text/event-stream")
                        and not _streamed(ctype, first[1])
                    ):
                        # A stream asked for, a whole answer given (a JSON body: a proxy or an
                        # engine that ignored `stream`). Relayed as a stream it was lost (the
                        # client got the in-band error, the tenant was charged); it is read
                        # whole, as a non-streaming answer is, and answered with a 502
                        # (`_whole`). SSE events under another content-type (a sloppy server's
                        # application/json) are still relayed. One comparison on the hot path:
                        # vLLM's streams say `text/event-stream; charset=utf-8`.
                        whole = 200
                        return await self._whole(call, worker, resp, headers, t, deadline, first)
                    now = time.perf_counter()
                    call.ttft = now - call.t_start
                    life.first_byte(worker, call, now - t_sent)
                    headers["content-type"] = ctype or "text/event-stream; charset=utf-8"
                    handed_off = True
                    served = True
                    return RelayResponse(life, call, worker, resp, first, headers, t, deadline)
                except UpstreamPoolFull:
                    if self.closing is not None:  # the drain's cut ended the wait for a slot
                        raise self._shut_down(call, worker) from None
                    # Every upstream connection (`upstream.max_connections`, all workers) stayed
                    # busy for the attempt's whole deadline: the request never left the gateway.
                    # The worker never saw it, so it is not blamed (blamed, idle workers were
                    # ejected under a spike); another worker needs a slot from the same pool, so
                    # no retry either: the client is told to come back, nothing was generated.
                    call.upstream_sent = False
                    life.refused(worker, call)
                    raise APIError(
                        503,
                        "The gateway has no free connection to its workers; retry shortly.",
                        "service_unavailable",
                        code="upstream_pool_full",
                        retry_after_s=1.0,
                    ) from None
                except UpstreamConnectError as e:
                    call.upstream_sent = False
                    # Clients get a stable message; the log gets what the socket said (failed).
                    last_error = APIError(
                        502,
                        "A worker could not be reached.",
                        "upstream_error",
                        code="upstream_connect_error",
                    )
                    life.refused(worker, call)
                    life.failed(worker, f"connect: {e}")
                except (TimeoutError, UpstreamStreamError) as e:
                    if self.closing is not None:
                        # `cut_waiting` ended the wait (or it ended past the grace anyway): the
                        # upstream request is aborted already (`_send`, `_first_chunk`, `_whole`).
                        raise self._shut_down(call, worker) from None
                    timeout = isinstance(e, TimeoutError)
                    if timeout and whole not in (0, 200):
                        # A refusal's body (a 4xx, read whole) outlasted the total deadline: no
                        # time is left for another worker, whose attempt would only fail (and be
                        # blamed) as one that "sent nothing"; the worker turned the request down,
                        # so nothing was generated (refunded, as a refusal that ends is).
                        call.upstream_sent = False
                        life.failed(worker, "answer timeout")
                        raise APIError(
                            504,
                            "The worker's answer did not finish within the gateway's total "
                            "timeout.",
                            "upstream_error",
                            code="upstream_timeout",
                        ) from None
                    if timeout and (not call.stream or whole == 200) and call.upstream_sent:
                        # The worker took the request and was generating: another attempt would
                        # generate it all again (and a client could burn fleet compute for free).
                        # No retry; the walk charges the reservation (gateway.app). A stream
                        # answered whole (`_streamed`) whose body outlasted the total deadline
                        # too: no time is left for another attempt (the walk refunds a stream).
                        call.worker, call.status, call.outcome = (
                            worker.name,
                            504,
                            "upstream_timeout",
                        )
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
                        else "The worker's answer broke off."
                        if whole
                        else "The worker's response broke off before it started.",
                        "upstream_error",
                        code="upstream_timeout" if timeout else "upstream_error",
                    )
                    life.failed(worker, "first-byte timeout" if timeout else str(e))
                finally:
                    if not handed_off:
                        life.released(worker, call)
            if last_error is not None:
                raise last_error
            raise no_capacity(f"no healthy worker is serving model `{call.model}`")
        finally:
            if served:
                for w in suspects:
                    life.failed(w, "HTTP 500")

    def cut_waiting(self, message: str) -> int:
        """A drain's grace is over: end every request still waiting on its worker now; returns
        how many were waiting.

        A request with no first byte yet (a long prefill, a queue inside vLLM) or a whole
        response still generating has no relay, so `Lifecycle.cut_streams` cannot reach it;
        left alone it outlived the drain until uvicorn cancelled it into a plain-text 500.
        Every such wait is in `deadlines` already (no registry of its own on the request path),
        so each is expired now: its upstream request is aborted (the worker stops the work),
        and `forward`, seeing ``closing`` set, answers the 503 `shutting_down` new and queued
        requests get during a drain, instead of a timeout or a retry elsewhere. A request
        between two attempts (reading a worker's 5xx body, bounded by ``idle_s``) tries no
        other worker either."""
        self.closing = message
        return self.deadlines.expire_all()

    def _shut_down(self, call: Call, worker: Worker | None) -> APIError:
        """The drain's answer for a request it cut off its worker (`cut_waiting`). The call is
        marked so the walk records it (a worker had it) and settles it as nothing generated:
        the gateway's shutdown is not the tenant's doing, so the reservation goes back."""
        if worker is not None:
            call.worker = worker.name
        call.status, call.outcome = 503, "gateway_shutdown"
        assert self.closing is not None
        return APIError(
            503, self.closing, "service_unavailable", code="shutting_down", retry_after_s=1.0
        )

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
        call.t_sent = time.perf_counter()
        try:
            with self.deadlines.within(timeout):
                return await self.client.post(
                    worker.url + call.path,
                    call.body,
                    headers,
                    functools.partial(self.life.learned, call, worker),
                )
        except TimeoutError as e:
            if ended_pool_wait(e):  # the gateway's own pool, not the worker, was too slow
                raise UpstreamPoolFull from None
            raise

    async def _first_chunk(
        self, resp: UpstreamResponse, timeout: float
    ) -> tuple[Callable[[], Awaitable[bytes]], bytes] | None:
        """The first body bytes, and how to read the next ones (b"" at the end)."""
        nxt = reader(resp)
        try:
            with self.deadlines.within(timeout):
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
        first: tuple[Callable[[], Awaitable[bytes]], bytes] | None = None,
    ) -> Response:
        """A whole answer: a non-streaming request's 200, a refusal (4xx), or a stream's 200 that
        came as a whole answer (`forward`: ``first``, its reader and first chunk); read to its end,
        within the total deadline, bounded.

        A 200 is relayed as it came only when it is an answer: a JSON object (`_whole_answer`).
        One that broke off mid-body, or that is something else (text, truncated JSON, an SSE
        body for a non-streaming request, any whole body for a stream), was generated all the
        same: no retry, a 502, charged as a cut-off answer (`_unrelayable`). A refusal's body
        reaches the client as the OpenAI envelope (`_error_envelope`)."""
        status = resp.status
        cap = WHOLE_BODY_MAX if status == 200 else WHOLE_ERROR_MAX
        try:
            with self.deadlines.within(deadline - _now()):
                body = await _read_capped(resp, cap, first)
        except UpstreamStreamError as e:
            await resp.abort()
            if status != 200 or self.closing is not None:
                raise  # a refusal's body cut: nothing was generated (`forward` retries it)
            # The worker had generated the answer whole before its first byte: retried, it ran
            # twice (review); with no other worker, it was a 502 charged nothing.
            return await self._unrelayable(
                call,
                worker,
                headers,
                f"answer broke off ({e})",
                "The worker's answer broke off.",
                outcome="upstream_broken",
                code="upstream_error",
            )
        except BaseException:
            await resp.abort()
            raise
        if body is None:
            await resp.abort()  # mid-body: the connection cannot be reused
            raise self._too_large(call, worker, status, cap)
        await resp.release()
        # No call.ttft: a whole response has no first token, and its duration would pollute the
        # TTFT histogram and the autoscaler's TTFT p95; it is recorded as e2e only.
        ctype = resp.headers.get("content-type")
        if status == 200:
            answer, call.usage = _whole_answer(body, ctype)
            if call.stream:
                # Charged by its usage when it has one (it is what the worker generated), else
                # the reservation (settlement: an `upstream_invalid_response`).
                return await self._unrelayable(
                    call,
                    worker,
                    headers,
                    f"a whole answer ({ctype}) to a stream request",
                    "The worker answered a stream request with a whole answer, not a stream.",
                )
            if not answer:
                call.usage = None  # not an answer: its bytes say nothing trustworthy
                return await self._unrelayable(
                    call,
                    worker,
                    headers,
                    f"HTTP 200 answer that is not a JSON object ({ctype}, {len(body)} bytes)",
                    "The worker's answer is not a valid response.",
                )
            call.outcome = "ok"
            headers["content-type"] = ctype or JSON
        else:
            call.outcome = "upstream_4xx"
            body = _error_envelope(status, body)
            headers["content-type"] = JSON
        self.life.succeeded(worker)
        await self._settle_whole(call)
        return Response(body, status, headers=headers)

    async def _settle_whole(self, call: Call, error: str | None = None) -> None:
        """`Lifecycle.finish` for an answer read whole. A client that hangs up now cancels this
        task (the dispatch's disconnect watch), and a settlement cancelled half way leaks the
        tenant's lease until its TTL: it finishes on its own task whatever happens to this one."""
        done = asyncio.ensure_future(self.life.finish(call, error))
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            _SETTLING.add(done)
            done.add_done_callback(_SETTLING.discard)
            raise

    async def _unrelayable(
        self,
        call: Call,
        worker: Worker,
        headers: dict[str, str],
        why: str,
        message: str,
        *,
        outcome: str = "upstream_invalid_response",
        code: str = "upstream_invalid_response",
    ) -> Response:
        """The 502 for a worker's answer the gateway cannot relay, though the worker worked on
        it: a 200 that broke off or is no answer, a stream answered whole, a 2xx other than 200
        with a body. Its body is read (or given up) already.

        Not retried: the worker took the request and answered, so it generated (another
        attempt would generate it again). Settled here, as a whole answer is, under
        ``outcome`` (gateway.settlement: the reservation, as for an answer cut off, unless
        ``call.usage`` says what it cost); the client's envelope carries the request's ids.
        The worker is blamed: a broken answer is its failure. Logged with what it did."""
        call.status, call.outcome = 502, outcome
        log.warning("request %s on %s: %s", call.request_id, worker.name, why)
        self.life.failed(worker, why, logged=True)
        err = APIError(502, message, "upstream_error", code=code)
        await self._settle_whole(call, message)
        return err.response(headers)

    def _too_large(self, call: Call, worker: Worker, status: int, cap: int) -> APIError:
        """The 502 for a whole answer over its bound (`_whole`); retried nowhere.

        A 200 was generated whole before its first byte came: the worker spent the compute, so
        the walk settles it as a whole answer cut off (the reservation, ``upstream_sent`` left
        set), and another attempt would generate it again for nothing. Nor is the worker blamed:
        a tenant's request (``prompt_logprobs`` over a long prompt) can make an answer this big.
        Any other status was no work done (refunded, as a worker's refusal is)."""
        if status != 200:
            call.upstream_sent = False
        log.warning(
            "request %s on %s: HTTP %d answer over %d bytes, cut off",
            call.request_id,
            worker.name,
            status,
            cap,
        )
        what = (
            f"The worker's answer is larger than the gateway relays whole ({cap >> 20} MiB); "
            "ask for less (prompt_logprobs, logprobs, n) or split the request."
            if status == 200
            else f"The worker answered HTTP {status} with a body larger than the gateway "
            f"relays ({cap} bytes)."
        )
        return APIError(502, what, "upstream_error", code="upstream_response_too_large")

    def _headers(self, call: Call, worker: str, reason: str, settings: Settings) -> dict[str, str]:
        h = echo_headers(call.request_id, call.client_request_id)
        server = settings.server
        if server.worker_header:
            h["x-kvgate-worker"] = worker
        if server.debug_headers:
            d = call.route_debug
            scores = ";".join(f"{k}={v:.3f}" for k, v in (d.scores if d else {}).items())
            h["x-kvgate-route"] = (
                f"reason={reason};attempts={call.attempts};matched_blocks="
                f"{d.matched_blocks if d else 0}" + (f";{scores}" if scores else "")
            )
        return h


async def _read_bounded(resp: UpstreamResponse, timeout: float) -> bytes:
    """A worker's 5xx body, for its own error envelope (`_upstream_error`): at most
    ``ERROR_BODY_MAX`` bytes kept, and not much more read (what one read brings, bounded by the
    upstream client's buffer). A broken worker streaming a huge or endless error body must not
    make the gateway buffer all of it until the timeout: past the cap the connection is aborted
    (it cannot be reused mid-body) and the error is built from what came."""
    nxt = reader(resp)
    parts: list[bytes] = []
    size = 0
    ended = False
    try:
        async with asyncio.timeout(timeout):
            while size < ERROR_BODY_MAX:
                chunk = await nxt()
                if not chunk:
                    ended = True
                    break
                parts.append(chunk)
                size += len(chunk)
    except (TimeoutError, UpstreamStreamError):
        await resp.abort()
        return b""
    except BaseException:  # cancelled (the client left): the connection must not leak either
        await resp.abort()
        raise
    if ended:
        await resp.release()
    else:
        await resp.abort()
    return b"".join(parts)[:ERROR_BODY_MAX]


async def _read_capped(
    resp: UpstreamResponse,
    cap: int,
    first: tuple[Callable[[], Awaitable[bytes]], bytes] | None = None,
) -> bytes | None:
    """A whole answer's body, or None once more than ``cap`` bytes came (what one read brings
    past it is all that is held beyond the cap): the clients' own ``read`` buffers whatever the
    worker sends until it ends. ``first``: the body's reader and its first chunk, read already."""
    if first is None:
        nxt, parts, size = reader(resp), [], 0
    else:
        nxt, parts, size = first[0], [first[1]], len(first[1])
        if size > cap:
            return None
    while chunk := await nxt():
        size += len(chunk)
        if size > cap:
            return None
        parts.append(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _usage_of(body: bytes) -> Usage | None:
    r"""The usage of a whole 200 answer, without parsing all of a big one on the event loop.

    Up to ``WHOLE_PARSE_MAX`` bytes: parsed whole, the top-level ``usage`` exactly. Above (a
    46 MB ``prompt_logprobs`` answer held the loop 0.72 s), the object is found by bytes, which
    vLLM's own serialisation makes unambiguous (compact JSON, `starlette.JSONResponse`):

    * ``"usage":{`` never occurs inside a JSON string: a quote in one is written ``\"``, so the
      byte after ``usage`` there is a backslash. Its closing quote ends a key, then, and the
      byte before its opening quote is ``,`` or ``{`` exactly when that quote is the key's own
      (``\"usage":{`` is a key that merely ends in ``"usage``): a key named ``usage`` whose
      value is an object.
    * vLLM writes exactly one such key: the top-level ``usage`` (after ``choices``, before
      ``prompt_logprobs``). The keys a client can choose (completions ``top_logprobs``' decoded
      tokens) hold numbers, not objects. So a second occurrence (some other server, a nested
      field) makes the answer ambiguous, and ambiguous is no usage, which settlement charges
      the reservation: a client can never get a usage of its choosing counted.
    * The object is parsed alone: the first closing brace within ``_USAGE_SPAN`` at which the
      slice is valid JSON ends it (a brace inside a string or a nested object leaves it
      invalid), so the rest of the body is never parsed, nor need it be valid.

    Cost: one ``find`` and one ``rfind`` over the body (C byte search: ~9 ms for 46 MB, about
    what receiving it costs) and a parse of ~200 bytes. None when there is no usage, or none
    that counts can be read from.
    """
    if len(body) <= WHOLE_PARSE_MAX:
        if USAGE_MARK not in body:
            return None
        with contextlib.suppress(orjson.JSONDecodeError, TypeError, ValueError, AttributeError):
            return Usage.from_json(orjson.loads(body).get("usage"))
        return None
    at = body.find(_USAGE_OBJ)
    if at <= 0 or body.rfind(_USAGE_OBJ) != at or body[at - 1] not in b",{":
        return None
    start = at + len(_USAGE_OBJ) - 1  # the object's "{"
    end = start
    limit = min(len(body), start + _USAGE_SPAN)
    for _ in range(16):  # a usage object has a few nested objects at most
        end = body.find(b"}", end + 1, limit)
        if end < 0:
            return None
        try:
            return Usage.from_json(orjson.loads(body[start : end + 1]))
        except orjson.JSONDecodeError:
            continue  # that brace was inside a string or a nested object
    return None


# How an SSE body starts: a field (or a comment), past any blank lines.
_SSE_STARTS = (b"data:", b":", b"event:", b"id:", b"retry:")


def _streamed(ctype: str, first: bytes) -> bool:
    """A stream's answer under a content-type other than vLLM's exact one (`forward`) is a
    stream all the same: SSE's, spelt otherwise (case, spaces), or SSE events under another
    (a server that labels its events application/json). Anything else (a JSON object, text)
    is a whole answer."""
    return ctype.strip().lower().startswith("text/event-stream") or first[:64].lstrip(
        b" \r\n"
    ).startswith(_SSE_STARTS)


def _whole_answer(body: bytes, ctype: str | None) -> tuple[bool, Usage | None]:
    """Whether a whole 200's body is an answer at all (a JSON object, as its content-type and
    bytes say), and its usage (`_usage_of`).

    A body up to ``WHOLE_PARSE_MAX`` is parsed whole (it was already, for its usage: vLLM's
    answers all carry one), so text, truncated JSON or an empty body is caught exactly. A
    bigger one is only looked at: its content-type and its first byte past whitespace (``{``);
    parsing tens of MB to validate them would hold the loop (see `_usage_of`). A big answer
    cut inside its JSON but framed whole passes, charged as an answer without usage is."""
    if ctype is not None and "json" not in ctype.lower():
        return False, None
    if len(body) <= WHOLE_PARSE_MAX:
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            return False, None
        if not isinstance(doc, dict):
            return False, None
        with contextlib.suppress(TypeError, ValueError, AttributeError):
            return True, Usage.from_json(doc.get("usage"))
        return True, None
    start = _JSON_SPACE.match(body)
    at = start.end() if start is not None else 0
    if body[at : at + 1] != b"{":
        return False, None
    return True, _usage_of(body)


# What a retry is counted under (`kvgate_retries_total{reason}`): the gateway's own codes for the
# failures it names, else the worker's status (`upstream_503`). The worker's own `code` is kept in
# the client's error but never made a label: vLLM's is an int (read as None: reason="None"), and a
# worker with a code per response made a new series with each (review: 10 series in 20 requests).
_RETRY_REASONS = frozenset(
    {
        "upstream_connect_error",
        "upstream_empty_stream",
        "upstream_error",
        "upstream_invalid_response",
        "upstream_overloaded",
        "upstream_pool_full",
        "upstream_redirect",
        "upstream_response_too_large",
        "upstream_timeout",
    }
)


def _retry_reason(e: APIError | None) -> str:
    if e is None:
        return "unknown"
    return e.code if e.code in _RETRY_REASONS else f"upstream_{e.status}"


def _upstream_error(status: int, body: bytes, retry_after_s: float | None = None) -> APIError:
    """A worker's 5xx (or 429) as the client's error, should no other worker serve the request.

    Keeps the worker's own error (its envelope, or older vLLM's top-level shape) when there is
    one: it says what really went wrong. A 429 (the worker too busy) is answered as a 503 is:
    the client's 429 means its own rate limit, which this is not. The worker's `retry-after`
    (seconds) is carried over, capped (`RETRY_AFTER_MAX_S`)."""
    _, message, type_, code, _param = _error_parts(status, body)
    if status == 429:
        return APIError(
            503,
            message,
            "service_unavailable",
            code="upstream_overloaded",
            retry_after_s=1.0 if retry_after_s is None else retry_after_s,
        )
    return APIError(
        status,
        message,
        type_,
        code=code if isinstance(code, str) else None,
        retry_after_s=retry_after_s,
    )


def _error_parts(status: int, body: bytes) -> tuple[bool, str, str, str | int | None, str | None]:
    """A worker's error body read: (is it the OpenAI envelope already, message, type, code,
    param). The envelope's fields, or those of older vLLM's top-level shape
    (``{"object": "error", "message": ...}``), or else "worker returned HTTP N"."""
    message, type_ = f"worker returned HTTP {status}", "upstream_error"
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False, message, type_, None, None
    if not isinstance(doc, dict):
        return False, message, type_, None, None
    err = doc.get("error")
    if isinstance(err, str) and err:
        return False, err, type_, None, None
    envelope = isinstance(err, dict)
    src = err if isinstance(err, dict) else doc
    if not envelope and doc.get("object") != "error" and "message" not in doc:
        return False, message, type_, None, None
    message = str(src.get("message") or message)
    type_ = str(src.get("type") or type_)
    code = src.get("code")
    if not isinstance(code, str | int) or isinstance(code, bool):
        code = None
    param = src.get("param")
    return envelope, message, type_, code, param if isinstance(param, str) else None


def _error_envelope(status: int, body: bytes) -> bytes:
    """A worker's refusal (a 4xx, read whole) as the client's body: verbatim when it is the
    OpenAI envelope (vLLM's own), else rebuilt as one (an HTML page from a proxy in front,
    older vLLM's top-level error, an empty body): clients parse the envelope."""
    envelope, message, type_, code, param = _error_parts(status, body)
    if envelope:
        return body
    return error_body(message, type_, param=param, code=code)


def _retry_after(headers: Mapping[str, str]) -> float | None:
    """A worker's `retry-after` in seconds, capped at ``RETRY_AFTER_MAX_S``; None when absent
    or not a number of seconds (the HTTP-date form is not carried over)."""
    v = headers.get("retry-after")
    if v is None:
        return None
    try:
        s = float(v)
    except ValueError:
        return None
    if not math.isfinite(s) or s < 0:
        return None
    return min(s, RETRY_AFTER_MAX_S)


def _now() -> float:
    return time.perf_counter()
