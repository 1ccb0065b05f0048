"""The pooled HTTP client that carries requests to workers, behind a small interface.

Three implementations so the choice stays a measurement, not a belief (`bench/overhead.py
--clients` runs them side by side): `h1` (gateway/upstream_h1.py, the default) is kvgate's own
pooled HTTP/1.1 client, which relayed ~25% more SSE events/s than aiohttp on one core and spent
less CPU per short stream; aiohttp (the default before it, and what h1 uses for https workers) and
httpx (its API serves probes, admin and bench) stay selectable as fallbacks.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from contextvars import ContextVar
from typing import Any, Protocol

import aiohttp
import httpx
from aiohttp.client_proto import ResponseHandler


class UpstreamConnectError(Exception):
    """The request never reached the worker (refused, reset, DNS, connect timeout)."""


class UpstreamStreamError(Exception):
    """The worker's response broke off (reset, truncated chunked body)."""


class UpstreamPoolFull(Exception):
    """No connection slot (`upstream.max_connections`, across all workers) came free within the
    attempt's deadline: the request never left the gateway, so no worker is to blame for it."""


def ended_pool_wait(e: BaseException) -> bool:
    """Whether ``e``, the TimeoutError of a `Deadlines` wait around `post`, ended the wait for a
    pool slot (`H1Upstream._acquire` marks the cancellation) rather than a worker's answer."""
    return getattr(e.__cause__, "kvgate_pool_wait", False) is True


class UpstreamResponse(Protocol):
    status: int
    headers: Mapping[str, str]

    async def read(self) -> bytes: ...

    def chunks(self) -> AsyncIterator[bytes]: ...

    async def abort(self) -> None:
        """Close the connection without reading on: the worker sees the client go away."""

    async def release(self) -> None:
        """The body was read to the end: return the connection to the pool."""


class UpstreamClient(Protocol):
    async def post(
        self,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        sent: Callable[[], None] | None = None,
    ) -> UpstreamResponse:
        """POST ``body``; the response once its head arrived. ``sent`` is called once, as soon
        as the request is on its way to the worker and in any case before this coroutine first
        yields to the loop (so nothing else runs between the caller's decision and it)."""
        ...

    async def close(self) -> None: ...


# -- aiohttp -----------------------------------------------------------------------------------
class _AiohttpResponse:
    __slots__ = ("_pool", "_r", "_settled", "headers", "status")

    def __init__(self, r: aiohttp.ClientResponse, pool: AiohttpUpstream) -> None:
        self._r = r
        self._pool = pool
        self._settled = False  # released or aborted: the pool slot is given back
        self.status = r.status
        self.headers = r.headers

    async def read(self) -> bytes:
        try:
            body = await self._r.read()
        except aiohttp.ClientError as e:
            raise UpstreamStreamError(str(e) or type(e).__name__) from e
        await self.release()  # aiohttp has released the connection at the body's end
        return body

    async def chunks(self) -> AsyncIterator[bytes]:
        content = self._r.content
        try:
            while True:
                chunk = await content.readany()
                if not chunk:
                    return
                yield chunk
        except aiohttp.ClientError as e:
            raise UpstreamStreamError(str(e) or type(e).__name__) from e

    async def abort(self) -> None:
        self._r.close()
        self._settle()

    async def release(self) -> None:
        self._r.release()
        self._settle()

    def _settle(self) -> None:
        """The slot back to the pool, once (callers release after a read, which releases)."""
        if not self._settled:
            self._settled = True
            self._pool._give_slot()


def _connect_timeout(connect_s: float) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=None, sock_connect=connect_s, connect=connect_s)


class _Handler(ResponseHandler):
    """aiohttp's protocol, noting whether a byte came since its connection was last handed
    out: whether a failed request may be sent again (`_Attempt.unanswered`) turns on that, and
    aiohttp's errors do not tell it (a reset after part of a head is a ClientOSError like one
    before any byte; an EOF after a few bytes under its pure-Python parser looks like one with
    none). Noted here, before any parser, so the answer does not depend on one."""

    __slots__ = ("answered",)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.answered = False

    def data_received(self, data: bytes) -> None:
        self.answered = True
        super().data_received(data)


class _Attempt:
    """One request's trip through `_Connector.connect`: was its connection a pooled one, and
    has the worker sent a byte on it since?"""

    __slots__ = ("proto", "reused")

    def __init__(self) -> None:
        self.reused = False
        self.proto: _Handler | None = None

    def unanswered(self) -> bool:
        """The request went out on a pooled connection and not a byte came back on it: the
        worker closed it idle and never ran the request, so a resend cannot run it twice. A
        byte of answer means the worker had it: never sent again. A connection not known to
        be ours (`_Handler`) counts as answered: no resend on a guess."""
        return self.reused and self.proto is not None and not self.proto.answered


# The attempt of the request this task is sending (`AiohttpUpstream._send`): aiohttp awaits the
# connector's `connect` inline, in the task that awaits `session.post`, so it sees it.
_ATTEMPT: ContextVar[_Attempt | None] = ContextVar("kvgate_aiohttp_attempt", default=None)


class _Connector(aiohttp.TCPConnector):
    """aiohttp's connector, telling the request whether the connection it hands out carried a
    request before (came from the pool) or is new: aiohttp says so only to trace hooks
    (`on_connection_reuseconn`), which, once configured, cost every request a signal send at
    each of its steps. A connection that was handed out before is one `_served` holds (weakly:
    it goes when aiohttp drops the connection)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._served: weakref.WeakSet[object] = weakref.WeakSet()
        # aiohttp builds each connection's protocol with this (no public hook for it).
        self._factory = functools.partial(_Handler, loop=self._loop)

    async def connect(self, req: Any, traces: Any, timeout: aiohttp.ClientTimeout) -> Any:
        conn = await super().connect(req, traces, timeout)
        proto = conn.protocol
        attempt = _ATTEMPT.get()
        if attempt is not None:
            attempt.reused = proto in self._served
            if isinstance(proto, _Handler):
                proto.answered = False  # what came before was an earlier request's answer
                attempt.proto = proto
        if proto is not None:
            self._served.add(proto)
        return conn


# How a pooled connection the worker closed ends a request: EOF (ServerDisconnectedError), a
# reset or a write to it once closed (ClientOSError, ClientConnectionResetError). Whether a byte
# of answer came first, none of them says: `_Attempt.unanswered` does. (A connect error,
# ClientConnectorError, is never a pooled connection's: its attempt has no protocol.)
_STALE = (
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,
    aiohttp.ClientConnectionResetError,
)


class AiohttpUpstream:
    """https workers (`H1Upstream` hands them here), and `upstream.client = "aiohttp"`. At
    parity with the h1 client on its pool's two edges:

    - The wait for a pool slot is this client's own (`_take_slot`: at most `max_connections`
      requests hold a connection, from `post` until their response is released or aborted), so
      aiohttp's connector never waits for one and its ``connect`` timeout bounds only the
      connect itself (DNS, TCP, TLS). aiohttp counted that wait inside the connect timeout: with
      every connection held by a busy stream, the requests waiting failed as connect timeouts,
      blamed on (and ejecting) a worker that never saw them. As the h1 client's (`_acquire`),
      the wait is bounded by the caller's deadline alone, and a cancellation that ends it is
      marked (`ended_pool_wait`): the proxy answers `UpstreamPoolFull`, a 503 blaming no worker.
    - A pooled connection that fails before a byte of answer (EOF or reset: the worker's idle
      keep-alive closed it as the request went out) is resent once on a new connection
      (`_resend`, as `H1Upstream._resend`, whose docstring says why that is safe). aiohttp
      resends only idempotent methods, never a POST: the request failed as a 502 and the worker
      was blamed. Which connection was pooled, and whether a byte came back on it, aiohttp
      does not say: `_Connector` and its `_Handler` tell. A head cut short (by an EOF or a
      reset) means the worker had the request: never resent, as running it twice would
      generate (and count tokens) twice."""

    def __init__(self, *, connect_s: float, max_connections: int, keepalive_s: float) -> None:
        self.max_connections = max_connections
        self._busy = 0  # requests holding a slot (`_take_slot`)
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        # aiohttp's own limit stays as a backstop: never reached (its connections in use are
        # fewer than the slots held), so it never waits inside a connect timeout.
        self._connector = _Connector(
            limit=max_connections,
            limit_per_host=0,
            keepalive_timeout=keepalive_s,
            use_dns_cache=True,
        )
        self._timeout = _connect_timeout(connect_s)
        self._session = self._new_session(self._connector)
        self._fresh: aiohttp.ClientSession | None = None  # resends' (`_resend`)

    def _new_session(self, connector: aiohttp.BaseConnector) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )

    @property
    def connect_s(self) -> float:
        return float(self._timeout.connect or 0.0)

    @connect_s.setter
    def connect_s(self, value: float) -> None:
        """A reload's `timeouts.connect_s`: sent with every request from now on (the session
        keeps the timeout it was built with; a reloaded one never reached https workers)."""
        self._timeout = _connect_timeout(value)

    @property
    def busy(self) -> int:
        """Requests holding a pool slot (tests watch it)."""
        return self._busy

    async def post(
        self,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        sent: Callable[[], None] | None = None,
    ) -> UpstreamResponse:
        if sent is not None:
            sent()
        await self._take_slot()
        try:
            r = await self._send(url, body, headers)
        except BaseException:
            self._give_slot()
            raise
        return _AiohttpResponse(r, self)

    async def _take_slot(self) -> None:
        """A slot among `max_connections`, waiting (FIFO) for one to be given back. No bound of
        its own: the caller's deadline ends the wait, as `H1Upstream._acquire`'s."""
        if self._busy < self.max_connections:
            self._busy += 1
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut  # `_give_slot` hands its slot over: `_busy` already counts it
        except BaseException as e:
            if fut.done() and not fut.cancelled():
                self._give_slot()  # handed one, but it will not be used: the next waiter's
            if isinstance(e, asyncio.CancelledError):
                # The caller's deadline (or its client leaving) ended a wait for a slot, not
                # for a worker: marked for `ended_pool_wait` (the proxy's 503, no blame).
                e.kvgate_pool_wait = True  # type: ignore[attr-defined]
            raise

    def _give_slot(self) -> None:
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_result(None)
                return
        self._busy -= 1

    async def _send(
        self, url: str, body: bytes, headers: Mapping[str, str]
    ) -> aiohttp.ClientResponse:
        attempt = _Attempt()
        token = _ATTEMPT.set(attempt)
        try:
            # Not followed: a worker's redirect would re-send the tenant's prompt wherever it
            # points (any host); the proxy answers a 3xx as the worker's failure instead.
            return await self._session.post(
                url, data=body, headers=headers, allow_redirects=False, timeout=self._timeout
            )
        except _STALE as e:
            if not attempt.unanswered():
                raise UpstreamConnectError(str(e) or type(e).__name__) from e
        except (aiohttp.ClientError, OSError) as e:
            # Any failure before the head (a malformed one included: ClientResponseError) is
            # the worker's, retried elsewhere as the h1 client's are; uncaught it was a 500
            # internal_error with a traceback, never retried, the worker never blamed. (A
            # connect timeout is one: TimeoutError is an OSError.)
            raise UpstreamConnectError(str(e) or type(e).__name__) from e
        finally:
            _ATTEMPT.reset(token)
        return await self._resend(url, body, headers)

    async def _resend(
        self, url: str, body: bytes, headers: Mapping[str, str]
    ) -> aiohttp.ClientResponse:
        """The request again, once, on a new connection to the same worker: the pooled one it
        went out on ended before a byte of answer (see `H1Upstream._resend` for why sending it
        again is safe). New for certain: it goes through a session of its own whose connector
        pools nothing (``force_close``: aiohttp then also asks the worker to close after its
        answer, ``connection: close``), so it is never a pooled connection gone stale too. A new
        connection that fails the same way is the worker's failure."""
        if self._fresh is None:
            self._fresh = self._new_session(
                aiohttp.TCPConnector(
                    force_close=True,
                    limit=self.max_connections,
                    limit_per_host=0,
                    use_dns_cache=True,
                )
            )
        try:
            return await self._fresh.post(
                url, data=body, headers=headers, allow_redirects=False, timeout=self._timeout
            )
        except (aiohttp.ClientError, OSError) as e:
            raise UpstreamConnectError(str(e) or type(e).__name__) from e

    async def close(self) -> None:
        await self._session.close()
        if self._fresh is not None:
            await self._fresh.close()


# -- httpx -------------------------------------------------------------------------------------
class _HttpxResponse:
    __slots__ = ("_r", "headers", "status")

    def __init__(self, r: httpx.Response) -> None:
        self._r = r
        self.status = r.status_code
        self.headers = r.headers

    async def read(self) -> bytes:
        try:
            return await self._r.aread()
        except httpx.HTTPError as e:
            raise UpstreamStreamError(str(e) or type(e).__name__) from e
        finally:
            await self._r.aclose()

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._r.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            raise UpstreamStreamError(str(e) or type(e).__name__) from e

    async def abort(self) -> None:
        await self._r.aclose()

    async def release(self) -> None:
        await self._r.aclose()


class HttpxUpstream:
    def __init__(self, *, connect_s: float, max_connections: int, keepalive_s: float) -> None:
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=connect_s),
            limits=httpx.Limits(
                max_connections=max_connections,
                max_keepalive_connections=max_connections,
                keepalive_expiry=keepalive_s,
            ),
        )

    async def post(
        self,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        sent: Callable[[], None] | None = None,
    ) -> UpstreamResponse:
        if sent is not None:
            sent()
        req = self._client.build_request("POST", url, content=body, headers=headers)
        try:
            r = await self._client.send(req, stream=True)
        except httpx.TransportError as e:
            # Any failure before the head (a reset after the request was read: ReadError) is
            # the worker's, retried elsewhere as the other clients' are (see aiohttp's above).
            raise UpstreamConnectError(str(e) or type(e).__name__) from e
        return _HttpxResponse(r)

    async def close(self) -> None:
        await self._client.aclose()


def make_upstream(
    kind: str, *, connect_s: float, max_connections: int, keepalive_s: float
) -> UpstreamClient:
    if kind == "h1":
        from gateway.upstream_h1 import H1Upstream  # imports this module

        return H1Upstream(
            connect_s=connect_s, max_connections=max_connections, keepalive_s=keepalive_s
        )
    cls = {"aiohttp": AiohttpUpstream, "httpx": HttpxUpstream}[kind]
    return cls(connect_s=connect_s, max_connections=max_connections, keepalive_s=keepalive_s)
