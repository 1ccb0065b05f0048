"""The HTTP edge: routes, the request's walk, and the gateway's lifecycle.

The walk for a completion: read the capped body -> parse and validate once -> find healthy
workers for the model (404 unknown / 503 none healthy) -> the proxy picks one through the routing
policy, retries before the first byte, relays SSE untouched -> metrics and one log line.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.config import ConfigWatcher, Settings, WorkerSettings, load_settings
from gateway.errors import APIError, model_not_found, no_capacity
from gateway.logs import setup_logging
from gateway.metrics import GatewayMetrics
from gateway.proxy import Call, Proxy
from gateway.upstream import UpstreamClient, make_upstream
from gateway.validate import CHAT, COMPLETIONS, parse_request, read_body
from scoring.policy import Policy, RouteRequest, make_policy
from workers.probe import Prober
from workers.registry import Health, Registry, Worker, WorkerSpec

log = logging.getLogger("kvgate.gateway")

_RID_OK = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def _spec(w: WorkerSettings) -> WorkerSpec:
    return WorkerSpec(
        name=w.name, url=w.url, weight=w.weight, labels=dict(w.labels), api_key=w.api_key
    )


class Gateway:
    """Everything one gateway process holds; `apply()` swaps in a reloaded config live."""

    def __init__(self, settings: Settings, config_path: Path | None = None) -> None:
        self.settings = settings
        self.config_path = config_path
        self.metrics = GatewayMetrics()
        p = settings.probes
        self.registry = Registry(
            (_spec(w) for w in settings.workers),
            unhealthy_after=p.unhealthy_after,
            healthy_after=p.healthy_after,
            backoff_initial_s=p.backoff_initial_s,
            backoff_max_s=p.backoff_max_s,
        )
        self.policy: Policy = make_policy(settings.routing.policy)
        self.upstream: UpstreamClient | None = None
        self.probe_client: httpx.AsyncClient | None = None
        self.prober: Prober | None = None
        self.proxy: Proxy | None = None
        self.watcher: ConfigWatcher | None = None
        self.started_at = time.time()

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        s = self.settings
        self.upstream = make_upstream(
            s.upstream.client,
            connect_s=s.timeouts.connect_s,
            max_connections=s.upstream.max_connections,
            keepalive_s=s.upstream.keepalive_s,
        )
        self.probe_client = httpx.AsyncClient(
            timeout=httpx.Timeout(
                s.probes.timeout_s, connect=min(s.timeouts.connect_s, s.probes.timeout_s)
            )
        )
        self.prober = Prober(
            self.registry,
            self.probe_client,
            interval_s=s.probes.interval_s,
            timeout_s=s.probes.timeout_s,
            on_probe=self._on_probe,
        )
        self.proxy = Proxy(
            self.registry,
            self.upstream,
            self.metrics,
            policy=lambda: self.policy,
            settings=lambda: self.settings,
            on_passive_failure=self._on_passive_failure,
        )
        self.prober.sync()
        if self.config_path is not None:
            self.watcher = ConfigWatcher(
                self.config_path, self.settings, self.apply, self._on_reload_error
            )
            await self.watcher.start()

    async def stop(self) -> None:
        if self.watcher:
            await self.watcher.stop()
        if self.prober:
            await self.prober.stop()
        if self.upstream:
            await self.upstream.close()
        if self.probe_client:
            await self.probe_client.aclose()

    def apply(self, new: Settings) -> None:
        """Apply a validated config to the running gateway."""
        old = self.settings
        for section in ("server", "upstream"):
            if getattr(old, section) != getattr(new, section):
                log.warning("[%s] changed: takes effect after a restart", section)
        self.settings = new
        if new.routing.policy != old.routing.policy:
            self.policy = make_policy(new.routing.policy)
        p = new.probes
        r = self.registry
        r.unhealthy_after, r.healthy_after = p.unhealthy_after, p.healthy_after
        r.backoff_initial_s, r.backoff_max_s = p.backoff_initial_s, p.backoff_max_s
        if self.prober:
            self.prober.interval_s, self.prober.timeout_s = p.interval_s, p.timeout_s
        self._sync_workers([_spec(w) for w in new.workers])
        setup_logging(new.logging.level, new.logging.format)
        self.metrics.config_reloads.inc()

    def _sync_workers(self, specs: list[WorkerSpec]) -> None:
        added, removed = self.registry.sync(specs)
        for name in removed:
            self.metrics.forget_worker(name, [h.value for h in Health])
        if added or removed:
            log.info("fleet changed: added %s, removed %s", added, removed)
        if self.prober:
            self.prober.sync()

    def _on_reload_error(self, msg: str) -> None:
        self.metrics.config_reload_errors.inc()

    def _on_probe(self, w: Worker, ok: bool, seconds: float) -> None:
        m = self.metrics
        m.probe_seconds.labels(w.name).observe(seconds)
        if not ok:
            m.probe_failures.labels(w.name).inc()
        self._export_health(w)

    def _export_health(self, w: Worker) -> None:
        m = self.metrics
        m.worker_up.labels(w.name).set(1 if w.health is Health.HEALTHY else 0)
        for h in Health:
            m.worker_state.labels(w.name, h.value).set(1 if w.health is h else 0)

    def _on_passive_failure(self, name: str) -> None:
        w = self.registry.workers.get(name)
        if w is None:
            return
        self._export_health(w)
        if self.prober and w.health is not Health.HEALTHY:
            self.prober.poke(name)

    # -- the walk ----------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        path = request.url.path
        rid = request.headers.get("x-request-id") or ""
        if not _RID_OK.match(rid):
            rid = uuid.uuid4().hex
        t0 = time.perf_counter()
        try:
            raw = await read_body(request, self.settings.server.max_body_bytes)
            req = parse_request(path, raw)
            if not self.registry.candidates(req.model):
                if self.registry.knows_model(req.model) or not self.registry.healthy():
                    raise no_capacity(f"no healthy worker is serving model `{req.model}`")
                raise model_not_found(req.model)
            call = Call(
                request_id=rid,
                model=req.model,
                path=path,
                body=req.body,
                stream=req.stream,
                client_wants_usage=req.client_wants_usage,
                route=RouteRequest(model=req.model, request_id=rid),
                t_start=t0,
            )
            assert self.proxy is not None
            return await self.proxy.forward(call)
        except APIError as e:
            self.metrics.rejected.labels(str(e.status)).inc()
            log.info(
                "rejected",
                extra={
                    "fields": {
                        "request_id": rid,
                        "path": path,
                        "status": e.status,
                        "error": e.message[:200],
                    }
                },
            )
            return e.response({"x-request-id": rid})

    async def models(self, request: Request) -> Response:
        cards = self.registry.served_models()
        data = [
            {
                "id": mid,
                "object": "model",
                "created": card.get("created", int(self.started_at)),
                "owned_by": card.get("owned_by", "kvgate"),
                **{
                    k: v
                    for k, v in card.items()
                    if k not in ("id", "object", "created", "owned_by")
                },
            }
            for mid, card in sorted(cards.items())
        ]
        return Response(
            orjson.dumps({"object": "list", "data": data}), media_type="application/json"
        )

    async def health(self, request: Request) -> Response:
        return Response(b"", 200)

    async def ready(self, request: Request) -> Response:
        healthy = len(self.registry.healthy())
        status = 200 if healthy else 503
        return JSONResponse(
            {
                "ready": bool(healthy),
                "healthy_workers": healthy,
                "workers": len(self.registry.workers),
            },
            status_code=status,
        )

    async def prom(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # -- admin -------------------------------------------------------------------------------------
    def _admin(self, request: Request) -> None:
        want = self.settings.admin.key_sha256
        if not want:
            raise APIError(
                403, "admin endpoints are disabled (set admin.key_sha256)", "permission_error"
            )
        auth = request.headers.get("authorization", "")
        key = auth[7:] if auth[:7].lower() == "bearer " else ""
        got = hashlib.sha256(key.encode()).hexdigest()
        if not key or not hmac.compare_digest(got, want.lower()):
            raise APIError(401, "invalid admin key", "authentication_error", code="invalid_api_key")

    async def admin_workers(self, request: Request) -> Response:
        try:
            self._admin(request)
            if request.method == "POST":
                try:
                    spec = WorkerSettings.model_validate(orjson.loads(await request.body()))
                except (orjson.JSONDecodeError, ValueError) as e:
                    raise APIError(400, f"invalid worker: {e}", "invalid_request_error") from None
                if spec.name in self.registry.workers:
                    raise APIError(409, f"worker {spec.name!r} exists", "invalid_request_error")
                self._sync_workers([*(w.spec for w in self.registry.workers.values()), _spec(spec)])
                return JSONResponse({"added": spec.name}, status_code=201)
            return JSONResponse(
                {"workers": [_worker_doc(w) for w in self.registry.workers.values()]}
            )
        except APIError as e:
            return e.response()

    async def admin_worker(self, request: Request) -> Response:
        try:
            self._admin(request)
            name = request.path_params["name"]
            if name not in self.registry.workers:
                raise APIError(404, f"no worker {name!r}", "invalid_request_error")
            self._sync_workers([w.spec for w in self.registry.workers.values() if w.name != name])
            return JSONResponse({"removed": name})
        except APIError as e:
            return e.response()

    async def admin_reload(self, request: Request) -> Response:
        try:
            self._admin(request)
            if self.watcher is None:
                raise APIError(
                    409, "gateway was started without a config file", "invalid_request_error"
                )
            ok = self.watcher.reload()
            if not ok:
                raise APIError(
                    400,
                    "config rejected; the running config is unchanged (see logs)",
                    "invalid_request_error",
                )
            return JSONResponse({"reloaded": True})
        except APIError as e:
            return e.response()


def _worker_doc(w: Worker) -> dict[str, object]:
    m = w.metrics
    return {
        "name": w.name,
        "url": w.url,
        "health": w.health.value,
        "models": sorted(w.models),
        "in_flight": w.in_flight,
        "running": m.running,
        "waiting": m.waiting,
        "kv_usage": m.kv_usage,
        "block_size": m.block_size,
        "num_blocks": m.num_blocks,
        "consecutive_failures": w.consecutive_failures,
        "last_error": w.last_error,
        "labels": w.spec.labels,
        "weight": w.spec.weight,
    }


def create_app(settings: Settings, config_path: Path | None = None) -> Starlette:
    gw = Gateway(settings, config_path)

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
        Route("/v1/models", gw.models, methods=["GET"]),
        Route("/health", gw.health, methods=["GET"]),
        Route("/ready", gw.ready, methods=["GET"]),
        Route("/metrics", gw.prom, methods=["GET"]),
        Route("/admin/workers", gw.admin_workers, methods=["GET", "POST"]),
        Route("/admin/workers/{name}", gw.admin_worker, methods=["DELETE"]),
        Route("/admin/reload", gw.admin_reload, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.gateway = gw
    return app


def app_from_file(path: str | Path) -> Starlette:
    settings = load_settings(path)
    setup_logging(settings.logging.level, settings.logging.format)
    return create_app(settings, Path(path))
