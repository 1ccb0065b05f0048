"""The pooled HTTP client that carries requests to workers, behind a small interface.

Three implementations so the choice stays a measurement, not a belief (`bench/overhead.py
--clients` runs them side by side): `h1` (gateway/upstream_h1.py, the default) is kvgate's own
pooled HTTP/1.1 client, which relayed ~25% more SSE events/s than aiohttp on one core and spent
less CPU per short stream; aiohttp (the default before it, and what h1 uses for https workers) and
httpx (its API serves probes, admin and bench) stay selectable as fallbacks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from typing import Protocol

import aiohttp
import httpx


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
    __slots__ = ("_r", "headers", "status")

    def __init__(self, r: aiohttp.ClientResponse) -> None:
        self._r = r
        self.status = r.status
        self.headers = r.headers

    async def read(self) -> bytes:
        try:
            return await self._r.read()
        except aiohttp.ClientError as e:
            raise UpstreamStreamError(str(e) or type(e).__name__) from e

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

    async def release(self) -> None:
        self._r.release()


def _connect_timeout(connect_s: float) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=None, sock_connect=connect_s, connect=connect_s)


class AiohttpUpstream:
    """Known gap (https workers, and `upstream.client = "aiohttp"`): aiohttp's ``connect``
    timeout includes the wait for a free pool slot, so a pool full of busy streams fails the
    waiting requests as connect timeouts, blamed on a worker that never saw them; the h1 client
    answers that wait with `UpstreamPoolFull` (a 503, no blame). Nor does aiohttp reconnect when
    a pooled connection turns out stale (the h1 client's `_resend`)."""

    def __init__(self, *, connect_s: float, max_connections: int, keepalive_s: float) -> None:
        self._connector = aiohttp.TCPConnector(
            limit=max_connections,
            limit_per_host=0,
            keepalive_timeout=keepalive_s,
            use_dns_cache=True,
        )
        self._timeout = _connect_timeout(connect_s)
        self._session = aiohttp.ClientSession(
            connector=self._connector,
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

    async def post(
        self,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        sent: Callable[[], None] | None = None,
    ) -> UpstreamResponse:
        if sent is not None:
            sent()
        try:
            # Not followed: a worker's redirect would re-send the tenant's prompt wherever it
            # points (any host); the proxy answers a 3xx as the worker's failure instead.
            r = await self._session.post(
                url, data=body, headers=headers, allow_redirects=False, timeout=self._timeout
            )
        except (aiohttp.ClientError, OSError) as e:
            # Any failure before the head (a malformed one included: ClientResponseError) is
            # the worker's, retried elsewhere as the h1 client's are; uncaught it was a 500
            # internal_error with a traceback, never retried, the worker never blamed.
            raise UpstreamConnectError(str(e) or type(e).__name__) from e
        except TimeoutError as e:  # connect timeout
            raise UpstreamConnectError("connect timeout") from e
        return _AiohttpResponse(r)

    async def close(self) -> None:
        await self._session.close()


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
