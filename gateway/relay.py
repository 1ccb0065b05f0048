"""The SSE relay: one upstream stream to one client, from the first event to [DONE].

It forwards the worker's bytes untouched. It looks at the bytes only to find event boundaries,
`[DONE]`, and the final usage chunk (a substring test, no JSON per event); the usage chunk is
parsed once, and removed again when the client did not ask for it (the proxy forces
`include_usage` upstream so every stream can be accounted). Once the first byte is out, a failure
becomes an in-band SSE error event followed by the end of the stream, as vLLM ends a stream that
failed, so clients see one well-formed stream either way. Before it, a bug of the relay's own is
answered as one in the walk is: the 500 envelope with the request's ids (`RelayResponse._bug`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from gateway.call import USAGE_MARK, Call, Usage
from gateway.client_socket import AckProbe
from gateway.config import TimeoutSettings
from gateway.errors import sse_error_event
from gateway.metrics import BatchedHistogram
from gateway.server import DisconnectWatch
from gateway.upstream import UpstreamResponse, UpstreamStreamError
from workers.worker import Worker

if TYPE_CHECKING:
    from gateway.lifecycle import Lifecycle

log = logging.getLogger("kvgate.proxy")

_DONE = b"data: [DONE]\n\n"
# A content event's usage (vLLM puts it after `choices`): the object, with at most one level of
# nesting (`completion_tokens_details`, `prompt_tokens_details`).
_LIVE_MARK = b',"usage":{'
_LIVE_USAGE = re.compile(rb',"usage":(\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\})')
# Where a vLLM event names its choice: each streamed event holds one choice, `index` its first
# field. Like the usage mark, it cannot occur inside a JSON string (its quotes would be escaped).
_CHOICE_MARK = b'"choices":[{"index":'
_INDEX = re.compile(rb"\d{1,9}")
_COMPLETION = re.compile(rb'"completion_tokens":(\d{1,15})')
# The most bytes one SSE event may take before its blank line. The relay holds an event until it
# is whole, so a worker that never ends one (no blank line: a broken server, CRLF framing, which
# the scan does not take for a boundary) would otherwise grow that buffer without bound until
# total_s, while its client gets nothing. The cap sits far above any real event of vLLM: a
# token's event is well under 1 kB, even with top_logprobs=20 only a few kB, and the largest is
# the first event of a streamed /v1/completions with `echo` and `logprobs`, which carries the
# whole prompt with its logprobs: ~600 bytes per prompt token at logprobs=20, so ~40 MB for a
# 64k-token prompt (the whole-response path sees such answers of tens of MB too). 64 MiB takes
# prompts up to ~110k tokens at that; past it the stream ends with the in-band upstream error.
EVENT_MAX = 64 * 1024 * 1024
# How a worker's in-band error event starts (vLLM: `json.dumps` of `{"error": ...}`).
_ERROR_EVENT = b'data: {"error"'
_STREAM_ERRORS = {
    "idle_timeout": "The worker sent nothing for too long; the gateway ended the stream.",
    "upstream_broken": "The worker's stream ended unexpectedly; the response is incomplete.",
}


class RelayResponse(Response):
    """Streams one upstream SSE response to the client.

    The pump runs in the request's task and a disconnect cancels it (the server's callback, or a
    watcher task under another server): the moment the client goes away the upstream connection
    is closed, so the worker aborts the request and frees its KV blocks. Cleanup sits in
    `finally` of `__call__`, so it runs even if the response is cancelled before its first byte.
    """

    def __init__(
        self,
        life: Lifecycle,
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
        self._life = life
        self._call = call
        self._worker = worker
        self._resp = resp
        self._next, self._first = first
        self._t = timeouts
        self._deadline = deadline
        self._done = False
        # [DONE], or an event over EVENT_MAX: the byte scan (`_feed`) takes no more bytes.
        self._scan_over = False
        self._too_big = False  # an event over EVENT_MAX, seen by the splice: the pump fails it
        self._finished = False  # _complete ran: slot, lease and settlement are already settled
        self.cut: str | None = None  # set (then the task cancelled) to end the stream: shutdown
        self.stalled = False  # set (then the task cancelled) by _check_stall
        self._sending = 0.0  # perf_counter when the send in progress started; 0 = none
        # One timer per stream watches both ends: the client's reading (stall) and the worker's
        # silence (idle_s) and the total deadline, instead of a timeout context per SSE read
        # (asyncio.timeout enter/exit/reschedule was ~5% of the loop's time under load).
        self._stall_every = max(0.05, min(1.0, timeouts.client_stall_s / 4, timeouts.idle_s / 4))
        self._last_chunk = 0.0  # perf_counter of the worker's last chunk (or the stream start)
        self._stall_timer: asyncio.Handle | None = None  # the next check (`_check_stall`)
        self._watch: DisconnectWatch | None = None  # a client that leaves cancels the stream
        self._settling = False  # _complete is running: the stall check must not cancel it
        self._acks: AckProbe | None = None  # the client's TCP progress, where the kernel says
        # The ``send`` to find the probe by, at the first stall check: most streams end sooner.
        self._acks_of: Send | None = None
        self._acked = -1  # bytes the client had acked at the last stall check
        self._progress_at = 0.0  # perf_counter of the last stall check that saw progress
        # What the byte scan (`_feed`) keeps between chunks.
        # An event not yet complete, in the pieces it came in: joined once, when its end comes
        # (re-joined on every read, a big event cost quadratic copying).
        self._pending: list[bytes] = []
        self._pending_size = 0  # bytes in ``_pending`` (bounded by EVENT_MAX)
        self._cr = False  # the last chunk ended in CR: a LF starting the next is its CRLF's
        self._prev = b""  # the events of the read before (an error event just before [DONE])
        self._out: list[bytes] = []  # complete events not yet written to the client
        self._strip = not call.client_wants_usage
        self._strip_live = not call.client_wants_live_usage
        self._live = call.live_usage_upstream  # content events carry usage
        # A stream of several choices (n > 1, a batch of prompts) keeps each choice's last live
        # usage by its index (`_keep_choices`), the index -1 for events whose index is unread;
        # None for one choice, whose last usage is also its largest.
        self._choices = call.account.choices if call.account is not None else 1
        self._by_choice: dict[int, bytes] | None = {} if self._live and self._choices > 1 else None
        self._inter: BatchedHistogram | None = None
        self._cycle: Any = None  # uvicorn's request cycle when chunks may be written directly
        self._head = b""  # the response head, held back to go out with the first events
        # The response's start until it is sent (with the first body chunk: `_start_out`) or
        # rendered into ``_head`` (`_held_head`): until then a bug can still be answered whole.
        self._start: Message | None = {
            "type": "http.response.start",
            "status": 200,
            "headers": self.raw_headers,
        }
        self._ended = False  # the client has its whole response (the final chunk is out)
        # The pump's waits on the worker (`with self._waiting:`), which the stall check watches.
        self._waiting = _AwaitingWorker()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        call = self._call
        me = asyncio.current_task()
        assert me is not None
        # The pump runs in this task, and a client that leaves cancels it.
        watch = self._watch = DisconnectWatch(receive, me)
        streams = self._life.streams
        streams[me] = self
        try:
            # Inside the try: whatever happens from here, the cleanup below settles the call.
            self._acks_of = send
            self._progress_at = self._last_chunk = time.perf_counter()
            self._stall_timer = asyncio.get_running_loop().call_later(
                self._stall_every, self._check_stall, me
            )
            await self._pump(send)
        except asyncio.CancelledError:
            if self.stalled and not watch.gone:
                me.uncancel()
                self._client_stalled(call)
                self._drop_client()
            elif self.cut is not None and not watch.gone:
                me.uncancel()
                if not self._ended:  # else [DONE] is out: only the upstream's tail was left
                    call.outcome = "gateway_shutdown"
                    self._life.metrics.stream_errors.labels("gateway_shutdown").inc()
                    with contextlib.suppress(OSError):
                        err = sse_error_event(self.cut, "server_error", 503)
                        await self._send(send, self._take_out() + err)
                        await self._end(send)
            elif not watch.gone:
                raise
            else:
                me.uncancel()
        except OSError:  # the socket died under a send
            watch.gone = True
        except Exception:
            if not watch.gone:
                self._bug()
            raise
        finally:
            if self._stall_timer is not None:
                self._stall_timer.cancel()
            streams.pop(me, None)
            watch.stop()
            if watch.gone and not self._finished:  # a settled outcome is final
                call.outcome = "client_disconnect"
                self._life.metrics.client_disconnects.inc()
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
        disconnect watch stops, a drain no longer sees the stream and the stall check holds off
        first, and a cancel either already requested is taken now, so the cleanup in
        ``__call__`` settles instead."""
        if self._watch is not None:
            self._watch.stop()
        me = asyncio.current_task()
        if me is not None:
            self._life.streams.pop(me, None)  # a drain's cut (`cut_streams`) passes it by now
            if me.cancelling():
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
        life = self._life
        life.released(self._worker, call)
        if self._done and not call.outcome:
            call.outcome = "ok"
        if call.outcome == "ok":
            life.succeeded(self._worker)
        if self._by_choice:
            # Built once, for the settlement (the only reader), not on every read.
            call.live_usage = _choices_usage(self._by_choice)
        await life.finish(call)

    def _bug(self) -> None:
        """A bug escaped the relay (an exception of its own, not an upstream error: those end
        the stream in band) and goes on to `FastPathApp._failed`, which logs it once under the
        request's id and answers it. Before the response's first byte reached the client
        (`_unstart`) that answer is the 500 envelope with the ids, not a connection closed on
        it; and the call is settled as a bug in the walk is (`Gateway._failed`): the client got
        none of the stream, so what the scan took from it (events, usage) is dropped and the
        settlement gives the reservation back whole (a 5xx) and frees the lease. Past the first
        byte the response cannot be answered again: the connection closes on it, as before."""
        if not self._unstart() or self._finished:
            return
        call = self._call
        call.status, call.outcome = 500, "internal_error"
        call.usage, call.events = None, 0

    def _unstart(self) -> bool:
        """Whether nothing of the response has reached the client, the response made unstarted
        for the server if so: a head held back (`_held_head`) was rendered by uvicorn, whose
        request cycle took the response for started, and is told it was not (framing too: the
        answer in its place has a content-length)."""
        if self._start is not None:
            return True  # not sent: the generic relay sends it with the first chunk
        if not self._head:
            return False
        self._head = b""
        cy = self._cycle
        cy.response_started = False
        cy.chunked_encoding = None
        cy.expected_content_length = 0
        return True

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
        splice = getattr(self._resp, "splice", None)
        if splice is not None and _can_hold_head(send):
            start, self._start = self._start, None
            head = await _held_head(send, start)
            self._cycle = _direct_cycle(send)
            if self._cycle is None:  # not a stream we may write ourselves: the head goes now
                send.__self__.transport.write(head)  # type: ignore[attr-defined]
            else:
                self._head = head
        # Else the start goes with the first body chunk (`_start_out`), as a held head does.
        if self._cycle is None:
            splice = None
        m = self._life.metrics
        self._inter = m.batched(m.inter_event, call.model)
        self._last_chunk = time.perf_counter()
        try:
            self._feed(self._first)
            ended = False
            while True:
                # The events that came with [DONE] wait for it: one write after the settlement.
                if self._out and not self._done:
                    await self._flush(send)
                if self._done or ended:
                    break
                if time.perf_counter() > self._deadline:
                    raise TimeoutError
                with self._waiting:
                    if splice is not None:
                        ended = await splice(self._on_chunk)
                        if self._too_big:
                            raise UpstreamStreamError(_too_big())
                    else:
                        chunk = await self._next()
                        if chunk:
                            self._took(chunk)
                        else:
                            ended = True
            if not self._done:
                # An event cut in half is dropped, never sent: a client's SDK parsed the half
                # event's JSON, raised, and never read the error event after it (review). It may
                # hold usage the client did not ask for, too.
                raise UpstreamStreamError("worker closed the stream without [DONE]")
        except (UpstreamStreamError, TimeoutError) as e:
            if not (isinstance(e, TimeoutError) and self._done):
                await self._fail(send, e)
                return
            # The timer's cut (idle_s, deadline) was asked for, but the splice fed the worker's
            # [DONE] before this task woke up to take it: the stream is whole, not timed out.
            ended = False  # `_drain_upstream` reads the worker's stream on to its end
        # Everything is settled before the client sees the end: a client that starts its next
        # request on [DONE] must find its concurrency lease and the worker's slot already free
        # (else a false 429 at max_concurrent).
        await self._settle_before_done()
        if not call.outcome:
            call.outcome = "ok"
        await self._end(send, self._take_out() + _DONE)
        await self._drain_upstream(ended)

    async def _fail(self, send: Send, e: UpstreamStreamError | TimeoutError) -> None:
        """End the stream with the in-band error event for ``e`` (its one terminal event).

        The stream leaves ``streams`` first: it is ending already, and a drain's cut
        (`cut_streams`) arriving while the error event is sent would add a second error event
        and a second [DONE]. What bounds these sends is the stall check, as for any send."""
        me = asyncio.current_task()
        if me is not None:
            self._life.streams.pop(me, None)
        call = self._call
        reason = "idle_timeout" if isinstance(e, TimeoutError) else "upstream_broken"
        # A stable message per reason: clients branch on it, and the transport's own words
        # (aiohttp internals, addresses) belong in the log, not in a tenant's stream.
        msg = _STREAM_ERRORS[reason]
        call.outcome = reason
        self._life.metrics.stream_errors.labels(reason).inc()
        log.warning(
            # The text, not the exception: a record that keeps an exception keeps its
            # traceback, and with it this request's frames, body and relay, for as long as
            # any handler holds the record (the writer's queue, a test's log capture).
            "request %s on %s: %s (%s)",
            call.request_id,
            call.worker,
            reason,
            str(e) or type(e).__name__,
        )
        if self._out:  # complete events the client had no room for yet
            await self._flush(send)
        await self._send(
            send, sse_error_event(msg, "upstream_error", 504 if reason == "idle_timeout" else 502)
        )
        await self._end(send)

    async def _drain_upstream(self, ended: bool) -> None:
        """After [DONE]: read the worker's stream to its end (its terminating chunk usually came
        with [DONE]) so the connection goes back to the pool; bounded like any read."""
        try:
            with self._waiting:
                while not ended:
                    ended = not await self._next()
        except (TimeoutError, UpstreamStreamError):
            self._done = False  # not read to the end: the connection is closed, not reused

    def _took(self, chunk: bytes) -> None:
        prev = self._last_chunk
        self._last_chunk = now = time.perf_counter()
        assert self._inter is not None
        self._inter.observe(now - prev)
        self._feed(chunk)

    def _feed(self, chunk: bytes) -> None:
        """Scan one chunk from the worker: complete events go to ``_out``; [DONE] ends it.

        Raises UpstreamStreamError for an event over EVENT_MAX (`_whole_events`)."""
        if self._scan_over:
            return  # nothing after [DONE] reaches the client
        if not self._pending and chunk.endswith(b"\n\n") and not self._cr:
            out = chunk  # the usual case: the worker's writes are whole events
        else:
            # CRLF- or CR-framed events never end in two LFs: looked for only off the fast path.
            if self._cr or b"\r" in chunk:
                chunk = self._lf(chunk)
            out = self._whole_events(chunk)
            if not out:
                return
        # [DONE] ends the read (vLLM's last write). Else it is looked for only in a read that
        # ends in something other than a JSON event (a comment, a blank line after [DONE]): a
        # search of every read added ~25% to this scan's cost per event. A JSON event after
        # [DONE] in the same read (no server sends one) hides it: that stream ends as before.
        done = out.endswith(_DONE)
        if not done and not out.endswith(b"}\n\n") and b"[DONE]" in out:
            at = _done_at(out)
            if at >= 0:  # nothing after [DONE] is the stream's: dropped, as later reads are
                out = out[: at + len(_DONE)]
                done = True
        if USAGE_MARK in out:
            out = self._take_usage(out, self._strip)
        self._call.events += out.count(b"\n\n")
        if not done:
            self._prev = out
        else:
            if (_ERROR_EVENT in out or _ERROR_EVENT in self._prev) and not self._call.outcome:
                # vLLM's in-band error (the engine failed the request after its first byte),
                # written just before [DONE]: relayed as sent, recorded as what it is. It was
                # logged `ok`, counted nowhere and taken as the worker's success (review).
                # Neither success nor failure for its health: the request may be what failed.
                # Looked for at [DONE] only: a search of every read cost ~0.3% per request.
                self._call.outcome = "upstream_error_event"
                self._life.metrics.stream_errors.labels("upstream_error_event").inc()
            self._done = self._scan_over = True
            self._pending.clear()
            self._pending_size = 0
            out = out[: -len(_DONE)]
        if out:
            self._out.append(out)

    def _lf(self, chunk: bytes) -> bytes:
        """``chunk`` with its SSE line ends (CRLF, CR: both valid SSE) made LF, the scan's one
        boundary. A worker framing events with CRLF (sse-starlette's default) had no event
        found in its whole stream: it reached the client raw, unstripped, with a second [DONE],
        and was charged nothing (review). A CRLF split over two reads loses its LF in the
        second. JSON escapes CR inside strings, so a raw CR is only ever a line end."""
        if self._cr and chunk[:1] == b"\n":
            chunk = chunk[1:]
        self._cr = chunk[-1:] == b"\r"
        if b"\r" in chunk:
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        return chunk

    def _whole_events(self, chunk: bytes) -> bytes:
        """The complete events that ``chunk`` ends (with the pending ones before it, joined),
        keeping what follows the last of them pending; b"" when it ends none.

        The pending pieces hold no event boundary, so only ``chunk`` is searched, plus the one
        byte before it: a blank line may straddle two reads ("...\n" + "\n..."). A pending
        event past EVENT_MAX ends the stream (UpstreamStreamError): it is dropped, and no more
        bytes are taken."""
        pending = self._pending
        cut = chunk.rfind(b"\n\n") + 2
        if cut < 2:
            if not (pending and chunk[:1] == b"\n" and pending[-1].endswith(b"\n")):
                if chunk:
                    pending.append(chunk)
                    self._pending_size += len(chunk)
                    if self._pending_size > EVENT_MAX:
                        self._overflow()
                return b""
            cut = 1  # the straddling blank line ends with the chunk's first byte
        if pending:
            pending.append(chunk[:cut])
            out = b"".join(pending)
            pending.clear()
        else:
            out = chunk[:cut]
        self._pending_size = rest = len(chunk) - cut
        if rest:
            pending.append(chunk[cut:])
            if rest > EVENT_MAX:
                self._overflow()
        return out

    def _overflow(self) -> None:
        """An event over EVENT_MAX: its bytes are dropped (never sent: the client has none of
        them) and the scan stops; the stream ends with the upstream error (`_fail`)."""
        self._pending.clear()
        self._pending_size = 0
        self._scan_over = True
        raise UpstreamStreamError(_too_big())

    def _on_chunk(self, chunk: bytes) -> bool:
        """The splice's sink, called from the upstream connection's ``data_received``: scan,
        write to the client if it can take it, and say whether the task may keep sleeping."""
        try:
            self._took(chunk)
        except UpstreamStreamError:  # not raised into data_received: the task wakes to fail it
            self._too_big = True
            return False
        if self._done:
            return False  # the task settles, then writes these events with [DONE]
        if self._out and not self._write_now():
            return False
        return self._last_chunk <= self._deadline

    def _take_out(self) -> bytes:
        out = self._out
        body = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        return body

    def _write_now(self) -> bool:
        """Write the backlog as one chunk straight to the client's transport, as uvicorn's send
        would frame it; False when the client is not taking data (flow control, gone)."""
        cy = self._cycle
        if cy.flow.write_paused or cy.disconnected:
            return False
        body = self._take_out()
        if self._head:
            head, self._head = self._head, b""
            cy.transport.write(b"%b%x\r\n%b\r\n" % (head, len(body), body))
        else:
            cy.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        return True

    async def _flush(self, send: Send) -> None:
        if self._cycle is not None and self._write_now():
            return
        await self._send(send, self._take_out())

    async def _start_out(self, send: Send) -> None:
        """The response's head goes out before anything sent through ``send``: the held one
        (`_held_head`), or the start not sent yet (the generic relay's, held back like it, so
        that a bug before the first event is still answered whole: `_bug`)."""
        if self._head:
            head, self._head = self._head, b""
            self._cycle.transport.write(head)
        elif self._start is not None:
            start, self._start = self._start, None
            await send(start)

    async def _end(self, send: Send, body: bytes = b"") -> None:
        """The response's last chunk (with the terminator in the same write)."""
        if self._head or self._start is not None:
            await self._start_out(send)
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
        if self._head or self._start is not None:
            await self._start_out(send)
        self._sending = time.perf_counter()
        await send({"type": "http.response.body", "body": body, "more_body": True})
        self._sending = 0.0

    def _client_stalled(self, call: Call) -> None:
        """Cut off: the response stays unfinished, so the server closes the connection.

        Past the settlement (a stall while [DONE] is sent, or while `_drain_upstream` reads the
        worker's tail) the cut only frees the task and the upstream connection: the outcome the
        call was settled, charged and logged under is final, and it is not counted again."""
        if self._finished:
            return
        call.outcome = "client_stalled"
        self._life.metrics.stream_errors.labels("client_stalled").inc()
        log.warning("request %s: client stopped reading; stream cut off", call.request_id)

    def _drop_client(self) -> None:
        """A client cut off for not reading: its connection goes now (the server resets one with
        bytes unsent) and uvicorn's cycle is told it is gone, as a lost connection would, so it
        does not log the cut, already counted and logged as `client_stalled`, as an app that
        "returned without completing response" at ERROR (an alert per stalled client)."""
        cy = self._cycle
        if cy is None:
            return  # not a uvicorn cycle: its server closes it its own way
        with contextlib.suppress(Exception):
            cy.transport.close()
        cy.disconnected = True

    def _check_stall(self, task: asyncio.Task[Any]) -> None:
        """The stream's timer: the worker's side (`_worker_overdue`), then the client's
        (`_check_client`)."""
        now = time.perf_counter()
        if self._worker_overdue(now):
            # Cut one loop step later, not now: a worker read handled in this same iteration
            # (I/O runs before timers, on asyncio and on uvloop's libuv) may have woken the task
            # with a chunk it has not taken yet (the generic relay takes chunks in its task),
            # and that wake-up runs before a callback scheduled now. The chunk resets the idle
            # clock or ends the stream; once it is taken, the recheck sees which.
            self._stall_timer = asyncio.get_running_loop().call_soon(self._cut_for_worker, task)
            return
        self._check_client(task, now)

    def _worker_overdue(self, now: float) -> bool:
        """The pump waits on a worker silent past ``idle_s``, or past the total deadline."""
        return (
            self._waiting.awaiting
            # Not once [DONE] is in: the task is about to settle, it only has not run yet.
            # (After the end is out, the wait is `_drain_upstream`'s, bounded by these too.)
            and (self._ended or not self._done)
            and (now - self._last_chunk > self._t.idle_s or now > self._deadline)
        )

    def _cut_for_worker(self, task: asyncio.Task[Any]) -> None:
        """The worker's cut, asked for by `_check_stall` one loop step ago, if still due."""
        now = time.perf_counter()
        if not self._worker_overdue(now):
            self._check_client(task, now)
            return
        self._waiting.idle_cut = True  # the pump turns this cancel into the idle-timeout error
        task.cancel()
        # Still watched: the error event's send can block on a client that stopped reading.
        self._stall_timer = asyncio.get_running_loop().call_later(
            self._stall_every, self._check_stall, task
        )

    def _check_client(self, task: asyncio.Task[Any], now: float) -> None:
        """Cut off a client that stopped reading within ``client_stall_s`` of the last byte its
        TCP stack accepted (``AckProbe``), however much the buffers between could still absorb;
        a send blocked past that window (no probe) or past the total deadline cuts it too."""
        started = self._sending
        stalled = bool(started) and now > self._deadline and not self._settling
        if self._acks_of is not None:
            self._acks, self._acks_of = AckProbe.of(self._acks_of), None
        acks = self._acks
        if acks is not None and not stalled:
            try:
                acked, queued = acks.read()
            except OSError:  # the socket is gone: the disconnect handling takes it from here
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
        """Find the usage chunk among complete events; parse it once; drop it if unrequested.
        Where the worker was asked for usage on every event (`Call.live_usage_upstream`), keep
        the last one an event carried and strip those the client did not ask for.

        vLLM's usage chunk (``"choices":[]``) is the last event with a usage before [DONE], so
        it is found from the end, not by splitting every event of the read (a short stream's
        whole answer often arrives in one read: the split and scan were ~2% of a request)."""
        at = out.rfind(USAGE_MARK)
        sep = out.rfind(b"\n\n", 0, at)
        start = sep + 2 if sep >= 0 else 0
        end = out.find(b"\n\n", at)  # found: ``out`` holds complete events only
        ev = out[start:end] if end >= 0 else out[start:]
        final = ev.startswith(b"data: {") and b'"choices":[]' in ev
        if final:
            # TypeError: a usage of the wrong shape ("prompt_tokens": [9]) must not break a
            # stream that is otherwise whole (the whole-response path suppresses it too).
            with contextlib.suppress(orjson.JSONDecodeError, TypeError, ValueError):
                self._call.usage = Usage.from_json(orjson.loads(ev[6:]).get("usage"))
        if not self._live:  # no usage on content events: the usage chunk alone
            if final and strip:
                return out[:start] + (out[end + 2 :] if end >= 0 else b"")
            return out  # a content chunk carrying usage the client asked for: kept as is
        if final:
            # Stripped, what follows it in this read ([DONE]) stays.
            after = out[end + 2 :] if end >= 0 else b""
            last = after if strip else out[start:]
            out = out[:start]
        else:
            last = b""
        # Content events carrying usage (`continuous_usage_stats`): the last is what a cut
        # stream is charged by; stripped for clients that did not ask. The mark cannot occur
        # inside a JSON string (its quotes would be escaped there).
        i = out.rfind(_LIVE_MARK)
        if i >= 0:
            if self._by_choice is not None:
                self._keep_choices(out)
            else:
                m = _LIVE_USAGE.match(out, i)
                if m is not None:
                    self._call.live_usage = m[1]
            if self._strip_live:
                out = _LIVE_USAGE.sub(b"", out)
        return out + last if last else out

    def _keep_choices(self, out: bytes) -> None:
        """Keep the last live usage of every choice whose events are in ``out``, by its index.

        vLLM's live usage counts one choice (`completion_tokens` is that choice's, and
        `prompt_tokens` its prompt's), and a batch's prompts and a prompt's n choices are
        engine requests of their own, merged as they come: the last event may be a choice far
        behind another, so a cut batch charged by it paid for the laggard alone (2,003 tokens
        generated, 14 charged). Every event of the read counts here, not the read's last, and
        its index is a byte search from the event's start: no event is parsed. An event whose
        index cannot be read (not vLLM's layout, or out of range) is kept under -1, the largest
        such count, for the settlement to take as any choice's."""
        by = self._by_choice
        assert by is not None
        for m in _LIVE_USAGE.finditer(out):
            at = m.start()
            sep = out.rfind(b"\n\n", 0, at)
            j = out.find(_CHOICE_MARK, sep + 2 if sep >= 0 else 0, at)
            d = _INDEX.match(out, j + len(_CHOICE_MARK)) if j >= 0 else None
            index = int(d[0]) if d is not None else -1
            if 0 <= index < self._choices:
                by[index] = m[1]
            elif _tokens(m[1]) >= _tokens(by.get(-1, b"")):
                by[-1] = m[1]


def _tokens(usage: bytes) -> int:
    """The completion count in a live usage's bytes (0 if none), to compare two of them."""
    m = _COMPLETION.search(usage)
    return int(m[1]) if m is not None else 0


def _choices_usage(by_choice: dict[int, bytes]) -> bytes:
    """``Call.live_usage`` of a stream of several choices: a JSON list of [index, usage]."""
    return b"[%b]" % b",".join(b"[%d,%b]" % kv for kv in by_choice.items())


def _too_big() -> str:
    return f"worker sent an SSE event over {EVENT_MAX} bytes without its end (a blank line)"


def _done_at(out: bytes) -> int:
    """Where the [DONE] event starts in ``out`` (complete events), or -1: at an event's start
    only (the start of ``out``, or right after a blank line), not in an event's text."""
    if out.startswith(_DONE):
        return 0
    at = out.find(b"\n\n" + _DONE)
    return at + 2 if at >= 0 else -1


class _AwaitingWorker:
    """``with`` around the relay's awaits on the worker: flags them for the stall timer, which
    cancels the task when the worker stays silent past ``idle_s`` or the deadline; that cancel
    leaves the block as TimeoutError. A context object made once per stream, not a coroutine
    wrapper: no extra frame per chunk. It holds its own flags and no reference to the relay: a
    relay <-> helper cycle made every stream garbage that only the cyclic collector could free
    (with everything the stream held: its call, route, upstream response), ~60 containers per
    request and a 30-50 ms collection every ~1,000 requests."""

    __slots__ = ("awaiting", "idle_cut")

    def __init__(self) -> None:
        self.awaiting = False  # the pump is waiting for the worker's next chunk
        self.idle_cut = False  # set (then the task cancelled) by the stall check: worker silent

    def __enter__(self) -> None:
        self.awaiting = True

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: Any) -> None:
        self.awaiting = False
        if et is asyncio.CancelledError and self.idle_cut:
            self.idle_cut = False
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            raise TimeoutError from None


def reader(resp: UpstreamResponse) -> Callable[[], Awaitable[bytes]]:
    """A response's next-chunk call: its own where it has one (no async generator per stream),
    else a step of ``chunks()``."""
    nxt = getattr(resp, "next_chunk", None)
    if nxt is not None:
        return nxt  # type: ignore[no-any-return]
    it = resp.chunks()
    return lambda: anext(it, b"")


def _can_hold_head(send: Send) -> bool:
    """uvicorn's cycle behind ``send`` writes the head at once and without waiting (not
    started, not paused): `_held_head` may catch it."""
    cy = getattr(send, "__self__", None)
    return (
        getattr(cy, "response_started", True) is False
        and getattr(cy, "disconnected", True) is False
        and getattr(getattr(cy, "flow", None), "write_paused", True) is False
        and getattr(cy, "transport", None) is not None
    )


class _HeldWrite:
    """Stands in for the client's transport while uvicorn writes the response head."""

    __slots__ = ("data",)

    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data


async def _held_head(send: Send, start: Any) -> bytes:
    """The head uvicorn would write for ``start``, caught instead of written: it goes out in one
    write with the first events (`_write_now`), one syscall per response fewer. uvicorn still
    renders it (default headers, validation) and marks the response started."""
    cy: Any = getattr(send, "__self__")  # noqa: B009 (checked by _can_hold_head)
    real, held = cy.transport, _HeldWrite()
    cy.transport = held
    try:
        await send(start)
    finally:
        cy.transport = real
    return held.data


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
