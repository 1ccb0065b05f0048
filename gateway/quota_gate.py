"""The request path's view of quotas: admit, settle exactly once, and survive a Redis outage.

Wraps a `QuotaStore` with the circuit breaker and the per-tenant failure mode. While the shared
store is unreachable, fail-open tenants are limited locally at `limit / replicas` (so a fleet of
replicas does not admit `limit x replicas`), fail-closed tenants get 503 + Retry-After. A request is
settled against the store that admitted it, so a mode switch mid-request loses nothing.

A settlement that cannot reach the store is kept and replayed once the store answers again
(settlement is idempotent per request id, so a settle whose reply was lost is not charged twice).
Without the replay a Redis blip would leave every request that finished during it charged its
whole reservation and holding its concurrency lease until it expired: a tenant at its
`max_concurrent` would be locked out for up to `lease_ttl_s` (a minute by default) after Redis
came back. The backlog is bounded (`max_deferred_settlements`); past it the oldest fall back to
lease expiry, counted.

Leases are renewed by the store while their request runs (gateway.quota_redis); a ticket that is
done stops its renewal at once (`forget`), whether or not its settlement reached the store, so a
deferred or dropped settlement costs its tenant the slot for at most one lease TTL.

Only an outage (`QuotaStoreUnavailable`) keeps an entry waiting and counts against the breaker,
at admission as at settlement. Any other store error is the store answering that this entry (or
admission) cannot be applied (another app wrote at one of the tenant's keys: WRONGTYPE): the
breaker is shared by every tenant, so counting it there would refuse or degrade them all on a
healthy store, and the entry would be retried for ever in front of the others. Such an entry
is retried a few times, then dropped (logged, counted); its lease expires by age.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

from gateway.circuit_breaker import BreakerState, CircuitBreaker
from gateway.config import QuotaSettings
from gateway.errors import APIError
from gateway.metrics import GatewayMetrics
from gateway.quota import (
    LEASE_RENEWALS_PER_TTL,
    Admission,
    QuotaStore,
    QuotaStoreError,
    QuotaStoreUnavailable,
    Reservation,
    TenantLimits,
)
from gateway.quota_memory import DegradedLocalStore, MemoryQuotaStore
from gateway.tenancy import Tenant

log = logging.getLogger("kvgate.quota")
# A tenant whose admissions the store refuses (not an outage) is logged at most this often.
REFUSED_LOG_EVERY_S = 60.0

# Store errors that are not an outage before a deferred settlement is given up: it is retried in
# case the error was passing (a key repaired), not for ever (each try costs a round trip, and on
# every admission of its tenant).
MAX_SETTLE_ERRORS = 3
# Deferred settlements of its tenant that one admission applies before its own admit, waiting for
# each. Enough to free the leases of a tenant at its `max_concurrent`; after a long outage a tenant
# may have thousands, which are the replayer's (this request must not wait for them all).
INLINE_REPLAY = 16

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


@dataclass(slots=True)
class _Deferred:
    """A settle (`actual` set) or release that the store could not take yet."""

    ticket: Ticket
    actual: int | None
    refund_all: bool
    errors: int = 0  # store errors that were not an outage (MAX_SETTLE_ERRORS)
    # Sent and not answered yet: an admission replaying its tenant's backlog and the replayer
    # must not send it both.
    in_flight: bool = False


class QuotaGate:
    def __init__(self, cfg: QuotaSettings, metrics: GatewayMetrics) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.shared: QuotaStore
        # Well under the TTL, so a renewal lost to a blip does not cost a live request its lease.
        renew_s = cfg.lease_ttl_s / LEASE_RENEWALS_PER_TTL
        if cfg.backend == "redis":
            from gateway.quota_redis import RedisQuotaStore

            self.shared = RedisQuotaStore(
                cfg.redis_url,
                prefix=cfg.key_prefix,
                socket_timeout_s=cfg.socket_timeout_s,
                connect_timeout_s=cfg.socket_timeout_s,
                op_timeout_s=cfg.op_timeout_s,
                lease_renew_s=renew_s,
            )
        else:
            self.shared = MemoryQuotaStore(prefix=cfg.key_prefix, lease_renew_s=renew_s)
        self.degraded = DegradedLocalStore(
            cfg.replicas, prefix=cfg.key_prefix, lease_renew_s=renew_s
        )
        self.breaker = CircuitBreaker(
            failure_threshold=cfg.breaker_failures,
            cooldown_s=cfg.breaker_cooldown_s,
            on_transition=self._transition,
        )
        self._deferred: OrderedDict[str, _Deferred] = OrderedDict()  # oldest first
        # tenant -> (when its store refusal was last logged, refusals since): `_log_refused`
        self._refused_logged: dict[str, tuple[float, int]] = {}
        # The same entries by tenant, oldest first: an admission finds its tenant's without a walk
        # of the whole backlog (up to `max_deferred_settlements`).
        self._deferred_by: dict[str, dict[str, _Deferred]] = {}
        self._replayer: asyncio.Task[None] | None = None
        self._dropped = 0
        self._export_mode()

    def _transition(self, old: BreakerState, new: BreakerState) -> None:
        level = logging.WARNING if new is BreakerState.OPEN else logging.INFO
        log.log(level, "quota store circuit %s -> %s", old.value, new.value)
        self._export_mode()

    def _export_mode(self) -> None:
        for st in BreakerState:
            self.metrics.quota_breaker.labels(st.value).set(1 if self.breaker.state is st else 0)

    async def close(self) -> None:
        if self._replayer is not None:
            self._replayer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replayer
        if self._deferred and self.breaker.state is BreakerState.CLOSED:
            await self._replay_deferred()  # one last try: the store may be back already
        if self._deferred:
            log.warning(
                "%d settlements never reached the quota store; their leases expire by age",
                len(self._deferred),
            )
        await self.shared.close()
        await self.degraded.close()

    def _log_refused(self, tenant: str, e: QuotaStoreError) -> None:
        """A store refusing a tenant's admissions (its keys clobbered) refuses every one of
        them: one error line per tenant and REFUSED_LOG_EVERY_S, with the count since the
        last, instead of one per request."""
        now = time.monotonic()
        last = self._refused_logged.get(tenant)
        if last is not None and now - last[0] < REFUSED_LOG_EVERY_S:
            self._refused_logged[tenant] = (last[0], last[1] + 1)
            return
        self._refused_logged[tenant] = (now, 0)
        log.error(
            "quota store refused an admission of tenant %s (%d more since the last line; "
            "its failure mode answers them): %s",
            tenant,
            last[1] if last is not None else 0,
            str(e),
        )

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
                if tenant.name in self._deferred_by:
                    await self._replay_tenant(tenant.name)
                adm = await self.shared.admit(res)
                self.breaker.record_success(time.monotonic())
            except QuotaStoreError as e:
                # Any store failure, an outage's or not (a reply no one classified): the
                # tenant's store-failure mode answers, never a 500 for every limited request.
                # Only an outage counts on the breaker that every tenant shares: a store that
                # replied is up, and one tenant's key that another app overwrote (WRONGTYPE on
                # every admit) opened it, so fail-closed tenants got 503 and the rest degraded
                # limits on a healthy Redis (review). Such a reply costs no wait to repeat.
                if isinstance(e, QuotaStoreUnavailable):
                    _log_store_failure("quota store unavailable", e)
                    self.breaker.record_failure(time.monotonic())
                    # The script may have run with its reply lost (a timeout, Redis killed
                    # after the write): a full refund for this id, replayed later, frees what
                    # it may hold and is a no-op on a store that never saw it.
                    self._defer_orphan(tenant, request_id, model, tokens)
                else:
                    # A reply: the script failed before it reserved anything (ADMIT_LUA reads
                    # every key before its first reserving write), so it holds nothing. A
                    # refund deferred anyway failed the same way, and each later admit of that
                    # tenant replayed up to INLINE_REPLAY of them first, a round trip and a log
                    # line each (review).
                    self.breaker.record_success(time.monotonic())
                    self._log_refused(tenant.name, e)
            except asyncio.CancelledError:
                # Cancelled mid-call (a drain whose grace ended cuts walks not yet sent to a
                # worker): the script may have run on the store with its reply still on the
                # wire, and no ticket is returned to release what it holds, so the reservation
                # and the `max_concurrent` lease stayed until the lease TTL, on every replica.
                # The same maybe-admitted refund as above, deferred: the cancel must go on now,
                # and the replayer (or `close`, at shutdown after the drain) applies it. The
                # store did not fail: the breaker is not told.
                self._defer_orphan(tenant, request_id, model, tokens)
                raise
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
            raise _refusal(adm, model, tokens, tenant.limits.max_concurrent)
        m.child(m.tenant_requests, tenant.name, "admitted").inc()
        m.child(m.tenant_tokens, tenant.name, "reserved").inc(tokens)
        m.child(m.tenant_in_flight, tenant.name).inc()
        return Ticket(tenant, request_id, model, tokens, store, adm)

    def _defer_orphan(self, tenant: Tenant, request_id: str, model: str, tokens: int) -> None:
        """Queue a full refund for an admission whose outcome is unknown (the store may have
        run it). Replayed like any deferred release; on a store that never admitted the id it
        finds no reservation and changes nothing, so it is safe to send when in doubt."""
        orphan = Ticket(tenant, request_id, model, tokens, self.shared, None)
        _forget(orphan)  # held only if the reply came back; in doubt, renew nothing
        self._defer(_Deferred(orphan, None, True), None)

    # -- settlement ------------------------------------------------------------------------------
    async def settle(self, t: Ticket, actual_tokens: int) -> None:
        """Charge what was really used (refund or debt) and free the lease; once per ticket."""
        if t.done:
            return
        t.done = True
        _forget(t)
        m = self.metrics
        if t.store is not None:
            m.child(m.tenant_in_flight, t.tenant.name).dec()
        try:  # nothing a metric raises may keep the lease (the ticket is done already)
            m.child(m.tenant_tokens, t.tenant.name, "settled").inc(actual_tokens)
        finally:
            if t.store is not None:
                await self._finish(t, actual_tokens, False)

    async def release(self, t: Ticket, *, refund_all: bool) -> None:
        """Nothing was generated: refund the tokens (and the request when it was not the client's
        fault) and free the lease; once per ticket."""
        if t.done:
            return
        t.done = True
        _forget(t)
        m = self.metrics
        m.child(m.tenant_tokens, t.tenant.name, "refunded").inc(t.reserved)
        if t.store is None:
            return
        m.child(m.tenant_in_flight, t.tenant.name).dec()
        await self._finish(t, None, refund_all)

    # -- settlements the store could not take ----------------------------------------------------
    @property
    def deferred(self) -> int:
        """Settlements waiting for the store to come back."""
        return len(self._deferred)

    async def _finish(self, t: Ticket, actual: int | None, refund_all: bool) -> None:
        """Settle (`actual` set) or release `t` on its store, or defer it while that is down."""
        # While the circuit is open the store is known to be down: queue without a doomed call
        # (each would cost a socket timeout on a black-holed Redis).
        if t.store is self.shared and self.breaker.state is not BreakerState.CLOSED:
            self._defer(_Deferred(t, actual, refund_all), None)
            return
        # Deferred whatever the failure: `t` is done, so an error escaping here would hold its
        # lease and reservation until they expire (and cut the client's stream).
        try:
            await _apply(t, actual, refund_all)
        except QuotaStoreUnavailable as e:
            self.breaker.record_failure(time.monotonic())
            self._defer(_Deferred(t, actual, refund_all), e)
        except QuotaStoreError as e:
            # The store answered: not an outage, so not the breaker's (see the module's doc).
            _log_store_failure(f"{_settlement(t)} failed", e)
            self._defer(_Deferred(t, actual, refund_all, errors=1), None)
        except asyncio.CancelledError:
            # Cancelled mid-call (a drain whose grace ended cuts a walk refunding a refusal; a
            # slow store): `t` is done, so no later call would send it, and its lease and
            # reservation stayed until the lease TTL on every replica. Deferred as an outage's
            # is (a settlement is once-only per request id on the store, so one that did run
            # is not applied twice); the replayer or `close` sends it. Not the breaker's.
            self._defer(_Deferred(t, actual, refund_all), None)
            raise

    def _defer(self, d: _Deferred, err: Exception | None) -> None:
        m = self.metrics
        rid = d.ticket.request_id
        prev = self._deferred.get(rid)
        if prev is not None:
            self._unlink(rid, prev)
        self._deferred[rid] = d
        self._deferred_by.setdefault(d.ticket.tenant.name, {})[rid] = d
        if err is not None:
            log.warning(
                "settlement of %s deferred until the store answers: %s", d.ticket.request_id, err
            )
        while len(self._deferred) > self.cfg.max_deferred_settlements:
            old_rid, old = next(iter(self._deferred.items()))
            self._unlink(old_rid, old)
            m.quota_deferred.labels("dropped").inc()
            self._dropped += 1
            if self._dropped in (1, 10, 100) or self._dropped % 1000 == 0:  # not one line each
                log.error(
                    "settlement backlog full (%d): %d dropped so far, latest %s; their leases "
                    "expire by age",
                    self.cfg.max_deferred_settlements,
                    self._dropped,
                    old.ticket.request_id,
                )
        m.quota_deferred_pending.set(len(self._deferred))
        if self._replayer is None or self._replayer.done():
            self._replayer = asyncio.get_running_loop().create_task(self._replay_loop())

    async def _replay_loop(self) -> None:
        """Retry the backlog whenever the breaker lets a call through; this loop is also the
        half-open probe when no request arrives to make one."""
        while self._deferred:
            await asyncio.sleep(min(1.0, self.cfg.breaker_cooldown_s))
            if self.breaker.allow(time.monotonic()):
                await self._replay_deferred()

    async def _replay_deferred(self) -> None:
        """One pass over the backlog, oldest first, until the store turns out to be down."""
        for rid, d in list(self._deferred.items()):
            try:
                await self._replay(rid, d)
            except QuotaStoreUnavailable:
                self.breaker.record_failure(time.monotonic())
                return

    async def _replay_tenant(self, tenant: str) -> None:
        """Settle the oldest of a tenant's backlog before its next admission: otherwise the
        leases of its requests that finished during the outage still count against its
        `max_concurrent` (a fault test saw a 429 right after Redis came back). At most
        INLINE_REPLAY: the replayer has the rest. Raises QuotaStoreUnavailable."""
        batch: list[tuple[str, _Deferred]] = []
        for rid, d in self._deferred_by.get(tenant, {}).items():
            if not d.in_flight:
                batch.append((rid, d))
                if len(batch) == INLINE_REPLAY:
                    break
        for rid, d in batch:
            await self._replay(rid, d)

    async def _replay(self, rid: str, d: _Deferred) -> None:
        """Apply one backlog entry, unless it is gone or another caller has it in flight.
        Raises QuotaStoreUnavailable (the entry stays); another store error is counted on the
        entry, not the breaker, and the caller goes on with the next."""
        if d.in_flight or self._deferred.get(rid) is not d:
            return
        d.in_flight = True
        try:
            await _apply(d.ticket, d.actual, d.refund_all)
        except QuotaStoreUnavailable:
            raise
        except QuotaStoreError as e:
            self._failed(rid, d, e)
            return
        finally:
            d.in_flight = False
        # At once, not after the caller's other calls: when this is the half-open probe, every
        # other request is refused or degraded until the breaker hears of it.
        self.breaker.record_success(time.monotonic())
        self._replayed(rid, d)

    def _replayed(self, rid: str, d: _Deferred) -> None:
        # By identity: the id may have been deferred anew while the call ran.
        if self._deferred.get(rid) is d:
            self._unlink(rid, d)
        m = self.metrics
        m.quota_deferred.labels("replayed").inc()
        m.quota_deferred_pending.set(len(self._deferred))

    def _failed(self, rid: str, d: _Deferred, e: QuotaStoreError) -> None:
        """A replay the store answered with an error that is not an outage."""
        d.errors += 1
        what = _settlement(d.ticket)
        if self._deferred.get(rid) is not d:  # replaced or pushed out of the backlog meanwhile
            log.warning("replayed %s failed: %s", what, str(e))
            return
        if d.errors < MAX_SETTLE_ERRORS:
            left = MAX_SETTLE_ERRORS - d.errors
            log.warning("replayed %s failed, %d tries left: %s", what, left, str(e))
            return
        self._unlink(rid, d)
        m = self.metrics
        m.quota_deferred.labels("failed").inc()
        m.quota_deferred_pending.set(len(self._deferred))
        log.error(
            "%s given up after %d store errors; its lease expires by age: %s",
            what,
            d.errors,
            str(e),
        )

    def _unlink(self, rid: str, d: _Deferred) -> None:
        """Take `d`, the entry now at `rid`, out of the backlog."""
        del self._deferred[rid]
        mine = self._deferred_by[d.ticket.tenant.name]
        del mine[rid]
        if not mine:
            del self._deferred_by[d.ticket.tenant.name]


def _forget(t: Ticket) -> None:
    """Stop renewing the lease of a request that is over (`QuotaStore.forget`)."""
    if t.store is not None:
        t.store.forget(t.tenant.name, t.request_id)


def _settlement(t: Ticket) -> str:
    """A settlement as its log lines name it."""
    return f"settlement of {t.request_id} (tenant {t.tenant.name}, model {t.model})"


def _log_store_failure(what: str, e: QuotaStoreError) -> None:
    if isinstance(e, QuotaStoreUnavailable):
        log.warning("%s: %s", what, str(e))  # text: see RelayResponse
    else:  # not an outage the store module knows: worth a look
        log.error("%s (unclassified store error): %s", what, str(e))


async def _apply(t: Ticket, actual: int | None, refund_all: bool) -> None:
    assert t.store is not None
    if actual is not None:
        await t.store.settle(t.tenant.name, t.request_id, actual, limits=t.tenant.limits)
    else:
        await t.store.release(
            t.tenant.name, t.request_id, limits=t.tenant.limits, refund_all=refund_all
        )


def _refusal(
    adm: Admission, model: str, tokens: int, max_concurrent: int | None = None
) -> APIError:
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
            f"Too many concurrent requests for {model} on your key (limit "
            f"{adm.in_flight if max_concurrent is None else max_concurrent}). "
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
