"""The ASGI application: `create_app` assembles a `Gateway` (gateway/app.py), its routes (the
walk's two completion paths and gateway/endpoints.py's), lifespan and error envelopes into what
uvicorn serves (gateway/server.py, gateway/cli.py).

Apart from the Gateway because it is the one place that knows Starlette's assembly, and because
`FastPathApp`, the edge every request enters first, sends the completion paths straight to the
walk past Starlette's middleware and router.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway.app import Gateway
from gateway.config import Settings
from gateway.endpoints import Endpoints
from gateway.errors import APIError
from gateway.ids import echo_raw
from gateway.server import HEAD_AT
from gateway.validate import CHAT, COMPLETIONS

log = logging.getLogger("kvgate.gateway")


def create_app(settings: Settings, config_path: Path | None = None) -> FastPathApp:
    gw = Gateway(settings, config_path)
    ep = Endpoints(gw)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    routes = [
        Route(CHAT, gw.completions, methods=["POST"]),
        Route(COMPLETIONS, gw.completions, methods=["POST"]),
        Route("/v1/models", ep.models, methods=["GET"]),
        Route("/health", ep.health, methods=["GET"]),
        Route("/ready", ep.ready, methods=["GET"]),
        Route("/metrics", ep.prom, methods=["GET"]),
        Route("/admin/workers", ep.admin_workers, methods=["GET", "POST"]),
        Route("/admin/workers/{name}", ep.admin_worker, methods=["DELETE"]),
        Route("/admin/workers/{name}/drain", ep.admin_drain, methods=["GET", "POST", "DELETE"]),
        Route("/admin/reload", ep.admin_reload, methods=["POST"]),
    ]

    async def on_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path, exc_info=exc)
        return APIError(500, "internal gateway error", "internal_error").response()

    async def not_found(request: Request, exc: Exception) -> Response:
        return APIError(404, f"no route {request.url.path}", "invalid_request_error").response()

    async def bad_method(request: Request, exc: Exception) -> Response:
        # With the `Allow` header Starlette's exception carries: a 405 must list the methods.
        return APIError(
            405, f"method {request.method} not allowed", "invalid_request_error"
        ).response(getattr(exc, "headers", None) or {})

    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={Exception: on_error, 404: not_found, 405: bad_method},
    )
    app.state.gateway = gw
    return FastPathApp(app, gw)


def _header_bytes(scope: Scope) -> int:
    return sum(len(k) + len(v) for k, v in scope["headers"])


_Prebuilt = tuple[bytes, list[tuple[bytes, bytes]], str]


def _prebuilt(err: APIError) -> _Prebuilt:
    """An edge refusal's body, fixed headers and message, built once: the per-request part is
    the ids."""
    body = err.body()
    headers = [(k.encode(), v.encode()) for k, v in err.response().headers.items()]
    return body, headers, err.message


_TOO_MANY = _prebuilt(
    APIError(
        503,
        "The gateway is serving too many requests at once; retry shortly.",
        "service_unavailable",
        code="too_many_connections",
        retry_after_s=1.0,
    )
)
_HEADERS_TOO_LARGE = _prebuilt(
    APIError(
        431,
        "Request headers too large",
        "invalid_request_error",
        code="request_header_fields_too_large",
    )
)
# Request lines for the edge's refusals, per second at most: past the cap of
# `server.max_concurrent_requests` a flood is the usual cause, and every refused request is
# counted in kvgate_rejected_requests_total anyway; the lines past it are summed in one warning.
EDGE_LINES_PER_S = 50


class FastPathApp:
    """The two completion routes go straight to the walk; everything else through Starlette.

    Starlette's error middleware, exception middleware and router cost tens of microseconds per
    request on the hot path; the walk already answers every failure with an OpenAI envelope.
    """

    def __init__(self, app: Starlette, gw: Gateway) -> None:
        self.app = app
        self.state = app.state
        self._gw = gw
        self._active = 0  # completion requests being served (the edge's concurrency cap)
        self._log_second = -1  # the edge's request-line budget: the second it counts
        self._logged = 0  # lines written in that second
        self._unlogged = 0  # refusals over the budget, not yet reported

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and _header_bytes(scope) > self._gw.settings.server.max_header_bytes
        ):
            await self._refuse(scope, send, 431, _HEADERS_TOO_LARGE)
            return
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] in (CHAT, COMPLETIONS)
        ):
            if self._active >= self._gw.settings.server.max_concurrent_requests:
                # A flood of connections must not become a flood of tasks, buffers and queue
                # entries: past the cap, a cheap refusal before anything is read.
                await self._refuse(scope, send, 503, _TOO_MANY)
                return
            self._active += 1
            try:
                response = await self._gw.completions(Request(scope, receive))
                await response(scope, receive, send)
            finally:
                self._active -= 1
            return
        await self.app(scope, receive, send)

    async def _refuse(
        self,
        scope: Scope,
        send: Send,
        status: int,
        prebuilt: _Prebuilt,
    ) -> None:
        """A refusal before anything is read: its prebuilt envelope with the ids every response
        carries (`gateway.ids.echo_headers`), counted, and logged as a request line within the
        edge's budget (`EDGE_LINES_PER_S`)."""
        rid, client_rid, ids = echo_raw(scope["headers"])
        body, headers, message = prebuilt
        await send({"type": "http.response.start", "status": status, "headers": headers + ids})
        await send({"type": "http.response.body", "body": body})
        now = time.perf_counter()
        self._gw.life.rejected(
            rid,
            client_rid,
            None,
            scope["path"],
            status,
            scope.get(HEAD_AT) or now,
            message,
            log=self._budget(now),
        )

    def _budget(self, now: float) -> bool:
        """Whether this edge refusal gets its request line (`EDGE_LINES_PER_S`)."""
        second = int(now)
        if second != self._log_second:
            if self._unlogged:
                log.warning(
                    "%d requests refused at the edge (431, or 503 past "
                    "server.max_concurrent_requests) were not logged: over %d lines/s",
                    self._unlogged,
                    EDGE_LINES_PER_S,
                )
            self._log_second, self._logged, self._unlogged = second, 0, 0
        if self._logged < EDGE_LINES_PER_S:
            self._logged += 1
            return True
        self._unlogged += 1
        return False
