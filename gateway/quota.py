"""Tenant quotas: the backend-agnostic core (limits, GCRA, key layout, results).

Every limit is a GCRA (generic cell rate algorithm): O(1) state per limit, the theoretical
arrival time (TAT). A limit of `rate` units per minute spends `T = 60 s / rate` of TAT per unit;
a request costing `c` units is admitted when, after adding `c*T`, the TAT is no more than
`capacity*T` ahead of now. That gives an exact smooth rate, a configurable burst, weighted
costs (tokens), an exact `retry-after` and `remaining`, and refunds by moving the TAT back. Fixed
windows (2x bursts at boundaries, retry-after = whole window) and sliding logs (state grows with
traffic) are what this replaces.

The TAT is stored as `(t0, backlog)`: at time `t0` the TAT was `backlog` UNITS (cells) ahead.
Adding `c*T` microseconds to a float TAT near 1.7e15 us rounds to 0.25 us every time and drifts
by whole cells at high rates; in units, a charge adds an integer (exact), and only the decay
`(now - t0) * rate / 60 s` is fractional. Both backends store and compute it the same way.

Semantics the gateway and the tests rely on (both backends implement exactly these):

* `capacity` ("burst") is how many units may be spent back-to-back from idle. In ANY 60 s window
  a limit admits at most `rate + capacity` units, which is what "RPM 60 (+ burst)" promises a
  fleet of replicas sharing one Redis. Defaults: requests `ceil(rpm / 6)` (ten seconds' worth:
  a chat frontend can fire a handful of parallel calls, and a minute never exceeds ~1.17x rpm);
  tokens `tpm` (a minute's worth) because a single reservation is `prompt + max_tokens`, often a
  large slice of a small TPM budget: a smaller default would make such tenants unusable.
* A request whose cost exceeds a limit's capacity can never be admitted (`never=True`,
  reason `insufficient_quota`, sent as `x-should-retry: false`).
* All of a request's limits (tenant RPM/TPM, the model's RPM/TPM, the concurrency lease) pass
  or nothing is charged: a refused request consumes nothing, so rejections never eat RPM.
* Settlement is exactly-once per request id. `settle` moves the TPM state by
  `actual - reserved` (back for a refund, forward for debt) and frees the lease.
  `release(refund_all=False)` is for failures the client caused (an upstream 4xx; a client
  gone once a worker had the request is settled with its prompt, gateway.settlement): tokens
  are refunded, the attempt still counts against RPM, as
  OpenAI counts attempts. `release(refund_all=True)` is for failures that are the gateway's or
  the upstream's own (no worker, connect error, 5xx before any token): the request's RPM cell is
  refunded too, because the tenant got nothing and did nothing wrong.
* A concurrency lease is renewed by the process that holds it (every sixth of `lease_ttl_s`,
  while its request runs) and pruned once it has gone `lease_ttl_s` (`[quota] lease_ttl_s`,
  default 60 s) without a renewal: a request that runs for hours keeps counting toward
  `max_concurrent`, and the leases of a gateway that crashed (SIGKILL, OOM) are gone about a
  minute later. The renewal also extends
  the request's reservation record, which lives `RECORD_GRACE_S` past the last renewal, so a
  settle after the prune (a late one, or one replayed after an outage) still settles tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal, Protocol

PERIOD_S = 60.0
PERIOD_US = PERIOD_S * 1_000_000.0
# Slack, in units, for float rounding in the decay arithmetic (errors are < 1e-9 units).
TOLERANCE = 1e-6
# Ten seconds' worth of requests may arrive back-to-back by default.
DEFAULT_REQUEST_BURST_S = 10.0
# A concurrency lease not renewed for this long is pruned: its owner is gone (crashed, killed).
DEFAULT_LEASE_TTL_S = 60.0
# How often a process renews the leases it holds: well under the TTL, so a renewal lost to a
# blip (or a slow event loop) does not cost a live request its lease.
LEASE_RENEWALS_PER_TTL = 6
LEASE_RENEW_S = DEFAULT_LEASE_TTL_S / LEASE_RENEWALS_PER_TTL
# A reservation record lives this long past its lease's TTL (counted from the last renewal) so
# a late settle still refunds.
RECORD_GRACE_S = 3600.0
# How long a settled marker catches duplicate callbacks.
SETTLED_TTL_S = 900.0
# The same for the in-process store: one replica, whose walk settles each ticket once (under an
# id of its own), so a duplicate can only be a bug of this process. Markers cost ~240 B per
# request: at 900 s they were half the RSS growth of a 10-minute soak (bench/soak.py).
MEMORY_SETTLED_TTL_S = 60.0
# There is no exact time at which some other request finishes; this is a polite guess.
CONCURRENCY_RETRY_S = 1.0

Kind = Literal["requests", "tokens"]
Reason = Literal["requests", "tokens", "concurrency", "insufficient_quota", "duplicate"]
Dimension = Literal["requests", "tokens", "concurrency"]


class QuotaStoreError(Exception):
    """A quota store failed in a way that is a bug or a misconfiguration, not an outage."""


class QuotaStoreUnavailable(QuotaStoreError):
    """The shared store cannot answer now; the caller's circuit breaker picks fail-open/closed."""


# --------------------------------------------------------------------------------------------
# Limits


def default_request_burst(rpm: int) -> int:
    return max(1, math.ceil(rpm * DEFAULT_REQUEST_BURST_S / PERIOD_S))


def default_token_burst(tpm: int) -> int:
    return tpm


def _check_positive(name: str, value: int | None, *, zero_ok: bool = False) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 0 or (value == 0 and not zero_ok):
        raise ValueError(f"{name} must be {'>= 0' if zero_ok else '> 0'}, got {value}")


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """Extra limits for one model (a LoRA adapter is a model), on top of the tenant's."""

    rpm: int | None = None
    tpm: int | None = None
    burst_requests: int | None = None
    burst_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("rpm", "tpm", "burst_requests", "burst_tokens"):
            _check_positive(name, getattr(self, name))


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """A tenant's quota. `None` means unlimited in that dimension.

    `max_concurrent=0` is allowed and means the tenant may not run anything (every request is
    `never`), which is how ops suspend a tenant without removing its keys.
    """

    rpm: int | None = None
    tpm: int | None = None
    burst_requests: int | None = None
    burst_tokens: int | None = None
    per_model: Mapping[str, ModelLimits] = field(default_factory=dict)
    max_concurrent: int | None = None
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S

    def __post_init__(self) -> None:
        for name in ("rpm", "tpm", "burst_requests", "burst_tokens"):
            _check_positive(name, getattr(self, name))
        _check_positive("max_concurrent", self.max_concurrent, zero_ok=True)
        if not self.lease_ttl_s > 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {self.lease_ttl_s}")
        # Frozen means frozen: a caller mutating its dict must not change a live limit.
        object.__setattr__(self, "per_model", MappingProxyType(dict(self.per_model)))

    def __hash__(self) -> int:
        return hash(
            (
                self.rpm,
                self.tpm,
                self.burst_requests,
                self.burst_tokens,
                tuple(sorted(self.per_model.items())),
                self.max_concurrent,
                self.lease_ttl_s,
            )
        )


@dataclass(frozen=True, slots=True)
class Reservation:
    """What one request asks for at admission: `tokens` = prompt estimate + max output."""

    tenant: str
    request_id: str
    model: str
    tokens: int
    limits: TenantLimits

    def __post_init__(self) -> None:
        if not self.tenant or not self.request_id:
            raise ValueError("tenant and request_id must be non-empty")
        _check_positive("tokens", self.tokens, zero_ok=True)


@dataclass(frozen=True, slots=True)
class LimitSpec:
    """One GCRA limit a request is checked against, resolved to its key and cost."""

    key: str
    kind: Kind
    scope: str  # "tenant" or "model"
    rate: int  # units per minute
    capacity: int  # units admissible back-to-back from idle
    cost: int
    model: str = ""  # set for scope "model": settlement matches it against the record


# --------------------------------------------------------------------------------------------
# Keys


class QuotaKeys:
    """The key layout, shared by both backends so the memory backend is a faithful stand-in.

    Every key of a tenant carries the hash tag `{t:<tenant>}`: Redis Cluster hashes only the
    tag, so one tenant's keys share a slot and one Lua script may touch them all.
    """

    def __init__(self, prefix: str = "kvgate:") -> None:
        if "{" in prefix or "}" in prefix:
            raise ValueError("the key prefix must not contain '{' or '}' (it would move the tag)")
        self.prefix = prefix

    def tag(self, tenant: str) -> str:
        return f"{self.prefix}{{t:{tenant}}}"

    def rpm(self, tenant: str) -> str:
        return f"{self.tag(tenant)}:rpm"

    def tpm(self, tenant: str) -> str:
        return f"{self.tag(tenant)}:tpm"

    def model_rpm(self, tenant: str, model: str) -> str:
        return f"{self.tag(tenant)}:m:{model}:rpm"

    def model_tpm(self, tenant: str, model: str) -> str:
        return f"{self.tag(tenant)}:m:{model}:tpm"

    def leases(self, tenant: str) -> str:
        return f"{self.tag(tenant)}:leases"

    def reservation(self, tenant: str, request_id: str) -> str:
        return f"{self.tag(tenant)}:res:{request_id}"


def limit_specs(
    keys: QuotaKeys, tenant: str, model: str | None, limits: TenantLimits, tokens: int
) -> list[LimitSpec]:
    """The GCRA limits of one request, tenant-wide first, then the model's.

    `model=None` lists the limits of every configured model (settlement does not know the
    model up front; the script matches it against the reservation record).
    """
    specs: list[LimitSpec] = []
    if limits.rpm is not None:
        cap = limits.burst_requests or default_request_burst(limits.rpm)
        specs.append(LimitSpec(keys.rpm(tenant), "requests", "tenant", limits.rpm, cap, 1))
    if limits.tpm is not None:
        cap = limits.burst_tokens or default_token_burst(limits.tpm)
        specs.append(LimitSpec(keys.tpm(tenant), "tokens", "tenant", limits.tpm, cap, tokens))
    models = limits.per_model.items() if model is None else [(model, limits.per_model.get(model))]
    for name, ml in models:
        if ml is None:
            continue
        if ml.rpm is not None:
            cap = ml.burst_requests or default_request_burst(ml.rpm)
            key = keys.model_rpm(tenant, name)
            specs.append(LimitSpec(key, "requests", "model", ml.rpm, cap, 1, name))
        if ml.tpm is not None:
            cap = ml.burst_tokens or default_token_burst(ml.tpm)
            key = keys.model_tpm(tenant, name)
            specs.append(LimitSpec(key, "tokens", "model", ml.tpm, cap, tokens, name))
    return specs


# --------------------------------------------------------------------------------------------
# GCRA (the Lua script in quota_redis.py mirrors this expression by expression)


@dataclass(frozen=True, slots=True)
class GcraResult:
    allowed: bool
    never: bool
    backlog: float  # units the TAT is ahead of now after this decision (unchanged if refused)
    retry_after_us: float
    remaining: int
    reset_us: float


def backlog_at(state: tuple[float, float] | None, now_us: float, rate: int) -> float:
    """Units a stored `(t0_us, backlog)` is ahead of now; 0 when full (or no state)."""
    if state is None:
        return 0.0
    x = state[1] - (now_us - state[0]) * rate / PERIOD_US
    return x if x > 0 else 0.0


def gcra_remaining(backlog: float, rate: int, capacity: int) -> tuple[int, float]:
    """Units admissible right now and the microseconds until the limit is back to full."""
    remaining = min(capacity, max(0, math.floor(capacity - backlog + TOLERANCE)))
    return remaining, max(0.0, backlog) * (PERIOD_US / rate)


def gcra(backlog: float, cost: int, rate: int, capacity: int) -> GcraResult:
    """One GCRA decision on a limit whose TAT is `backlog` units ahead of now."""
    if cost > capacity:
        remaining, reset = gcra_remaining(backlog, rate, capacity)
        return GcraResult(False, True, backlog, 0.0, remaining, reset)
    new = backlog + cost
    over = new - capacity
    if over > TOLERANCE:
        remaining, reset = gcra_remaining(backlog, rate, capacity)
        return GcraResult(False, False, backlog, over * (PERIOD_US / rate), remaining, reset)
    remaining, reset = gcra_remaining(new, rate, capacity)
    return GcraResult(True, False, new, 0.0, remaining, reset)


def gcra_adjust(backlog: float, units: int) -> float:
    """The backlog after moving a limit by `units` (negative = refund, positive = debt).

    A result <= 0 means full: a refund cannot lift a limit above its capacity, because the
    backlog it starts from is never negative.
    """
    return backlog + units


def never_admissible(res: Reservation) -> Dimension | None:
    """The dimension in which `res` can never pass, whatever the current usage."""
    if res.limits.max_concurrent == 0:
        return "concurrency"
    for spec in limit_specs(QuotaKeys(), res.tenant, res.model, res.limits, res.tokens):
        if spec.cost > spec.capacity:
            return spec.kind
    return None


# --------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True, slots=True)
class Admission:
    """The verdict on one request plus the OpenAI `x-ratelimit-*` values of its tightest limits.

    The header values describe the state AFTER this decision: after the charge when admitted,
    untouched when refused. `reason` is `insufficient_quota` when `never` is set; `dimension`
    always says which limit tripped (for the 429 message and metrics).
    """

    allowed: bool
    reason: Reason | None = None
    dimension: Dimension | None = None
    scope: str | None = None
    never: bool = False
    retry_after_s: float = 0.0
    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests_s: float | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float | None = None
    in_flight: int = 0
    duplicate: bool = False
    backend: str = ""

    def headers(self) -> dict[str, str]:
        """Response headers: `x-ratelimit-*` always, retry hints on a refusal."""
        h: dict[str, str] = {}
        if self.limit_requests is not None:
            h["x-ratelimit-limit-requests"] = str(self.limit_requests)
            h["x-ratelimit-remaining-requests"] = str(self.remaining_requests)
            h["x-ratelimit-reset-requests"] = go_duration(self.reset_requests_s or 0.0)
        if self.limit_tokens is not None:
            h["x-ratelimit-limit-tokens"] = str(self.limit_tokens)
            h["x-ratelimit-remaining-tokens"] = str(self.remaining_tokens)
            h["x-ratelimit-reset-tokens"] = go_duration(self.reset_tokens_s or 0.0)
        if not self.allowed:
            if self.never:
                h["x-should-retry"] = "false"
            else:
                h["retry-after"] = str(max(1, math.ceil(self.retry_after_s)))
                h["retry-after-ms"] = str(max(1, math.ceil(self.retry_after_s * 1000)))
        return h


@dataclass(frozen=True, slots=True)
class Settlement:
    """What a settle/release did: `duplicate` and `unknown` changed no token state."""

    status: Literal["settled", "duplicate", "unknown"]
    reserved_tokens: int = 0
    actual_tokens: int = 0

    @property
    def delta_tokens(self) -> int:
        return self.actual_tokens - self.reserved_tokens if self.status == "settled" else 0


def go_duration(seconds: float) -> str:
    """Go's `time.Duration` text at millisecond precision (`12ms`, `1s`, `6m0s`, `1h0m0s`)."""
    ms = max(0, math.ceil(seconds * 1000 - 1e-6))
    if ms < 1000:
        return f"{ms}ms"
    h, rem = divmod(ms, 3_600_000)
    m, rem = divmod(rem, 60_000)
    s, frac = divmod(rem, 1000)
    sec = f"{s}.{frac:03d}".rstrip("0") if frac else str(s)
    if h:
        return f"{h}h{m}m{sec}s"
    if m:
        return f"{m}m{sec}s"
    return f"{sec}s"


def _tightest(specs: list[LimitSpec], results: list[GcraResult], kind: Kind) -> tuple[Any, ...]:
    best: tuple[int, float, int] | None = None
    for spec, r in zip(specs, results, strict=True):
        if spec.kind != kind:
            continue
        cand = (r.remaining, -r.reset_us, spec.rate)
        if best is None or cand < best:
            best = cand
    if best is None:
        return (None, None, None)
    return (best[2], best[0], -best[1] / 1e6)


def build_admission(
    specs: list[LimitSpec],
    results: list[GcraResult],
    *,
    concurrency_ok: bool,
    max_concurrent: int | None,
    in_flight: int,
    backend: str,
    duplicate: Literal["open", "settled"] | None = None,
) -> Admission:
    """Turn per-limit GCRA results into one verdict; shared so both backends answer alike.

    Of several refusals, the one with the longest wait is reported: retrying after it passes
    every GCRA limit at once (they only recover with time). A never-admissible limit trumps.
    """
    lr, rr, sr = _tightest(specs, results, "requests")
    lt, rt, st = _tightest(specs, results, "tokens")
    common: dict[str, Any] = {
        "limit_requests": lr,
        "remaining_requests": rr,
        "reset_requests_s": sr,
        "limit_tokens": lt,
        "remaining_tokens": rt,
        "reset_tokens_s": st,
        "in_flight": in_flight,
        "backend": backend,
    }
    if duplicate == "open":
        return Admission(True, duplicate=True, **common)
    if duplicate == "settled":
        return Admission(False, "duplicate", never=True, duplicate=True, **common)
    if max_concurrent == 0:
        return Admission(False, "insufficient_quota", "concurrency", "tenant", True, **common)
    for spec, r in zip(specs, results, strict=True):
        if r.never:
            return Admission(False, "insufficient_quota", spec.kind, spec.scope, True, **common)
    refusals: list[tuple[float, Dimension, str]] = [
        (r.retry_after_us / 1e6, spec.kind, spec.scope)
        for spec, r in zip(specs, results, strict=True)
        if not r.allowed
    ]
    if not concurrency_ok:
        refusals.append((CONCURRENCY_RETRY_S, "concurrency", "tenant"))
    if not refusals:
        return Admission(True, **common)
    wait, dim, scope = max(refusals, key=lambda x: x[0])
    return Admission(False, dim, dim, scope, False, wait, **common)


# --------------------------------------------------------------------------------------------
# The store interface


class QuotaStore(Protocol):
    """What the gateway calls; `RedisQuotaStore`, `MemoryQuotaStore`, `DegradedLocalStore`."""

    backend: str

    async def admit(self, res: Reservation) -> Admission: ...

    async def settle(
        self, tenant: str, request_id: str, actual_tokens: int, *, limits: TenantLimits
    ) -> Settlement: ...

    async def release(
        self, tenant: str, request_id: str, *, limits: TenantLimits, refund_all: bool
    ) -> Settlement: ...

    async def usage(self, tenant: str, limits: TenantLimits | None = None) -> dict[str, Any]: ...

    def forget(self, tenant: str, request_id: str) -> None:
        """Stop renewing a finished request's concurrency lease (its settlement may follow)."""

    async def close(self) -> None: ...


def usage_dict(specs: list[LimitSpec], results: list[GcraResult], in_flight: int) -> dict[str, Any]:
    """`usage()`'s shape: in-flight count, then remaining/reset per limit key suffix."""
    out: dict[str, Any] = {"in_flight": in_flight}
    for spec, r in zip(specs, results, strict=True):
        name = spec.kind if spec.scope == "tenant" else f"model:{spec.model}:{spec.kind}"
        out[name] = {
            "limit": spec.rate,
            "capacity": spec.capacity,
            "remaining": r.remaining,
            "reset_s": r.reset_us / 1e6,
        }
    return out


# --------------------------------------------------------------------------------------------
# Degraded mode helpers


def scale_limits(limits: TenantLimits, replicas: int) -> TenantLimits:
    """The share of a limit one replica enforces alone while the shared store is down.

    Each of `replicas` gateways then admits `limit / replicas`, so the fleet stays near the
    configured limit instead of admitting `limit x replicas` (the classic fail-open failure).
    Rounded up and kept >= 1 so a small tenant is throttled, not locked out.
    """
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    if replicas == 1:
        return limits

    def div(v: int | None) -> int | None:
        return None if v is None else max(1, math.ceil(v / replicas))

    def div_burst(burst: int | None, rate: int | None, default: Callable[[int], int]) -> int | None:
        if rate is None:
            return None
        return div(burst if burst is not None else default(rate))

    models = {
        name: ModelLimits(
            div(m.rpm),
            div(m.tpm),
            div_burst(m.burst_requests, m.rpm, default_request_burst),
            div_burst(m.burst_tokens, m.tpm, default_token_burst),
        )
        for name, m in limits.per_model.items()
    }
    conc = limits.max_concurrent
    return replace(
        limits,
        rpm=div(limits.rpm),
        tpm=div(limits.tpm),
        burst_requests=div_burst(limits.burst_requests, limits.rpm, default_request_burst),
        burst_tokens=div_burst(limits.burst_tokens, limits.tpm, default_token_burst),
        per_model=models,
        max_concurrent=conc if not conc else max(1, math.ceil(conc / replicas)),
    )
