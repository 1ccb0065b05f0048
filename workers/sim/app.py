"""The simulated worker's HTTP surface: vLLM 0.32's routes as one ASGI app per worker.

One `create_app` call is one worker: its own engine, real-time loop, fault switches and Prometheus
registry, so many workers can share a process (`workers.sim.server`) without sharing any state.

The two generation routes are raw ASGI endpoints that skip Starlette's Request and middleware,
because every streamed event would otherwise pay for each middleware's `send` wrapper; the other
routes are rare and stay plain Starlette, with the 404/405 bodies and `vary: Origin` that vLLM's
FastAPI app sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from workers.sim import tokenizer as tok
from workers.sim.config import VLLM_VERSION, SimWorkerConfig
from workers.sim.errors import AbruptClose, HTTPError
from workers.sim.faults import FaultValidationError
from workers.sim.metrics import Tracker
from workers.sim.parsing import GenRequest, is_int, opt_bool
from workers.sim.realtime import RequestHandle
from workers.sim.worker import SimWorker

__all__ = ["create_app"]

_JSON_CT = b"application/json"
_SSE_CT = b"text/event-stream; charset=utf-8"


# --------------------------------------------------------------------------------------------
# ASGI plumbing
# --------------------------------------------------------------------------------------------


class _ClientGone(Exception):
    """The client disconnected before its request body arrived: nothing to answer."""


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise _ClientGone()
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body", False):
            return b"".join(chunks)


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        msg: Message = await receive()
        if msg["type"] == "http.disconnect":
            return


def _response_rid(w: SimWorker, headers: dict[bytes, bytes]) -> bytes | None:
    """The X-Request-Id response header's value, or None: vLLM sends one only when started with
    --enable-request-id-headers (its XRequestIdMiddleware: the client's, else a uuid4 hex)."""
    if not w.request_id_headers:
        return None
    return headers.get(b"x-request-id") or uuid.uuid4().hex.encode()


def _headers(status: int, ctype: bytes, rid: bytes | None, length: int | None = None) -> Message:
    hdrs = [(b"content-type", ctype)]
    if length is not None:
        hdrs.append((b"content-length", str(length).encode()))
    hdrs.append((b"vary", b"Origin"))
    if rid:  # after `vary`: vLLM's XRequestIdMiddleware wraps its CORS middleware
        hdrs.append((b"x-request-id", rid))
    return {"type": "http.response.start", "status": status, "headers": hdrs}


async def _send_json(send: Send, status: int, body: bytes, rid: bytes | None = None) -> None:
    await send(_headers(status, _JSON_CT, rid, len(body)))
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _race_disconnect(receive: Receive, work: asyncio.Future[Any]) -> bool:
    """Run `work` until it ends or the client goes away; True if the client went away.

    vLLM aborts requests whose client disconnected (streaming or not); watching `receive` in a
    side task is the one signal that works even while the stream is idle (queued, stalled).
    """
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        watcher.cancel()
        raise
    if work in done:
        watcher.cancel()
        return False
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError, AbruptClose):
        await work
    return True


class _GenerateEndpoint:
    """Raw ASGI endpoint for the two generation routes: the hot path skips Starlette's Request."""

    def __init__(self, worker: SimWorker, chat: bool) -> None:
        self.worker = worker
        self.chat = chat

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        w = self.worker
        headers = dict(scope.get("headers", ()))
        rid = _response_rid(w, headers)
        if scope.get("method") != "POST":
            body = b'{"detail":"Method Not Allowed"}'
            start = _headers(405, _JSON_CT, rid, len(body))
            start["headers"].append((b"allow", b"POST"))
            await send(start)
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        try:
            raw = await _read_body(receive)
        except _ClientGone:
            return
        try:
            g = w.parse_generation(self.chat, raw, headers)
            await w.apply_pre_faults()
            tracker = Tracker(w.metrics, w.profile, time.monotonic())
            handle = w.submit(g)
        except HTTPError as e:
            await _send_json(send, e.status, e.body(), rid)
            return
        if g.stream:
            try:
                await send(_headers(200, _SSE_CT, rid))
            except BaseException:
                handle.abort()  # never leave an engine request nobody will read
                raise
            work = asyncio.ensure_future(self._stream(g, handle, tracker, send))
            await _race_disconnect(receive, work)
            if work.done() and not work.cancelled():
                exc = work.exception()
                if exc is not None:
                    raise exc
            return
        task = asyncio.ensure_future(w.run_full(g, handle, tracker))
        if await _race_disconnect(receive, task):
            return
        try:
            body = task.result()
        except HTTPError as e:
            await _send_json(send, e.status, e.body(), rid)
            return
        await _send_json(send, 200, body, rid)

    async def _stream(
        self, g: GenRequest, handle: RequestHandle, tracker: Tracker, send: Send
    ) -> None:
        await self.worker.run_stream(g, handle, tracker, send)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


# --------------------------------------------------------------------------------------------
# Small endpoints
# --------------------------------------------------------------------------------------------


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def _err(e: HTTPError) -> Response:
    return Response(e.body(), status_code=e.status, media_type="application/json")


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as e:
        raise HTTPError(f"Invalid JSON body: {e}") from None
    if not isinstance(body, dict):
        raise HTTPError("The request body must be a JSON object.")
    return body


def _routes(w: SimWorker) -> list[Route]:
    async def health(_: Request) -> Response:
        # vLLM: 503 once the engine is dead; here, once the engine loop stopped (`loop.error`
        # holds why, when it crashed).
        if w.faults.unhealthy or not w.loop.alive:
            return Response(b"", status_code=503)
        return Response(b"", status_code=200)

    async def models(_: Request) -> Response:
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": w.model,
                        "object": "model",
                        "created": w.created,
                        "owned_by": "vllm",
                        "root": w.model,
                        "parent": None,
                        "max_model_len": w.engine_config.max_model_len,
                        "permission": [
                            {
                                "id": w.perm_id,
                                "object": "model_permission",
                                "created": w.created,
                                "allow_create_engine": False,
                                "allow_sampling": True,
                                "allow_logprobs": True,
                                "allow_search_indices": False,
                                "allow_view": True,
                                "allow_fine_tuning": False,
                                "organization": "*",
                                "group": None,
                                "is_blocking": False,
                            }
                        ],
                    }
                ],
            }
        )

    async def version(_: Request) -> Response:
        return _json({"version": VLLM_VERSION})

    async def tokenize(request: Request) -> Response:
        try:
            body = await _json_body(request)
            w._check_model(body)
            if "messages" in body:
                messages = body["messages"]
                if not isinstance(messages, list):
                    raise HTTPError("'messages' must be a list", param="messages")
                try:
                    text = tok.render_chat(
                        messages, body.get("tools"), opt_bool(body, "add_generation_prompt", True)
                    )
                except ValueError as e:
                    raise HTTPError(str(e), param="messages") from None
            else:
                prompt = body.get("prompt")
                if not isinstance(prompt, str):
                    raise HTTPError("'prompt' must be a string", param="prompt")
                text = prompt
            ids = tok.encode(text)
            strs = [tok.token_str(t) for t in ids] if opt_bool(body, "return_token_strs") else None
        except HTTPError as e:
            return _err(e)
        return _json(
            {
                "count": len(ids),
                "max_model_len": w.engine_config.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def detokenize(request: Request) -> Response:
        try:
            body = await _json_body(request)
            w._check_model(body)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(is_int(t) for t in tokens):
                raise HTTPError("'tokens' must be a list of integers", param="tokens")
        except HTTPError as e:
            return _err(e)
        return _json({"prompt": tok.decode(tokens)})

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(w.registry), media_type=CONTENT_TYPE_LATEST)

    async def sim_stats(_: Request) -> Response:
        """The engine's own books (not a vLLM endpoint): how requests ended, aborts included,
        which /metrics leaves out as vLLM does."""
        s = w.engine.stats()
        return _json(
            {
                "finished_by_reason": dict(sorted(s.request_success.items())),
                "num_running": s.num_running,
                "num_waiting": s.num_waiting,
            }
        )

    async def faults_get(_: Request) -> Response:
        return _json(w.faults.to_dict())

    async def faults_post(request: Request) -> Response:
        try:
            body = await _json_body(request)
            w.faults.update(body)
        except HTTPError as e:
            return _err(e)
        except FaultValidationError as e:
            return _err(HTTPError(str(e)))
        return _json(w.faults.to_dict())

    async def faults_reset(_: Request) -> Response:
        # Back to a clean worker: no faults and, when nothing is running, a cold prefix cache.
        w.faults.reset()
        w.reset_prefix_cache()
        return _json(w.faults.to_dict())

    async def reset_prefix_cache(_: Request) -> Response:
        return _json({"success": w.reset_prefix_cache()})

    return [
        Route("/v1/chat/completions", _GenerateEndpoint(w, chat=True)),
        Route("/v1/completions", _GenerateEndpoint(w, chat=False)),
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/sim/stats", sim_stats, methods=["GET"]),
        Route("/sim/faults", faults_get, methods=["GET"]),
        Route("/sim/faults", faults_post, methods=["POST"]),
        Route("/sim/reset", faults_reset, methods=["POST"]),
        Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
    ]


async def _not_found(_: Request, __: Exception) -> Response:
    return JSONResponse({"detail": "Not Found"}, status_code=404)


async def _not_allowed(_: Request, __: Exception) -> Response:
    return JSONResponse({"detail": "Method Not Allowed"}, status_code=405)


class _VaryOrigin:
    """vLLM's CORS middleware adds `vary: Origin` to every response; so do we, for parity. With
    the worker's `request_id_headers` on, X-Request-Id too (vLLM's XRequestIdMiddleware)."""

    def __init__(self, app: Any, worker: SimWorker | None = None) -> None:
        self.app = app
        self.worker = worker

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        extra = [(b"vary", b"Origin")]
        if self.worker is not None:
            rid = _response_rid(self.worker, dict(scope.get("headers", ())))
            if rid is not None:
                extra.append((b"x-request-id", rid))

        async def send_vary(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), *extra]
            await send(message)

        await self.app(scope, receive, send_vary)


class _SimApp(Starlette):
    """Starlette for everything, except that the two generation routes skip its middleware.

    Every streamed event goes through each middleware's `send` wrapper; three wrappers cost
    about 3 us per event, a sixth of a worker's per-token CPU. The generation endpoints set
    their own headers (incl. `vary`) and need no exception handling from Starlette.
    """

    fast_paths: dict[str, _GenerateEndpoint]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            endpoint = self.fast_paths.get(scope["path"])
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def create_app(cfg: SimWorkerConfig) -> Starlette:
    """One simulated worker as an ASGI app; the engine loop lives in the app's lifespan."""
    worker = SimWorker(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await worker.start()
        try:
            yield
        finally:
            await worker.stop()

    app = _SimApp(
        routes=_routes(worker),
        lifespan=lifespan,
        exception_handlers={404: _not_found, 405: _not_allowed},
        middleware=[Middleware(_VaryOrigin, worker=worker)],
    )
    app.fast_paths = {
        "/v1/chat/completions": _GenerateEndpoint(worker, chat=True),
        "/v1/completions": _GenerateEndpoint(worker, chat=False),
    }
    app.state.worker = worker
    return app
