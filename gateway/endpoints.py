"""The HTTP endpoints beside the completion walk: /v1/models, /health, /ready, /metrics and
the admin API (/admin/workers, worker drains, /admin/reload).

They read the gateway's state or change it through its own methods, and none of them is on a
request's walk, so they live apart from it (gateway/app.py: `Gateway`); gateway/asgi.py
registers them as routes.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from typing import TYPE_CHECKING, Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.config import WorkerSettings
from gateway.core_settings import worker_spec
from gateway.errors import APIError
from gateway.tenancy import bearer_key
from gateway.validate import read_body
from workers.worker import Worker

if TYPE_CHECKING:
    from gateway.app import Gateway

log = logging.getLogger("kvgate.gateway")


# Where /v1/models leaves the tenant it served, for the route's request line (gateway/asgi.py).
TENANT_KEY = "kvgate.tenant"

# The most an admin request's body may hold: a worker's spec is a few hundred bytes.
ADMIN_BODY_MAX = 64 * 1024


def _printable(entry: dict[str, Any]) -> dict[str, Any]:
    """A model entry as JSON can carry it: a worker's card is passed on as the worker wrote it,
    and one whose value orjson cannot write (an integer past 64 bits, nesting past 255 levels,
    both valid JSON from a worker) made /v1/models a 500 for every client. Such a card keeps
    what the gateway itself vouches for, the id, object, created and owned_by."""
    try:
        orjson.dumps(entry)
    except orjson.JSONEncodeError:
        log.warning("model %r: its card cannot be written as JSON; listed without it", entry["id"])
        return {
            "id": entry["id"],
            "object": "model",
            "created": c if type(c := entry["created"]) is int and 0 <= c < 1 << 53 else 0,
            "owned_by": entry["owned_by"] if type(entry["owned_by"]) is str else "kvgate",
        }
    return entry


class Endpoints:
    """The non-completion routes of one `Gateway`, as bound methods for Starlette's routes."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def models(self, request: Request) -> Response:
        """OpenAI's /v1/models: a key is required (when tenants exist) and a tenant sees only the
        models its allowlist grants, like the completion routes' 404 for the rest."""
        try:
            h = request.headers
            tenant = self.gw.tenants.authenticate(h.get("authorization"), h.get("x-api-key"))
        except APIError as e:
            return e.response()
        if self.gw.tenants.enabled:
            request.scope[TENANT_KEY] = tenant.name
        cards = self.gw.registry.served_models()
        allowed = tenant.cfg.models
        if allowed:
            cards = {m: c for m, c in cards.items() if m in allowed}
        data = [
            {
                "id": mid,
                "object": "model",
                "created": card.get("created", int(self.gw.started_at)),
                "owned_by": card.get("owned_by", "kvgate"),
                **{
                    k: v
                    for k, v in card.items()
                    if k not in ("id", "object", "created", "owned_by")
                },
            }
            for mid, card in sorted(cards.items())
        ]
        try:
            body = orjson.dumps({"object": "list", "data": data})
        except orjson.JSONEncodeError:
            body = orjson.dumps({"object": "list", "data": [_printable(e) for e in data]})
        return Response(body, media_type="application/json")

    async def health(self, request: Request) -> Response:
        if self.gw.processes is not None:
            return JSONResponse(self.gw.processes.health())
        return Response(b"", 200)

    async def ready(self, request: Request) -> Response:
        # Workers that take new requests: a drained one is healthy but takes none, and counting
        # it kept a replica whose every worker was drained in its balancer's rotation, answering
        # each request with a 503 (review).
        healthy = self.gw.registry.healthy()
        serving = sum(1 for w in healthy if not w.draining)
        ok = bool(serving) and not self.gw.draining
        body: dict[str, Any] = {
            "ready": ok,
            "draining": self.gw.draining,
            "healthy_workers": serving,
            "draining_workers": len(healthy) - serving,
            "workers": len(self.gw.registry.workers),
        }
        if self.gw.processes is not None:
            body.update(self.gw.processes.health())
        return JSONResponse(body, status_code=200 if ok else 503)

    async def prom(self, request: Request) -> Response:
        if self.gw.settings.admin.metrics_require_key:
            try:
                self._admin(request)
            except APIError as e:
                return e.response()
        if self.gw.processes is not None:
            body = await self.gw.processes.scrape()
        else:
            body = generate_latest(self.gw.metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    # -- admin -------------------------------------------------------------------------------------
    def _admin(self, request: Request) -> None:
        want = self.gw.settings.admin.key_sha256
        if not want:
            raise APIError(
                403, "admin endpoints are disabled (set admin.key_sha256)", "permission_error"
            )
        key = bearer_key(request.headers.get("authorization"))
        got = hashlib.sha256(key.encode()).hexdigest()
        if not key or not hmac.compare_digest(got.encode(), want.lower().encode()):
            raise APIError(401, "invalid admin key", "authentication_error", code="invalid_api_key")

    async def admin_workers(self, request: Request) -> Response:
        try:
            self._admin(request)
            if request.method == "POST":
                # Bounded as a completion's body is: an admin key is no reason to buffer any
                # size for any time (a stuck client, a script sending the wrong file).
                settings = self.gw.settings
                raw = await read_body(
                    request,
                    request.headers.get("content-length"),
                    min(settings.server.max_body_bytes, ADMIN_BODY_MAX),
                    settings.timeouts.client_body_s,
                )
                try:
                    spec = WorkerSettings.model_validate(orjson.loads(raw))
                except (orjson.JSONDecodeError, ValueError) as e:
                    raise APIError(400, f"invalid worker: {e}", "invalid_request_error") from None
                if spec.name in self.gw.registry.workers:
                    raise APIError(409, f"worker {spec.name!r} exists", "invalid_request_error")
                self.gw.sync_workers(
                    [*(w.spec for w in self.gw.registry.workers.values()), worker_spec(spec)]
                )
                return JSONResponse({"added": spec.name}, status_code=201)
            return JSONResponse(
                {"workers": [_worker_doc(w) for w in self.gw.registry.workers.values()]}
            )
        except APIError as e:
            return e.response()

    async def admin_worker(self, request: Request) -> Response:
        try:
            self._admin(request)
            name = request.path_params["name"]
            if name not in self.gw.registry.workers:
                raise APIError(404, f"no worker {name!r}", "invalid_request_error")
            self.gw.sync_workers(
                [w.spec for w in self.gw.registry.workers.values() if w.name != name]
            )
            return JSONResponse({"removed": name})
        except APIError as e:
            return e.response()

    async def admin_drain(self, request: Request) -> Response:
        """Drain a worker for a rolling update: POST stops new requests to it (in-flight ones
        finish), GET polls until ``drained``, DELETE readmits it. The state lives in this gateway
        process: with several replicas, drain the worker on each of them."""
        try:
            self._admin(request)
            name = request.path_params["name"]
            w = self.gw.registry.workers.get(name)
            if w is None:
                raise APIError(404, f"no worker {name!r}", "invalid_request_error")
            if request.method != "GET":
                self.gw.drain_worker(name, request.method == "POST")
                log.warning("worker %s %s", name, "draining" if w.draining else "undrained")
            return JSONResponse(
                {
                    "name": name,
                    "draining": w.draining,
                    "in_flight": w.in_flight,
                    "drained": w.drained,
                    "health": w.health.value,
                }
            )
        except APIError as e:
            return e.response()

    async def admin_reload(self, request: Request) -> Response:
        try:
            self._admin(request)
            if self.gw.watcher is None:
                raise APIError(
                    409, "gateway was started without a config file", "invalid_request_error"
                )
            ok = self.gw.watcher.reload()
            if not ok:
                raise APIError(
                    400,
                    "config rejected; the running config is unchanged (see logs)",
                    "invalid_request_error",
                )
            if self.gw.processes is not None:
                self.gw.processes.reload_all()
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
        "draining": w.draining,
        "drained": w.drained,
        "ejection_reason": w.ejection_reason or None,
        "ejected_for_s": round(max(0.0, w.ejected_until - time.monotonic()), 3),
        "error_rate": round(w.error_rate, 3),
        "ttft_median_s": w.ttft_median(),
        "labels": w.spec.labels,
        "weight": w.spec.weight,
    }
