"""The HTTP server under the gateway: uvicorn with a connection guard and a draining shutdown.

uvicorn's httptools protocol has no bound on how long a client may take to send a request head
(the keep-alive timer only runs between requests, and any byte, even half a head, stops it), no
bound on open connections short of `limit_concurrency` (which counts requests as well and still
accepts the idle ones that exhaust file descriptors), and answers malformed requests in plain text.
A few thousand silent or half-sent connections then lock every real client out. So:

* `GuardedHttpProtocol` bounds the time to a complete request head (`server.head_timeout_s`),
  its size, its number of fields (`MAX_HEADER_FIELDS`) and its request-target (`MAX_URL_BYTES`,
  414), closes idle keep-alive connections (`server.keepalive_timeout_s`), and keeps open
  connections under `server.max_connections`. At the cap a new connection makes room by closing
  the oldest *idle* one (no complete request head yet, or waiting between requests): a flood of
  idle sockets then recycles itself while real clients, whose heads arrive within milliseconds,
  get through. Only when every connection is busy with a request is the newcomer refused (a
  prebuilt 503 and close: no parsing, no task).
* What follows a head is bounded as well. At most `MAX_PIPELINED` pipelined requests queue behind
  the running one (uvicorn queued every head of a read: a gigabyte of them in seconds, keyless);
  trailer fields are dropped and counted as head bytes (uvicorn added them to the request's
  headers); a response that beats its request's body closes the connection (the rest of the body
  was read as the next head). A refusal or a lost client ends the running request and drops the
  queued ones (uvicorn told only the last one parsed: under pipelining a queued one). While
  reading is paused (a queued request's body past 64 KiB), the socket's TCP state is read each
  second, so a client that leaves is still seen (`GuardedHttpProtocol._check_paused`).
* What llhttp lets through and RFC 9110/9112 do not: an HTTP/1.1 request without exactly one
  Host (400; HTTP/1.0 without one is served), a Host whose value is no `uri-host [":" port]`
  (400, `valid_host`; an empty one is valid and served), a transfer coding other than `chunked`
  (501, or 400 when `chunked` is not the last), `100 Continue` to an HTTP/1.0 client (not sent).
* A connection the server closes with bytes it wrote still unsent (in the transport's buffer:
  a client that does not read) is aborted instead, with a reset: asyncio's and uvloop's `close`
  waits for the buffer to drain, forever for such a client, and the socket, its pending bytes
  and its place under the cap stayed. A complete response whose bytes sit unsent (a whole answer
  bigger than the socket buffers) keeps its connection busy, not idle, until they are out, and
  is aborted once its client takes nothing for `timeouts.client_stall_s` (see
  `GuardedHttpProtocol._watch_drain`).
* Protocol-level refusals (bad framing, request smuggling shapes, oversized or late heads) are
  OpenAI error envelopes like every other refusal of the gateway (gateway/errors.py).
* Every response carries a request id, `x-kvgate-request-id` (gateway/ids.py). The app sets
  them on its answers (the walk on the two completion paths, `gateway.asgi.FastPathApp` on
  Starlette's routes, whose request lines name the id); on every other request the server adds
  them to a response that still lacks them (`_with_ids`: uvicorn's own plain-text 500 for an
  app that failed before answering), and to its own refusals (`_with_id`).
* `DrainingServer` turns the first SIGTERM/SIGINT into `Gateway.drain` (with a grace the caller
  picks: production's `drain_grace_s`, or a short one for `kvgate dev`), a second into a stop now
  (streams are ended at once, then a normal shutdown); see its docstring for a third.

Timers are armed per connection, or when a head arrives in pieces, never for a head that arrives
whole; per request the guard adds three short callbacks and two dict operations, about 2 us on
uvicorn's ~29 us protocol path (measured with a fake transport; within the noise of
bench/overhead.py's end-to-end numbers), plus one read of the write buffer's size at the end of
each response (a timer only where bytes are still unsent). The Host check and the walk-path test
for the request ids add ~0.3 us a head (the same way, on a slower machine: ~9 us a head).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import resource
import signal
import socket
import struct
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, ClassVar, Protocol

import httptools
import uvicorn
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from gateway.client_socket import AckProbe
from gateway.config import ServerSettings
from gateway.errors import error_body
from gateway.ids import echo_raw, next_request_id
from gateway.validate import CHAT, COMPLETIONS

log = logging.getLogger("kvgate.server")

# Scope key: perf_counter() when the request head was complete (read by the walk).
HEAD_AT = "kvgate.head_at"
# File descriptors kept free of client connections: the upstream connection each busy client
# connection may hold is counted separately (half the rest); these are for listeners, logs,
# the config watcher, probes, Redis and KV-event sockets.
FD_RESERVE = 128
# How long a refused connection keeps reading (and dropping) what its client still sends, so the
# refusal is read rather than lost to a reset (see GuardedHttpProtocol._refuse).
LINGER_S = 2.0
# SO_LINGER on with a 0 s timeout: closing the socket resets the connection and drops what the
# kernel still holds for the client (an abort's own close would leave it queued, orphaned).
_RESET_ON_CLOSE = struct.pack("ii", 1, 0)
# Requests one connection may have queued behind the one being answered (HTTP/1.1 pipelining).
# uvicorn queues every complete head a read holds, and one read of whole `GET /health` heads is
# ten thousand of them: without a cap a client grew the queue by that much per answer. Clients
# that pipeline send two or three; at the cap the parser stops, the last queued request's answer
# closes the connection, and the client sends the unanswered ones again (RFC 9112 9.3.2).
MAX_PIPELINED = 8
# Fields one request head may carry (and, apart, one trailer section): past it a 431. The byte
# bound alone let a head of 32,000 empty `a:` fields through, each a parser callback, a tuple
# and a list entry: ~40x the CPU per byte of one big field. Clients send 10 to 30 (Apache's
# LimitRequestFields is 100, Tomcat's maxHeaderCount 100).
MAX_HEADER_FIELDS = 256
# Bytes of a request-target: past it a 414 (RFC 9112 section 3). Nothing served here takes more
# than a short path and query (httptools' URL parser fails past 64 KiB, which read as a 400).
MAX_URL_BYTES = 16 * 1024
# While reading is paused (uvicorn pauses it once a request holds more than 64 KiB of body that
# nobody reads: a queued pipelined one), how often the socket's TCP state is read: the FIN of a
# client that left sits unread in the kernel, and the running request worked on for nobody.
PAUSED_CHECK_S = 1.0
# tcp_info's first byte, `tcpi_state` (linux/tcp_states.h): the peer has closed (a FIN: CLOSE_WAIT)
# or reset the connection (CLOSE).
_PEER_CLOSED = frozenset({7, 8})
# The head fields `on_header` looks at (one set lookup per field; the rest only when one matches).
_NOTED_FIELDS = frozenset({b"host", b"expect", b"transfer-encoding"})
# A Host field's whole value (RFC 9112 section 3.2, RFC 3986 section 3.2.2): uri-host [":" port],
# uri-host an IP-literal in brackets (IPv6 by its characters, or IPvFuture), or a reg-name
# (unreserved / pct-encoded / sub-delims; an IPv4 address is one), port digits (maybe none), then
# the trailing whitespace llhttp leaves in a value (it strips the leading). Empty is valid: a
# target URI without an authority is sent with an empty Host (section 3.2), and served. Linear
# (no ambiguous repetition), but a regex call still cost ~0.5 us a head where the whole head's
# parse was ~8 us (a fake transport, a slow machine): the values found valid are kept
# (`_HOSTS_OK`: a set lookup), and a deployment's clients send a handful.
valid_host = re.compile(
    rb"(?:\[(?:[0-9A-Fa-f:.]+|[vV][0-9A-Fa-f]+\.[A-Za-z0-9\-._~!$&'()*+,;=:]+)\]"
    rb"|[A-Za-z0-9\-._~!$&'()*+,;=]*(?:%[0-9A-Fa-f]{2}[A-Za-z0-9\-._~!$&'()*+,;=]*)*)"
    rb"(?::[0-9]*)?[ \t]*"
).fullmatch
# Host values `valid_host` accepted, up to a bound in number and length (a client sending a new
# valid one per request only keeps the rest on the regex).
_HOSTS_OK: set[bytes] = set()
_HOSTS_OK_MAX = 64
_HOST_KEPT_BYTES = 255  # a DNS name's length, and a port


def _envelope_response(
    status: int, message: str, code: str, type_: str, extra: bytes = b""
) -> bytes:
    """A whole HTTP/1.1 response carrying an OpenAI error envelope, closing the connection."""
    body = error_body(message, type_, code=code)
    return b"".join(
        [
            STATUS_LINE[status],
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            extra,
            b"connection: close\r\n\r\n",
            body,
        ]
    )


def _with_id(response: bytes) -> bytes:
    """A refusal of the server's own (`_envelope_response`) with a request id of ours: every
    response the gateway sends carries one. Only ours: the request's head was not (all) read,
    so no client id is echoed."""
    line = response.index(b"\r\n") + 2
    rid = next_request_id().encode()
    return b"%bx-kvgate-request-id: %b\r\n%b" % (response[:line], rid, response[line:])


# The paths whose requests the app's walk answers (`FastPathApp`, POST only): it sets the ids
# on each of its responses itself, so the server adds nothing there (see `_with_ids`).
_WALK_PATHS = frozenset({CHAT, COMPLETIONS})
# A client's request id that is echoed back (else ours is): gateway.app checks the walk's with it.
_RID_FIELD = b"x-kvgate-request-id"


def _with_ids(send: Callable[[Any], Awaitable[None]], request_headers: list[Any]) -> Any:
    """``send`` for a request outside the walk: a response start that lacks
    `x-kvgate-request-id` gets the ids every response carries (`gateway.ids.echo_headers`), a
    new id of ours and the client's `x-request-id` echoed. One that has them (every answer of
    `gateway.asgi.FastPathApp`, which picks them to log them) is sent as it is: this is the
    backstop for what the app did not answer (uvicorn's plain-text 500), and for an app other
    than the gateway's. Nothing on the walk's paths: a wrapped send costs a call per message,
    and a stream sends hundreds."""

    async def send_with_ids(message: Any) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", ()))
            if not any(k.lower() == _RID_FIELD for k, _ in headers):
                message = {**message, "headers": headers + echo_raw(request_headers)[2]}
        await send(message)

    return send_with_ids


# Prebuilt: refusing a connection at the cap must cost no more than a write and a close (and
# the id, `_with_id`).
_REFUSED = _envelope_response(
    503,
    "The gateway has too many open connections; retry shortly.",
    "too_many_connections",
    "service_unavailable",
    b"retry-after: 1\r\n",
)


class DisconnectWatch:
    """Cancels ``task`` once the client of the request behind ``receive`` goes away (at once
    when it is gone already); ``gone`` then says why the task was cancelled. ``stop()`` ends the
    watch (the task's work no longer depends on the client, or is over).

    Under this module's protocol, ``connection_lost`` (and a refusal mid-request) calls back:
    watching is two attribute writes. A task per request that sat in ``receive()`` only to learn
    of a disconnect cost a task creation, two steps and a cancellation on every stream; other
    servers (or a wrapped ``receive``) still get one, started after ``fallback_after_s``.
    """

    __slots__ = ("_cycle", "_receive", "_task", "_timer", "_watcher", "gone")

    def __init__(self, receive: Any, task: asyncio.Task[Any], fallback_after_s: float = 0.0):
        self.gone = False
        self._task: asyncio.Task[Any] | None = task
        self._receive = receive
        self._watcher: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        cycle = self._cycle = getattr(receive, "__self__", None)
        if cycle is not None and hasattr(cycle, "kvgate_lost"):
            if cycle.disconnected:
                self.lost()
            else:
                cycle.kvgate_lost = self.lost
                cycle.flow.resume_reading()  # as receive() does: a paused socket misses a close
            return
        self._cycle = None
        loop = asyncio.get_running_loop()
        if fallback_after_s > 0:
            self._timer = loop.call_later(fallback_after_s, self._start_watcher)
        else:
            self._start_watcher()

    def lost(self) -> None:
        if self._task is not None:
            self.gone = True
            self._task.cancel()

    def _start_watcher(self) -> None:
        self._timer = None
        self._watcher = asyncio.get_running_loop().create_task(self.watch())

    async def watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self.lost()

    def stop(self) -> None:
        """The client's disconnect no longer cancels the task (idempotent)."""
        self._task = None
        cycle = self._cycle
        if cycle is not None and cycle.kvgate_lost is not None:
            cycle.kvgate_lost = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None


class ConnectionGuard:
    """What one server's connections share: the cap, the timeouts, and which may be closed.

    `idle` holds the connections with no request in progress and no complete head yet, in the
    order they became idle (a dict keeps insertion order; re-entering moves one to the end), so
    the oldest is `next(iter(idle))`. `lingering` holds refused connections still reading what
    their client sends (see `GuardedHttpProtocol._refuse`): they go first when room is needed.
    """

    def __init__(
        self,
        max_connections: int,
        head_timeout_s: float,
        max_head_bytes: int,
        client_stall_s: float | Callable[[], float] = 30.0,
    ) -> None:
        self.max_connections = max_connections
        self.head_timeout_s = head_timeout_s
        self.max_head_bytes = max_head_bytes
        # `timeouts.client_stall_s`, or what reads the live setting (a reload may change it).
        self._client_stall_s = client_stall_s
        self.open = 0  # connections counted against the cap (evicted ones no longer are)
        self.idle: dict[GuardedHttpProtocol, None] = {}
        self.lingering: dict[GuardedHttpProtocol, None] = {}
        # What the guard did, for logs and tests.
        self.evicted = 0
        self.refused = 0
        self.head_timeouts = 0
        self.head_too_large = 0
        self.bad_requests = 0
        self.unsent_aborted = 0  # aborted with bytes unsent: the client did not take them

    def client_stall_s(self) -> float:
        """How long a client may take nothing of what it was sent."""
        s = self._client_stall_s
        return s() if callable(s) else s

    def make_room(self) -> bool:
        """Close the oldest lingering or idle connection; False when every one is busy."""
        victims = self.lingering or self.idle
        if not victims:
            return False
        next(iter(victims)).evict()
        self.evicted += 1
        return True


_on_message_begin = HttpToolsProtocol.on_message_begin
_on_headers_complete = HttpToolsProtocol.on_headers_complete
_on_response_complete = HttpToolsProtocol.on_response_complete
_TCP_INFO = getattr(socket, "TCP_INFO", None)  # Linux


def _peer_closed(transport: asyncio.Transport) -> bool:
    """Whether the client closed or reset the connection, from the socket's TCP state (what a
    paused transport does not read). False where that cannot be read (not TCP, not Linux)."""
    if _TCP_INFO is None:
        return False
    try:
        sock = transport.get_extra_info("socket")
        if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return False
        return sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 8)[0] in _PEER_CLOSED
    except (OSError, ValueError):  # closed meanwhile (uvloop's socket raises ValueError)
        return False


class _StopParsing(Exception):
    """Raised by a parser callback that has dealt with the connection already (refused it, or
    stopped taking requests on it): httptools cannot pause, and an error is the only way to stop
    it in the middle of a read. `data_received` finds it as the context of the parser's error."""


class _ClientTransport:
    """The client connection's transport as uvicorn's code sees it (`protocol.transport`, which
    each request cycle takes): the real one, but its `close` is the protocol's `_uvicorn_close`.
    uvicorn closes from the request cycle too (a response sent with `connection: close`, an app
    that returned or failed mid-response), where no protocol method runs.

    `write` and the other methods used per request are the real transport's own bound methods,
    kept on the instance: no call is added. Anything else is read from the real transport.
    """

    __slots__ = (
        "_protocol",
        "_real",
        "get_extra_info",
        "get_write_buffer_size",
        "is_closing",
        "write",
    )

    def __init__(self, real: asyncio.Transport, protocol: GuardedHttpProtocol) -> None:
        self._real = real
        self._protocol: GuardedHttpProtocol | None = protocol
        self.write = real.write
        self.is_closing = real.is_closing
        self.get_write_buffer_size = real.get_write_buffer_size
        self.get_extra_info = real.get_extra_info

    def close(self) -> None:
        p = self._protocol
        if p is None:  # the connection is lost (uvicorn's `connection_lost` closes it again)
            self._real.close()
        else:
            p._uvicorn_close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the guard's bounds (see the module docstring).

    `guard` is set on a subclass per server (`protocol_for`): uvicorn builds protocols itself,
    with a fixed set of arguments.
    """

    guard: ClassVar[ConnectionGuard]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The head deadline; while lingering, the end of the lingering.
        self._timer: asyncio.TimerHandle | None = None
        # Bytes received while the current head is incomplete, or of its trailer section.
        self._head_bytes = 0
        self._waiting = True  # no complete head since the connection opened or the last request
        # Of the head being parsed: its Host fields, and its Transfer-Encoding values.
        self._hosts = 0
        self._te: list[bytes] | None = None
        self._trailer_fields = 0  # fields of the trailer section being parsed
        self._counted = False  # counted in guard.open
        self._lingering = False  # refused: reading and dropping what the client still sends
        self._discard = False  # the parser stopped (lingering, or no more requests taken)
        self._idle = self.guard.idle
        # The request whose task runs (uvicorn's `cycle` is the last one parsed: under
        # pipelining, a queued one), and the cycle whose chunked body is between a chunk's size
        # line and its end (its data, or after the last one the trailer section).
        self._running: RequestResponseCycle | None = None
        self._in_chunk: RequestResponseCycle | None = None
        # A response's bytes still unsent (`_watch_drain`): the check's timer, the bytes left
        # and acked (kernel) at the last progress, when that was, and the bound.
        self._drain_timer: asyncio.TimerHandle | None = None
        self._drain_left = 0
        self._drain_acked = 0
        self._drain_at = 0.0
        self._drain_stall_s = 0.0
        self._drain_probe: AckProbe | None = None
        # While reading is paused, the check of the socket's TCP state (`_check_paused`).
        self._paused_timer: asyncio.TimerHandle | None = None

    # -- connection lifetime ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._raw = transport
        self.transport = _ClientTransport(transport, self)  # type: ignore[assignment]
        g = self.guard
        if g.open >= g.max_connections and not g.make_room():
            g.refused += 1
            self._waiting = False
            transport.write(_with_id(_REFUSED))
            transport.close()
            return
        g.open += 1
        self._counted = True
        g.idle[self] = None
        self._timer = self.loop.call_later(g.head_timeout_s, self._on_head_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._forget()
        super().connection_lost(exc)
        self._end_requests()
        if isinstance(self.transport, _ClientTransport):
            self.transport._protocol = None  # no reference cycle left for the collector

    def _end_requests(self) -> None:
        """Every request on the connection is over for its client (gone, or the framing is lost):
        the running one is marked disconnected, so it writes nothing more, and its disconnect
        callback (`DisconnectWatch`) runs, which aborts its upstream call; the queued ones are
        dropped, never started. uvicorn itself marks only `cycle`, the last one parsed: under
        pipelining a queued request, while the running one went on for nobody."""
        pipeline = self.pipeline
        for cycle, _app in pipeline:
            cycle.disconnected = True
        pipeline.clear()
        cycle = self._running
        if cycle is None or cycle.response_complete:
            return
        cycle.disconnected = True
        cycle.waiting_for_100_continue = False  # its `receive` writes nothing either
        cycle.message_event.set()
        lost = getattr(cycle, "kvgate_lost", None)  # DisconnectWatch.lost
        if lost is not None:
            cycle.kvgate_lost = None
            lost()

    def _forget(self) -> None:
        """Stop counting this connection (it is closing or closed) and drop its timer."""
        g = self.guard
        if self._counted:
            self._counted = False
            g.open -= 1
        g.idle.pop(self, None)
        g.lingering.pop(self, None)
        self._cancel_timer()
        self._stop_drain_watch()
        if self._paused_timer is not None:
            self._paused_timer.cancel()
            self._paused_timer = None

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def evict(self) -> None:
        """Closed to make room for a new connection: it has no request in progress."""
        self._waiting = False
        self._give_up()

    # -- closing ---------------------------------------------------------------------------------
    # asyncio's and uvloop's `close` waits for the transport's buffer to drain before closing the
    # socket: forever, for a client that does not read. So no close here leaves bytes unsent
    # without a bound: those that give up on the client abort, and the close after a complete
    # response is watched (`_watch_drain`).
    def _give_up(self) -> None:
        """The guard is done with the connection (idle past its keep-alive, evicted, no head in
        time, a refusal's lingering over, a refusal mid-response): uncounted at once, and
        aborted if bytes it was sent are still unsent: its client has not taken them by now."""
        self._forget()
        if self._raw.get_write_buffer_size():
            self._abort()
        else:
            self._raw.close()

    def _close_sent(self) -> None:
        """Close once what was written is out (a whole refusal): at once, uncounted, when it is
        out already; else the connection counts until it is, bounded by `_watch_drain`."""
        if self._raw.get_write_buffer_size():
            self._watch_drain()
        else:
            self._forget()
        self._raw.close()

    def _uvicorn_close(self) -> None:
        """uvicorn closes the connection (`_ClientTransport.close`): after a complete response
        sent with `connection: close` (or its `shutdown` between requests), the response is still
        delivered, bounded by `_watch_drain`; mid-response (the app returned without finishing,
        as the relay does for a client it cut off for not reading, or failed) unsent bytes are
        the rest of a response that will never be whole, and the connection is aborted."""
        raw = self._raw
        if raw.get_write_buffer_size() and not raw.is_closing():
            cycle = self._running
            if cycle is not None and not cycle.response_complete:
                self._abort()
                return
            self._watch_drain()
        raw.close()

    def _abort(self) -> None:
        """Reset the connection now, dropping what is still unsent (uncounted at once: the
        transport calls `connection_lost` on the next loop iteration)."""
        self._forget()
        self.guard.unsent_aborted += 1
        raw = self._raw
        with contextlib.suppress(Exception):  # best effort: uvloop's socket is a stand-in
            sock = raw.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
        raw.abort()

    def _watch_drain(self) -> None:
        """Bound a complete response whose bytes still sit in the transport's buffer: checked
        every `client_stall_s / 4` (at most 1 s), aborted once its client takes nothing of them
        for `client_stall_s` (the kernel's count of acked bytes did not grow, where it is read,
        and the buffer did not shrink). Once they are out, a kept-alive connection is idle and
        its keep-alive clock starts (`_drained`).

        A next request does not stop the watch: its response queues behind those bytes (uvicorn's
        `send` waits for the buffer to drain, for good if the client never reads), so a client
        that sent its next request without reading would have escaped the bound. The watch ends
        when the bytes are out, or with the connection."""
        if self._drain_timer is not None:
            return
        raw = self._raw
        self._drain_left = raw.get_write_buffer_size()
        self._drain_stall_s = stall = self.guard.client_stall_s()
        self._drain_at = self.loop.time()
        self._drain_probe = None
        if sys.platform == "linux":
            with contextlib.suppress(Exception):
                sock = raw.get_extra_info("socket")
                if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                    probe = AckProbe(sock, raw)
                    self._drain_acked = probe.read()[0]
                    self._drain_probe = probe
        self._drain_timer = self.loop.call_later(_check_every(stall), self._check_drain)

    def _check_drain(self) -> None:
        self._drain_timer = None
        raw = self._raw
        left = raw.get_write_buffer_size()
        if not left:
            self._drained()
            return
        now = self.loop.time()
        moved = left < self._drain_left
        probe = self._drain_probe
        if probe is not None:
            try:
                acked = probe.read()[0]
            except OSError:  # the socket is closed: `connection_lost` is on its way
                return
            moved = moved or acked != self._drain_acked
            self._drain_acked = acked
        if moved:
            self._drain_left, self._drain_at = left, now
        elif now - self._drain_at >= self._drain_stall_s:
            log.debug("client %s took nothing of %d unsent bytes: reset", self.client, left)
            self._abort()
            return
        self._drain_timer = self.loop.call_later(
            _check_every(self._drain_stall_s), self._check_drain
        )

    def _drained(self) -> None:
        """The response is out: a kept-alive connection between requests is idle now, with
        uvicorn's keep-alive clock (as `on_response_complete` arms it) unless a head is coming."""
        if self._raw.is_closing() or not self._counted or self._lingering:
            return
        cycle = self.cycle
        if (cycle is not None and not cycle.response_complete) or self.pipeline:
            return
        self._waiting = True
        self._idle[self] = None
        if not self._head_bytes and self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    def _stop_drain_watch(self) -> None:
        if self._drain_timer is not None:
            self._drain_timer.cancel()
            self._drain_timer = None
            self._drain_probe = None

    def timeout_keep_alive_handler(self) -> None:
        """uvicorn's keep-alive timer: an idle connection is closed (`_give_up`)."""
        if not self._raw.is_closing():
            self._give_up()

    # -- request heads ---------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._discard:
            return  # the rest of a refused request, or requests no longer taken: dropped
        # uvicorn's own, with the parser's reason in the error (one static phrase per failure).
        self._unset_keepalive_if_required()
        chunk = self._in_chunk
        # Inside a head (or between requests) at the read's start; `cycle` changes with each
        # head the read completes. Past a head, the bytes its request's body holds so far.
        waiting = self._waiting
        cycle = self.cycle
        body = 0 if waiting or cycle is None else len(cycle.body)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, _StopParsing):
                return  # a callback dealt with the connection
            if not self.transport.is_closing() and not self._lingering:  # else refused already
                self.guard.bad_requests += 1
                log.debug("malformed request from %s: %r", self.client, exc)
                self._refuse(400, _malformed(exc), "bad_http_request")
            return
        except httptools.HttpParserUpgrade:
            # The parser stops at an Upgrade (or CONNECT) request and parses nothing after it;
            # `on_headers_complete` dealt with the request and closes after its response.
            return
        if self._waiting:
            if not self._lingering and not self.transport.is_closing():
                # Still no complete head after this chunk: bound its size and its time. A read
                # that lay within the head counts whole; one where the head began after other
                # bytes (a body's tail, whole pipelined requests) counts the head's part of it
                # (`_head_begun_in`): charged whole, a valid request behind a big body got a 431
                # (its predecessor, still running, ended unanswered); charged 1, as it was, up
                # to a read (256 KiB) of head went uncounted, past the bound.
                last = self.cycle
                if waiting and last is cycle:
                    self._head_bytes += len(data)
                else:
                    self._head_bytes = _head_begun_in(data, last, body if last is cycle else 0)
                if self._head_bytes > self.guard.max_head_bytes:
                    self.guard.head_too_large += 1
                    self._refuse(
                        431, "Request headers too large", "request_header_fields_too_large"
                    )
                elif self._timer is None:
                    self._timer = self.loop.call_later(
                        self.guard.head_timeout_s, self._on_head_timeout
                    )
        elif chunk is not None and self._in_chunk is chunk and len(chunk.body) == body:
            # A whole read past a chunk's size line that added nothing to the body: the
            # trailer section. The parser holds a field until it ends, out of `on_header`'s
            # sight, so one that never ends is bounded here.
            self._trailer_bytes(len(data))

    # The callbacks below run once per request (`on_header` once per field): base methods called
    # directly (not through super()) and the idle dict held on the instance keep them to about
    # 1 us together.
    def on_message_begin(self) -> None:
        if self.pipeline and len(self.pipeline) >= MAX_PIPELINED:
            self._stop_taking()
            raise _StopParsing
        self._waiting = True
        self._head_bytes = 0  # not a trailer section's before it
        self._hosts = 0
        self._te = None
        _on_message_begin(self)

    def on_url(self, url: bytes) -> None:
        self.url += url  # uvicorn's own
        if len(self.url) > MAX_URL_BYTES:
            self.guard.head_too_large += 1
            self._refuse(414, f"The request target is over {MAX_URL_BYTES} bytes.", "uri_too_long")
            raise _StopParsing

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._waiting:  # a field of the head: uvicorn's own, inline (a call per field saved)
            name = name.lower()
            headers = self.headers
            if len(headers) >= MAX_HEADER_FIELDS:
                self.guard.head_too_large += 1
                self._refuse(
                    431,
                    f"Too many request header fields (at most {MAX_HEADER_FIELDS}).",
                    "request_header_fields_too_large",
                )
                raise _StopParsing
            if name in _NOTED_FIELDS:
                if name == b"host":
                    self._hosts += 1
                    if value not in _HOSTS_OK:
                        self._check_host(value)
                elif name == b"expect":
                    if value.lower() == b"100-continue":
                        self.expect_100_continue = True
                elif self._te is None:
                    self._te = [value]
                else:  # several lines are one list (RFC 9110 section 5.3)
                    self._te.append(value)
            headers.append((name, value))
        elif self._trailer_field(len(name) + len(value) + 4):
            raise _StopParsing

    def _check_host(self, value: bytes) -> None:
        """A Host value not known valid (`_HOSTS_OK`): kept if `valid_host`, else refused (and
        the parser stopped)."""
        if valid_host(value) is None:
            self.guard.bad_requests += 1
            self._refuse(
                400,
                "The Host header field is not a valid host[:port] (RFC 9112 section 3.2).",
                "bad_http_request",
            )
            raise _StopParsing
        if len(_HOSTS_OK) < _HOSTS_OK_MAX and len(value) <= _HOST_KEPT_BYTES:
            _HOSTS_OK.add(value)

    def on_headers_complete(self) -> None:
        # When the request head was complete: the walk's clock starts here, not when its task
        # first runs, so TTFT and the request log count the time a busy loop kept it waiting.
        self.scope[HEAD_AT] = time.perf_counter()  # type: ignore[literal-required]
        self._waiting = False
        self._head_bytes = 0
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._idle.pop(self, None)
        if (self._hosts != 1 or self._te is not None) and self._refuse_head():
            raise _StopParsing
        if self.expect_100_continue and self.parser.get_http_version() != "1.1":
            # An HTTP/1.0 client is sent no `100 Continue` (RFC 9110 sections 10.1.1, 15.2).
            self.expect_100_continue = False
        if self.parser.should_upgrade():
            self._upgrade_requested()
            return
        _on_headers_complete(self)
        cycle = self.cycle
        if cycle is not None:
            cycle.kvgate_lost = None  # this cycle reports its disconnect (DisconnectWatch)
            scope = self.scope
            if scope["method"] != "POST" or scope["path"] not in _WALK_PATHS:
                cycle.send = _with_ids(cycle.send, self.headers)  # type: ignore[method-assign]
        if self.pipeline:
            # Queued behind the running request, and uvicorn stopped reading until its turn: a
            # client that left meanwhile went unseen (its FIN waiting in the kernel) while the
            # running request worked on for nobody. The queue is bounded (`MAX_PIPELINED`).
            self.flow.resume_reading()
        else:
            self._running = self.cycle  # started at once (a queued one: `on_response_complete`)

    def on_body(self, body: bytes) -> None:
        # uvicorn's own, inline (its upgrade check is moot: the parser stops at an upgrade's head)
        cycle = self.cycle
        if cycle.response_complete:
            return
        cycle.body += body
        if len(cycle.body) > HIGH_WATER_LIMIT:
            # Over 64 KiB of body nobody reads yet (a queued pipelined request's, whose turn
            # comes after the running one's answer): reading pauses, and is watched.
            self.flow.pause_reading()
            if self._paused_timer is None:
                self._paused_timer = self.loop.call_later(PAUSED_CHECK_S, self._check_paused)
        cycle.message_event.set()

    def _check_paused(self) -> None:
        """Reading is paused, so a client that leaves goes unseen: its FIN waits in the kernel,
        and the running request (a long completion) worked on to the end for nobody, its slot
        and lease held. The socket's TCP state says it: closed by the peer ends the requests
        and the connection. Checked while reading stays paused (not queued bodies read on: they
        are up to `max_body_bytes` each, times `MAX_PIPELINED`)."""
        self._paused_timer = None
        if not self.flow.read_paused or self._raw.is_closing():
            return
        if _peer_closed(self._raw):
            log.debug("client %s left while reading was paused", self.client)
            self._end_requests()
            self._give_up()
            return
        self._paused_timer = self.loop.call_later(PAUSED_CHECK_S, self._check_paused)

    def _refuse_head(self) -> bool:
        """The head has no Host field, or several, or a Transfer-Encoding (rare: checked only
        then): True when that refused the request. llhttp let through an HTTP/1.1 request with
        no Host or two (RFC 9112 section 3.2: 400), and a coding before `chunked` (`gzip,
        chunked`), which the app read as the plain body (section 6.1: 501)."""
        if self._hosts > 1 or (not self._hosts and self.parser.get_http_version() == "1.1"):
            self.guard.bad_requests += 1
            self._refuse(
                400,
                "A request may carry only one Host header field."
                if self._hosts
                else "An HTTP/1.1 request needs a Host header field.",
                "bad_http_request",
            )
            return True
        if self._te is None:
            return False
        listed = (c.strip().lower() for c in b",".join(self._te).split(b","))
        codings = [c for c in listed if c]  # a list's empty elements are ignored (RFC 9110 5.6.1)
        if codings == [b"chunked"]:
            return False
        self.guard.bad_requests += 1
        if not codings or codings[-1] != b"chunked" or codings.count(b"chunked") > 1:
            # The body's length cannot be known (RFC 9112 section 6.3; llhttp refuses it too, but
            # after this callback, with the request's task started).
            self._refuse(
                400,
                "Malformed HTTP request (Transfer-Encoding must end in a single chunked).",
                "bad_http_request",
            )
        else:
            self._refuse(
                501,
                "Only the chunked transfer coding is supported.",
                "unsupported_transfer_coding",
            )
        return True

    # A chunked body's chunks: what follows the last one's size line is the trailer section.
    def on_chunk_header(self) -> None:
        self._in_chunk = self.cycle
        self._trailer_fields = 0

    def on_chunk_complete(self) -> None:
        self._in_chunk = None
        self._head_bytes = 0

    def _trailer_field(self, n: int) -> bool:
        """A trailer field of ``n`` bytes: counted against `MAX_HEADER_FIELDS` and the head's
        bound (`_trailer_bytes`); True when that refused the request."""
        self._trailer_fields += 1
        if self._trailer_fields <= MAX_HEADER_FIELDS:
            return self._trailer_bytes(n)
        self.guard.head_too_large += 1
        self._refuse(
            431,
            f"Too many request trailer fields (at most {MAX_HEADER_FIELDS}).",
            "request_header_fields_too_large",
        )
        return True

    def _trailer_bytes(self, n: int) -> bool:
        """Count ``n`` bytes of a trailer section against the head's bound; True when that
        refused the request. uvicorn added trailer fields to the request's headers, where auth,
        request ids and the header limit are read, without a bound (a client grew one request's
        headers by a hundred megabytes); nothing here uses trailers, so `on_header` drops them.
        """
        self._head_bytes += n
        if self._head_bytes <= self.guard.max_head_bytes:
            return False
        self.guard.head_too_large += 1
        self._refuse(431, "Request trailer section too large", "request_header_fields_too_large")
        return True

    def _stop_taking(self) -> None:
        """The pipeline is full: the parser stops (what the read still holds is dropped) and the
        last queued request's answer closes the connection; the client sends the unanswered
        ones again on a new one. Until then the connection reads and drops what comes: a client
        that leaves is seen (a paused socket misses a close, and the running request worked on
        for nobody), and a flood costs reads, no memory."""
        self.cycle.keep_alive = False
        self._discard = True
        self.flow.resume_reading()

    def _upgrade_requested(self) -> None:
        """No protocol upgrade is served here (websockets are off, h2c is not supported), and the
        parser reads nothing after an upgrade request, its body included. A request without a
        body is served as plain HTTP/1.1, as RFC 9110 lets a server ignore `Upgrade` (what
        `curl --http2` expects), then the connection closes; one with a body would reach the
        app without it, so it is refused, and so is CONNECT (this is no forward proxy)."""
        method = self.parser.get_method()
        has_body = any(
            (name == b"content-length" and value.strip() not in (b"", b"0"))
            or name == b"transfer-encoding"
            for name, value in self.headers
        )
        if method == b"CONNECT" or has_body:
            self.guard.bad_requests += 1
        if method == b"CONNECT":
            self._refuse(405, "method CONNECT not allowed", "method_not_allowed")
        elif has_body:
            self._refuse(
                400,
                "Protocol upgrades are not supported; send the request without an Upgrade header.",
                "upgrade_not_supported",
            )
        else:
            _on_headers_complete(self)
            cycle = self.cycle
            if cycle is not None:
                scope = self.scope
                if scope["method"] != "POST" or scope["path"] not in _WALK_PATHS:
                    cycle.send = _with_ids(cycle.send, self.headers)  # type: ignore[method-assign]
                if not self.pipeline:
                    self._running = cycle
                cycle.keep_alive = False

    def on_response_complete(self) -> None:
        running = self._running
        if running is not None and running.more_body and not self._raw.is_closing():
            self._answered_early()
            return
        if self.pipeline and not self._raw.is_closing():
            self._running = self.pipeline[-1][0]  # the next queued: uvicorn starts it now
        _on_response_complete(self)
        # uvicorn armed its keep-alive timer: no pipelined request, the connection stays open and
        # is idle until the next head (the timer stops at the next byte; `data_received` then
        # arms the head timer if the head comes in pieces).
        if self._raw.get_write_buffer_size() and self._counted:
            # Not out yet (a whole response bigger than the socket buffers): bounded, and busy,
            # not idle, until it is; then the keep-alive clock starts (`_drained`). A pipelined
            # request uvicorn has just started waits behind these bytes: bounded the same.
            if self.timeout_keep_alive_task is not None:
                self.timeout_keep_alive_task.cancel()
                self.timeout_keep_alive_task = None
                self._waiting = True
            self._watch_drain()
        elif self.timeout_keep_alive_task is not None and self._counted:
            self._waiting = True
            self._idle[self] = None

    def _answered_early(self) -> None:
        """The response went out before its request's body was all in (a bad key, a declared
        size over the limit: answered from the head). The connection closes, lingering (the
        client, maybe still sending, reads the answer rather than a reset) and dropping the rest
        of the body: kept open, it was read as the next request's head, answered with a second,
        unsolicited 431, or a 408 for a slow upload."""
        self.server_state.total_requests += 1  # as uvicorn's `on_response_complete` counts
        self._cancel_timer()
        self._close_lingering()

    def _on_head_timeout(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        self.guard.head_timeouts += 1
        if self._head_bytes:  # part of a head: say why (the client is not sending: no linger)
            self._refuse(
                408,
                f"The request head did not arrive within {self.guard.head_timeout_s:g} s.",
                "request_timeout",
                linger=False,
            )
        else:  # nothing sent: nothing to answer
            self._give_up()

    # -- refusals --------------------------------------------------------------------------------
    def send_400_response(self, msg: str) -> None:
        """uvicorn's plain-text 400 (should one of its code paths still call it), as an envelope."""
        self._refuse(400, msg, "bad_http_request")

    def _refuse(
        self,
        status: int,
        message: str,
        code: str,
        type_: str = "invalid_request_error",
        *,
        linger: bool = True,
    ) -> None:
        """Answer with an OpenAI error envelope and close: the connection's framing is lost.

        A request in progress on this connection (a pipelined head went bad) is ended, and any
        queued behind it dropped (`_end_requests`): its response could not be delimited from
        this one, and it must not run on for nobody. With `linger`, the close is a lingering
        one (RFC 9112 section 9.6): the response and a FIN go out, and what the client is still
        sending (the rest of a big body) is read and dropped for up to `LINGER_S`. Closing
        with unread data would send a reset, and the client's stack may then drop the response
        before it reads it: the refusal would arrive as "connection reset". A lingering
        connection still counts against the cap and is the first to go when room is needed.
        """
        self._waiting = False
        self._cancel_timer()
        self.guard.idle.pop(self, None)
        running = self._running
        mid_response = (
            running is not None and running.response_started and not running.response_complete
        )
        self._end_requests()
        if mid_response:  # no room for another status line
            self._give_up()
            return
        self.transport.write(_with_id(_envelope_response(status, message, code, type_)))
        if linger:
            self._close_lingering()
        else:
            self._close_sent()

    def _close_lingering(self) -> None:
        """Close after what was written, reading and dropping what the client still sends for up
        to `LINGER_S` (see `_refuse`)."""
        if not (self._counted and self.transport.can_write_eof()):
            self._close_sent()
            return
        self._lingering = self._discard = True
        self.guard.lingering[self] = None
        self.transport.write_eof()
        self.flow.resume_reading()
        self._timer = self.loop.call_later(LINGER_S, self._end_linger)

    def _end_linger(self) -> None:
        self._timer = None
        self._give_up()


def _head_begun_in(data: bytes, last: RequestResponseCycle | None, body_before: int) -> int:
    """The bytes of ``data`` (one read) that belong to a head which began inside it and is not
    complete at its end: what the guard charges that head for the read. ``last`` is the request
    parsed before it, whose body held ``body_before`` bytes at the read's start.

    httptools tells no offsets, so the head's start is bounded from two sides and the lesser
    bound is charged; each is exact in a shape pipelining clients send:

    * the bytes after the read's last blank line (CRLF CRLF): a head that has not ended holds
      none (llhttp takes no bare LF and no folded line), so it lies within them. Exact when the
      request before it ends with one: it has no body, or a chunked one.
    * the read less the bytes it added to ``last``'s body, which all precede the head. Exact
      when the read began in that body (a content-length body's tail, then the head).

    Otherwise (a whole request with a content-length body, then the head, in one read) it is
    over, never under: by what the read held before that body (its request's head, and any
    whole requests before), or by the body's bytes after its own last blank line, whichever is
    less; never by the body whole (charged the read whole, a valid request behind a big body got
    a 431). Runs only for a head that a read began and left incomplete, never once per request.
    """
    n = len(data)
    end = data.rfind(b"\r\n\r\n")
    if end >= 0:
        n -= end + 4
    if last is not None:
        n = min(n, len(data) - (len(last.body) - body_before))
    return max(n, 1)  # begun: never 0, which reads as no head at all (`_on_head_timeout`)


def _check_every(stall_s: float) -> float:
    """How often `_watch_drain` looks (as the relay's stall check does)."""
    return max(0.05, min(1.0, stall_s / 4))


class ConnectionMetrics(Collector):
    """The guard's counts as Prometheus series, read at scrape time (nothing on the hot path)."""

    def __init__(self, guard: ConnectionGuard) -> None:
        self.guard = guard

    def collect(self) -> Iterator[Metric]:
        g = self.guard
        yield GaugeMetricFamily(
            "kvgate_client_connections", "Open client connections", value=g.open
        )
        yield GaugeMetricFamily(
            "kvgate_client_connections_max",
            "Cap on open client connections (server.max_connections, or what the open-file "
            "limit holds)",
            value=g.max_connections,
        )
        closed = CounterMetricFamily(
            "kvgate_client_connections_closed",
            "Client connections the server closed or refused itself, by reason",
            labels=["reason"],
        )
        for reason, n in (
            ("evicted_idle", g.evicted),
            ("refused_at_cap", g.refused),
            ("head_timeout", g.head_timeouts),
            ("head_too_large", g.head_too_large),
            ("bad_request", g.bad_requests),
            ("unsent_aborted", g.unsent_aborted),
        ):
            closed.add_metric([reason], n)
        yield closed


def _malformed(exc: BaseException) -> str:
    """The client-facing message for a parser error: llhttp's reason is a static phrase
    ("invalid character in chunk size"), worth passing on; two need saying differently."""
    reason = str(exc).strip().rstrip(".")
    if "PRI/Upgrade" in reason:  # the HTTP/2 connection preface, without TLS
        return "HTTP/2 without TLS (prior knowledge) is not supported; use HTTP/1.1."
    if not reason or "callback" in reason:  # one of uvicorn's callbacks failed (e.g. the URL)
        return "Malformed HTTP request."
    return f"Malformed HTTP request ({reason})."


def protocol_for(guard: ConnectionGuard) -> type[GuardedHttpProtocol]:
    """A protocol class bound to one server's guard (uvicorn takes a class, not an instance)."""
    return type("BoundGuardedHttpProtocol", (GuardedHttpProtocol,), {"guard": guard})


def effective_max_connections(configured: int) -> int:
    """`configured`, or less where the file-descriptor limit could not hold it.

    Raises the soft RLIMIT_NOFILE to the hard one first (as Go's runtime does): the soft 1024 of
    many shells is a legacy of select(). Each client connection may hold an upstream one, so at
    most half the descriptors left after `FD_RESERVE` go to clients; past that, `accept` fails
    with EMFILE and every new client sees a reset, which is what the cap is there to prevent.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    if soft == resource.RLIM_INFINITY:
        return configured
    fit = max(16, (soft - FD_RESERVE) // 2)
    if fit < configured:
        log.warning(
            "server.max_connections=%d does not fit the open-file limit (%d): using %d",
            configured,
            soft,
            fit,
        )
        return fit
    return configured


class Drainable(Protocol):
    def drain(self, grace_s: float | None = None) -> Awaitable[None]: ...


class DrainingServer(uvicorn.Server):
    """The first SIGTERM/SIGINT drains the gateway (`Gateway.drain`) and then stops the server;
    a second one ends open streams at once and stops; a third stops waiting for anything but the
    gateway's own shutdown, and a fourth interrupts Python (KeyboardInterrupt).

    uvicorn alone would close its sockets straight away and leave load balancers and in-flight
    streams to find out the hard way, and its second Ctrl-C waits out `timeout_graceful_shutdown`
    then cancels request tasks mid-flight (a `CancelledError` traceback per request). Signals we
    handle are not re-raised after the server stops (uvicorn's default): the process exits 0
    through the normal path, where `kvgate dev` stops its workers.
    """

    def __init__(
        self, config: uvicorn.Config, gateway: Drainable, drain_grace_s: float | None = None
    ) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.drain_grace_s = drain_grace_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self.signals = 0
        self.guard: ConnectionGuard | None = None  # set by build_server
        self._drain: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def serve(self, sockets: list[Any] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: object) -> None:
        # A signal handler runs between two bytecodes of whatever the loop was doing: only hand
        # the work to the loop from here. Nothing is re-raised after the server stops.
        self.signals += 1
        if not self.started or self.loop is None:
            self.should_exit = True  # during start-up: it stops as soon as it has started
            return
        if self.signals <= 2:
            self.loop.call_soon_threadsafe(self._drain_now if self.signals == 1 else self._stop_now)
            return
        # A third: wait for nothing more (the lifespan shutdown still runs, so the gateway still
        # closes its clients); a fourth interrupts Python itself.
        self.config.timeout_graceful_shutdown = 0.2  # type: ignore[assignment]
        self.should_exit = True
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def _spawn(self, coro: Awaitable[None]) -> asyncio.Task[None]:
        t: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def _drain_now(self) -> None:
        async def drain_then_exit() -> None:
            try:
                await self.gateway.drain(self.drain_grace_s)
            finally:
                if self.signals < 2:  # else `_stop_now` took over (and cancelled this)
                    self.should_exit = True

        self._drain = self._spawn(drain_then_exit())

    def _stop_now(self) -> None:
        async def cut_then_exit() -> None:
            if self._drain is not None:
                self._drain.cancel()
            try:
                await self.gateway.drain(0.0)  # ends open streams with the SSE error event
            finally:
                # Nothing is left to finish: don't let uvicorn wait its full grace for stragglers.
                self.config.timeout_graceful_shutdown = min(
                    self.config.timeout_graceful_shutdown or 1.0, 1.0
                )
                self.should_exit = True

        log.warning("second signal: ending open streams and stopping now")
        self._spawn(cut_then_exit())


def uvicorn_config(app: Any, server: ServerSettings, guard: ConnectionGuard) -> uvicorn.Config:
    """The gateway's uvicorn settings: the guarded httptools protocol, no websockets (nothing
    here serves them), no access log (the gateway logs each request itself), no proxy-headers
    middleware (it rewrote the client address from X-Forwarded-For on every request, and nothing
    in the gateway reads the client address)."""
    return uvicorn.Config(
        app,
        host=server.host,
        port=server.port,
        http=protocol_for(guard),
        ws="none",
        log_config=None,
        access_log=False,
        proxy_headers=False,
        lifespan="on",
        timeout_keep_alive=server.keepalive_timeout_s,  # type: ignore[arg-type]
        timeout_graceful_shutdown=10,
    )


def build_server(
    app: Any, server: ServerSettings, *, drain_grace_s: float | None = None
) -> DrainingServer:
    """The gateway's uvicorn server; `app` is `gateway.asgi.create_app`'s (its state holds the
    `Gateway` to drain). `drain_grace_s` None: the configured `server.drain_grace_s`."""
    gateway = app.state.gateway
    guard = ConnectionGuard(
        max_connections=effective_max_connections(server.max_connections),
        head_timeout_s=server.head_timeout_s,
        # The exact header limit (431) is the app's, on complete heads; this only stops a head
        # that never completes from growing without bound, so it is generous.
        max_head_bytes=2 * server.max_header_bytes,
        # Live: `[timeouts]` take effect on reload (the relay reads them per request).
        client_stall_s=lambda: gateway.settings.timeouts.client_stall_s,
    )
    gateway.metrics.registry.register(ConnectionMetrics(guard))
    s = DrainingServer(uvicorn_config(app, server, guard), gateway, drain_grace_s)
    s.guard = guard
    return s
