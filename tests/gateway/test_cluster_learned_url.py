"""Shared learned notes (prefix chains, session pins) are about a server, not a worker name: a
rollout that points a name at a new server must not credit the new, cold server with what the
old one holds, on a replica that moved it while a peer still routes to the old one, nor from the
stream's history at a warm start. And chains are only recorded between replicas that key a model
the same way (token mode or text mode), during a rollout of `[routing.token_mode]` too. Real
redis-server, the syncs driven tick by tick."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Collection
from typing import Any

import msgpack
import pytest
from redis.asyncio import Redis

from bench.redis_server import RedisServer
from gateway.cluster import ClusterSync
from gateway.config import ClusterSettings
from gateway.keying import route_key_now
from gateway.tokenizers import sim_token_keyer
from scoring.learned import Journal
from scoring.policy import make_policy
from scoring.route_key import route_request
from scoring.state import RoutingState
from scoring.views import RouteRequest, RoutingOptions
from workers.learned_share import decode_batch, decode_frame, encode_batch, frame_batch, pack_entry
from workers.registry import Registry
from workers.worker import WorkerSpec

OLD = "http://10.0.0.1:8000"
NEW = "http://10.0.0.2:8000"
W1 = "http://10.0.0.3:8000"
OPTIONS = RoutingOptions()


def fleet(w0: str, models: dict[str, str] | None = None) -> Registry:
    """w0 at ``w0`` and w1, probed: serving ``models`` (worker -> model), started an hour ago
    (notes are judged against a known process start, as in a running gateway)."""
    reg = Registry([WorkerSpec("w0", w0), WorkerSpec("w1", W1)])
    for name, model in (models or {"w0": "m", "w1": "m"}).items():
        reg.probe_ok(name, [{"id": model, "object": "model"}], None)
    started = time.time() - 3600
    for w in reg.workers.values():
        w.metrics = dataclasses.replace(w.metrics, process_start=started)
    return reg


def replica(
    redis: RedisServer,
    prefix: str,
    rid: str,
    reg: Registry,
    token_models: Collection[str] | None = None,
) -> ClusterSync:
    cfg = ClusterSettings(enabled=True, key_prefix=prefix, expiry_s=30.0, op_timeout_s=5.0)
    hook = None if token_models is None else (lambda: token_models)
    return ClusterSync(
        cfg,
        reg,
        redis_url=redis.url,
        replica_id=rid,
        state=RoutingState(OPTIONS),
        token_models=hook,
    )


def routing(s: ClusterSync) -> RoutingState:
    assert s.routing is not None
    return s.routing


def body(i: int, model: str = "m") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": f"doc {i} " + "lorem " * 300}]}


def text_key(i: int, session: str, model: str = "m") -> RouteRequest:
    return route_request("chat", body(i, model), options=OPTIONS, session_id=session)


def token_key(i: int, session: str) -> RouteRequest:
    return route_key_now(
        needs_chain=True,
        keyer=sim_token_keyer(),
        block_size=16,
        options=OPTIONS,
        is_chat=True,
        data=body(i),
        model="m",
        namespace="",
        session_id=session,
        tenant_priority=0.5,
        request_id=f"r{i}",
        precise=False,
    )


def dispatch(s: ClusterSync, worker: str, route: RouteRequest) -> None:
    make_policy("kv_aware", options=OPTIONS, state=routing(s)).on_dispatch(worker, route)


async def sync(*replicas: ClusterSync, rounds: int = 3) -> None:
    for _ in range(rounds):
        for s in replicas:
            assert await s.sync_once()


def holds(s: ClusterSync, worker: str, route: RouteRequest) -> int:
    return routing(s).index.match(route.chain).get(worker, 0)


def pinned(s: ClusterSync, session: str) -> str | None:
    return routing(s).sessions.get(session, time.monotonic())


async def stop(*replicas: ClusterSync) -> None:
    for s in replicas:
        await s.stop()


async def test_a_note_about_the_old_server_is_not_replayed_into_the_new_one(
    redis: RedisServer,
) -> None:
    """A still sends w0 to the old server, B reloaded it to a new one (and forgot w0), C has
    not moved either: A's notes teach C, and B only where its worker is the same server (w1)."""
    prefix = "kvt:{url-live}:"
    a = replica(redis, prefix, "a", fleet(OLD))
    b = replica(redis, prefix, "b", fleet(NEW))
    c = replica(redis, prefix, "c", fleet(OLD))
    routing(b).forget_worker("w0")  # what Gateway.sync_workers does on the move
    try:
        moved, stayed = text_key(1, "s-moved"), text_key(2, "s-stayed")
        dispatch(a, "w0", moved)
        dispatch(a, "w1", stayed)
        await sync(a, b, c)
        assert holds(c, "w0", moved) == len(moved.chain)
        assert pinned(c, "s-moved") == "w0"
        # B's w0 is a cold server: neither the prefix nor the session is credited to it ...
        assert holds(b, "w0", moved) == 0
        assert routing(b).index.size("w0") == 0
        assert pinned(b, "s-moved") is None
        # ... and the same server under the same name still learns as before.
        assert holds(b, "w1", stayed) == len(stayed.chain)
        assert pinned(b, "s-stayed") == "w1"
        assert b.learned_applied == 1 and c.learned_applied == 2
    finally:
        await stop(a, b, c)


async def test_a_warm_start_skips_the_history_about_the_server_a_name_left(
    redis: RedisServer,
) -> None:
    prefix = "kvt:{url-warm}:"
    a = replica(redis, prefix, "a", fleet(OLD))
    try:
        before = text_key(3, "s-before")
        dispatch(a, "w0", before)
        await sync(a)
        # Started after the move (w0 is the new server): the stream's history holds A's note.
        b = replica(redis, prefix, "b", fleet(NEW))
        late = replica(redis, prefix, "late", fleet(OLD))
        await sync(b, late)
        assert holds(late, "w0", before) == len(before.chain)  # the history is there
        assert holds(b, "w0", before) == 0
        assert pinned(b, "s-before") is None
        await stop(b, late)
    finally:
        await stop(a)


async def test_notes_made_before_the_publisher_moved_the_name_do_not_go_out_under_the_new_url(
    redis: RedisServer,
) -> None:
    """A dispatches to the old server and reloads w0 to the new one before its next sync: the
    batch names w0 at the new URL, so the note must not travel in it (B, on the new server
    since before the dispatch, would take it); A's later notes about the new server do."""
    prefix = "kvt:{url-race}:"
    b = replica(redis, prefix, "b", fleet(NEW))
    routing(b).forget_worker("w0")
    reg = fleet(OLD)
    a = replica(redis, prefix, "a", reg)
    try:
        old = text_key(4, "s-old")
        dispatch(a, "w0", old)
        reg.sync([WorkerSpec("w0", NEW), WorkerSpec("w1", W1)])
        reg.workers["w0"].metrics = reg.workers["w1"].metrics  # the new server, probed
        routing(a).forget_worker("w0")
        new = text_key(5, "s-new")
        dispatch(a, "w0", new)
        await sync(a, b)
        assert holds(b, "w0", old) == 0
        assert pinned(b, "s-old") is None
        assert holds(b, "w0", new) == len(new.chain)
        assert pinned(b, "s-new") == "w0"
    finally:
        await stop(a, b)


async def test_an_older_publishers_batch_names_no_url_and_still_matches_by_name(
    redis: RedisServer,
) -> None:
    """A rolling upgrade: a batch as the previous version wrote it (no ``u``) is replayed by
    worker name, whatever the URL, as that version's readers do."""
    prefix = "kvt:{url-older}:"
    b = replica(redis, prefix, "b", fleet(NEW))
    route = text_key(6, "s-older")
    note = make_policy("kv_aware", options=OPTIONS, state=RoutingState(OPTIONS))
    st = note.state
    st.journal = Journal()
    note.on_dispatch("w0", route)
    rows = st.journal.take(10)
    raw = encode_batch(OPTIONS.key_fields(), rows, rows[0].at)
    assert set(msgpack.unpackb(raw)) == {"v", "k", "t", "e"}
    admin = Redis.from_url(redis.url)
    try:
        await admin.xadd(prefix + "learned", {"r": "old-peer", "s": 1, "b": raw})
        await sync(b)
        assert holds(b, "w0", route) == len(route.chain)
        assert pinned(b, "s-older") == "w0"
    finally:
        await admin.aclose()
        await stop(b)


async def test_chains_of_a_model_keyed_the_other_way_are_not_recorded_but_sessions_are(
    redis: RedisServer,
) -> None:
    """A keys model m by tokens, B (not rolled out yet) by text, C by tokens too. A's token-mode
    chains for m can never match what B computes for the same prompt: B learns the session
    only; C learns everything; a model both key alike (w1's) still shares its chains."""
    prefix = "kvt:{token-mode}:"
    models = {"w0": "m", "w1": "other"}
    a = replica(redis, prefix, "a", fleet(OLD, models), token_models={"m"})
    b = replica(redis, prefix, "b", fleet(OLD, models), token_models=set())
    c = replica(redis, prefix, "c", fleet(OLD, models), token_models={"m"})
    try:
        tok, txt = token_key(7, "s-tok"), text_key(7, "s-txt")
        assert tok.chain and not set(tok.chain) & set(txt.chain)  # the same prompt, two keys
        other = text_key(8, "s-other", model="other")
        dispatch(a, "w0", tok)
        dispatch(a, "w1", other)
        await sync(a, b, c)
        assert holds(c, "w0", tok) == len(tok.chain)
        assert routing(b).index.size("w0") == 0  # no dead entries taking w0's capacity
        assert holds(b, "w0", tok) == 0
        assert pinned(b, "s-tok") == "w0"
        assert holds(b, "w1", other) == len(other.chain)
        assert b.learned_applied == 2
        # And the reverse: B's text-mode chain for m is no use to A or C.
        dispatch(b, "w0", txt)
        await sync(b, a, c)
        assert routing(a).index.size("w0") == len(tok.chain)
        assert holds(a, "w0", txt) == 0 and holds(c, "w0", txt) == 0
        assert pinned(a, "s-txt") == "w0" and pinned(c, "s-txt") == "w0"
    finally:
        await stop(a, b, c)


async def test_notes_packed_across_a_token_mode_reload_go_out_for_their_sessions_only(
    redis: RedisServer,
) -> None:
    """A's notes still in its journal when a reload turns token mode on for m were keyed either
    way: their batch carries no key (every reader, older ones too, then skips its chains),
    and notes after the reload share their chains with a peer that keys m by tokens."""
    prefix = "kvt:{token-reload}:"
    mine: set[str] = set()
    a = replica(redis, prefix, "a", fleet(OLD), token_models=mine)
    b = replica(redis, prefix, "b", fleet(OLD), token_models={"m"})
    try:
        await sync(a, b)  # A has packed once under text mode
        before = text_key(9, "s-before")
        dispatch(a, "w0", before)
        mine.add("m")  # the reload: A keys m by tokens from now on
        await sync(a, b)
        assert pinned(b, "s-before") == "w0"
        assert routing(b).index.size("w0") == 0
        after = token_key(10, "s-after")
        dispatch(a, "w0", after)
        await sync(a, b)
        assert holds(b, "w0", after) == len(after.chain)
        assert pinned(b, "s-after") == "w0"
    finally:
        await stop(a, b)


def test_the_new_fields_leave_what_an_older_reader_reads_unchanged() -> None:
    """``u`` and ``m`` are added beside ``v``/``k``/``t``/``e``, which keep their bytes' meaning:
    the previous version reads those four alone and replays the rows by name, as before."""
    note = make_policy("kv_aware", options=OPTIONS, state=RoutingState(OPTIONS))
    note.state.journal = Journal()
    note.on_dispatch("w0", text_key(11, "s"))
    rows = [pack_entry(e) for e in note.state.journal.take(10)]
    plain = frame_batch(OPTIONS.key_fields(), rows, 5.0)
    tagged = frame_batch(OPTIONS.key_fields(), rows, 5.0, {"w0": OLD}, {"m"})
    d = msgpack.unpackb(tagged)
    assert d["v"] == 2 and d["u"] == {"w0": OLD} and d["m"] == ["m"]
    assert {k: v for k, v in d.items() if k not in ("u", "m")} == msgpack.unpackb(plain)
    assert decode_batch(tagged, 1.0) == decode_batch(plain, 1.0)
    got, old = decode_frame(tagged, 1.0), decode_frame(plain, 1.0)
    assert got is not None and got.urls == {"w0": OLD} and got.token_models == {"m"}
    assert old is not None and old.urls is None and old.token_models is None


@pytest.mark.parametrize(
    "extra",
    [{"u": ["w0", OLD]}, {"u": {"w0": 7}}, {"m": "m"}, {"m": [1]}],
)
def test_a_url_map_or_model_list_of_another_shape_drops_the_batch(extra: dict[str, Any]) -> None:
    """Read as absent, the rows would match by name alone: what the fields are there to stop."""
    raw = msgpack.packb({"v": 2, "k": [], "t": 0.0, "e": [], **extra})
    assert decode_frame(raw, 1.0) is None
    assert decode_frame(msgpack.packb({"v": 2, "k": [], "t": 0.0, "e": []}), 1.0) is not None
