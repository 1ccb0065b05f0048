"""The gateway itself: the request's walk, and the gateway's lifecycle and live reload.

The walk for a completion (`Gateway.completions`, top to bottom): authenticate the tenant
(gateway/tenancy.py) -> read the capped body, parse and validate once (gateway/validate.py) ->
apply the tenant's output caps -> find the workers serving the model (404 unknown / 503 none
healthy; full ones, or a half-open one whose trial runs, are waited for) -> the route key
(gateway/keying.py) -> reserve quota (gateway/quota_gate.py) -> wait for room
(gateway/admission.py) -> the proxy picks a worker through the routing policy and
retries before the first byte (gateway/proxy.py) -> the relay streams SSE untouched
(gateway/relay.py) -> both report to the lifecycle (gateway/lifecycle.py), whose finish has
settlement charge what was used and write the usage record (gateway/settlement.py), then
records metrics and one log line. Nothing calls back into the walk.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import random
import time
from collections.abc import Collection, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway.admission import AdmissionController, Admitted
from gateway.autoscale import AutoscaleCollector, fleet_loads
from gateway.call import Account, Call
from gateway.cluster import ClusterSync
from gateway.config import ConfigError, RoutingSettings, Settings, to_core
from gateway.config_watcher import RESTART_ONLY_CLUSTER, RESTART_ONLY_SECTIONS, ConfigWatcher
from gateway.core_settings import (
    admission_settings,
    precise_index,
    registry_knobs,
    routing_weights,
    worker_spec,
)
from gateway.desired_workers import AutoscaleSettings, DesiredWorkers, request_tokens
from gateway.errors import (
    APIError,
    bad_request,
    internal_error,
    log_internal_error,
    model_not_found,
    no_capacity,
)
from gateway.ids import client_rid_ok, echo_headers, next_request_id
from gateway.keying import load_keyers, route_key
from gateway.lifecycle import Lifecycle
from gateway.logs import setup_logging
from gateway.metrics import (
    AdmissionCollector,
    AdmissionMetrics,
    GatewayMetrics,
    KVEventCollector,
    LogCollector,
)
from gateway.proxy import Proxy
from gateway.quota_gate import QuotaGate, Ticket
from gateway.server import HEAD_AT, DisconnectWatch
from gateway.settlement import Settlement
from gateway.slots import Slots, canary_pool
from gateway.tenancy import (
    Access,
    Tenant,
    Tenants,
    apply_caps,
    choices_per_prompt,
    estimate_prompt_tokens,
    media_bytes,
    output_tokens,
    prompt_count,
)
from gateway.upstream import UpstreamClient, make_upstream
from gateway.usage import JsonlSink, NullSink, RedisStreamSink, UsageSink
from gateway.validate import CHAT, ParsedRequest, parse_request, read_body, request_headers
from scoring.policy import Policy, make_policy
from scoring.state import RoutingState
from scoring.views import RoutingOptions
from workers.dispatch_load import DispatchLoad
from workers.kv_intake import KVEndpoint, KVEventFleet, PreciseSink
from workers.probe import Prober
from workers.registry import Registry
from workers.worker import Health, Worker, WorkerSpec

if TYPE_CHECKING:
    from gateway.process_child import Siblings

log = logging.getLogger("kvgate.gateway")

_WATCH_AFTER_S = 0.05  # another server: a dispatch waiting this long gets a disconnect watcher
_UNTRIED: frozenset[str] = frozenset()  # a first attempt's tried set (no allocation)
_CLIENT_CLOSED = 499  # nginx's status for a client that closed the connection first
# The load a record counts for requests still running on it (dispatched, prefill queued, KV on
# its way): what a worker re-added at its address takes over from its retired record.
_DISPATCH_LOAD = tuple(DispatchLoad.__annotations__)
# What a drain answers every request it refuses or cuts off its worker (503 `shutting_down`).
_SHUTTING_DOWN = "This gateway replica is shutting down; retry (another replica will answer)."


def _shutting_down() -> APIError:
    return APIError(
        503, _SHUTTING_DOWN, "service_unavailable", code="shutting_down", retry_after_s=1.0
    )


def _base_model(w: Worker) -> str | None:
    """The model a worker's unsalted, non-LoRA KV blocks belong to (LoRA cards have a parent)."""
    base = sorted(m for m, card in w.model_cards.items() if not card.get("parent"))
    return base[0] if base else (min(w.models) if w.models else None)


def _tenant_names(tenants: Tenants) -> set[str]:
    """The tenant names requests of a config can be counted under (series' `tenant` label)."""
    names = set(tenants.by_name)
    if tenants.anonymous is not None:
        names.add(tenants.anonymous.name)
    return names


class Gateway:
    """Everything one gateway process holds; `apply()` swaps in a reloaded config live."""

    def __init__(self, settings: Settings, config_path: Path | None = None) -> None:
        self.settings = settings
        self.config_path = config_path
        self.metrics = GatewayMetrics()
        p = settings.probes
        self.registry = Registry(
            (worker_spec(w) for w in settings.workers),
            **registry_knobs(p),
            on_change=self._on_health_change,
        )
        self.metrics.worker_names = self.registry.workers  # removed workers' series stay gone
        self.metrics.model_known = self.registry.knows_model  # and removed models' series
        self.routing_options = RoutingOptions(**settings.routing.options)
        self._media_bytes = self._media_charge(settings)
        self.precise = precise_index(settings.routing.kv_events)
        self.routing_state = RoutingState(self.routing_options, self.precise)
        self.kv_fleet = KVEventFleet(
            PreciseSink(
                self.precise,
                self._worker_model,
                self._worker_block_size,
                capacity_of=self._worker_num_blocks,
            )
        )
        self.metrics.registry.register(KVEventCollector(self.kv_fleet))
        self.metrics.registry.register(LogCollector())
        self._kv_sync_lock = asyncio.Lock()
        self._kv_tasks: set[asyncio.Task[None]] = set()
        self._started: dict[str, float] = {}  # worker -> its process's start time, last probe
        # Worker -> the models its last probe listed: a probe that drops one may leave requests
        # queued for a model nothing serves any more (`_on_probe`).
        self._models: dict[str, frozenset[str]] = {}
        # Models of workers a reload (or /admin/workers) removed whose queued requests wait for
        # a worker still starting (a URL move adds the new one before its first probe).
        self._orphaned: set[str] = set()
        # Worker records a reload removed (or replaced: a new URL) while requests ran on them.
        self._retired: list[Worker] = []
        # Walks not yet handed to admission and a worker, and those a drain's grace cut.
        self._walks: set[asyncio.Task[Any] | None] = set()
        self._walks_cut: set[asyncio.Task[Any] | None] = set()
        # Tenant -> request bodies it is uploading now (`_read_body`).
        self._uploading: dict[str, int] = {}
        self.token_keyers = load_keyers(settings.routing.token_mode)
        self.policy: Policy = self._make_policy(settings.routing)
        self.tenants = Tenants(settings)
        self.slots = Slots(
            self.registry, settings.admission, self.routing_options, self.tenants.top_priority
        )
        self.quota = QuotaGate(settings.quota, self.metrics)
        self.admission = AdmissionController(
            admission_settings(settings.admission), observer=AdmissionMetrics(self.metrics)
        )
        self.metrics.registry.register(AdmissionCollector(self.admission))
        # [cluster]: other replicas' per-worker load, refreshed in the background (no Redis on
        # the request path); None = this replica routes on its own dispatches alone.
        self.cluster: ClusterSync | None = None
        if settings.cluster.enabled:
            self.cluster = ClusterSync(
                settings.cluster,
                self.registry,
                redis_url=settings.cluster.redis_url or settings.quota.redis_url,
                on_freed=self.admission.kick,
                metrics=self.metrics.registry,
                state=self.routing_state,
                retired=self._retired_running,
                # Swapped on reload: read through the lambda, never captured.
                token_models=lambda: self.token_keyers,
            )
        self.autoscale = DesiredWorkers(to_core(settings.autoscale, AutoscaleSettings))
        self.metrics.registry.register(
            AutoscaleCollector(
                self.autoscale, functools.partial(fleet_loads, self.registry, self.admission)
            )
        )
        self.usage: UsageSink = NullSink()
        self.settlement = Settlement(self.quota, self.usage)
        # What a dispatch changes, reported by the proxy and the relay (the prober joins at start).
        self.life = Lifecycle(
            self.registry,
            self.metrics,
            self.admission,
            self.settlement,
            log_requests=settings.logging.requests,
        )
        self._rng = random.Random()
        self.upstream: UpstreamClient | None = None
        self.probe_client: httpx.AsyncClient | None = None
        self.prober: Prober | None = None
        self.proxy: Proxy | None = None
        self.watcher: ConfigWatcher | None = None
        self.started_at = time.time()
        self.draining = False
        # One of `kvgate serve --processes N`'s children (gateway/process_child.py sets it):
        # /metrics then answers for every process, /health and /ready say which one answered.
        self.processes: Siblings | None = None

    def _make_policy(self, r: RoutingSettings) -> Policy:
        return make_policy(
            r.policy,
            weights=routing_weights(r.weights),
            options=self.routing_options,
            state=self.routing_state,
        )

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        s = self.settings
        if s.quota.backend == "redis":
            self.usage = RedisStreamSink(
                self.quota.shared.client,  # type: ignore[attr-defined]
                s.quota.usage_stream,
                s.quota.usage_stream_maxlen,
                buffer_max=s.quota.usage_buffer_max,
                buffered_gauge=self.metrics.usage_buffered,
                dropped_counter=self.metrics.usage_dropped,
            )
        elif s.quota.usage_file:
            self.usage = JsonlSink(s.quota.usage_file)
        self.settlement.usage = self.usage
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
            deep_every=s.probes.deep_every,
            deep_timeout_s=s.probes.deep_timeout_s,
            deep_model=s.probes.deep_model,
        )
        self.life.prober = self.prober
        self.proxy = Proxy(self.registry, self.upstream, self.metrics, self.slots, self.life)
        self.proxy.wait_room = self._wait_room
        self.prober.sync()
        if self.cluster is not None:
            await self.cluster.start()
        await self._sync_kv_events()
        if self.config_path is not None:
            self.watcher = ConfigWatcher(
                self.config_path,
                self.settings,
                self.apply,
                self._on_reload_error,
                watch=s.server.watch_config,
            )
            await self.watcher.start()
        if self.processes is not None:
            await self._first_probes(s.probes.timeout_s + 1.0)

    async def _first_probes(self, seconds: float) -> None:
        """A restarted process of several listens (and takes its share of new connections)
        only once its probes found a healthy worker, or every worker answered, or `seconds`
        passed: until then it could only answer 503 where its siblings serve."""
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        workers = self.registry.workers.values()
        while loop.time() < end and not self.registry.healthy():
            if all(w.health is not Health.STARTING for w in workers):
                return
            await asyncio.sleep(0.02)

    async def drain(self, grace_s: float | None = None) -> None:
        """Graceful shutdown, step one (SIGTERM): stop taking work, let in-flight work finish.

        /ready fails at once (load balancers stop sending), new requests and queued ones get 503
        with Retry-After, in-flight requests get ``grace_s`` to finish. Then streams still
        running end with an SSE error event, and requests still waiting on their worker (no
        first byte yet, or a whole response still generating) with the same 503 as new ones,
        their upstream requests aborted: else they would outlive the drain until uvicorn
        cancelled them into a plain-text 500. Every one of them is settled (the relay's cleanup
        charges what was streamed; a request cut before any byte is refunded). The process
        exits after this returns.
        """
        if grace_s is None:
            grace_s = self.settings.server.drain_grace_s
        self.draining = True
        self.admission.close(_SHUTTING_DOWN, 1.0)
        log.warning("draining: %d requests in flight, %.1f s grace", self._in_flight(), grace_s)
        if not await self._wait_idle(grace_s):
            cut = self.life.cut_streams("the gateway is shutting down; stream ended")
            waiting = self.proxy.cut_waiting(_SHUTTING_DOWN) if self.proxy is not None else 0
            walking = list(self._walks)
            self._walks_cut.update(walking)
            for task in walking:
                if task is not None:
                    task.cancel()
            log.warning(
                "draining: grace over, ending %d streams, %d requests waiting on a worker and "
                "%d not yet sent to one",
                cut,
                waiting,
                len(walking),
            )
            await self._wait_idle(5.0)

    async def _wait_idle(self, seconds: float) -> bool:
        """Poll until nothing is in flight (True) or ``seconds`` pass (False)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        while loop.time() < end:
            if not self._in_flight() and not self._walks:
                return True
            await asyncio.sleep(0.02)
        return not self._in_flight() and not self._walks

    def _retired_running(self) -> list[Worker]:
        """Records a reload removed (or replaced) whose requests still run: [cluster] publishes
        their load, under the name and URL they ran at, until the last one ends. Those done are
        dropped here too (every publish interval), not only when a drain counts them."""
        gone = self._retired
        if gone:
            gone[:] = [w for w in gone if w.in_flight > 0 or w.prefill_tokens > 0]
        return gone

    def _in_flight(self) -> int:
        """Requests on any worker, those a reload removed (or moved to a new URL) included:
        a drain must wait for (or cut) them too."""
        gone = self._retired
        if gone:
            gone[:] = [w for w in gone if w.in_flight > 0]
        return sum(w.in_flight for w in self.registry.workers.values()) + sum(
            w.in_flight for w in gone
        )

    async def stop(self) -> None:
        if self.watcher:
            await self.watcher.stop()
        if self.prober:
            await self.prober.stop()
        if self.cluster is not None:
            await self.cluster.stop()
        await self.kv_fleet.close()
        if self.upstream:
            await self.upstream.close()
        await self.usage.close()
        await self.quota.close()
        if self.probe_client:
            await self.probe_client.aclose()

    def _media_charge(self, settings: Settings) -> dict[str, int]:
        return media_bytes(
            settings.tenancy.media_tokens.model_dump(), self.routing_options.chars_per_token
        )

    def apply(self, new: Settings) -> None:
        """Apply a validated config to the running gateway, whole or not at all: what can fail
        (a config that would let in callers the running one turns away, `Access.opened_by`;
        loading tokenizers) runs before anything changes, and raises to the caller (the
        watcher then keeps the running config and counts a rejected reload)."""
        old = self.settings
        opened = Access.of(old).opened_by(new)
        if opened:
            raise ConfigError(
                f"{opened}; a reload never turns authentication off (a file caught "
                "half-written would do it too): to run this config on purpose, restart the "
                "gateway with it"
            )
        r = new.routing
        keyers = None
        if r.token_mode != old.routing.token_mode:
            # A tokenizer.json that does not load: rejected. Unchanged models keep theirs.
            keyers = load_keyers(r.token_mode, self.token_keyers, old.routing.token_mode)
        # What a reload cannot change stays as it runs, and `self.settings` says so: installed,
        # the new [server] applied its body limit, headers and drain grace at once, though the
        # log said "after a restart", and `--processes` children then disagreed (a restarted one
        # runs the start's values): the same request got 200 or 413 by process (review).
        pinned: dict[str, object] = {}
        for section in RESTART_ONLY_SECTIONS:
            if getattr(old, section) != getattr(new, section):
                log.warning("[%s] changed: takes effect after a restart", section)
                pinned[section] = getattr(old, section)
        if new.autoscale != old.autoscale:
            self.autoscale.configure(to_core(new.autoscale, AutoscaleSettings))
        if new.cluster != old.cluster:
            if any(
                getattr(old.cluster, k) != getattr(new.cluster, k) for k in RESTART_ONLY_CLUSTER
            ):
                log.warning(
                    "[cluster] %s: take effect after a restart", "/".join(RESTART_ONLY_CLUSTER)
                )
                pinned["cluster"] = new.cluster.model_copy(
                    update={k: getattr(old.cluster, k) for k in RESTART_ONLY_CLUSTER}
                )
            if self.cluster is not None:
                self.cluster.configure(new.cluster)  # interval, expiry, timeout: live
        if new.timeouts.connect_s != old.timeouts.connect_s:
            if self.prober is not None:
                self.prober.connect_s = new.timeouts.connect_s
            if hasattr(self.upstream, "connect_s"):
                self.upstream.connect_s = new.timeouts.connect_s
            else:
                log.warning("[timeouts] connect_s: takes effect for workers after a restart")
        if pinned:
            new = new.model_copy(update=pinned)
        self.settings = new
        if r.options != old.routing.options:
            self.routing_options = RoutingOptions(**r.options)
        self._media_bytes = self._media_charge(new)
        if r.policy != old.routing.policy or r.options != old.routing.options:
            self.policy = self._make_policy(r)  # same RoutingState: the index survives
        elif r.weights != old.routing.weights:
            self.policy.set_weights(routing_weights(r.weights))
        if r.kv_events != old.routing.kv_events:
            k = r.kv_events
            p_ = self.precise
            p_.offload_weight, p_.pending_ttl_s = k.offload_weight, k.pending_ttl_s
            p_.settle_s = k.settle_s
            p_.stale_after_s, p_.stale_after_dispatches = k.stale_after_s, k.stale_after_dispatches
        if keyers is not None:
            self.token_keyers = keyers
        was = _tenant_names(self.tenants)
        self.tenants = Tenants(new)
        now = _tenant_names(self.tenants)
        self.metrics.keep_tenants(now)  # back in the config before their series went: kept
        self.metrics.forget_tenants(was - now)  # per-tenant series of tenants no longer there
        self.life.log_requests = new.logging.requests
        self.slots.configure(new.admission, self.routing_options, self.tenants.top_priority)
        if new.admission != old.admission:
            self.admission.configure(admission_settings(new.admission))
        p = new.probes
        r = self.registry
        r.configure(**registry_knobs(p))
        if self.prober:
            self.prober.interval_s, self.prober.timeout_s = p.interval_s, p.timeout_s
            self.prober.deep_every, self.prober.deep_timeout_s = p.deep_every, p.deep_timeout_s
            self.prober.deep_model = p.deep_model
        if new.workers != old.workers:
            self._sync_file_workers(old, new)
        setup_logging(new.logging.level, new.logging.format)
        self.metrics.config_reloads.inc()

    def _sync_file_workers(self, old: Settings, new: Settings) -> None:
        """The file's [[workers]] changed: the fleet becomes its list. Only then: a reload of
        anything else (a routing weight) used to reset the fleet to the file too, dropping
        workers added through /admin/workers and bringing back ones removed there. Admin
        changes that this one replaces are named in the log."""
        listed = {w.name for w in old.workers}
        now = set(self.registry.workers)
        added, removed = sorted(now - listed), sorted(listed - now)
        if added or removed:
            log.warning(
                "[[workers]] changed in the file, which now sets the fleet: replaces the "
                "/admin/workers changes since the last load (added %s, removed %s)",
                added,
                removed,
            )
        self.sync_workers([worker_spec(w) for w in new.workers])

    def sync_workers(self, specs: list[WorkerSpec]) -> None:
        before = dict(self.registry.workers)
        added, removed = self.registry.sync(specs)
        for name in removed:
            if name in before:
                self._orphaned |= before[name].models
            self.metrics.forget_worker(name, [h.value for h in Health])
            self._forget_routing(name)
            self._started.pop(name, None)
            self._models.pop(name, None)
            old = before.get(name)
            if old is not None and old.in_flight > 0:
                self._retired.append(old)  # its requests still run: drain counts them
        for name in added:
            self._reclaim(name)
        if removed:
            self._fail_orphaned()
            self._forget_models()
        if added or removed:
            log.info("fleet changed: added %s, removed %s", added, removed)
        if self.prober:
            self.prober.sync()
            # Started gateways only: start() subscribes the initial fleet itself.
            self._schedule_kv_sync()

    def _reclaim(self, name: str) -> None:
        """A worker just added under the name and URL of a retired record (removed, then added
        back, while requests ran there) is the same server: those requests take its room.

        The registry's new record started at 0 in flight, and the retired one's requests release
        the record they hold, never the new one: the server took its whole cap again on top of
        what still ran (review: cap 4, 4 running, room 4 after a remove and re-add), and other
        replicas did not see that load ([cluster] publishes registry records only). So the
        retired record, reset to what a new one holds except that load, takes the new one's
        place: the requests running there release the record that counts them, once each."""
        fresh = self.registry.workers[name]
        for i, old in enumerate(self._retired):
            if old.name == name and old.url == fresh.url and old.in_flight > 0:
                del self._retired[i]
                break
        else:
            return
        load = {k: getattr(old, k) for k in _DISPATCH_LOAD}
        for f in dataclasses.fields(Worker):
            setattr(old, f.name, getattr(fresh, f.name))
        for k, v in load.items():
            setattr(old, k, v)
        self.registry.workers[name] = old
        self.metrics.child(self.metrics.in_flight, name).set(old.in_flight)

    def _forget_routing(self, name: str) -> None:
        """What routing learned of a worker that left (or restarted: its cache is gone). The
        shared state, not only the policy's hook: a stateless policy's hook does nothing, and
        the index and session pins it leaves survive a switch back to kv_aware, crediting a
        cold server under the old name with the old one's cache."""
        self.routing_state.forget_worker(name)
        self.policy.on_worker_removed(name)

    def _forget_models(self) -> None:
        """Admission pools and series of models no worker in the fleet lists any more (a pool
        that still queues requests keeps its series until they are served or refused)."""
        held = set()
        for pool in self.admission.pools():
            if not self.registry.knows_model(pool) and not self.admission.forget_pool(pool):
                held.add(pool)
        for model in self.metrics.label_values("model") - held:
            if not self.registry.knows_model(model):
                self.metrics.forget_model(model)

    def _limited_as(self, tenant: Tenant, model: str) -> str:
        """The name whose `model_limits` a request for ``model`` counts under: ``model``, or
        another name the same server serves the same model under (`--served-model-name a b`:
        both cards name one `root`, neither an adapter). vLLM serves one model under all its
        names, so a limit set on one name was skipped by calling another (rpm 1 on `llama`:
        429 there, any number of 200s under its alias). Only names served together: two
        deployments of the same weights under different names (a short- and a long-context
        one) are two models, their limits apart. Looked up only when the tenant has model
        limits that do not name ``model``."""
        per_model = tenant.limits.per_model
        if not per_model or model in per_model:
            return model
        for w in self.registry.workers.values():
            cards = w.model_cards
            card = cards.get(model)
            if card is None or card.get("parent"):
                continue
            root = card.get("root")
            if not isinstance(root, str) or not root:
                continue
            for name in per_model:
                other = cards.get(name)
                if other is not None and other.get("root") == root and not other.get("parent"):
                    return name
        return model

    def _unserved(self, model: str) -> APIError:
        """What a request for ``model`` that no worker serves now is answered: 503 while a worker
        has listed it (it may come back) or none is healthy (nothing can be said of the model),
        else 404. New and queued requests alike."""
        if self.registry.knows_model(model):
            self.autoscale.note_unserved(model)  # refused demand (gateway/desired_workers.py)
        if self.registry.knows_model(model) or not self.registry.healthy():
            return no_capacity(f"no healthy worker is serving model `{model}`")
        return model_not_found(model)

    def _fail_unserved(self, models: Collection[str]) -> None:
        """Refuse at once the requests queued for those of ``models`` that no worker serves any
        more, with what a new request gets (`_unserved`), rather than at their deadline as "no
        worker became free"."""
        for model in models:
            if not self.registry.serving(model):
                self.admission.fail_pool(model, functools.partial(self._unserved, model))
            else:  # retries left with no untried worker that serves it are refused (`kick`)
                self.admission.kick(model)

    def drain_worker(self, name: str, draining: bool) -> bool:
        """Drain a worker (no new requests; in-flight ones finish) or readmit it: requests queued
        for a model it was the last to serve get a new request's answer at once (they waited out
        their deadline, then read "no worker became free", while a new request got a 503 at
        once), and on readmission its models' waiters go without waiting for the next
        re-check. False for an unknown worker."""
        w = self.registry.workers.get(name)
        if w is None or not self.registry.drain(name, draining):
            return False
        if draining:
            self._fail_unserved(w.models)
        else:
            self.admission.kick(w.models)
        return True

    def _fail_orphaned(self) -> None:
        """Requests queued for a model whose workers a reload removed get a new request's answer
        (`_fail_unserved`) once no worker is still starting: one that is may list the model at
        its first probe (a URL move: the old record goes, the new one has not answered yet),
        and its first probe's verdict calls this again (`_on_health_change`). Without it they
        waited out their whole deadline and read "no worker became free"."""
        if not self._orphaned or any(
            w.health is Health.STARTING for w in self.registry.workers.values()
        ):
            return
        models, self._orphaned = self._orphaned, set()
        self._fail_unserved(models)
        self._forget_models()  # a model the fleet no longer lists takes its series with it

    def _schedule_kv_sync(self) -> None:
        task = asyncio.get_running_loop().create_task(self._sync_kv_events())
        self._kv_tasks.add(task)
        task.add_done_callback(self._kv_tasks.discard)

    async def _sync_kv_events(self) -> None:
        """Subscribe to the events of every worker that publishes them and whose models are
        known: an event's blocks are keyed by the model they belong to, so a subscriber that
        started before the first probe would have to drop what it replays."""
        async with self._kv_sync_lock:
            eps = {
                w.name: KVEndpoint(
                    w.spec.kv_events, w.spec.kv_events_replay or None, w.spec.kv_events_topic
                )
                for w in self.registry.workers.values()
                if w.spec.kv_events and w.models
            }
            try:
                await self.kv_fleet.sync(eps)
            except Exception:
                log.exception("kv events: subscriber sync failed")

    def _worker_model(self, name: str) -> str | None:
        """The name a worker's KV events are keyed under: its model's, as requests key theirs
        (`Registry.cache_name`)."""
        w = self.registry.workers.get(name)
        base = None if w is None else _base_model(w)
        return None if base is None else self.registry.cache_name(base)

    def _worker_block_size(self, name: str) -> int:
        w = self.registry.workers.get(name)
        return (w.metrics.block_size or 0) if w is not None else 0

    def _worker_num_blocks(self, name: str) -> int:
        """The KV blocks a worker reports (vLLM's num_gpu_blocks): what its events may claim."""
        w = self.registry.workers.get(name)
        return (w.metrics.num_blocks or 0) if w is not None else 0

    def _on_reload_error(self, msg: str) -> None:
        self.metrics.config_reload_errors.inc()

    def _on_probe(self, w: Worker, ok: bool, seconds: float) -> None:
        m = self.metrics
        models, self._models[w.name] = self._models.get(w.name), w.models
        if models is not None and models - w.models:
            # Restarted serving other models, health unchanged: the requests queued for a model
            # it was the last to serve would wait out their deadline (review: 10 s, then "no
            # worker became free" where a new request got a 404 at once).
            self._fail_unserved(models - w.models)
            self._forget_models()
        m.probe_seconds.labels(w.name).observe(seconds)
        if not ok:
            m.probe_failures.labels(w.name).inc()
        self.metrics.export_health(w.name, w.health)
        started = w.metrics.process_start
        if started is not None:
            was = self._started.get(w.name)
            self._started[w.name] = started
            if was is not None and was != started:
                # A new process at the same address: its prefix cache is empty, so what routing
                # learned of it (index, session pins) would send prefixes to a cold worker.
                log.info("worker %s restarted: routing forgets what it held", w.name)
                self._forget_routing(w.name)
        if w.spec.kv_events:
            self.kv_fleet.note_probe(w.name, w.health is Health.HEALTHY, w.metrics.process_start)
            if w.models and not self.kv_fleet.subscribed(w.name):
                self._schedule_kv_sync()
        self.admission.kick()  # fresh metrics (or a readmitted worker) may make room

    def _on_health_change(self, w: Worker, was: Health) -> None:
        """Every health change, whatever caused it (probes, failed requests, the breaker, outlier
        ejection, a half-open trial): exported and logged here, once per transition."""
        self.metrics.export_health(w.name, w.health)
        down = w.health is Health.UNHEALTHY
        log.log(logging.WARNING if down else logging.INFO, "%s", w.change_message(was))
        if was is Health.STARTING:
            self._fail_orphaned()
        if down:  # its models' waiters may have no worker left: they get a new request's 503
            self._fail_unserved(self.admission.pools())
        else:
            # Back, or on trial: its models' waiters may go (a trial that passed at a stream's
            # first byte frees its room long before the stream releases its slot).
            self.admission.kick(w.models)

    # -- the walk ----------------------------------------------------------------------------------
    def _read_body(
        self, request: Request, tenant: Tenant, hdrs: dict[str, str]
    ) -> Coroutine[Any, Any, bytes]:
        """The body's read, with no more uploads of one tenant at once than it may run requests
        (`_upload`) where the tenant has a concurrency limit; the plain read, no extra frame on
        every request, where it has none."""
        settings = self.settings
        read = read_body(
            request,
            hdrs.get("content-length"),
            settings.server.max_body_bytes,
            settings.timeouts.client_body_s,
        )
        cap = tenant.limits.max_concurrent
        return read if cap is None else self._upload(tenant.name, cap, read)

    async def _upload(self, name: str, cap: int, read: Coroutine[Any, Any, bytes]) -> bytes:
        """A body is read before the quota admits the request (a refused one costs no upload),
        while it already holds a place under `server.max_concurrent_requests`: a tenant with
        `max_concurrent = 1` that opened 8 slow uploads held all 8 places of that cap, and
        every other tenant got a 503 (review finding). Per process, as the cap is."""
        uploading = self._uploading
        n = uploading.get(name, 0)
        if n >= max(cap, 1):
            read.close()  # never started
            raise APIError(
                429,
                f"Too many concurrent requests on your key (limit {cap}): this many of its "
                "requests are still uploading their bodies. Please try again shortly.",
                "requests",
                code="rate_limit_exceeded",
            )
        uploading[name] = n + 1
        try:
            return await read
        finally:
            n = uploading[name] - 1
            if n:
                uploading[name] = n
            else:
                del uploading[name]

    async def completions(self, request: Request) -> Response:
        path: str = request.scope["path"]  # not request.url: it builds a URL object (~2.5% CPU)
        # Our own id names the request everywhere it matters (quota reservation, usage record,
        # logs, the worker's x-request-id): clients reuse and collide ids, and billing dedupes
        # on this one. The client's id is kept beside it, echoed and forwarded as a label.
        rid = next_request_id()
        hdrs = request_headers(request.scope)
        client_rid = hdrs.get("x-request-id") or None
        if client_rid is not None and not client_rid_ok(client_rid):
            client_rid = None
        echo = echo_headers(rid, client_rid)
        # From the complete request head when the server says (gateway.server), so a loop busy
        # elsewhere shows in TTFT instead of hiding before the walk's first line.
        t0 = request.scope.get(HEAD_AT) or time.perf_counter()
        ticket: Ticket | None = None
        call: Call | None = None
        req: ParsedRequest | None = None  # parsed: its model and stream go in a refusal's line
        settings = self.settings
        # Until it is handed to `_dispatch` (admission, then a worker: what a drain sees and
        # cuts there), the walk is counted here for the drain: reading a body, keying, quota.
        me = asyncio.current_task()
        walks = self._walks
        walks.add(me)
        # Two levels: the inner handlers answer the walk's refusals and its bugs; the outer one
        # a bug in those handlers (a refund, a request line), which escaped to uvicorn as a
        # plain-text 500 without the request's ids. Neither costs anything until it catches.
        try:
            try:
                if self.draining:
                    raise _shutting_down()
                tenant = self.tenants.authenticate(hdrs.get("authorization"), hdrs.get("x-api-key"))
                raw = await self._read_body(request, tenant, hdrs)
                open_gateway = not self.tenants.enabled  # caps nothing: the workers' flags decide
                req = parse_request(
                    path,
                    raw,
                    accept_embeds=tenant.cfg.accept_embeds or open_gateway,
                    accept_media_kwargs=tenant.cfg.accept_media_kwargs or open_gateway,
                    live_usage=not open_gateway,
                )
                data, model = req.data, req.model
                is_chat = path == CHAT
                prompt_est = estimate_prompt_tokens(
                    is_chat, data, self.routing_options.chars_per_token, self._media_bytes
                )
                if self.tenants.enabled:
                    # Output reserved: per-choice limit (capped/injected) x choices x prompts.
                    max_out, changed = apply_caps(tenant, model, data, prompt_est, is_chat=is_chat)
                    req.modified |= changed
                else:
                    max_out = output_tokens(is_chat, data)
                # Serving, not `candidates` (those with room now): a request behind full workers,
                # or a half-open one whose trial runs, waits in admission for room or the verdict.
                serving = self.registry.serving(model)
                if not serving:
                    raise self._unserved(model)
                if self.tenants.enabled:
                    # Before keying: a refused request costs no tokenizing (token mode: ~150 ms of
                    # a worker thread for a 195 kB prompt), and its latency says nothing of it.
                    limited = self._limited_as(tenant, model)
                    ticket = await self.quota.admit(tenant, rid, limited, prompt_est + max_out)
                route = await route_key(
                    policy=self.policy,
                    keyers=self.token_keyers,
                    views=(w.view() for w in serving),
                    options=self.routing_options,
                    token_mode=settings.routing.token_mode,
                    is_chat=is_chat,
                    data=data,
                    raw_len=len(raw),
                    model=model,
                    cache_model=self.registry.cache_name(model),
                    namespace=tenant.namespace,
                    session_scope=tenant.session_scope,
                    headers=hdrs,
                    session_header=settings.routing.session_header,
                    tenant_priority=tenant.priority,
                    request_id=rid,
                    precise=self.kv_fleet.active,
                )
                cap = tenant.cfg.max_input_tokens
                if route.exact_tokens and cap is not None and route.exact_tokens > cap:
                    # The tokenizer's count (token mode) where the estimate let it pass: text that
                    # tokenizes finer than the estimate's bytes per token (control characters, rare
                    # scripts) held up to ~4x the tokens it said. Refused before any worker sees it;
                    # the reservation goes back.
                    raise bad_request(
                        f"This request's prompt is {route.exact_tokens} tokens; the limit for your "
                        f"key is {cap} input tokens.",
                        "messages" if is_chat else "prompt",
                    )
                call = Call(
                    request_id=rid,
                    client_request_id=client_rid,
                    model=model,
                    path=path,
                    body=orjson.dumps(data) if req.modified else raw,
                    stream=req.stream,
                    client_wants_usage=req.client_wants_usage,
                    client_wants_live_usage=req.client_wants_live_usage,
                    live_usage_upstream=req.stream
                    and (not open_gateway or req.client_wants_live_usage),
                    route=route,
                    t_start=t0,
                    pool_ok=canary_pool(settings.routing.splits, model, self._rng),
                    account=Account(
                        tenant,
                        ticket,
                        prompt_est,
                        tokens=request_tokens(prompt_est, data, max_out),
                        # What a cut stream's live usage is multiplied by: tenants' alone.
                        choices=choices_per_prompt(data) * prompt_count(is_chat, data)
                        if not open_gateway
                        else 1,
                        hidden_output=is_chat and data.get("include_reasoning") is False,
                    ),
                )
                walks.discard(me)
                resp = await self._dispatch(request, call, tenant, hdrs)
                if ticket is not None and ticket.admission is not None:
                    resp.headers.update(ticket.admission.headers())
                return resp
            except asyncio.CancelledError:
                # Cancelled from outside (server shutdown past its grace): nothing was produced for
                # the client, so the reservation goes back, never leaks.
                await self.settlement.refund(call, ticket)
                if me not in self._walks_cut:
                    raise
                # The drain's grace ended before this walk reached a worker (a body still
                # uploading, say): the 503 new requests get, not uvicorn's plain-text 500 later.
                self._walks_cut.discard(me)
                if me is not None:
                    me.uncancel()
                err = _shutting_down()
                await self._refused(call, req, rid, client_rid, path, t0, err)
                return err.response(echo)
            except APIError as e:
                if call is not None and call.outcome == "gateway_shutdown":
                    # A drain cut it off its worker before any byte reached the client
                    # (gateway.proxy.Proxy.cut_waiting): recorded as a request its worker had, like
                    # a cut stream, and settled as nothing generated (no usage, no events): the
                    # reservation is refunded, the concurrency lease freed, once (`finish`).
                    await self.life.finish(call)
                elif (
                    call is not None
                    and call.upstream_sent
                    and (not call.stream or e.status == _CLIENT_CLOSED)
                ):
                    # Cut off while a worker had it (a whole response's total timeout, a client
                    # gone, a stream's before its first token): the compute was spent, so it is
                    # settled (gateway.settlement.charge says what it costs), not refunded.
                    call.status = e.status
                    call.outcome = (
                        "upstream_timeout"
                        if e.status == 504
                        else "upstream_too_large"
                        if e.code == "upstream_response_too_large"
                        else "client_disconnect"
                    )
                    await self.life.finish(call)
                else:
                    # No worker produced anything: not the tenant's doing, refund it all.
                    await self.settlement.refund(call, ticket)
                    await self._refused(call, req, rid, client_rid, path, t0, e)
                if ticket is not None and ticket.admission is not None:
                    # Every response says the key's budget (README), errors after admission too: a
                    # client backing off after a worker's 5xx reads what it has left here.
                    return e.response({**ticket.admission.headers(), **echo})
                return e.response(echo)
            except Exception as exc:
                return await self._failed(exc, call, req, ticket, rid, client_rid, path, t0, echo)
            finally:
                walks.discard(me)
        except Exception as exc:
            return await self._failed(exc, call, req, ticket, rid, client_rid, path, t0, echo)

    async def _failed(
        self,
        exc: Exception,
        call: Call | None,
        req: ParsedRequest | None,
        ticket: Ticket | None,
        rid: str,
        client_rid: str | None,
        path: str,
        t0: float,
        echo: dict[str, str],
    ) -> Response:
        """A bug in the walk, or in its answer to a refusal: the client still gets the envelope
        with its ids, and the reservation and lease go back (`QuotaGate.release` and the request
        line's `finish` are once-only, so repeating what the failed handler began is safe).
        Never raises: a failure of this cleanup is logged too (without a second traceback when
        it is the same failure again: the handler that broke is the one retried here), and the
        500 still goes out."""
        fields = log_internal_error(exc, rid, client_rid, "POST", path)
        err = internal_error()
        try:
            if ticket is not None:
                await self.quota.release(ticket, refund_all=True)
            await self._refused(call, req, rid, client_rid, path, t0, err)
        except Exception as again:
            repeat = type(again) is type(exc) and again.args == exc.args
            log.error(
                "request %s: its cleanup after the failure failed too (%r)",
                rid,
                again,
                exc_info=None if repeat else again,
                extra={"fields": fields},
            )
        return err.response(echo)

    async def _refused(
        self,
        call: Call | None,
        req: ParsedRequest | None,
        rid: str,
        client_rid: str | None,
        path: str,
        t0: float,
        e: APIError,
    ) -> None:
        """Count and log, once, a request the walk answers with ``e`` that `Lifecycle.finish`
        has not recorded. Refused before any worker was picked: kvgate_rejected_requests_total
        and a `rejected` request line. A worker was picked (it refused or failed the request,
        or the client left meanwhile; refunded, nothing generated): a request of that worker,
        in kvgate_requests_total, as the requests it answered are."""
        if call is None or not call.attempts:
            self.life.rejected(
                rid,
                client_rid,
                req.model if req is not None else None,
                path,
                e.status,
                t0,
                e.message,
                req.stream if req is not None else None,
            )
        elif not call.finished:
            call.status = e.status
            if not call.outcome:
                call.outcome = (
                    "client_disconnect" if e.status == _CLIENT_CLOSED else e.code or e.type
                )
            await self.life.finish(call, e.message[:200], settle=False)

    def _admit(
        self, tenant: Tenant, model: str, deadline_s: float | None, tried: Collection[str] = ()
    ) -> Coroutine[Any, Any, Admitted]:
        """The wait for room in ``model``'s admission queue (the coroutine itself: no frame of
        its own on every request), counting the slots of the workers not ``tried``."""
        return self.admission.admit(
            tenant=tenant.name,
            priority=tenant.priority,
            weight=tenant.cfg.queue_weight,
            deadline_s=deadline_s,
            has_room=functools.partial(self.slots.free, model, tenant.priority, tried),
            pool=model,
            tried=frozenset(tried) if tried else _UNTRIED,
        )

    async def _wait_room(self, call: Call, tried: Collection[str], deadline: float) -> None:
        """A retry's wait for a worker it has not tried to have room (`Proxy.forward`): in the
        model's queue of retries (new requests do not wait behind it for the worker it tried),
        counting only those workers' slots, bounded by the wait the client allowed
        (`x-kvgate-deadline-ms`, or the default: 0 was "do not queue me" and still waited) and
        by what is left of the request's deadline; refused as a new request is."""
        assert call.account is not None  # the walk's calls all have one
        left = deadline - time.perf_counter()
        await self._admit(call.account.tenant, call.model, min(left, call.admit_s), tried)

    async def _dispatch(
        self, request: Request, call: Call, tenant: Tenant, headers: dict[str, str]
    ) -> Response:
        """Wait for room, then forward; a client that leaves meanwhile cancels both.

        Until a response starts nothing reads the client's socket, so without a watcher a client
        that hangs up while queued or during a long prefill would keep its queue entry, worker
        request, slot and lease to the end. A disconnect cancels this task; the proxy's cleanup
        aborts the upstream request, the walk's error path refunds the reservation. Streams
        hand over to the relay's own watch once they start.
        """
        me = asyncio.current_task()
        assert me is not None and self.proxy is not None
        # Under another server than kvgate's, the watcher task starts only if the dispatch is
        # still waiting after a moment: most requests get their first byte sooner, and a timer
        # handle costs a fraction of a task (bench/overhead.py: a task per request took 20% off
        # requests/s at 16 in flight).
        watch = DisconnectWatch(request.receive, me, _WATCH_AFTER_S)
        try:
            adm = self.admission.settings
            # The last await before the proxy picks a worker (see gateway.admission): the room
            # this grants is taken synchronously by the dispatch.
            call.admit_s = adm.deadline_s(headers.get(adm.deadline_header.lower()))
            admitted = await self._admit(tenant, call.model, call.admit_s)
            # Every request (0 s when it went straight through): the p95 is over all of them.
            self.autoscale.observe_queue_wait(call.model, admitted.wait_s)
            account = call.account
            assert account is not None
            lease = account.in_flight = self.autoscale.begin(call.model, account.tokens)
            try:
                resp = await self.proxy.forward(call, self.settings, self.policy)
            except BaseException:
                lease.end()  # nothing was handed to the client
                raise
            if call.ttft is not None and call.status == 200:
                self.autoscale.observe_ttft(call.model, call.ttft)  # streams return at 1st byte
            return resp
        except asyncio.CancelledError:
            if not watch.gone:
                raise
            me.uncancel()
            self.metrics.client_disconnects.inc()
            raise APIError(
                _CLIENT_CLOSED,
                "Client closed the connection before the response started",
                "invalid_request_error",
                code="client_closed_request",
            ) from None
        finally:
            watch.stop()
