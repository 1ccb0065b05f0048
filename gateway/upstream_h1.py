"""A minimal pooled HTTP/1.1 client for the one call the hot path makes: POST JSON to a worker,
stream the response back.

Why not aiohttp here: per request it builds a `ClientRequest`, a `URL`, a payload object, a
response object, timers and a `StreamReader`, and every body chunk crosses two buffers; profiled
under the `bench overhead` ladder that was ~11% of the gateway's core (the largest single item
after uvicorn's own send). This client writes the request as one pre-assembled buffer and feeds the
response to httptools (the C parser uvicorn already uses for the other side), handing body chunks
straight from `data_received` to the relay. What it leaves out is what a worker call does not use:
redirects, cookies, proxies, compression, TLS to workers (https worker URLs go through aiohttp:
`make_upstream` picks per URL), HTTP/2.

Semantics kept from the aiohttp client (tests/faults run against both): a failure before the
response head is `UpstreamConnectError` (the request is retried elsewhere), a body that breaks off
is `UpstreamStreamError`; `abort` closes the connection (the worker sees the client leave),
`release` after a full read returns it to the pool. A pooled connection the worker closed while
idle is found by `connection_lost` and never handed out; one that dies in the instant between
being picked and written, before a byte of answer, is resent once on a new connection
(`H1Upstream._resend`; the aiohttp client does the same).

A connection is pooled only while the worker has sent nothing but the answers asked of it: a byte
that starts another message after the current answer ended (in the same read as its end, or on
the idle connection) closes it at once (`on_message_begin`), as aiohttp's `should_close` and Go's
"unsolicited response on idle HTTP channel" do. Reused, that stray response was the next request's
answer: another client's. A `101 Switching Protocols` (no answer to a POST) is a malformed
response: a connect error, retried elsewhere.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

import httptools

from gateway.upstream import (
    AiohttpUpstream,
    UpstreamClient,
    UpstreamConnectError,
    UpstreamResponse,
    UpstreamStreamError,
)
from workers.deadlines import Deadlines

# Body bytes buffered from a worker before its socket stops being read (the relay is slower than
# the worker: a slow client); reading resumes once the relay has taken them.
HIGH_WATER = 256 * 1024
# A response head (status line and headers, interim 1xx heads included) bigger than this, or with
# more header lines, is malformed. httptools bounds neither: a worker sending header lines without
# end grew the gateway by 235 MiB, and one endless header value, which httptools re-joins on every
# read, stalled the event loop 80-160 ms a read. vLLM's heads are a few hundred bytes.
HEAD_MAX = 64 * 1024
HEADERS_MAX = 256
# Bytes a response may send in a row without a body byte once its head is parsed: in practice
# its trailer section (after a chunked body's last chunk), which vLLM never sends. httptools
# bounds none of it and re-joins a trailer value on every read (quadratic, as a head's), so a
# worker sending one without end grew the gateway without bound; past this it is malformed.
DRY_MAX = 16 * 1024


class _Unsolicited(Exception):
    """Raised from a parser callback to stop parsing a connection that is being closed."""


class _Conn(asyncio.Protocol):
    """One keep-alive connection to a worker; its parser outlives the responses it carries."""

    def __init__(self, pool: H1Upstream, key: tuple[str, int]) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.pulled = 0  # body bytes of the current response read off the socket
        self.counted = True  # in the pool's open count until discarded
        self.idle = False
        self.idle_since = 0.0
        # The transport's reading is paused (`on_body` past HIGH_WATER; `take` resumes it): state
        # of the socket, not of one response, so `_reset` leaves it, and `release` never pools a
        # paused connection (its next request would never be read: a first-byte timeout).
        self.paused = False
        self.dry_at = 0  # `pulled` when `dry` was last counted: body read since starts anew
        self._reset()
        # No request in flight yet: a message the worker starts now is unsolicited.
        self.done = True

    def _reset(self) -> None:
        self.status = 0  # 0 until the final head is parsed: reads until then are head bytes
        self.head_bytes = 0
        self.dry = 0  # bytes read since the head with no body byte among them (`_dried`)
        self.interim = False  # parsing a 1xx response that precedes the real one
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.head: asyncio.Future[None] | None = None
        self.body: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.done = False
        self.keep_alive = False
        self.error: Exception | None = None
        self.waiter: asyncio.Future[None] | None = None
        # The relay's splice (`_Response.splice`): body chunks go to it from `data_received`; it
        # returns False when it wants its task woken (see `RelayResponse._on_chunk`).
        self.sink: Callable[[bytes], bool] | None = None
        # The body chunks of one socket read, handed to the sink as one piece: a worker's read
        # often carries several HTTP chunks (an SSE event each), and one piece means one write
        # to the client instead of one per event (5 -> 1 syscalls per read, measured with strace).
        self.batch: list[bytes] = []

    def begin(self, loop: asyncio.AbstractEventLoop) -> None:
        self._reset()
        self.pulled = 0
        self.head = loop.create_future()

    # -- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as e:
            # HttpParserUpgrade is no HttpParserError: uncaught, asyncio logged a fatal error.
            self.head_bytes += len(data)  # the worker did answer (`H1Upstream._resend` asks)
            self._to_sink()
            if not self.done:  # an unsolicited message after a whole answer fails nothing
                self._fail(f"malformed response from worker: {e}")
            self.close()
            return
        if not self.status:  # the head is still incomplete: all of this read was head
            self.head_bytes += len(data)
            if self.head_bytes > HEAD_MAX:
                self._fail(f"malformed response from worker: head over {HEAD_MAX} bytes")
                self.close()
                return
        if self.batch:
            self._to_sink()
        elif self.status and not self.body and not self.done:
            # No body byte in this read (a sink's reads carry theirs in `batch`, a reader's in
            # `body`), so the flag checks above are all a body's read pays.
            self._dried(len(data))

    def _dried(self, n: int) -> None:
        """``n`` bytes read after the head carried no body: a split chunk header now and then,
        or a trailer section, which is bounded here (`DRY_MAX`)."""
        if self.pulled != self.dry_at:  # body came in between: a new run
            self.dry_at = self.pulled
            self.dry = 0
        self.dry += n
        if self.dry > DRY_MAX:
            self._fail(f"malformed response from worker: over {DRY_MAX} bytes after the body")
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.done and exc is None and self._ends_at_close():
            self._to_sink()  # the close ends a body that has no length: it is whole
            self.done = True
            self.keep_alive = False
            self._wake()
        elif not self.done:
            self._fail(f"worker closed the connection{f' ({exc})' if exc else ''}")
        if self.idle:  # the worker closed a pooled connection: its slot is free now
            self.pool.drop_idle(self)

    def _ends_at_close(self) -> bool:
        """A response with neither a length nor chunks: its body ends when the worker closes
        the connection (RFC 9112 6.3), which httptools cannot be told. Asked only at a close,
        so the per-response path reads no header."""
        if not self.status or self.status in (204, 304):
            return False
        names = {n.lower() for n, _ in self.raw_headers}
        return b"content-length" not in names and b"transfer-encoding" not in names

    # -- httptools callbacks -------------------------------------------------------------------
    def on_message_begin(self) -> None:
        """Once per message: after the answer ended (or before a request was written), any byte
        but CR/LF starts one here (llhttp calls this before it validates anything). Nobody asked
        for it: the connection is closed and parsing stops, so it reaches neither the response
        still being read (its headers and body) nor, pooled, the next request on this
        connection."""
        if self.done:
            self.close()
            raise _Unsolicited

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.status:
            # A trailer field (after a chunked body's last chunk): dropped, as aiohttp does.
            # Kept, it overrode the head's field of the same name (the client's content-type).
            return
        raw = self.raw_headers
        if len(raw) >= HEADERS_MAX:
            self._fail(f"malformed response from worker: over {HEADERS_MAX} header lines")
            raise _Unsolicited
        raw.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:
            if status >= 100 and status != 101:
                # An interim response (100 Continue, 103 Early Hints): the real one follows on
                # this connection. Taken for the answer, it ended the request with an empty body
                # and the connection went back to the pool with that answer still to come.
                self.interim = True
                self.raw_headers = []
                return
            # 101 Switching Protocols (what follows is another protocol), or no HTTP status at
            # all: no answer to a POST. Malformed, so a connect error (retried elsewhere), never
            # a bodiless 101 for the client; parsing stops and the connection is closed.
            self._fail(f"malformed response from worker: HTTP {status} to a POST")
            raise _Unsolicited
        self.status = status
        if self.head is not None and not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.sink is not None:
            self.batch.append(body)  # to the sink once the read is parsed (`_to_sink`)
            return
        self.body.append(body)
        self.buffered += len(body)
        self.pulled += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self.done = True
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    # -- plumbing ------------------------------------------------------------------------------
    def _to_sink(self) -> None:
        batch = self.batch
        if not batch:
            return
        body = batch[0] if len(batch) == 1 else b"".join(batch)
        batch.clear()
        self.pulled += len(body)
        sink = self.sink
        if sink is not None and not sink(body):
            self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, message: str) -> None:
        if self.error is None:
            self.error = UpstreamStreamError(message)
        if self.head is not None and not self.head.done():
            self.head.set_exception(UpstreamConnectError(message))
        self._wake()

    def take(self) -> bytes:
        """Everything buffered, as one chunk (fewer sends when the relay fell behind)."""
        body = self.body
        data = body.popleft() if len(body) == 1 else b"".join(body)
        body.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    def close(self) -> None:
        """Abort, not `transport.close()`: a connection is closed here only when nothing more
        is to be sent on it, and close() waits for unsent request bytes to drain first, which
        a worker that stopped reading (a hung process, a zero TCP window) never lets happen:
        the socket and the body it holds leaked, outside the pool's count."""
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class _RawHeaders(Mapping[str, str]):
    """A response's headers by lower-case name, decoded only when asked: the relay reads one
    (content-type), and decoding them all was ~3 us per request."""

    __slots__ = ("_all", "_raw")

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self._raw = raw
        self._all: dict[str, str] | None = None

    def get(self, key: str, default: Any = None) -> Any:
        want = key.lower().encode("latin-1")
        for k, v in reversed(self._raw):  # the last of repeated names, as `_dict` keeps
            if k.lower() == want:
                return v.decode("latin-1")
        return default

    def _dict(self) -> dict[str, str]:
        if self._all is None:
            self._all = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in self._raw}
        return self._all

    def __getitem__(self, key: str) -> str:
        return self._dict()[key.lower()]

    def __iter__(self) -> Iterator[str]:
        return iter(self._dict())

    def __len__(self) -> int:
        return len(self._dict())


class _Response:
    __slots__ = ("_conn", "_pool", "_settled", "headers", "status")

    def __init__(self, pool: H1Upstream, conn: _Conn) -> None:
        self._pool = pool
        self._conn = conn
        self._settled = False  # released or aborted: the connection is no longer ours
        self.status = conn.status
        # Lower-cased names: the only reader asks for content-type.
        self.headers: Mapping[str, str] = _RawHeaders(conn.raw_headers)

    @property
    def pulled(self) -> int:
        """Body bytes read off the worker's socket so far (backpressure tests watch it)."""
        return self._conn.pulled

    async def _more(self) -> None:
        c = self._conn
        c.waiter = asyncio.get_running_loop().create_future()
        try:
            await c.waiter
        finally:
            c.waiter = None

    async def read(self) -> bytes:
        c = self._conn
        parts: list[bytes] = []
        while True:
            if c.body:
                parts.append(c.take())
            if c.done:
                break
            if c.error is not None:
                raise c.error
            await self._more()
        await self.release()
        return b"".join(parts)

    async def chunks(self) -> AsyncIterator[bytes]:
        while chunk := await self.next_chunk():
            yield chunk

    async def next_chunk(self) -> bytes:
        """The next body bytes (all buffered so far), b"" at the end; no generator to close."""
        c = self._conn
        while True:
            if c.body:
                return c.take()
            if c.done:
                return b""
            if c.error is not None:
                raise c.error
            await self._more()

    async def splice(self, sink: Callable[[bytes], bool]) -> bool:
        """Hand body chunks to ``sink`` straight from ``data_received`` (no task wake-up per
        chunk: the relay's per-event cost) until the sink returns False, the body ends or the
        connection fails; True once the body is complete. Chunks buffered before are fed first.
        """
        c = self._conn
        while c.body:
            if not sink(c.take()):
                return c.done
        if c.done:
            return True
        if c.error is not None:
            raise c.error
        c.sink = sink
        try:
            await self._more()
        finally:
            c.sink = None
        if c.done:
            return True
        if c.error is not None:
            raise c.error
        return False

    async def abort(self) -> None:
        if not self._settled:
            self._settled = True
            self._pool.discard(self._conn)

    async def release(self) -> None:
        """Idempotent (a read releases, and callers release after reading): a connection handed
        back twice would carry two requests at once."""
        if self._settled:
            return
        self._settled = True
        c = self._conn
        if c.done and c.keep_alive and not c.closed and not c.body and not c.paused:
            self._pool.put_back(c)
        else:
            self._pool.discard(c)


class H1Upstream:
    """Connections per worker (host, port), most recently used first, `max_connections` open in
    all; past the limit an idle connection to another worker is closed to make room, else the
    caller waits for one to come back, as aiohttp's connector does."""

    def __init__(self, *, connect_s: float, max_connections: int, keepalive_s: float) -> None:
        self._connect_s = connect_s
        self.max_connections = max_connections
        self.keepalive_s = keepalive_s
        self._deadlines = Deadlines()  # the connect bound
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._open = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._targets: dict[str, tuple[tuple[str, int], bytes]] = {}
        self._tls: UpstreamClient | None = None  # https workers: aiohttp (see the docstring)

    @property
    def open_connections(self) -> int:
        return self._open

    @property
    def connect_s(self) -> float:
        return self._connect_s

    @connect_s.setter
    def connect_s(self, value: float) -> None:
        """A reload's `timeouts.connect_s`, for https workers' client too (it kept the start's)."""
        self._connect_s = value
        if isinstance(self._tls, AiohttpUpstream):
            self._tls.connect_s = value

    def _target(self, url: str) -> tuple[tuple[str, int], bytes]:
        """(host, port) and the request line + Host header, parsed once per URL."""
        t = self._targets.get(url)
        if t is None:
            u = urlsplit(url)
            path = (u.path or "/") + (f"?{u.query}" if u.query else "")
            line = f"POST {path} HTTP/1.1\r\nhost: {u.netloc}\r\n".encode("latin-1")
            if len(self._targets) > 4096:  # worker URLs come and go: never grow without end
                self._targets.clear()
            t = self._targets[url] = ((u.hostname or "", u.port or 80), line)
        return t

    async def post(
        self,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        sent: Callable[[], None] | None = None,
    ) -> UpstreamResponse:
        """``sent`` runs right after the request is written to a pooled connection, or before
        a new connection (or a free slot) is awaited: the caller's bookkeeping (the prefix
        index learning the prompt, ~50-80 us) overlaps the worker's work instead of delaying
        its start, and still happens before any other request can be routed."""
        if url.startswith("https:"):
            if self._tls is None:
                self._tls = AiohttpUpstream(
                    connect_s=self.connect_s,
                    max_connections=self.max_connections,
                    keepalive_s=self.keepalive_s,
                )
            return await self._tls.post(url, body, headers, sent)
        key, line = self._target(url)
        conn = self._pop_idle(key, time.monotonic())
        reused = conn is not None
        if conn is None:
            if sent is not None:
                sent()
                sent = None
            conn = await self._fresh(key)
        try:
            conn.begin(asyncio.get_running_loop())
            head = [line]
            for k, v in headers.items():
                head.append(f"{k}: {v}\r\n".encode("latin-1"))
            head.append(b"content-length: %d\r\n\r\n" % len(body))
            head.append(body)
            assert conn.transport is not None and conn.head is not None
            request = b"".join(head)
            conn.transport.write(request)
            if sent is not None:
                sent()
            await conn.head
        except UpstreamConnectError:
            self.discard(conn)
            if not reused or conn.head_bytes or conn.status:
                raise
            return await self._resend(key, request)
        except BaseException:  # connect error, timeout, cancellation: the connection is spent
            self.discard(conn)
            raise
        return _Response(self, conn)

    async def _resend(self, key: tuple[str, int], request: bytes) -> _Response:
        """The request again, once, on a new connection to the same worker: the pooled one it
        went out on ended (EOF or reset) before a byte of answer. That is the worker's idle
        keep-alive closing it as the request arrived (uvicorn, vLLM's server, closes idle
        connections after 5 s), not a failure: failed, the worker was blamed and a model's
        only worker answered the client 502. Sending it again is safe: uvicorn closes a
        connection only between requests, so a request it read whole gets an answer (or, the
        worker dying, no connection comes up for this one); a request it cut off mid-read was
        never started. A new connection that fails the same way is the worker's failure."""
        conn = await self._fresh(key)
        try:
            conn.begin(asyncio.get_running_loop())
            assert conn.transport is not None and conn.head is not None
            conn.transport.write(request)
            await conn.head
        except BaseException:
            self.discard(conn)
            raise
        return _Response(self, conn)

    async def _fresh(self, key: tuple[str, int]) -> _Conn:
        """A connection from `_acquire` that is still open (one that sent something unasked
        before its request is closed: `_Conn`)."""
        conn = await self._acquire(key)
        if conn.closed:
            self.discard(conn)
            raise UpstreamConnectError("worker closed the connection")
        return conn

    def _pop_idle(self, key: tuple[str, int], now: float) -> _Conn | None:
        idle = self._idle.get(key)
        while idle:
            c = idle.pop()
            c.idle = False
            if not c.closed and now - c.idle_since < self.keepalive_s:
                return c
            self.discard(c)
        return None

    def _close_oldest_idle(self) -> bool:
        """Free a slot held by an idle connection to any worker; False when none is idle."""
        oldest: _Conn | None = None
        for conns in self._idle.values():
            if conns and (oldest is None or conns[0].idle_since < oldest.idle_since):
                oldest = conns[0]
        if oldest is None:
            return False
        self.drop_idle(oldest)
        return True

    async def _acquire(self, key: tuple[str, int]) -> _Conn:
        """A connection to ``key`` when the caller found none idle: a new one, or one that comes
        back while waiting for a free slot."""
        while self._open >= self.max_connections and not self._close_oldest_idle():
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            except BaseException as e:
                if fut.done() and not fut.cancelled():
                    self._wake_one()  # pass on a wake-up we were given but will not use
                if isinstance(e, asyncio.CancelledError):
                    # The caller's deadline (or its client leaving) ended a wait for a slot,
                    # not for a worker: marked so the deadline's TimeoutError can say so
                    # (`ended_pool_wait`: the proxy answers 503, blaming no worker). A plain
                    # cancellation stays one.
                    e.kvgate_pool_wait = True  # type: ignore[attr-defined]
                raise
            c = self._pop_idle(key, time.monotonic())
            if c is not None:
                return c
        self._open += 1
        loop = asyncio.get_running_loop()
        try:
            # Not `asyncio.timeout`: a gateway saturated by a spike must not time out its own
            # connects to healthy workers (`workers.deadlines`: the loop's stalls are forgiven).
            with self._deadlines.within(self.connect_s):
                _t, conn = await loop.create_connection(lambda: _Conn(self, key), *key)
        except TimeoutError as e:
            self._closed_one()
            raise UpstreamConnectError("connect timeout") from e
        except OSError as e:
            self._closed_one()
            raise UpstreamConnectError(str(e) or type(e).__name__) from e
        except BaseException:
            self._closed_one()
            raise
        return conn

    def put_back(self, c: _Conn) -> None:
        c.idle = True
        c.idle_since = time.monotonic()
        self._idle.setdefault(c.key, []).append(c)
        self._wake_one()

    def drop_idle(self, c: _Conn) -> None:
        conns = self._idle.get(c.key)
        if conns and c in conns:
            conns.remove(c)
        c.idle = False
        self.discard(c)

    def discard(self, c: _Conn) -> None:
        """Close ``c`` and free its slot (once, however often it is called)."""
        c.close()
        if c.counted:
            c.counted = False
            self._closed_one()

    def _closed_one(self) -> None:
        self._open -= 1
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_result(None)
                return

    async def close(self) -> None:
        for conns in list(self._idle.values()):
            for c in list(conns):
                self.drop_idle(c)
        if self._tls is not None:
            await self._tls.close()
