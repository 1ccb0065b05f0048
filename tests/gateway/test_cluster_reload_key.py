"""A reload that changes what chains mean (``RoutingOptions.key_fields``) while notes made under
the old options wait to be shared: they must not reach the peers framed with the new key, where
they would be recorded as meaningless chains and evict valid entries (real redis-server, the
sync driven tick by tick)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from bench.redis_server import RedisServer, free_port
from gateway.cluster import ClusterSync
from gateway.config import ClusterSettings
from scoring.learned import Journal
from scoring.policy import make_policy
from scoring.route_key import route_request
from scoring.state import RoutingState
from scoring.views import RoutingOptions
from workers.learned_share import decode_batch
from workers.registry import Registry
from workers.worker import WorkerSpec

OLD = RoutingOptions(block_chars=64, default_capacity_blocks=200)
NEW = RoutingOptions(block_chars=128, default_capacity_blocks=200)
WORKERS = ["w0", "w1"]


def replica(cfg: ClusterSettings, port: int, rid: str, options: RoutingOptions) -> ClusterSync:
    return ClusterSync(
        cfg,
        Registry([WorkerSpec(w, f"http://{w}") for w in WORKERS]),
        redis_url=f"redis://127.0.0.1:{port}/0",
        replica_id=rid,
        state=RoutingState(options),
    )


def doc(i: int) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": f"doc {i} " + "lorem " * 400}]}


HOT = {
    "model": "m",
    "messages": [{"role": "system", "content": "S" * 6000}, {"role": "user", "content": "q"}],
}


def test_a_key_change_drops_the_journals_unshared_notes_and_counts_them() -> None:
    state = RoutingState(OLD)
    state.journal = Journal()
    policy = make_policy("kv_aware", options=OLD, state=state)
    for i in range(5):
        policy.on_dispatch("w0", route_request("chat", doc(i), options=OLD))
    make_policy("kv_aware", options=dataclasses.replace(OLD, tie_tolerance=0.5), state=state)
    assert len(state.journal) == 5 and state.journal.dropped == 0  # same key: kept
    make_policy("kv_aware", options=NEW, state=state)  # Gateway.apply on a reload
    assert len(state.journal) == 0
    assert state.journal.dropped == 5  # what kvgate_cluster_learned_dropped_total adds


async def test_notes_packed_before_a_key_change_go_out_under_their_own_key() -> None:
    port = free_port()
    cfg = ClusterSettings(enabled=True, key_prefix="kvt:{rekey}:")
    a = replica(cfg, port, "a", OLD)
    assert a.routing is not None
    policy = make_policy("kv_aware", options=OLD, state=a.routing)
    # Redis away: each sync packs the journal into the outbox, where the notes wait.
    for i in range(40):
        policy.on_dispatch("w0", route_request("chat", doc(i), options=OLD, session_id=f"s{i}"))
    assert not await a.sync_once()
    assert len(a.routing.journal or ()) == 0 and a.outbox_bytes > 0
    # The reload: same RoutingState, new chain key. A dispatch after it, under the new options.
    policy = make_policy("kv_aware", options=NEW, state=a.routing)
    policy.on_dispatch("w1", route_request("chat", doc(99), options=NEW, session_id="new"))

    with RedisServer(port):
        b = replica(cfg, port, "b", NEW)  # a peer already on the new options
        assert b.routing is not None
        peer = make_policy("kv_aware", options=NEW, state=b.routing)
        hot = route_request("chat", HOT, options=NEW)
        peer.on_dispatch("w0", hot)
        entries = b.routing.index.size("w0")
        before = b.routing.matches(hot, 0.0)[0].get("w0")
        assert before == len(hot.chain)
        for _ in range(10):
            assert await a.sync_once()
            if not a.outbox_bytes:
                break
        assert a.outbox_bytes == 0 and a.learned_published == 41
        for _ in range(10):
            assert await b.sync_once()
            if b.learned_applied >= 41:
                break
        assert b.learned_applied == 41
        # What went out: each batch framed with its own rows' key, never mixed.
        raw = await b.client.xrange(cfg.key_prefix + "learned")
        keys = []
        for _id, fields in raw:
            got = decode_batch(fields[b"b"], None)
            assert got is not None
            keys.append((tuple(got[0]), {e.session_id for e in got[1]}))
        await a.stop()
        await b.stop()
    assert (OLD.key_fields(), {f"s{i}" for i in range(40)}) in keys
    assert (NEW.key_fields(), {"new"}) in keys
    # The peer kept what it knew (the old notes' chains were not recorded; 40 of them used to
    # evict the hot prefix there) and learned the new note's chain and every session.
    assert b.routing.matches(hot, 0.0)[0].get("w0") == before
    assert b.routing.index.size("w0") == entries
    assert b.routing.index.size("w1") > 0
    now = time.monotonic()
    assert b.routing.sessions.get("s0", now) == "w0"
    assert b.routing.sessions.get("new", now) == "w1"
