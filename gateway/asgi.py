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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and _header_bytes(scope) > self._gw.settings.server.max_header_bytes
        ):
            err = APIError(
                431,
                "Request headers too large",
                "invalid_request_error",
                code="request_header_fields_too_large",
            )
            self._gw.metrics.rejected.labels("431").inc()
            await err.response()(scope, receive, send)
            return
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] in (CHAT, COMPLETIONS)
        ):
            if self._active >= self._gw.settings.server.max_concurrent_requests:
                # A flood of connections must not become a flood of tasks, buffers and queue
                # entries: past the cap, a cheap refusal before anything is read.
                self._gw.metrics.rejected.labels("503").inc()
                err = APIError(
                    503,
                    "The gateway is serving too many requests at once; retry shortly.",
                    "service_unavailable",
                    code="too_many_connections",
                    retry_after_s=1.0,
                )
                await err.response()(scope, receive, send)
                return
            self._active += 1
            try:
                response = await self._gw.completions(Request(scope, receive))
                await response(scope, receive, send)
            finally:
                self._active -= 1
            return
        await self.app(scope, receive, send)
