"""In-process quota store: the embedded default for a single replica and `make run`.

Same semantics as the Redis backend (same GCRA functions, same keys, same TTL rules), so one
test suite covers both. Each operation runs to completion without awaiting, which makes it atomic
among coroutines on one event loop; a lock makes it safe from threads too (a bench driver, a sync
admin call). The clock is injectable so tests can check exact retry-after values.

Leases follow the Redis backend's rule (pruned after `lease_ttl_s` without a renewal), and every
lease here belongs to this process, alive until its request settles (a crash takes the store with
it): so all of them are renewed, lazily, by the first operation at least `lease_renew_s` after
the last renewal. A request that runs longer than the TTL keeps counting toward `max_concurrent`.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Literal

from gateway.quota import (
    LEASE_RENEW_S,
    MEMORY_SETTLED_TTL_S,
    RECORD_GRACE_S,
    Admission,
    QuotaKeys,
    Reservation,
    Settlement,
    TenantLimits,
    backlog_at,
    build_admission,
    gcra,
    gcra_adjust,
    limit_specs,
    never_admissible,
    scale_limits,
    usage_dict,
)

# Expired state is dropped lazily on access and by a sweep every this many operations, so a
# tenant that never comes back costs nothing after its TTLs.
_SWEEP_EVERY = 4096


@dataclass(slots=True)
class _Record:
    state: Literal["open", "settled"]
    tokens: int
    model: str
    expires_us: float


@dataclass(slots=True)
class _Leases:
    ttl_us: float
    tenant: str
    members: dict[str, float] = field(default_factory=dict)  # request id -> last renewal

    def prune(self, now_us: float) -> None:
        cutoff = now_us - self.ttl_us
        stale = [rid for rid, t in self.members.items() if t <= cutoff]
        for rid in stale:
            del self.members[rid]


class MemoryQuotaStore:
    """The quota store in one process; `clock` returns seconds (default `time.time`)."""

    backend = "memory"

    def __init__(
        self,
        *,
        prefix: str = "kvgate:",
        clock: Callable[[], float] = time.time,
        lease_renew_s: float = LEASE_RENEW_S,
    ) -> None:
        if not lease_renew_s > 0:
            raise ValueError(f"lease_renew_s must be > 0, got {lease_renew_s}")
        self.keys = QuotaKeys(prefix)
        self._clock = clock
        self._renew_us = lease_renew_s * 1e6
        self._renewed_us = -math.inf
        self._lock = threading.Lock()
        # key -> (t0_us, backlog in units, rate): see gateway.quota for why not a plain TAT.
        self._tats: dict[str, tuple[float, float, int]] = {}
        self._leases: dict[str, _Leases] = {}
        self._records: dict[str, _Record] = {}
        self._ops = 0

    # -- state access ------------------------------------------------------------------------

    def _now_us(self) -> float:
        # Whole microseconds, like Redis TIME, so both backends see the same arithmetic.
        return float(round(self._clock() * 1_000_000.0))

    def _backlog(self, key: str, now_us: float, rate: int) -> float:
        state = self._tats.get(key)
        if state is None:
            return 0.0
        b = backlog_at(state[:2], now_us, rate)
        if b <= 0:
            del self._tats[key]
        return b

    def _set_backlog(self, key: str, backlog: float, now_us: float, rate: int) -> None:
        if backlog > 0:
            self._tats[key] = (now_us, backlog, rate)
        else:
            self._tats.pop(key, None)

    @staticmethod
    def _live(state: tuple[float, float, int], now_us: float) -> bool:
        return backlog_at(state[:2], now_us, state[2]) > 0

    def _record(self, key: str, now_us: float) -> _Record | None:
        rec = self._records.get(key)
        if rec is not None and rec.expires_us <= now_us:
            del self._records[key]
            return None
        return rec

    def _renew(self, now_us: float) -> None:
        """Renew every lease (and its open record) once `lease_renew_s` has passed since the
        last renewal: each is a live request of this process until it is settled."""
        if now_us - self._renewed_us < self._renew_us:
            return
        self._renewed_us = now_us
        for leases in self._leases.values():
            grace = leases.ttl_us + RECORD_GRACE_S * 1e6
            for rid in leases.members:
                leases.members[rid] = now_us
                rec = self._records.get(self.keys.reservation(leases.tenant, rid))
                if rec is not None and rec.state == "open":
                    rec.expires_us = max(rec.expires_us, now_us + grace)

    def _tick(self, now_us: float) -> None:
        self._renew(now_us)
        self._ops += 1
        if self._ops % _SWEEP_EVERY:
            return
        self._tats = {k: v for k, v in self._tats.items() if self._live(v, now_us)}
        self._records = {k: r for k, r in self._records.items() if r.expires_us > now_us}
        for lk in list(self._leases):
            self._leases[lk].prune(now_us)
            if not self._leases[lk].members:
                del self._leases[lk]

    def keys_in_use(self) -> list[str]:
        """Every live key, for tests that check the layout matches Redis's."""
        now = self._now_us()
        with self._lock:
            tats = [k for k, v in self._tats.items() if self._live(v, now)]
            recs = [k for k, r in self._records.items() if r.expires_us > now]
            leases = [k for k, v in self._leases.items() if v.members]
        return sorted(tats + recs + leases)

    # -- operations --------------------------------------------------------------------------

    async def admit(self, res: Reservation) -> Admission:
        with self._lock:
            return self._admit(res)

    def _admit(self, res: Reservation) -> Admission:
        now = self._now_us()
        self._tick(now)
        lim = res.limits
        specs = limit_specs(self.keys, res.tenant, res.model, lim, res.tokens)
        rkey = self.keys.reservation(res.tenant, res.request_id)
        lkey = self.keys.leases(res.tenant)
        leases = self._leases.get(lkey)
        if leases is None:
            leases = self._leases[lkey] = _Leases(lim.lease_ttl_s * 1e6, res.tenant)
        leases.ttl_us = lim.lease_ttl_s * 1e6
        leases.prune(now)
        rec = self._record(rkey, now)
        if rec is not None:
            peek = [gcra(self._backlog(s.key, now, s.rate), 0, s.rate, s.capacity) for s in specs]
            return build_admission(
                specs,
                peek,
                concurrency_ok=True,
                max_concurrent=lim.max_concurrent,
                in_flight=len(leases.members),
                backend=self.backend,
                duplicate=rec.state,
            )
        results = [
            gcra(self._backlog(s.key, now, s.rate), s.cost, s.rate, s.capacity) for s in specs
        ]
        conc_ok = lim.max_concurrent is None or len(leases.members) < lim.max_concurrent
        allowed = conc_ok and all(r.allowed for r in results)
        if not allowed:
            # Refused: report the untouched state, not what this request would have left.
            results = [
                r
                if not r.allowed
                else gcra(self._backlog(s.key, now, s.rate), 0, s.rate, s.capacity)
                for s, r in zip(specs, results, strict=True)
            ]
        else:
            for s, r in zip(specs, results, strict=True):
                self._set_backlog(s.key, r.backlog, now, s.rate)
            leases.members[res.request_id] = now
            self._records[rkey] = _Record(
                "open", res.tokens, res.model, now + (lim.lease_ttl_s + RECORD_GRACE_S) * 1e6
            )
        return build_admission(
            specs,
            results,
            concurrency_ok=conc_ok,
            max_concurrent=lim.max_concurrent,
            in_flight=len(leases.members),
            backend=self.backend,
        )

    async def settle(
        self, tenant: str, request_id: str, actual_tokens: int, *, limits: TenantLimits
    ) -> Settlement:
        if actual_tokens < 0:
            raise ValueError("actual_tokens must be >= 0")
        with self._lock:
            return self._finish(tenant, request_id, actual_tokens, limits, refund_request=False)

    async def release(
        self, tenant: str, request_id: str, *, limits: TenantLimits, refund_all: bool
    ) -> Settlement:
        with self._lock:
            return self._finish(tenant, request_id, 0, limits, refund_request=refund_all)

    def _finish(
        self,
        tenant: str,
        request_id: str,
        actual: int,
        limits: TenantLimits,
        *,
        refund_request: bool,
    ) -> Settlement:
        now = self._now_us()
        self._tick(now)
        leases = self._leases.get(self.keys.leases(tenant))
        if leases is not None:
            leases.members.pop(request_id, None)
        rec = self._record(self.keys.reservation(tenant, request_id), now)
        if rec is None:
            return Settlement("unknown", 0, actual)
        if rec.state == "settled":
            return Settlement("duplicate", rec.tokens, actual)
        for s in limit_specs(self.keys, tenant, None, limits, 0):
            if s.scope == "model" and s.model != rec.model:
                continue
            # Tokens move by actual - reserved; the request cell only on a refund_all release.
            units = actual - rec.tokens if s.kind == "tokens" else -int(refund_request)
            if units:
                new = gcra_adjust(self._backlog(s.key, now, s.rate), units)
                self._set_backlog(s.key, new, now, s.rate)
        rec.state = "settled"
        rec.expires_us = now + MEMORY_SETTLED_TTL_S * 1e6
        return Settlement("settled", rec.tokens, actual)

    def forget(self, tenant: str, request_id: str) -> None:
        """Nothing to stop: every lease here is renewed until its request settles."""

    async def usage(self, tenant: str, limits: TenantLimits | None = None) -> dict[str, Any]:
        with self._lock:
            now = self._now_us()
            self._renew(now)
            leases = self._leases.get(self.keys.leases(tenant))
            if leases is not None and limits is not None:
                leases.ttl_us = limits.lease_ttl_s * 1e6
            if leases is not None:
                leases.prune(now)
            in_flight = 0 if leases is None else len(leases.members)
            if limits is None:
                return {"in_flight": in_flight}
            specs = limit_specs(self.keys, tenant, None, limits, 0)
            peek = [gcra(self._backlog(s.key, now, s.rate), 0, s.rate, s.capacity) for s in specs]
            return usage_dict(specs, peek, in_flight)

    async def close(self) -> None:
        return None


class DegradedLocalStore:
    """Fail-open-degraded: a local limiter at `limit / replicas` while the shared store is down.

    A request within the tenant's real budget but larger than this replica's share is refused
    as retryable (after `retry_after_s`, by which time the shared store may be back), never as
    `never`: telling a client to give up on a request the tenant's quota allows would be wrong.
    """

    backend = "degraded"

    def __init__(
        self,
        replicas: int,
        *,
        prefix: str = "kvgate:",
        clock: Callable[[], float] = time.time,
        retry_after_s: float = 5.0,
        lease_renew_s: float = LEASE_RENEW_S,
    ) -> None:
        if replicas < 1:
            raise ValueError("replicas must be >= 1")
        self.replicas = replicas
        self.retry_after_s = retry_after_s
        self._local = MemoryQuotaStore(prefix=prefix, clock=clock, lease_renew_s=lease_renew_s)
        self._scale = lru_cache(maxsize=1024)(lambda lim: scale_limits(lim, self.replicas))

    def scaled(self, limits: TenantLimits) -> TenantLimits:
        return self._scale(limits)

    async def admit(self, res: Reservation) -> Admission:
        adm = await self._local.admit(replace(res, limits=self.scaled(res.limits)))
        adm = replace(adm, backend=self.backend)
        if adm.never and not adm.duplicate and never_admissible(res) is None:
            wait = max(self.retry_after_s, math.ceil(adm.retry_after_s))
            return replace(adm, reason=adm.dimension, never=False, retry_after_s=wait)
        return adm

    async def settle(
        self, tenant: str, request_id: str, actual_tokens: int, *, limits: TenantLimits
    ) -> Settlement:
        return await self._local.settle(
            tenant, request_id, actual_tokens, limits=self.scaled(limits)
        )

    async def release(
        self, tenant: str, request_id: str, *, limits: TenantLimits, refund_all: bool
    ) -> Settlement:
        return await self._local.release(
            tenant, request_id, limits=self.scaled(limits), refund_all=refund_all
        )

    async def usage(self, tenant: str, limits: TenantLimits | None = None) -> dict[str, Any]:
        return await self._local.usage(tenant, None if limits is None else self.scaled(limits))

    def forget(self, tenant: str, request_id: str) -> None:
        self._local.forget(tenant, request_id)

    async def close(self) -> None:
        await self._local.close()
