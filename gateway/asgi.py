"""The ASGI application: `create_app` assembles a `Gateway` (gateway/app.py), its routes (the
walk's two completion paths and gateway/endpoints.py's), lifespan and error envelopes into what
uvicorn serves (gateway/server.py, gateway/cli.py).

Apart from the Gateway because it is the one place that knows Starlette's assembly, and because
`FastPathApp`, the edge every request enters first, sends the completion paths straight to the
walk past Starlette's middleware and router. Being the edge, it is also where what the walk and
Starlette leave to the server is settled: a failure that escaped them still gets the envelope
and the request's ids, its traceback logged once under that id, and a request Starlette served
gets the request line the walk writes for its own.
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
from starlette.types import Message, Receive, Scope, Send

from gateway.app import Gateway
from gateway.config import Settings
from gateway.endpoints import TENANT_KEY, Endpoints
from gateway.errors import APIError, internal_error, log_internal_error
from gateway.ids import client_request_id, echo_headers, echo_raw, next_request_id
from gateway.lifecycle import reqlog
from gateway.logs import log_fields
from gateway.server import HEAD_AT
from gateway.validate import CHAT, COMPLETIONS

log = logging.getLogger("kvgate.gateway")

# Scope key: the exception `on_error` answered and logged (Starlette's error middleware raises it
# again after the 500 is out, for the server to log a second time; `FastPathApp` drops it).
_ANSWERED = "kvgate.answered_error"
_RID_FIELD = b"x-kvgate-request-id"
# Probe and scrape paths: a load balancer or Prometheus asks every few seconds per replica, and a
# request line for each ordinary answer would bury the rest. Their unusual answers (`_quiet`) are
# still logged.
QUIET_PATHS = frozenset({"/health", "/ready", "/metrics"})
_PATH_LOGGED = 256  # a path outside the routes is the client's string (up to 16 KiB): capped


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
        # The ids are picked here, not by the server when the 500 goes out: the log line that
        # holds the traceback must name the id the client was given.
        scope = request.scope
        rid, client = next_request_id(), client_request_id(scope["headers"])
        log_internal_error(exc, rid, client, scope["method"], _capped(scope["path"]))
        scope[_ANSWERED] = exc
        return internal_error().response(echo_headers(rid, client))

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


def _capped(path: str) -> str:
    return path if len(path) <= _PATH_LOGGED else path[:_PATH_LOGGED]


def _quiet(status: int) -> bool:
    """A probe's or scrape's ordinary answer: a success, or /ready's 503 (not ready, draining:
    what the probe asks). A client error (a scrape without the admin key, a wrong method) or a
    failure is logged."""
    return status < 400 or status == 503


class _Answer:
    """``send`` for a request outside the walk: adds the ids every response carries when the
    route set none (`on_error` sets its own, to log under them) and notes what was answered,
    for the request line, which must name the id the client got. The server's own `_with_ids`
    then finds them set."""

    __slots__ = ("_headers", "_send", "complete", "rid", "status")

    def __init__(self, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        self._send = send
        self._headers = headers
        self.rid: str | None = None
        self.status: int | None = None
        self.complete = False

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            headers = list(message.get("headers", ()))
            rid = next((v for k, v in headers if k.lower() == _RID_FIELD), None)
            if rid is None:
                self.rid, _client, ids = echo_raw(self._headers)
                message = {**message, "headers": headers + ids}
            else:
                self.rid = rid.decode("latin-1")
            self.status = message["status"]
        elif kind == "http.response.body" and not message.get("more_body", False):
            self.complete = True
        await self._send(message)


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
        if scope["type"] != "http":
            await self.app(scope, receive, send)  # the lifespan
            return
        if _header_bytes(scope) > self._gw.settings.server.max_header_bytes:
            await self._refuse(scope, send, 431, _HEADERS_TOO_LARGE)
            return
        if scope["method"] == "POST" and scope["path"] in (CHAT, COMPLETIONS):
            if self._active >= self._gw.settings.server.max_concurrent_requests:
                # A flood of connections must not become a flood of tasks, buffers and queue
                # entries: past the cap, a cheap refusal before anything is read.
                await self._refuse(scope, send, 503, _TOO_MANY)
                return
            self._active += 1
            try:
                # The walk answers its own failures (gateway.app: `Gateway._failed`); these
                # handlers are for what is left, and cost nothing until they catch.
                try:
                    response = await self._gw.completions(Request(scope, receive))
                except Exception as exc:
                    if not await self._failed(scope, receive, send, exc, None):
                        raise
                    return
                try:
                    await response(scope, receive, send)
                except Exception as exc:
                    if not await self._failed(scope, receive, send, exc, response):
                        raise
            finally:
                self._active -= 1
            return
        await self._route(scope, receive, send)

    async def _failed(
        self, scope: Scope, receive: Receive, send: Send, exc: Exception, response: Response | None
    ) -> bool:
        """A bug that escaped the walk (or its response's sending), as uvicorn would have met it:
        a plain-text 500 without the request's ids, its traceback logged under no id. Logged
        once here, under the id the response carries (a new one if none was made), then the
        envelope with the ids when nothing was sent yet, else the connection closes (a response
        begun cannot be answered again). False under a server whose request cycle says nothing
        of what was sent: the caller re-raises, and that server answers as it would have."""
        cycle = getattr(send, "__self__", None)
        started = getattr(cycle, "response_started", None)
        if not isinstance(started, bool):
            return False
        rid = response.headers.get("x-kvgate-request-id") if response is not None else None
        rid = rid or next_request_id()
        client = client_request_id(scope["headers"])
        log_internal_error(exc, rid, client, scope["method"], _capped(scope["path"]))
        if cycle.disconnected:
            return True
        if not started:
            await internal_error().response(echo_headers(rid, client))(scope, receive, send)
        elif not cycle.response_complete:
            # As uvicorn does for a failed app mid-response, minus its second traceback; marked
            # gone as a lost connection is (the relay's `_drop_client` does the same).
            cycle.transport.close()
            cycle.disconnected = True
        return True

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A request outside the walk, through Starlette: with the ids every response carries,
        and a request line (`_log_route`), which the walk writes for its own requests.

        Starlette's error middleware raises a failure again once `on_error` has logged and
        answered it (so that a server may log it): dropped here, it was logged once already."""
        t0 = scope.get(HEAD_AT) or time.perf_counter()
        answer = _Answer(send, scope["headers"])
        try:
            await self.app(scope, receive, answer.send)
        except Exception as exc:
            if scope.get(_ANSWERED) is not exc or (answer.status and not answer.complete):
                raise  # not answered (the server answers, and closes a response begun)
        finally:
            self._log_route(scope, answer, t0)

    def _log_route(self, scope: Scope, answer: _Answer, t0: float) -> None:
        """The request line of a request outside the walk: the walk's line's identity and timing
        fields, with the method and, where the route serves one, the tenant. None for an ordinary
        answer on a probe or scrape path (`QUIET_PATHS`), nor when `logging.requests` is off."""
        status = answer.status
        if status is None:  # nothing was answered: the client left first
            return
        path = scope["path"]
        if path in QUIET_PATHS and _quiet(status):
            return
        if not (self._gw.life.log_requests and reqlog.isEnabledFor(logging.INFO)):
            return
        log_fields(
            reqlog,
            "request",
            {
                "request_id": answer.rid,
                "client_request_id": client_request_id(scope["headers"]),
                "method": scope["method"],
                "path": _capped(path),
                "status": status,
                "e2e_ms": round((time.perf_counter() - t0) * 1000, 3),
                "tenant": scope.get(TENANT_KEY),
            },
        )

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
