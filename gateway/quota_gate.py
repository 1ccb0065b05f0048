"""The request path's view of quotas: admit, settle exactly once, and survive a Redis outage.

Wraps a `QuotaStore` with the circuit breaker and the per-tenant failure mode. While the shared
store is unreachable, fail-open tenants are limited locally at `limit / replicas` (so a fleet of
replicas does not admit `limit x replicas`), fail-closed tenants get 503 + Retry-After. A request is
settled against the store that admitted it, so a mode switch mid-request loses nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Literal

from gateway.config import QuotaSettings
from gateway.errors import APIError
from gateway.metrics import GatewayMetrics
from gateway.quota import (
    Admission,
    BreakerState,
    CircuitBreaker,
    QuotaStore,
    QuotaStoreUnavailable,
    Reservation,
    TenantLimits,
)
from gateway.quota_memory import DegradedLocalStore, MemoryQuotaStore
from gateway.tenancy import Tenant

log = logging.getLogger("kvgate.quota")

Mode = Literal["shared", "degraded", "closed"]


def _unlimited(limits: TenantLimits) -> bool:
    return (
        limits.rpm is None
        and limits.tpm is None
        and limits.max_concurrent is None
        and not limits.per_model
    )


@dataclass(slots=True)
class Ticket:
    """One admitted request's claim on a store; settle/release it exactly once."""

    tenant: Tenant
    request_id: str
    model: str
    reserved: int
    store: QuotaStore | None  # None: the tenant has no limits, nothing to settle
    admission: Admission | None
    done: bool = False


class QuotaGate:
    def __init__(self, cfg: QuotaSettings, metrics: GatewayMetrics) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.shared: QuotaStore
        if cfg.backend == "redis":
            from gateway.quota_redis import RedisQuotaStore

            self.shared = RedisQuotaStore(
                cfg.redis_url,
                prefix=cfg.key_prefix,
                socket_timeout_s=cfg.socket_timeout_s,
                connect_timeout_s=cfg.socket_timeout_s,
                op_timeout_s=cfg.op_timeout_s,
            )
        else:
            self.shared = MemoryQuotaStore(prefix=cfg.key_prefix)
        self.degraded = DegradedLocalStore(cfg.replicas, prefix=cfg.key_prefix)
        self.breaker = CircuitBreaker(
            failure_threshold=cfg.breaker_failures,
            cooldown_s=cfg.breaker_cooldown_s,
            on_transition=self._transition,
        )
        self._export_mode()

    def _transition(self, old: BreakerState, new: BreakerState) -> None:
        level = logging.WARNING if new is BreakerState.OPEN else logging.INFO
        log.log(level, "quota store circuit %s -> %s", old.value, new.value)
        self._export_mode()

    def _export_mode(self) -> None:
        for st in BreakerState:
            self.metrics.quota_breaker.labels(st.value).set(1 if self.breaker.state is st else 0)

    async def close(self) -> None:
        await self.shared.close()
        await self.degraded.close()

    # -- admission -------------------------------------------------------------------------------
    async def admit(self, tenant: Tenant, request_id: str, model: str, tokens: int) -> Ticket:
        m = self.metrics
        if _unlimited(tenant.limits):
            m.child(m.tenant_requests, tenant.name, "admitted").inc()
            return Ticket(tenant, request_id, model, tokens, None, None)
        res = Reservation(tenant.name, request_id, model, tokens, tenant.limits)
        store: QuotaStore = self.shared
        adm: Admission | None = None
        now = time.monotonic()
        if self.breaker.allow(now):
            try:
                adm = await self.shared.admit(res)
                self.breaker.record_success(time.monotonic())
            except QuotaStoreUnavailable as e:
                self.breaker.record_failure(time.monotonic())
                log.warning("quota store unavailable: %s", e)
        if adm is None:
            if tenant.cfg.on_store_failure == "closed":
                m.child(m.tenant_requests, tenant.name, "store_unavailable").inc()
                raise APIError(
                    503,
                    "Rate limiting is temporarily unavailable and this key is configured to fail "
                    "closed. Please retry shortly.",
                    "service_unavailable",
                    code="quota_store_unavailable",
                    retry_after_s=max(1.0, self.breaker.retry_after_s(time.monotonic())),
                )
            store = self.degraded
            adm = await self.degraded.admit(res)
            m.child(m.quota_degraded, tenant.name).inc()
        if not adm.allowed:
            outcome = "insufficient_quota" if adm.never else f"rejected_{adm.dimension}"
            m.child(m.tenant_requests, tenant.name, outcome).inc()
            raise _refusal(adm, model, tokens)
        m.child(m.tenant_requests, tenant.name, "admitted").inc()
        m.child(m.tenant_tokens, tenant.name, "reserved").inc(tokens)
        m.child(m.tenant_in_flight, tenant.name).inc()
        return Ticket(tenant, request_id, model, tokens, store, adm)

    # -- settlement ------------------------------------------------------------------------------
    async def settle(self, t: Ticket, actual_tokens: int) -> None:
        """Charge what was really used (refund or debt) and free the lease; once per ticket."""
        if t.done:
            return
        t.done = True
        m = self.metrics
        m.child(m.tenant_tokens, t.tenant.name, "settled").inc(actual_tokens)
        if t.store is None:
            return
        m.child(m.tenant_in_flight, t.tenant.name).dec()
        try:
            await t.store.settle(t.tenant.name, t.request_id, actual_tokens, limits=t.tenant.limits)
        except QuotaStoreUnavailable as e:
            # The lease expires by age and the reservation stays charged: never a free request.
            self.breaker.record_failure(time.monotonic())
            log.warning("settle of %s deferred to lease expiry: %s", t.request_id, e)

    async def release(self, t: Ticket, *, refund_all: bool) -> None:
        """Nothing was generated: refund the tokens (and the request when it was not the client's
        fault) and free the lease; once per ticket."""
        if t.done:
            return
        t.done = True
        m = self.metrics
        m.child(m.tenant_tokens, t.tenant.name, "refunded").inc(t.reserved)
        if t.store is None:
            return
        m.child(m.tenant_in_flight, t.tenant.name).dec()
        try:
            await t.store.release(
                t.tenant.name, t.request_id, limits=t.tenant.limits, refund_all=refund_all
            )
        except QuotaStoreUnavailable as e:
            self.breaker.record_failure(time.monotonic())
            log.warning("release of %s deferred to lease expiry: %s", t.request_id, e)


def _refusal(adm: Admission, model: str, tokens: int) -> APIError:
    headers = adm.headers()
    if adm.never:
        return APIError(
            429,
            f"This request ({tokens} tokens reserved: prompt estimate + max_tokens) is larger than "
            f"your key's whole {adm.dimension} budget and can never be admitted. Lower max_tokens "
            "or the prompt size.",
            "insufficient_quota",
            code="insufficient_quota",
            headers=headers,
        )
    wait = adm.retry_after_s
    if adm.dimension == "concurrency":
        msg = (
            f"Too many concurrent requests for {model} on your key (limit {adm.in_flight}). "
            f"Please try again in {wait:.3f}s."
        )
        type_ = "requests"
    elif adm.dimension == "tokens":
        limit = adm.limit_tokens
        used = (limit - (adm.remaining_tokens or 0)) if limit is not None else None
        msg = (
            f"Rate limit reached for {model} on tokens per min (TPM): Limit {limit}, Used {used}, "
            f"Requested {tokens}. Please try again in {wait:.3f}s."
        )
        type_ = "tokens"
    else:
        limit = adm.limit_requests
        used = (limit - (adm.remaining_requests or 0)) if limit is not None else None
        msg = (
            f"Rate limit reached for {model} on requests per min (RPM): Limit {limit}, "
            f"Used {used}, Requested 1. Please try again in {wait:.3f}s."
        )
        type_ = "requests"
    return APIError(429, msg, type_, code="rate_limit_exceeded", headers=headers)
