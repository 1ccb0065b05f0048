"""Typed settings, loaded from one TOML file with `KVGATE_*` environment overrides.

The file is the source of truth ops edit; environment variables exist for containers and CI
(`KVGATE_SERVER__PORT=9000`). Unknown keys are errors: a typo in a routing weight must not be
silently ignored. Reloading builds a whole new `Settings`; a file that fails validation never
replaces the running one (see `gateway.config_watcher`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
import typing
from collections.abc import Collection
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from gateway.desired_workers import AutoscaleSettings as AutoscaleCore
from gateway.quota import DEFAULT_LEASE_TTL_S
from scoring.views import Weights

_T = TypeVar("_T")


def _sha256_hex(v: str, what: str) -> str:
    if len(v) != 64 or any(c not in "0123456789abcdefABCDEF" for c in v):
        raise ValueError(f"{what} must be 64 hex digits (sha256 of the key)")
    return v.lower()


class _Section(BaseModel):
    # No inf or nan anywhere (TOML has both): `queue_weight = inf` passed `gt=0` and turned
    # every queued request of that tenant into a 500.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ServerSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    # Apply edits of the config file as they land (a file watch, and a stat poll every 2 s).
    # Off: only SIGHUP and POST /admin/reload read it, for deployments that stage edits and
    # apply them at a moment of their choosing.
    watch_config: bool = True
    # Debug header with the routing decision (worker and reason) on every response.
    debug_headers: bool = False
    # Name the worker that served each proxied response in `x-kvgate-worker` (the bench tools
    # count placements by it). Off keeps the fleet's layout from clients.
    worker_header: bool = True
    # Total size of the request headers; larger requests get a 431 before any work is done.
    max_header_bytes: int = Field(64 * 1024, ge=1024)
    # Completion requests served at once (queued ones included); beyond it a 503 with Retry-After
    # before the body is read: a connection flood cannot turn into unbounded tasks and buffers.
    max_concurrent_requests: int = Field(4096, ge=1)
    # On SIGTERM: /ready fails and new requests get 503 at once; in-flight requests get this long
    # to finish, then remaining streams end with an SSE error event (all settled) and it exits.
    drain_grace_s: float = Field(30.0, ge=0)
    # A connection must deliver a complete request head this long after it opens (or after the
    # head's first byte, between requests); then it is closed (408 if it had sent part of one).
    head_timeout_s: float = Field(10.0, gt=0)
    # An idle keep-alive connection (between requests) is closed after this long.
    keepalive_timeout_s: float = Field(15.0, gt=0)
    # Open client connections; at the cap the oldest idle one (no request in progress) is closed
    # for a newcomer, and only when all are busy is the newcomer refused (503). Lowered at start
    # to what the open-file limit holds.
    max_connections: int = Field(8192, ge=16)
    # Gateway processes on this address (gateway/supervisor.py); "auto" = the cores this process
    # may run on. Above 1 they share quotas and worker load through Redis like replicas: needs
    # [quota] backend = "redis". Read at start only.
    processes: Annotated[int, Field(ge=1)] | Literal["auto"] = 1

    @field_validator("processes", mode="before")
    @classmethod
    def _processes(cls, v: object) -> object:
        if isinstance(v, bool):  # TOML `true` would otherwise read as 1
            raise ValueError('must be an integer >= 1 or "auto"')
        return v


class LoggingSettings(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["json", "text"] = "json"
    # One structured line per finished request.
    requests: bool = True


class AdminSettings(_Section):
    # sha256 hex digest of the admin key; empty disables every /admin endpoint.
    key_sha256: str = ""
    # /metrics answers only with the admin key (Prometheus: `authorization` with a bearer
    # credential): its labels name tenants, workers and models.
    metrics_require_key: bool = False

    @field_validator("key_sha256")
    @classmethod
    def _hex_digest(cls, v: str) -> str:
        # A key pasted in place of its digest would lock the operator out of every admin
        # endpoint (and a non-ASCII one made each a 500): refused when loaded instead.
        return _sha256_hex(v, "admin.key_sha256") if v else v


class WorkerSettings(_Section):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")
    url: str = Field(pattern=r"^https?://")
    weight: float = Field(1.0, gt=0)
    labels: dict[str, str] = Field(default_factory=dict)
    # Bearer key the worker expects (vLLM --api-key), never the tenant's key.
    api_key: str = ""
    # vLLM KV events (--kv-events-config): the PUB endpoint to subscribe to, e.g.
    # "tcp://10.0.0.5:5557"; empty = none, this worker is routed by the approximate index.
    kv_events: str = Field("", pattern=r"^$|^(tcp|ipc)://")
    # Its replay endpoint (replay_endpoint), used after a sequence gap or a reconnect.
    kv_events_replay: str = Field("", pattern=r"^$|^(tcp|ipc)://")
    # Topic prefix to subscribe to ("" = every topic; vLLM publishes on "kv" by default).
    kv_events_topic: str = ""
    # Requests this worker may run at once (its --max-num-seqs); 0 = [admission] worker_concurrency.
    max_concurrency: int = Field(0, ge=0)

    @field_validator("url")
    @classmethod
    def _strip_slash(cls, v: str) -> str:
        return v.rstrip("/")


class ProbeSettings(_Section):
    interval_s: float = Field(2.0, gt=0)
    timeout_s: float = Field(1.0, gt=0)
    # Consecutive failures (probes and proxied requests) before a worker is ejected. Request
    # failures among them make it a held ejection, readmitted only through half-open (below).
    unhealthy_after: int = Field(3, ge=1)
    # Consecutive successful probes before an ejected worker is readmitted (or goes half-open).
    healthy_after: int = Field(1, ge=1)
    # Re-probe backoff of an ejected worker; every ejection for failed requests, by the breaker or
    # as an outlier also holds a worker out for backoff_initial_s, doubling on each repeat up to
    # backoff_max_s, whatever its /health says.
    backoff_initial_s: float = Field(1.0, gt=0)
    backoff_max_s: float = Field(30.0, gt=0)
    # Half-open: after the hold, a worker ejected for failed requests takes at most this many
    # requests at once until one succeeds (then it is healthy); a failed one ejects it again for
    # twice as long. A /health 200 alone never readmits it.
    half_open_requests: int = Field(1, ge=1)
    # Deep probe: every N-th probe of a healthy worker also generates 1 token (/health alone misses
    # an engine that cannot generate). 0 = off. Every probe is deep while a worker is unhealthy or
    # failing; skipped while proxied requests to it succeed.
    deep_every: int = Field(0, ge=0)
    # The 1-token request waits in the worker's queue like any other: keep it above normal queueing.
    deep_timeout_s: float = Field(5.0, gt=0)
    # Model the deep probe asks for; "" (or not served by the worker) = its first base model.
    deep_model: str = ""
    # Circuit breaker: eject when more than breaker_error_rate of the last breaker_window proxied
    # requests failed before their first byte (with at least breaker_min_requests of them): catches
    # intermittent failures that never reach unhealthy_after in a row. 0 = off.
    breaker_window: int = Field(20, ge=0)
    breaker_error_rate: float = Field(0.5, ge=0, le=1)
    breaker_min_requests: int = Field(10, ge=1)
    # TTFT outlier ejection: eject a worker whose median TTFT (last outlier_window streams) is
    # above outlier_factor x its peers' median AND above outlier_min_s, with outlier_min_samples
    # each; at most outlier_max_fraction of a group out at once; compared every outlier_check_s.
    # Conservative: prefix-cache hits make TTFT vary a lot between healthy workers. 0 = off.
    outlier_factor: float = Field(3.0, ge=0)
    outlier_min_s: float = Field(1.0, ge=0)
    outlier_min_samples: int = Field(20, ge=1)
    outlier_max_fraction: float = Field(0.34, ge=0, le=0.5)
    outlier_window: int = Field(50, ge=1, le=1000)
    outlier_check_s: float = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _outlier_samples_fit_the_window(self) -> ProbeSettings:
        if self.outlier_min_samples > self.outlier_window:
            raise ValueError(
                "probes.outlier_min_samples must be <= outlier_window (a worker never has more "
                "samples than the window keeps)"
            )
        return self

    @model_validator(mode="after")
    def _breaker_can_trip(self) -> ProbeSettings:
        if self.breaker_window and self.breaker_min_requests > self.breaker_window:
            raise ValueError("probes.breaker_min_requests must be <= breaker_window")
        return self


class TimeoutSettings(_Section):
    connect_s: float = Field(2.0, gt=0)
    # Receiving the client's request body (slow or stalled uploads get a 408).
    client_body_s: float = Field(30.0, gt=0)
    # A client whose TCP stack accepts nothing of its stream for this long is cut off (its worker
    # request aborted, its tokens settled): a stalled reader must not hold a worker slot forever.
    client_stall_s: float = Field(30.0, gt=0)
    # Streams: headers and first SSE event; long prompts queue and prefill before anything comes
    # back. Non-streaming requests wait for their whole answer up to total_s instead.
    first_byte_s: float = Field(60.0, gt=0)
    # Longest silence between two SSE events before a stream is declared stuck.
    idle_s: float = Field(30.0, gt=0)
    total_s: float = Field(600.0, gt=0)


class RetrySettings(_Section):
    # Attempts in all (1 = no retry); only failures before the first byte are retried.
    max_attempts: int = Field(3, ge=1, le=10)


# [routing.weights]: one non-negative number per kv_aware signal, named and defaulted by the
# scorer's own `scoring.views.Weights` (a signal added there is configurable here as it is).
WeightsSettings = create_model(
    "WeightsSettings",
    __base__=_Section,
    **{f.name: (float, Field(f.default, ge=0)) for f in dataclasses.fields(Weights)},
)


class SplitSettings(_Section):
    # Model this split applies to ("*" = every model).
    model: str = "*"
    # Worker labels that make up the pool (all must match), e.g. { pool = "canary" }.
    labels: dict[str, str] = Field(min_length=1)
    # Share of the model's requests sent to the pool (the rest avoids it).
    share: float = Field(gt=0, le=1)


class TokenModeSettings(_Section):
    # Served model name -> local directory holding the files its workers serve (tokenizer.json and
    # tokenizer_config.json / chat_template.jinja), or "sim" for the simulated workers' own
    # tokenizer. Models not listed route in text mode.
    models: dict[str, str] = Field(default_factory=dict)
    # Prefix-ids cache per model (4 bytes per token held).
    cache_tokens: int = Field(1 << 20, ge=0)
    # Bodies larger than this are tokenized in a worker thread (tokenizers releases the GIL).
    offload_bytes: int = Field(16_384, ge=0)

    @field_validator("models")
    @classmethod
    def _has_tokenizer(cls, v: dict[str, str]) -> dict[str, str]:
        for name, path in v.items():
            if path != "sim" and not (Path(path) / "tokenizer.json").is_file():
                raise ValueError(f"token_mode.models[{name!r}]: no tokenizer.json in {path}")
        return v


class KVEventSettings(_Section):
    # Blocks held only in an offloaded tier (CPU, disk) count this much of a GPU-resident block.
    offload_weight: float = Field(0.5, ge=0, le=1)
    # A dispatched request's blocks count as held until its first token (vLLM publishes them
    # after prefill) plus settle_s, so a burst of one prefix stays on one worker; pending_ttl_s
    # bounds a dispatch whose end was never seen. Long: a prefill can queue for a long time.
    pending_ttl_s: float = Field(300.0, ge=0)
    settle_s: float = Field(1.0, ge=0)
    # A worker's events are stale (route it by the approximate index) after this many dispatches
    # AND this many seconds without an event batch: it got traffic but stopped publishing.
    stale_after_dispatches: int = Field(20, ge=1)
    stale_after_s: float = Field(10.0, gt=0)


class RoutingSettings(_Section):
    policy: Literal["round_robin", "least_loaded", "prefix", "session", "kv_aware"] = "kv_aware"
    # Header carrying the session id (else the body's `user` or `prompt_cache_key`).
    session_header: str = "x-session-id"
    weights: WeightsSettings = WeightsSettings()
    # scoring.views.RoutingOptions fields (hashing, queue model, saturation, index, sessions).
    options: dict[str, int | float] = Field(default_factory=dict)
    splits: list[SplitSettings] = Field(default_factory=list)
    token_mode: TokenModeSettings = TokenModeSettings()
    # Precise routing from workers' KV events (workers with `kv_events` set; needs token mode).
    kv_events: KVEventSettings = KVEventSettings()

    @field_validator("options")
    @classmethod
    def _known_options(cls, v: dict[str, int | float]) -> dict[str, int | float]:
        from scoring.views import RoutingOptions

        try:
            opts = RoutingOptions(**v)  # negatives, NaN and wrong types fail here, with the name
        except TypeError as e:  # an unknown name
            raise ValueError(str(e).replace("RoutingOptions.__init__()", "routing.options")) from e
        # As the options hold them: an integer knob written `64.0` is kept as the int 64.
        return {name: getattr(opts, name) for name in v}

    @model_validator(mode="after")
    def _split_shares(self) -> RoutingSettings:
        per_model: dict[str, float] = {}
        for sp in self.splits:
            per_model[sp.model] = per_model.get(sp.model, 0.0) + sp.share
        over = {m: t for m, t in per_model.items() if t > 1.0 + 1e-9}
        if over:
            raise ValueError(f"split shares add up to more than 1 for {sorted(over)}")
        return self


class UpstreamSettings(_Section):
    # HTTP client used to relay to workers; chosen by measurement (see bench/overhead.py).
    client: Literal["h1", "aiohttp", "httpx"] = "h1"
    max_connections: int = Field(1024, ge=1)
    keepalive_s: float = Field(4.0, gt=0)


# The largest rate, burst or concurrency limit: the Redis scripts compute in doubles, exact to
# 2^53, and a larger figure (a typo, `10^400` in a template) was read as infinite: no limit at all,
# silently. An operator who means "no limit" leaves the field out.
MAX_LIMIT = 10**12


class ModelQuotaSettings(_Section):
    rpm: int | None = Field(None, ge=1, le=MAX_LIMIT)
    tpm: int | None = Field(None, ge=1, le=MAX_LIMIT)
    burst_requests: int | None = Field(None, ge=1, le=MAX_LIMIT)
    burst_tokens: int | None = Field(None, ge=1, le=MAX_LIMIT)


class TenantSettings(_Section):
    # sha256 hex digests of the tenant's API keys (`kvgate key` prints one); never the keys.
    keys_sha256: list[str] = Field(default_factory=list)
    # 0..1: higher is more latency-sensitive (routing weight, and first in line when saturated).
    priority: float = Field(0.5, ge=0, le=1)
    # Share of the admission queue against other tenants of the same priority tier.
    queue_weight: float = Field(1.0, gt=0)
    rpm: int | None = Field(None, ge=1, le=MAX_LIMIT)
    # Input + output tokens per minute.
    tpm: int | None = Field(None, ge=1, le=MAX_LIMIT)
    burst_requests: int | None = Field(None, ge=1, le=MAX_LIMIT)
    burst_tokens: int | None = Field(None, ge=1, le=MAX_LIMIT)
    max_concurrent: int | None = Field(None, ge=0, le=MAX_LIMIT)
    max_input_tokens: int | None = Field(None, ge=1)
    # Output tokens per choice: applies to every output-limit field a worker may read
    # (`max_tokens`, `max_completion_tokens`), on both endpoints.
    max_output_tokens: int | None = Field(None, ge=1)
    # Injected as max_tokens when the request sets no limit the worker reads (and the reservation
    # uses it): otherwise vLLM generates up to the rest of the context, unreserved.
    default_max_tokens: int = Field(512, ge=1)
    # What an output limit above max_output_tokens gets: capped, or a 400.
    over_max_output: Literal["cap", "reject"] = "cap"
    # Choices per prompt (`n`, or `best_of` when larger): each one is generated and reserved in
    # full, so one request may hold max_n x prompts x max_output_tokens. Above it: a 400.
    max_n: int = Field(16, ge=1)
    # Model allowlist (LoRA adapter names are models); empty allows every served model.
    models: list[str] = Field(default_factory=list)
    # Per-model limits on top of the tenant's own.
    model_limits: dict[str, ModelQuotaSettings] = Field(default_factory=dict)
    # Own prefix-cache namespace and a cache_salt on every request: no KV reuse with others.
    isolate_cache: bool = False
    # When the quota store (Redis) is unreachable: "open" = local limiter at limit / replicas,
    # "closed" = 503 with Retry-After.
    on_store_failure: Literal["open", "closed"] = "open"
    # Fraction of cached prompt tokens NOT charged at settlement (0 = charge all, 1 = free).
    cached_token_discount: float = Field(0.0, ge=0, le=1)
    # Accept tensor inputs (completions `prompt_embeds`, chat `*_embeds` parts; workers need
    # --enable-prompt-embeds / --enable-mm-embeds): their token count is the tensor's length,
    # which the gateway cannot see, so `max_input_tokens` and the reservation do not bound them.
    accept_embeds: bool = False
    # Accept request-level media processing (`media_io_kwargs`, `mm_processor_kwargs`: video
    # frames, image pixels): they change what a media part costs, so [tenancy.media_tokens] no
    # longer bounds it.
    accept_media_kwargs: bool = False

    @field_validator("keys_sha256")
    @classmethod
    def _hex_digests(cls, v: list[str]) -> list[str]:
        return [_sha256_hex(k, "keys_sha256 entries") for k in v]


class MediaTokenSettings(_Section):
    """Prompt tokens the estimate (`max_input_tokens`, the reservation) charges per media part:
    vLLM expands each part into model-specific tokens the body does not show. Set them to the
    served models' largest per-part counts to make the input cap a bound; the settlement charges
    what the worker reports."""

    image: int = Field(1024, ge=0)
    audio: int = Field(1500, ge=0)
    video: int = Field(8192, ge=0)


class TenancySettings(_Section):
    # Tenant (from [tenants]) that serves requests without an API key; empty = keys required.
    # With no [tenants] at all, the gateway is open (single-tenant) and this is ignored.
    anonymous_tenant: str = ""
    # Secret that cache_salt values are derived from (HMAC per tenant). Set it in production so
    # salts survive key rotation and cannot be derived from anything a client knows.
    cache_salt_secret: str = ""
    # Prompt tokens the estimate charges per media part of a chat message.
    media_tokens: MediaTokenSettings = MediaTokenSettings()


class QuotaSettings(_Section):
    # memory: in-process (one replica, `make run`); redis: shared by every gateway replica.
    backend: Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "kvgate:"
    # Gateway replicas sharing the limits: fail-open-degraded enforces limit / replicas locally.
    replicas: int = Field(1, ge=1)
    socket_timeout_s: float = Field(0.25, gt=0)
    op_timeout_s: float = Field(0.5, gt=0)
    # Consecutive store failures that open the circuit, and how long it stays open.
    breaker_failures: int = Field(3, ge=1)
    breaker_cooldown_s: float = Field(5.0, gt=0)
    # Settlements kept for replay while the store is down (beyond: oldest fall back to lease
    # expiry). ~300 B each.
    max_deferred_settlements: int = Field(100_000, ge=1)
    # A concurrency lease whose process stops renewing it (crashed, killed) is dropped after this
    # long; the holder renews every sixth of it. Lower frees a crashed replica's slots sooner, at
    # more renewal calls; every replica must use the same value.
    lease_ttl_s: float = Field(DEFAULT_LEASE_TTL_S, ge=6.0, le=3600.0)
    # Usage records (one per finished request): a Redis stream with the redis backend ...
    usage_stream: str = "kvgate:usage"
    usage_stream_maxlen: int = Field(100_000, ge=1)
    # Records held in memory while the stream is unreachable (~0.5 KB each), written when it
    # answers again; beyond it the oldest are dropped and counted.
    usage_buffer_max: int = Field(100_000, ge=1)
    # ... or a JSONL file with the memory backend (empty = no records).
    usage_file: str = ""


class AdmissionSettings(_Section):
    # Queue requests when no worker has room; false = send everything through (comparison runs).
    enabled: bool = True
    # Requests a worker may run at once unless its [[workers]] max_concurrency says otherwise:
    # vLLM's default --max-num-seqs. Beyond it requests wait here, in priority order, rather than
    # in the worker's own FIFO queue.
    worker_concurrency: int = Field(256, ge=1)
    # Share of the fleet's slots only requests in reserve_min_priority's admission tier or above
    # may take (with 10 priority_levels, 0.7's tier starts at 0.65: a tier is queued as one), so
    # latency-sensitive tenants find room in a spike that low-priority traffic already fills;
    # the last free slots stay free for them. 0.3 held high-priority p99 TTFT within 1.2-1.5x
    # of unloaded in a 5x spike (bench/spike.py); 0.1 let it reach 12x.
    priority_reserve: float = Field(0.3, ge=0, lt=1)
    reserve_min_priority: float = Field(0.7, ge=0, le=1)
    # Queued requests per model, all tenants and priorities together; 0 = never queue.
    max_queued: int = Field(1024, ge=0)
    # Queued requests per tenant and model (429 beyond it); 0 = no fixed cap (a full queue is
    # shared by tenant queue_weight instead).
    max_queued_per_tenant: int = Field(0, ge=0)
    # How long a request may wait for a worker when the client does not say.
    default_deadline_s: float = Field(10.0, ge=0)
    # Upper bound on a client's own deadline (header below, in milliseconds; 0 = do not queue).
    max_deadline_s: float = Field(30.0, ge=0)
    deadline_header: str = "x-kvgate-deadline-ms"
    # Safety re-check while anything is queued (a wake-up can be missed; a waiter must not be).
    recheck_s: float = Field(0.05, gt=0)
    # Priority tiers: tier = round(priority * priority_levels); higher tiers always go first.
    priority_levels: int = Field(10, ge=1)
    # Memory of the service-rate estimate (predicted waits, Retry-After), seconds of backlog.
    rate_half_life_s: float = Field(10.0, gt=0)
    # Queued admissions seen before predicted waits refuse requests early.
    min_rate_samples: int = Field(16, ge=1)
    # Retry-After bounds; the fallback is used while the service rate is unknown.
    fallback_retry_after_s: float = Field(1.0, gt=0)
    max_retry_after_s: float = Field(60.0, gt=0)


class ClusterSettings(_Section):
    """Several gateway replicas sharing per-worker load through Redis (gateway.cluster)."""

    # Off: each replica routes on its own dispatches only (one replica, `make run`).
    enabled: bool = False
    # Empty = the [quota] redis_url.
    redis_url: str = ""
    # Every cluster key starts with this; the {hash tag} keeps them in one Redis Cluster slot.
    key_prefix: str = "kvgate:{cluster}:"
    # How often each replica writes its load and reads everyone else's (one round trip): a
    # dispatch shows on the other replicas within about two intervals (100 ms at 0.05).
    publish_interval_s: float = Field(0.05, ge=0.005, le=5)
    # A replica whose heartbeat has not moved for this long counts for nothing (killed, cut off
    # from Redis); with Redis down every peer's load lapses after it and routing goes local.
    expiry_s: float = Field(3.0, gt=0, le=300)
    # Budget of one sync round trip (connect included); a slower Redis counts as down.
    op_timeout_s: float = Field(0.5, gt=0)
    # Share what each replica learns from its dispatches (approximate prefix index entries,
    # session affinity) through a Redis stream, so a prefix routed by one replica is routed to
    # the same worker by all; false = share load only.
    share_learned: bool = True
    # Batches (one per replica per sync; a backlog goes as several of at most 1 MB) the stream
    # keeps: a replica that starts reads them to warm its index. ~0.1-0.6 KB per dispatch in
    # text mode, 8 bytes a worker block in KV-event mode (16 KB for a 32k-token prompt).
    learned_stream_maxlen: int = Field(2000, ge=10)
    # Dispatches held for sharing while Redis is unreachable, packed, within a budget of 1 KB
    # each (~50 MB at the default): ~0.1-0.6 KB a text-mode dispatch, 8 bytes a worker block in
    # KV-event mode (16 KB for a 32k-token prompt: ~3,000 of those fit); the oldest are dropped
    # beyond it (kvgate_cluster_learned_dropped_total).
    learned_journal_max: int = Field(50_000, ge=1)

    @model_validator(mode="after")
    def _expiry_covers_intervals(self) -> ClusterSettings:
        if self.expiry_s < 4 * self.publish_interval_s:
            raise ValueError(
                "cluster.expiry_s must be at least 4 x publish_interval_s, or live replicas "
                "would expire between two heartbeats"
            )
        return self


def _section_of(core: type, doc: str) -> type[_Section]:
    """A config section with exactly the core dataclass's fields, types and defaults, checked
    by the core's own ``__post_init__``: for a core whose knobs all face ops, one declaration
    (the core's) instead of two that drift. The comments ops read are in config.example.toml."""
    hints = typing.get_type_hints(core)
    fields = {f.name: (hints[f.name], f.default) for f in dataclasses.fields(core)}

    def check(self: BaseModel) -> BaseModel:
        to_core(self, core)  # the core's __post_init__ raises ValueError naming the rule broken
        return self

    return create_model(  # type: ignore[call-overload,no-any-return]
        core.__name__,
        __base__=_Section,
        __doc__=doc,
        __validators__={"_core_rules": model_validator(mode="after")(check)},
        **fields,
    )


# Targets and bounds of `kvgate_autoscale_desired_workers` (formula: gateway/desired_workers.py).
AutoscaleSettings = _section_of(AutoscaleCore, "[autoscale]: the desired-workers formula's knobs")


def to_core(section: BaseModel, cls: type[_T], *, gateway_only: Collection[str] = ()) -> _T:
    """The pure core's settings dataclass from a config section, field for field.

    Sections and cores are declared apart (the core stays importable without pydantic, and the
    section carries the ops-facing comments), so this fails loudly, at start and in the tests,
    when they drift: a core field the section lacks would silently keep its default, and a
    section field the core does not take (unless named in ``gateway_only``: read by the gateway
    itself) would be a knob that does nothing.
    """
    core = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    have = set(type(section).model_fields)
    missing, unknown = core - have, have - core - set(gateway_only)
    if missing or unknown:
        raise TypeError(
            f"{type(section).__name__} -> {cls.__name__}: fields missing from the section "
            f"{sorted(missing)}, section fields the core does not take {sorted(unknown)}"
        )
    return cls(**{n: getattr(section, n) for n in core})


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KVGATE_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    server: ServerSettings = ServerSettings()
    logging: LoggingSettings = LoggingSettings()
    admin: AdminSettings = AdminSettings()
    workers: list[WorkerSettings] = Field(default_factory=list)
    probes: ProbeSettings = ProbeSettings()
    timeouts: TimeoutSettings = TimeoutSettings()
    retries: RetrySettings = RetrySettings()
    routing: RoutingSettings = RoutingSettings()
    upstream: UpstreamSettings = UpstreamSettings()
    tenancy: TenancySettings = TenancySettings()
    quota: QuotaSettings = QuotaSettings()
    admission: AdmissionSettings = AdmissionSettings()
    cluster: ClusterSettings = ClusterSettings()
    autoscale: AutoscaleSettings = AutoscaleSettings()
    tenants: dict[str, TenantSettings] = Field(default_factory=dict)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment beats the file (init kwargs carry the file's contents).
        return (env_settings, init_settings)

    @model_validator(mode="after")
    def _unique_workers(self) -> Settings:
        names = [w.name for w in self.workers]
        dupes = {n for n in names if names.count(n) > 1}
        if dupes:
            raise ValueError(f"duplicate worker names: {sorted(dupes)}")
        # One vLLM server's KV events credited to two workers (a copy-pasted endpoint): both
        # would be routed on what only one of them holds.
        publishers: dict[str, str] = {}
        for w in self.workers:
            if w.kv_events:
                other = publishers.setdefault(w.kv_events, w.name)
                if other != w.name:
                    raise ValueError(
                        f"workers {other!r} and {w.name!r} share kv_events {w.kv_events!r}: "
                        "each worker's endpoint is its own server's"
                    )
        # Named by tenant and position only: an error message goes to logs and terminals, and
        # even a key's digest is worth a brute-force try there.
        admin = self.admin.key_sha256
        seen: dict[str, str] = {}
        for name, t in self.tenants.items():
            for i, k in enumerate(t.keys_sha256):
                if admin and k == admin:
                    # The tenant's clients would hold the admin key: every /admin route,
                    # adding a worker at any URL included.
                    raise ValueError(
                        f"tenants.{name}.keys_sha256[{i}] is admin.key_sha256: the admin key "
                        "must be a key of its own, not also a tenant's"
                    )
                if k in seen:
                    if seen[k] == name:
                        raise ValueError(
                            f"tenants.{name}.keys_sha256[{i}] repeats an earlier entry of the "
                            "same list: remove one (was another key meant?)"
                        )
                    raise ValueError(f"tenants {seen[k]!r} and {name!r} share an API key")
                seen[k] = name
        anon = self.tenancy.anonymous_tenant
        if anon and anon not in self.tenants:
            raise ValueError(f"tenancy.anonymous_tenant {anon!r} is not a configured tenant")
        return self


class ConfigError(Exception):
    """A config file that cannot become the running config; the message says why."""


def _reject_nan(obj: Any, path: str = "") -> None:
    if isinstance(obj, float) and not math.isfinite(obj):
        raise ConfigError(f"{path or 'value'}: must be a finite number, got {obj}")
    if isinstance(obj, dict):
        for k, v in obj.items():
            _reject_nan(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _reject_nan(v, f"{path}[{i}]")


def _reject_unknown_env() -> None:
    """Refuse a `KVGATE_*` variable that names a setting path (`SECTION__KEY`) whose section
    is no setting of `Settings`.

    pydantic-settings reads the environment per field: a variable for a field that does not
    exist is never looked at, so `KVGATE_ROUTNG__POLICY=prefix` was silently ignored (a typo
    inside a section is refused by the section's extra="forbid"). Names are matched as
    pydantic-settings matches them: case-insensitively. Only names with the nested delimiter
    are judged: other tools' variables share the prefix without it (docker compose's
    `KVGATE_PORT`, bench's `KVGATE_REDIS_SERVER`, and the `KVGATE_SERVICE_HOST` /
    `KVGATE_PORT_8000_TCP...` Kubernetes puts in every pod of a namespace with a service
    named kvgate), and refusing those would stop the gateway from starting there.
    """
    prefix = str(Settings.model_config.get("env_prefix", "")).upper()
    delimiter = str(Settings.model_config.get("env_nested_delimiter") or "").upper()
    if not delimiter:
        return
    known = set(Settings.model_fields)
    for name in os.environ:
        upper = name.upper()
        if not upper.startswith(prefix) or delimiter not in upper[len(prefix) :]:
            continue
        rest = upper[len(prefix) :]
        section = rest.split(delimiter, 1)[0].lower()
        if section not in known:
            raise ConfigError(
                f"environment variable {name}: {section!r} is not a config section or setting "
                f"(known: {', '.join(sorted(known))})"
            )


def load_settings(path: str | Path | None) -> Settings:
    """Parse and validate a whole file, or raise ConfigError; never returns half a config.

    Only ConfigError leaves it: the config watcher rejects and reports that, and anything else
    would escape a reload (SIGHUP, the file watch) unreported, with the fixed file never read.
    """
    try:
        return _load_settings(path)
    except ConfigError:
        raise
    except RecursionError as e:  # tomllib and validation recurse per level of nesting
        raise ConfigError(f"{path}: invalid config: values nested too deeply") from e
    except (ValueError, TypeError, OverflowError) as e:
        # Not a ValidationError (that one is below): a validator's own arithmetic on a value no
        # declared bound stopped, such as an integer too large to convert to a float.
        raise ConfigError(f"{path}: invalid config: {type(e).__name__}: {e}") from e


def _load_settings(path: str | Path | None) -> Settings:
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError as e:
            raise ConfigError(f"{p}: file not found") from e
        except OSError as e:  # permission, a directory in its place
            raise ConfigError(f"{p}: cannot read: {e.strerror or e}") from e
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{p}: invalid TOML: {e}") from e
    _reject_nan(data)
    _reject_unknown_env()
    try:
        return Settings(**data)
    except ValidationError as e:
        errs = "; ".join(
            f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors()
        )
        raise ConfigError(f"{path}: {errs}") from e
