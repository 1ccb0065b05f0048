"""The load other gateway replicas put on each worker, merged from their published snapshots.

Every replica routes on its own dispatches: without the others' it sees a worker it shares with
three more replicas as a quarter as busy as it is (`bench.simulate --replicas 4`: p99 TTFT 2.05 s
against 1.43 s with one gateway), and a fleet-wide `max_concurrency` becomes a per-replica one. So
each replica publishes, per worker, the requests it has in flight there and their queued-prefill
tokens, and adds up everyone else's (`gateway.cluster` moves the bytes; this module is the pure
part: encoding, liveness and the sums, driven by an injected clock).

Liveness is judged by each reader on its own clock, never by comparing timestamps written by other
hosts: a snapshot carries a sequence number its publisher bumps on every write, and a peer whose
number has not moved for ``expiry_s`` of the reader's time is dead (killed, partitioned from the
store, or frozen) and counts for nothing. The same rule covers the store being down: nothing moves,
so after ``expiry_s`` the remote totals are zero and the replica routes on its own view alone,
rather than on counts that grow staler forever. A peer that vanishes from a successful read is kept
until it expires too: a store that restarted empty gets every live replica's snapshot back within
one interval, and in that interval the fleet-wide limits must not read "nobody else is busy".

A reader that has just started has no past reads, so "has not moved for ``expiry_s``" cannot be
judged on its clock alone: it once took every snapshot in the store as live from its first read
on, a SIGKILLed replica's too. Its siblings dropped that load ``expiry_s`` after the death and
deleted the field, but the replica the supervisor started in its place (a new reader in exactly
that window) counted it for a full ``expiry_s`` of its own, and kept counting it after the field
was gone: phantom load for up to twice ``expiry_s``, its workers full under `max_concurrency`. So:
- a snapshot carries (``t``) when it was written on the store's clock, as its publisher reckons it
  from the store's ``TIME`` (`gateway.cluster`), and a reader given the store's clock at its read
  places a peer it sees for the first time that much in its past: a long-unchanged snapshot is
  already old, and no two hosts' clocks are ever compared. Older publishers write no ``t``: their
  snapshots count from first sight, as before;
- the keep-on-vanish rule covers only a peer this reader knows to have been alive: seen moving,
  or aged by ``t``. One seen once, undated, and gone from the next read (a sibling deleted a dead
  peer's field) gives no reason to be kept.

A worker is named in a snapshot by its name AND its URL: a name is the operator's label, the URL
the server. During a rollout that points a name at a new server, one replica (reloaded) routes it
to the new server while another (not yet) still sends it to the old one; matched by name alone,
the reloaded replica credited its new, idle server with the other's load on the old one (room 0,
its requests queued or were refused). So a reader counts a peer's load only into its own worker
of the same name and URL. The URLs travel in a field (``u``) that older readers ignore, beside the
per-name sums (``w``) they read; an older peer's snapshot has no URL and counts by name, as it
did (a rolling upgrade: both versions keep counting each other).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import orjson

__all__ = ["Load", "LoadView", "Site", "Snapshot", "decode_snapshot", "encode_snapshot"]

# (requests in flight, queued-prefill tokens) one replica has on one worker.
Load = tuple[int, int]
# A worker as a snapshot names it: (name, URL); the URL is None in an older version's snapshot,
# which named workers alone.
Site = tuple[str, str | None]

_VERSION = 1
# A peer's count on one worker, at most (requests in flight, queued-prefill tokens): far above
# anything a replica has. A buggy peer's 2**62 becomes a number that sums, gauges and float math
# handle; a live peer that claims a worker full still fills it, as real load would, until its
# heartbeat stops and it expires.
MAX_IN_FLIGHT = 1 << 20
MAX_PREFILL_TOKENS = 1 << 40


@dataclass(slots=True, frozen=True)
class Snapshot:
    """One replica's published load: ``seq`` moves on every publish (the heartbeat). ``loads``
    per worker name (every URL summed: what an older reader sees), ``sites`` per (name, URL).
    ``at_ms``: when it was written, in the store's milliseconds (None: not known, an older
    publisher or one that has not read the store's clock yet)."""

    seq: int
    loads: dict[str, Load] = field(default_factory=dict)
    sites: dict[Site, Load] = field(default_factory=dict)
    at_ms: int | None = None


def encode_snapshot(
    seq: int,
    loads: Mapping[tuple[str, str], Load] | Mapping[str, Load],
    *,
    at_ms: int | None = None,
) -> bytes:
    """``loads`` per (worker name, URL), or per name alone (what an older version wrote: it
    reads back with no URL). Workers with no load are left out: absent means (0, 0), and most
    of a big fleet is idle from any one replica's side at any instant.

    ``w`` holds the per-name sums, byte for byte what an older version writes and reads (it
    ignores ``u`` and ``t``): one name on two servers here (a retired record still running on
    the old URL) is one sum there, as that version counts it. ``u`` holds [name, URL, in
    flight, queued prefill] per server; ``t`` is ``at_ms``, left out when unknown."""
    by_name: dict[str, list[int]] = {}
    sites: list[list[object]] = []
    for key, (i, p) in loads.items():
        if not (i or p):
            continue
        name = key if isinstance(key, str) else key[0]
        if not isinstance(key, str):
            sites.append([name, key[1], i, p])
        cur = by_name.get(name)
        if cur is None:
            by_name[name] = [i, p]
        else:
            cur[0] += i
            cur[1] += p
    doc: dict[str, object] = {"v": _VERSION, "seq": seq, "w": by_name}
    if sites:
        doc["u"] = sites
    if at_ms is not None:
        doc["t"] = at_ms
    return orjson.dumps(doc)


def _count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _sites(u: object) -> dict[Site, Load] | None:
    """A snapshot's ``u`` field, or None when it is not a list (a later version's other shape:
    the per-name ``w`` is then what counts). Bad entries are dropped, the rest stand."""
    if not isinstance(u, list):
        return None
    out: dict[Site, Load] = {}
    for e in u:
        if (
            isinstance(e, list)
            and len(e) == 4
            and isinstance(e[0], str)
            and isinstance(e[1], str)
            and _count(e[2])
            and _count(e[3])
        ):
            key = (e[0], e[1])
            i, p = out.get(key, (0, 0))
            out[key] = (min(i + e[2], MAX_IN_FLIGHT), min(p + e[3], MAX_PREFILL_TOKENS))
    return out


def decode_snapshot(raw: bytes) -> Snapshot | None:
    """A peer's bytes, or None when they are not a snapshot this version reads (a newer replica
    during a rolling upgrade, or garbage under our key): such a peer is skipped, not trusted."""
    try:
        d = orjson.loads(raw)
        if not isinstance(d, dict) or d.get("v") != _VERSION:
            return None
        seq = d["seq"]
        w = d["w"]
        if not isinstance(seq, int) or not isinstance(w, dict):
            return None
        loads: dict[str, Load] = {}
        for name, v in w.items():
            if isinstance(v, list) and len(v) == 2 and all(_count(x) for x in v):
                loads[name] = (min(v[0], MAX_IN_FLIGHT), min(v[1], MAX_PREFILL_TOKENS))
        t = d.get("t")
        at_ms = t if _count(t) else None  # a bad stamp dates nothing: counted from first sight
        sites = _sites(d.get("u"))
        if sites is None:  # an older peer: its workers by name alone
            return Snapshot(seq, loads, {(n, None): v for n, v in loads.items()}, at_ms)
        return Snapshot(seq, loads, sites, at_ms)
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None


@dataclass(slots=True)
class _Peer:
    seq: int
    # Reader's clock when seq last changed; at first sight, when the snapshot was written (its
    # ``t``), or, undated, the first sight itself.
    moved_at: float
    loads: dict[str, Load]
    sites: dict[Site, Load]
    # Whether moved_at is a time the peer was known to write (seen moving, or dated by ``t``),
    # not merely when this reader first looked: only then is it kept when it vanishes.
    dated: bool


class LoadView:
    """Peers' snapshots as this replica last saw them, and their per-worker sums.

    ``observe`` takes every replica's snapshot from one successful read (our own is skipped by
    id); ``totals`` sums the live ones. Nothing here does I/O or reads a global clock.
    """

    def __init__(
        self, self_id: str, expiry_s: float, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.self_id = self_id
        self.expiry_s = expiry_s
        self.clock = clock
        self.peers: dict[str, _Peer] = {}
        # Fields that did not decode: id -> (hash of their bytes, when those last changed). Their
        # bytes are their heartbeat (another version's replica rewrites its field every interval,
        # a dead one's never changes), so they expire like a silent peer and the store forgets
        # them; untracked, a dead one's field stayed in Redis for good and counted once a read.
        self.undecodable: dict[str, tuple[int, float]] = {}
        self.malformed = 0  # fields that did not decode, each counted once

    def observe(
        self, raw: Mapping[str, bytes], now: float | None = None, *, redis_ms: int | None = None
    ) -> None:
        """Record one read of every replica's snapshot (replica id -> encoded bytes). ``redis_ms``
        is the store's clock at ``now``, when known: it dates peers seen for the first time."""
        if now is None:
            now = self.clock()
        bad = self.undecodable
        for rid, blob in raw.items():
            if rid == self.self_id:
                continue
            snap = decode_snapshot(blob)
            if snap is None:
                h = hash(blob)
                seen = bad.get(rid)
                if seen is None:
                    self.malformed += 1
                if seen is None or seen[0] != h:
                    bad[rid] = (h, now)
                continue
            bad.pop(rid, None)
            p = self.peers.get(rid)
            if p is None:
                age = self._age(snap.at_ms, redis_ms)
                self.peers[rid] = _Peer(
                    snap.seq, now - (age or 0.0), snap.loads, snap.sites, age is not None
                )
            elif p.seq != snap.seq:
                p.seq, p.moved_at, p.loads, p.sites = snap.seq, now, snap.loads, snap.sites
                p.dated = True
        for rid in [r for r, p in self.peers.items() if not p.dated and r not in raw]:
            del self.peers[rid]
        self._forget(now)

    def _age(self, at_ms: int | None, redis_ms: int | None) -> float | None:
        """How long a snapshot has stood in the store, both ends on the store's clock; None when
        either is unknown, or the stamp is later than the read (the store's clock stepped back,
        or its publisher reckoned it ahead): such a stamp dates nothing. At most twice
        ``expiry_s``: dead on every read from now on, yet still held (and listed by `expired`,
        so the store deletes it) rather than forgotten at once and taken for new again on every
        read."""
        if at_ms is None or redis_ms is None or at_ms > redis_ms:
            return None
        return min((redis_ms - at_ms) / 1000, 2 * self.expiry_s)

    def _forget(self, now: float) -> None:
        """Drop peers dead for a while (bounds memory with replicas coming and going)."""
        gone = now - 10 * self.expiry_s
        for rid in [r for r, p in self.peers.items() if p.moved_at < gone]:
            del self.peers[rid]
        bad = self.undecodable
        for rid in [r for r, (_h, moved_at) in bad.items() if moved_at < gone]:
            del bad[rid]

    def _alive(self, p: _Peer, now: float) -> bool:
        return now - p.moved_at <= self.expiry_s

    def live(self, now: float | None = None) -> list[str]:
        """Peers (not this replica) whose heartbeat moved within ``expiry_s``."""
        if now is None:
            now = self.clock()
        return sorted(r for r, p in self.peers.items() if self._alive(p, now))

    def expired(self, now: float | None = None) -> list[str]:
        """Peers known to be dead, and fields that did not decode and have not changed for as
        long: the store may forget their snapshots."""
        if now is None:
            now = self.clock()
        dead = {r for r, p in self.peers.items() if not self._alive(p, now)}
        dead.update(r for r, (_h, t) in self.undecodable.items() if now - t > self.expiry_s)
        return sorted(dead)

    def totals(self, now: float | None = None) -> dict[str, Load]:
        """Per worker name, the live peers' in-flight requests and queued-prefill tokens, summed
        over every URL they run it at."""
        if now is None:
            now = self.clock()
        out: dict[str, Load] = {}
        for p in self.peers.values():
            if not self._alive(p, now):
                continue
            for name, (i, t) in p.loads.items():
                cur = out.get(name)
                out[name] = (i, t) if cur is None else (cur[0] + i, cur[1] + t)
        return out

    def site_totals(self, now: float | None = None) -> dict[Site, Load]:
        """Per (worker name, URL), the live peers' load, summed; an older peer's under (name,
        None): a reader adds those to its worker of that name, whatever its URL."""
        if now is None:
            now = self.clock()
        out: dict[Site, Load] = {}
        for p in self.peers.values():
            if not self._alive(p, now):
                continue
            for key, (i, t) in p.sites.items():
                cur = out.get(key)
                out[key] = (i, t) if cur is None else (cur[0] + i, cur[1] + t)
        return out
