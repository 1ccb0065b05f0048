"""Redis quota store: the shared state that makes N gateway replicas enforce ONE limit.

Each operation is one Lua script, so admission is atomic across replicas and costs one round
trip. The scripts take the clock from Redis `TIME`: replicas' clocks disagree, Redis's is one.
They mirror `gateway.quota.gcra` expression by expression (same float operations in the same
order), which is why the memory backend's tests speak for this one too.

Scripts run with `EVALSHA` (the body is sent once); on `NOSCRIPT` (after a restart or `SCRIPT
FLUSH`) the body goes with `EVAL`, which also caches it again. A proxy that rejects `EVALSHA`
outright switches the store to plain `EVAL` for good. `SCRIPT LOAD` is never used, so proxies
that forbid it do not matter.

Failures: connection errors, timeouts and the server's "cannot serve now" replies (LOADING,
READONLY after a failover, MASTERDOWN, CLUSTERDOWN, TRYAGAIN, OOM, BUSY) raise
`QuotaStoreUnavailable` within `op_timeout_s`; the caller's circuit breaker decides what to do.
Retrying a timed-out call once is safe because admit and settle are idempotent per request id.

Concurrency leases are renewed by their owner: the store keeps the request ids whose admit made
a lease in this process (`_held`, until `forget` or a settle/release) and a background task,
started on the first such admit and cancelled by `close`, renews them every `lease_renew_s`
(one `RENEW_LUA` call per tenant and 512 ids). A lease is pruned when it has gone `lease_ttl_s`
without a renewal, so a crashed process's leases go within about a minute while a request that
runs for hours keeps its own.

Needs Redis >= 5 (scripts that call `TIME` and then write rely on effects replication, the
default since 5). Every key of a call shares the tenant's hash tag, so the key layout is
Cluster-safe; this module is tested against a standalone server only (`client=` takes any
redis.asyncio client).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    BusyLoadingError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.quota import (
    LEASE_RENEW_S,
    RECORD_GRACE_S,
    SETTLED_TTL_S,
    Admission,
    GcraResult,
    QuotaKeys,
    QuotaStoreError,
    QuotaStoreUnavailable,
    Reservation,
    Settlement,
    TenantLimits,
    build_admission,
    limit_specs,
    usage_dict,
)

_PRELUDE = """
local PERIOD = 60000000.0
local TOL = 1e-6
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local function fmt(x) return string.format('%.17g', x) end
-- A limit's state is "t0 backlog": at t0 its TAT was `backlog` units ahead. Returns the
-- units it is ahead now, 0 when full.
local function get_backlog(key, now, rate)
  local v = redis.call('GET', key)
  if v then
    local t0, b = string.match(v, '^(%S+) (%S+)$')
    local x = tonumber(b) - (now - tonumber(t0)) * rate / PERIOD
    if x > 0 then return x end
  end
  return 0
end
local function set_backlog(key, b, now, rate)
  if b > 0 then
    local ttl = math.ceil(b * (PERIOD / rate) / 1000) + 1000
    redis.call('SET', key, fmt(now) .. ' ' .. fmt(b), 'PX', ttl)
  else
    redis.call('DEL', key)
  end
end
local function remaining(b, rate, cap)
  local r = math.floor(cap - b + TOL)
  if r < 0 then r = 0 end
  if r > cap then r = cap end
  local reset = b
  if reset < 0 then reset = 0 end
  return r, reset * (PERIOD / rate)
end
local function gcra(b, cost, rate, cap)
  if cost > cap then
    local r, reset = remaining(b, rate, cap)
    return 0, 1, b, 0, r, reset
  end
  local new = b + cost
  local over = new - cap
  if over > TOL then
    local r, reset = remaining(b, rate, cap)
    return 0, 0, b, over * (PERIOD / rate), r, reset
  end
  local r, reset = remaining(new, rate, cap)
  return 1, 0, new, 0, r, reset
end
"""

# Arguments and replies are packed into space-separated strings: a reply of 24 RESP elements
# costs the Python client more CPU than the script costs Redis.
# KEYS: record, leases, limit keys...   ARGV: request_id, max_concurrent (-1: none),
# lease_ttl_us, record_ttl_ms, tokens, model, "rate capacity cost" per limit (one string).
# Returns "allowed concurrency_ok in_flight dup(0 new, 1 open, 2 settled)" then per limit
# "ok never retry_us remaining reset_us".
ADMIT_LUA = (
    _PRELUDE
    + """
local now = now_us()
local rid = ARGV[1]
local maxc = tonumber(ARGV[2])
local lease_ttl = tonumber(ARGV[3])
local n = #KEYS - 2
local spec = {}
for x in string.gmatch(ARGV[7], '%S+') do spec[#spec + 1] = tonumber(x) end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', fmt(now - lease_ttl))
local in_flight = redis.call('ZCARD', KEYS[2])
local state = redis.call('HGET', KEYS[1], 'state')
local dup = 0
if state == 'open' then dup = 1 elseif state then dup = 2 end
local conc_ok = 1
if dup == 0 and maxc >= 0 and in_flight >= maxc then conc_ok = 0 end
local allowed = conc_ok
local res = {}
for i = 1, n do
  local j = 3 * (i - 1)
  local rate, cap, cost = spec[j + 1], spec[j + 2], spec[j + 3]
  if dup ~= 0 then cost = 0 end
  local ok, never, b, retry, r, reset = gcra(get_backlog(KEYS[i + 2], now, rate), cost, rate, cap)
  if ok == 0 then allowed = 0 end
  res[i] = {ok, never, b, retry, r, reset}
end
if dup ~= 0 then allowed = (dup == 1) and 1 or 0 end
if allowed == 0 then
  -- Refused: report the untouched state, not what this request would have left.
  for i = 1, n do
    if res[i][1] == 1 then
      local rate, cap = spec[3 * (i - 1) + 1], spec[3 * (i - 1) + 2]
      res[i][5], res[i][6] = remaining(get_backlog(KEYS[i + 2], now, rate), rate, cap)
    end
  end
end
if allowed == 1 and dup == 0 then
  for i = 1, n do
    set_backlog(KEYS[i + 2], res[i][3], now, spec[3 * (i - 1) + 1])
  end
  redis.call('ZADD', KEYS[2], fmt(now), rid)
  redis.call('PEXPIRE', KEYS[2], math.ceil(lease_ttl / 1000) + 1000)
  redis.call('HSET', KEYS[1], 'state', 'open', 'tokens', ARGV[5], 'model', ARGV[6])
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[4]))
  in_flight = in_flight + 1
end
local out = {allowed, conc_ok, in_flight, dup}
for i = 1, n do
  local x = res[i]
  table.insert(out, x[1])
  table.insert(out, x[2])
  table.insert(out, fmt(x[4]))
  table.insert(out, x[5])
  table.insert(out, fmt(x[6]))
end
return table.concat(out, ' ')
"""
)

# KEYS: record, leases, limit keys...   ARGV: request_id, actual_tokens, refund_request (0/1),
# settled_ttl_ms, "kind(r|t) rate" per limit (one string), then per limit its model ('' for
# tenant-wide; separate arguments because model names are arbitrary strings).
# Returns {status, reserved_tokens}.
SETTLE_LUA = (
    _PRELUDE
    + """
local now = now_us()
redis.call('ZREM', KEYS[2], ARGV[1])
local rec = redis.call('HMGET', KEYS[1], 'state', 'tokens', 'model', 'restored')
if not rec[1] then return {'unknown', 0} end
local reserved = tonumber(rec[2])
if rec[1] ~= 'open' then return {'duplicate', reserved} end
local actual = tonumber(ARGV[2])
-- A restored record (RENEW_LUA) holds nothing: its request cell was lost with the data.
local refund = ARGV[3] == '1' and not rec[4]
local spec = {}
for x in string.gmatch(ARGV[5], '%S+') do spec[#spec + 1] = x end
for i = 1, #KEYS - 2 do
  local kind, rate, model = spec[2 * i - 1], tonumber(spec[2 * i]), ARGV[5 + i]
  if model == '' or model == rec[3] then
    local units = 0
    if kind == 't' then units = actual - reserved elseif refund then units = -1 end
    if units ~= 0 then
      local key = KEYS[i + 2]
      set_backlog(key, get_backlog(key, now, rate) + units, now, rate)
    end
  end
end
redis.call('HSET', KEYS[1], 'state', 'settled', 'actual', ARGV[2])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[4]))
return {'settled', reserved}
"""
)

# KEYS: leases, limit keys...   ARGV: lease_ttl_us (-1: count all), then (rate, capacity).
# Read-only. Returns {in_flight, per limit: remaining, reset_us}.
USAGE_LUA = (
    _PRELUDE
    + """
local now = now_us()
local ttl = tonumber(ARGV[1])
local in_flight
if ttl >= 0 then
  in_flight = redis.call('ZCOUNT', KEYS[1], '(' .. fmt(now - ttl), '+inf')
else
  in_flight = redis.call('ZCARD', KEYS[1])
end
local out = {in_flight}
for i = 1, #KEYS - 1 do
  local j = 1 + 2 * (i - 1)
  local rate, cap = tonumber(ARGV[j + 1]), tonumber(ARGV[j + 2])
  local r, reset = remaining(get_backlog(KEYS[i + 1], now, rate), rate, cap)
  table.insert(out, r)
  table.insert(out, fmt(reset))
end
return out
"""
)

# Renews the leases one process holds for one tenant.
# KEYS: leases, then the reservation record of each request.   ARGV: leases key TTL (ms), record
# TTL (ms), then the request ids (in KEYS order), then each one's model (same order).
# A request whose record is still open is live (its settle has not run: settle and release close
# the record and drop the lease in one script): its lease is scored now (re-added if it was pruned
# meanwhile, after an outage or a stall longer than the TTL: the request still runs) and its record
# kept for RECORD_GRACE_S more. A request with no record at all is live too: the server lost its
# data (a restart without persistence, a failover to a replica behind) while this
# process still runs it. Forgotten, it stopped counting toward max_concurrent (the tenant ran
# past its cap) and its settle found nothing to charge; its lease and record are restored, the
# record holding nothing (the lost buckets hold no reservation), so the settle charges what it
# used. Returns the 1-based positions of the ids whose record is closed (settled), which the
# caller stops renewing.
RENEW_LUA = (
    _PRELUDE
    + """
local now = fmt(now_us())
local record_ttl = tonumber(ARGV[2])
local n = #KEYS - 1
local gone = {}
local live = 0
for i = 2, #KEYS do
  local rid = ARGV[i + 1]
  local state = redis.call('HGET', KEYS[i], 'state')
  if state == 'open' or not state then
    if not state then
      redis.call('HSET', KEYS[i], 'state', 'open', 'tokens', 0, 'model', ARGV[n + i + 1],
        'restored', 1)
    end
    redis.call('ZADD', KEYS[1], now, rid)
    redis.call('PEXPIRE', KEYS[i], record_ttl)
    live = live + 1
  else
    gone[#gone + 1] = i - 1
  end
end
if live > 0 then redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1])) end
return table.concat(gone, ' ')
"""
)

# Server replies that mean "not now" rather than "your script is wrong": a replica demoted by a
# failover (READONLY), a failed RDB save (MISCONF, writes stop), too few replicas (NOREPLICAS).
# The code stands first in the reply (Redis 7), or after "Error running script ...: -" (Redis
# 5/6 wrap a write refused inside a script): matched at the start only, a failover's READONLY
# was a 500 for every limited request, and the settlements it refused kept their leases.
_UNAVAILABLE = re.compile(
    r"(?:^|: -)(?:LOADING|READONLY|MASTERDOWN|CLUSTERDOWN|TRYAGAIN|OOM|BUSY|MISCONF|NOREPLICAS)\b"
)
# redis-py strips the code from these replies and says it by the class instead.
_UNAVAILABLE_CLASSES = (ReadOnlyError, BusyLoadingError, OutOfMemoryError)
_TRANSPORT_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError, TimeoutError)


def _unavailable(e: ResponseError) -> bool:
    return isinstance(e, _UNAVAILABLE_CLASSES) or _UNAVAILABLE.search(str(e)) is not None


class _Script:
    __slots__ = ("body", "name", "sha")

    def __init__(self, name: str, body: str) -> None:
        self.name = name
        self.body = body
        self.sha = hashlib.sha1(body.encode()).hexdigest()


_ADMIT = _Script("admit", ADMIT_LUA)
_SETTLE = _Script("settle", SETTLE_LUA)
_USAGE = _Script("usage", USAGE_LUA)
_RENEW = _Script("renew", RENEW_LUA)

log = logging.getLogger("kvgate.quota")

# Request ids per renewal call: bounds one script's time on the server (3 commands per id).
RENEW_CHUNK = 512
# Renewal calls in flight at once: the request path shares the connection pool.
RENEW_PARALLEL = 4
# While renewals keep failing, one log line per this many seconds.
RENEW_LOG_EVERY_S = 60.0


_DUP: dict[int, Literal["open", "settled"] | None] = {0: None, 1: "open", 2: "settled"}


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _lease_key_ttl_ms(lease_ttl_s: float) -> int:
    """The leases key's TTL: one lease TTL past its newest lease, plus a second (as in admit)."""
    return math.ceil(lease_ttl_s * 1000) + 1000


def _record_ttl_ms(lease_ttl_s: float) -> int:
    return int((lease_ttl_s + RECORD_GRACE_S) * 1000)


@dataclass(slots=True)
class _Held:
    """The leases this process holds for one tenant (ordered set of request ids)."""

    lease_ttl_s: float
    rids: dict[str, str] = field(default_factory=dict)  # request id -> its model


class RedisQuotaStore:
    """Quota store in Redis (standalone, Sentinel-fronted or Cluster-safe key layout).

    Timeouts are short on purpose: a quota check that waits seconds for a sick Redis turns one
    outage into two. `op_timeout_s` bounds a whole call including the pool wait and one retry.
    """

    backend = "redis"

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        prefix: str = "kvgate:",
        socket_timeout_s: float = 0.25,
        connect_timeout_s: float = 0.25,
        op_timeout_s: float = 0.5,
        max_connections: int = 64,
        client: Redis | None = None,
        lease_renew_s: float = LEASE_RENEW_S,
    ) -> None:
        if not lease_renew_s > 0:
            raise ValueError(f"lease_renew_s must be > 0, got {lease_renew_s}")
        self.keys = QuotaKeys(prefix)
        self.url = url
        self.op_timeout_s = op_timeout_s
        self.lease_renew_s = lease_renew_s
        # tenant -> the leases this process holds there (admitted, not yet settled or forgotten).
        self._held: dict[str, _Held] = {}
        self._renewer: asyncio.Task[None] | None = None
        self._renew_failing_since: float | None = None  # monotonic; None while renewals succeed
        self._renew_logged_at = 0.0
        self.use_evalsha = True
        if client is None:
            pool = BlockingConnectionPool.from_url(
                url,
                max_connections=max_connections,
                timeout=op_timeout_s,
                socket_timeout=socket_timeout_s,
                socket_connect_timeout=connect_timeout_s,
                socket_keepalive=True,
                # One immediate retry: a pooled connection that died with a restarted Redis
                # should cost a reconnect, not a failed request.
                retry=Retry(
                    NoBackoff(), 1, supported_errors=(RedisConnectionError, RedisTimeoutError)
                ),
            )
            client = Redis.from_pool(pool)
        self.client = client

    # -- plumbing ----------------------------------------------------------------------------

    async def _call(self, *args: Any) -> Any:
        try:
            async with asyncio.timeout(self.op_timeout_s):
                return await self.client.execute_command(*args)  # type: ignore[no-untyped-call]
        except ResponseError as e:
            if isinstance(e, NoScriptError):
                raise
            if _unavailable(e):
                raise QuotaStoreUnavailable(f"redis at {self.url} cannot serve: {e}") from e
            raise
        except _TRANSPORT_ERRORS as e:
            raise QuotaStoreUnavailable(
                f"redis at {self.url} unreachable: {type(e).__name__}: {e}"
            ) from e
        except RedisError as e:
            raise QuotaStoreUnavailable(f"redis at {self.url} failed: {e}") from e

    async def _run(self, script: _Script, keys: list[str], args: list[Any]) -> Any:
        if self.use_evalsha:
            try:
                return await self._call("EVALSHA", script.sha, len(keys), *keys, *args)
            except NoScriptError:
                pass
            except ResponseError as e:
                msg = str(e).lower()
                if "unknown command" not in msg and "evalsha" not in msg:
                    raise QuotaStoreError(f"quota script {script.name} failed: {e}") from e
                # A proxy or a renamed command forbids EVALSHA: send bodies from now on.
                self.use_evalsha = False
        try:
            return await self._call("EVAL", script.body, len(keys), *keys, *args)
        except ResponseError as e:
            raise QuotaStoreError(f"quota script {script.name} failed: {e}") from e

    # -- operations --------------------------------------------------------------------------

    async def admit(self, res: Reservation) -> Admission:
        lim = res.limits
        specs = limit_specs(self.keys, res.tenant, res.model, lim, res.tokens)
        keys = [
            self.keys.reservation(res.tenant, res.request_id),
            self.keys.leases(res.tenant),
            *(s.key for s in specs),
        ]
        args: list[Any] = [
            res.request_id,
            -1 if lim.max_concurrent is None else lim.max_concurrent,
            int(lim.lease_ttl_s * 1e6),
            _record_ttl_ms(lim.lease_ttl_s),
            res.tokens,
            res.model,
            " ".join(f"{s.rate} {s.capacity} {s.cost}" for s in specs),
        ]
        out = _s(await self._run(_ADMIT, keys, args)).split()
        allowed, conc_ok, in_flight, dup = (int(x) for x in out[:4])
        results = []
        for i in range(len(specs)):
            ok, never, retry, remaining, reset = out[4 + 5 * i : 9 + 5 * i]
            results.append(
                GcraResult(ok == "1", never == "1", 0.0, float(retry), int(remaining), float(reset))
            )
        adm = build_admission(
            specs,
            results,
            concurrency_ok=bool(conc_ok),
            max_concurrent=lim.max_concurrent,
            in_flight=in_flight,
            backend=self.backend,
            duplicate=_DUP[dup],
        )
        if adm.allowed != bool(allowed):
            raise QuotaStoreError(f"admit script and builder disagree: {out!r}")
        if adm.allowed:  # a new lease, or an open one whose first reply was lost: ours to renew
            self._hold(res.tenant, res.request_id, res.model, lim.lease_ttl_s)
        return adm

    async def _finish(
        self, tenant: str, request_id: str, actual: int, limits: TenantLimits, refund: bool
    ) -> Settlement:
        # The request is over whether or not this call reaches Redis: a settlement that has to
        # wait for an outage to end must not keep its lease alive (it expires by age instead).
        self.forget(tenant, request_id)
        specs = limit_specs(self.keys, tenant, None, limits, 0)
        keys = [
            self.keys.reservation(tenant, request_id),
            self.keys.leases(tenant),
            *(s.key for s in specs),
        ]
        args: list[Any] = [
            request_id,
            actual,
            1 if refund else 0,
            int(SETTLED_TTL_S * 1000),
            " ".join(f"{'t' if s.kind == 'tokens' else 'r'} {s.rate}" for s in specs),
            *(s.model for s in specs),
        ]
        status, reserved = await self._run(_SETTLE, keys, args)
        return Settlement(_s(status), int(reserved), actual)  # type: ignore[arg-type]

    async def settle(
        self, tenant: str, request_id: str, actual_tokens: int, *, limits: TenantLimits
    ) -> Settlement:
        if actual_tokens < 0:
            raise ValueError("actual_tokens must be >= 0")
        return await self._finish(tenant, request_id, actual_tokens, limits, refund=False)

    async def release(
        self, tenant: str, request_id: str, *, limits: TenantLimits, refund_all: bool
    ) -> Settlement:
        return await self._finish(tenant, request_id, 0, limits, refund=refund_all)

    async def usage(self, tenant: str, limits: TenantLimits | None = None) -> dict[str, Any]:
        specs = [] if limits is None else limit_specs(self.keys, tenant, None, limits, 0)
        args: list[Any] = [-1 if limits is None else int(limits.lease_ttl_s * 1e6)]
        for s in specs:
            args += [s.rate, s.capacity]
        out = await self._run(_USAGE, [self.keys.leases(tenant), *(s.key for s in specs)], args)
        in_flight = int(out[0])
        if limits is None:
            return {"in_flight": in_flight}
        results = [
            GcraResult(True, False, 0.0, 0.0, int(out[1 + 2 * i]), float(_s(out[2 + 2 * i])))
            for i in range(len(specs))
        ]
        return usage_dict(specs, results, in_flight)

    async def ping(self) -> None:
        """A cheap round trip for the breaker's half-open probe."""
        await self._call("PING")

    # -- lease renewal -----------------------------------------------------------------------

    @property
    def held_leases(self) -> int:
        """Leases this process holds and renews (admitted, not yet settled or forgotten)."""
        return sum(len(h.rids) for h in self._held.values())

    def _hold(self, tenant: str, request_id: str, model: str, lease_ttl_s: float) -> None:
        held = self._held.get(tenant)
        if held is None:
            held = self._held[tenant] = _Held(lease_ttl_s)
        held.lease_ttl_s = lease_ttl_s  # the latest limits win (a reload may change them)
        held.rids[request_id] = model
        task = self._renewer
        loop = asyncio.get_running_loop()
        if task is None or task.done() or task.get_loop() is not loop:
            self._renewer = loop.create_task(self._renew_loop(), name="quota-lease-renewal")

    def forget(self, tenant: str, request_id: str) -> None:
        """Stop renewing a request's lease: it finished (its settlement may still be on its way,
        deferred while the store is down; if it never arrives the lease expires by age)."""
        held = self._held.get(tenant)
        if held is None:
            return
        held.rids.pop(request_id, None)
        if not held.rids:
            del self._held[tenant]

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.lease_renew_s)
            try:
                await self.renew_leases()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # never out of the task: the next period tries again
                self._renew_failed(e)
            else:
                if self._renew_failing_since is not None:
                    down = time.monotonic() - self._renew_failing_since
                    log.info("quota lease renewal works again (failing for %.0fs)", down)
                    self._renew_failing_since = None

    def _renew_failed(self, e: Exception) -> None:
        now = time.monotonic()
        if self._renew_failing_since is None:
            self._renew_failing_since = now
        elif now - self._renew_logged_at < RENEW_LOG_EVERY_S:
            return
        self._renew_logged_at = now
        log.warning(
            "quota lease renewal failed (%d leases held; retried every %gs, leases expire "
            "after their TTL without it): %s",
            self.held_leases,
            self.lease_renew_s,
            str(e),
        )

    async def renew_leases(self) -> None:
        """One renewal pass over the leases this process holds, RENEW_PARALLEL calls at a time.

        Stops at the first outage (`QuotaStoreUnavailable`, raised after the calls in flight
        end): every other call would wait out its timeout too. Another store error (one tenant's
        key clobbered: WRONGTYPE) skips that call and is raised once the pass is done.
        """
        jobs: list[tuple[str, float, list[tuple[str, str]]]] = []
        for tenant, held in self._held.items():
            rids = list(held.rids.items())
            for i in range(0, len(rids), RENEW_CHUNK):
                jobs.append((tenant, held.lease_ttl_s, rids[i : i + RENEW_CHUNK]))
        error: QuotaStoreError | None = None
        for i in range(0, len(jobs), RENEW_PARALLEL):
            batch = jobs[i : i + RENEW_PARALLEL]
            got = await asyncio.gather(*(self._renew(*j) for j in batch), return_exceptions=True)
            for r in got:
                if isinstance(r, QuotaStoreUnavailable):
                    raise r
                if isinstance(r, BaseException):
                    if not isinstance(r, QuotaStoreError):
                        raise r
                    error = r
        if error is not None:
            raise error

    async def _renew(self, tenant: str, lease_ttl_s: float, held: list[tuple[str, str]]) -> None:
        # Only those still held: a request settled since the pass began has no record to restore
        # (one whose record was lost with the data would come back, lease and all, for a TTL).
        still = self._held.get(tenant)
        held = [(r, m) for r, m in held if still is not None and r in still.rids]
        if not held:
            return
        rids = [r for r, _m in held]
        keys = [self.keys.leases(tenant), *(self.keys.reservation(tenant, r) for r in rids)]
        args: list[Any] = [
            _lease_key_ttl_ms(lease_ttl_s),
            _record_ttl_ms(lease_ttl_s),
            *rids,
            *(m for _r, m in held),
        ]
        gone = _s(await self._run(_RENEW, keys, args)).split()
        for i in gone:  # settled: another path got there first
            self.forget(tenant, rids[int(i) - 1])

    async def close(self) -> None:
        task, self._renewer = self._renewer, None
        if task is not None and not task.done():
            task.cancel()
            if task.get_loop() is asyncio.get_running_loop():
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.client.aclose()
