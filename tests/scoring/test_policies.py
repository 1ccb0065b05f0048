from __future__ import annotations

import dataclasses
import math
import random
import time
from collections import Counter
from typing import Any

import pytest

from scoring.kv_aware import KVAware
from scoring.learned import Journal
from scoring.policy import (
    POLICY_NAMES,
    LeastLoaded,
    Policy,
    PrefixAffinity,
    RoundRobin,
    SessionAffinity,
    make_policy,
)
from scoring.prefix import render_chat, text_key
from scoring.route_key import route_request, session_id_from
from scoring.signals import commitment_yield
from scoring.views import RouteRequest, RoutingOptions, Weights, WorkerView

SYSTEM = "You are the support assistant of ACME. Follow the policy below exactly. " * 60  # ~4.3k


def chat(user: str, system: str = SYSTEM) -> dict:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }


def key(p: Policy, body: dict, **kw: object) -> RouteRequest:
    return route_request("chat", body, options=p.options, hash_prefix=p.needs_chain, **kw)


def idle(*names: str, **kw: object) -> list[WorkerView]:
    return [WorkerView(n, in_flight_at_scrape=0, **kw) for n in names]


def warm(p: Policy, worker: str, body: dict) -> RouteRequest:
    r = key(p, body)
    p.on_dispatch(worker, r)
    return r


# -- construction --------------------------------------------------------------------------------
def test_every_named_policy_builds_and_offers_the_hooks() -> None:
    assert set(POLICY_NAMES) == {"round_robin", "least_loaded", "prefix", "session", "kv_aware"}
    for name in POLICY_NAMES:
        p = make_policy(name, rng=random.Random(0))
        assert p.name == name
        r = key(p, chat("hi"), session_id="s")
        d = p.choose(idle("a", "b"), r)
        p.on_dispatch(d.worker.name, r)
        p.on_worker_removed("a")
        p.set_weights(Weights(prefix=1.0))
    assert isinstance(make_policy("round_robin"), RoundRobin)
    assert make_policy("kv_aware").weights == Weights(0.45, 0.25, 0.20, 0.10, 0.15)


def test_weights_and_options_reject_invalid_values() -> None:
    for bad in ({"prefix": -0.1}, {"queue": math.nan}, {"kv": math.inf}, {"tenant": "1"}):
        with pytest.raises(ValueError):
            Weights(**bad)  # type: ignore[arg-type]
    for bad_opt in ({"block_chars": 0}, {"prefill_tokens_per_s": -1.0}, {"max_blocks": True}):
        with pytest.raises(ValueError):
            RoutingOptions(**bad_opt)  # type: ignore[arg-type]


# -- building the routing key ----------------------------------------------------------------------
def test_route_request_hashes_sizes_and_scopes_the_request() -> None:
    body = chat("refund please")
    r = route_request("chat", body, namespace="t1", session_id="s1", tenant_priority=0.9)
    rendered = render_chat(body["messages"]).encode()
    covered = r.matched_tokens(len(r.chain)) * 4  # bytes the chain covers: all but < 1/16
    assert r.model == "m" and len(rendered) * 15 / 16 - 64 <= covered <= len(rendered)
    assert r.block_tokens == 16.0
    assert r.prompt_tokens == round(len(rendered) / 4)
    assert r.session_id is not None and r.session_id != "s1"  # namespaced by tenant
    assert not set(r.chain) & set(route_request("chat", body).chain)
    bare = route_request("chat", body, hash_prefix=False, session_id="s1")
    assert bare.chain == () and bare.session_id == "s1"
    ids = route_request("completion", {"model": "m", "prompt": list(range(40))})
    assert len(ids.chain) == 2 and ids.prompt_tokens == 40


def test_route_request_puts_every_value_in_its_named_field() -> None:
    # route_request builds the RouteRequest positionally (for speed): a reordered field would
    # silently swap values, so compare with a keyword-built one.
    opts = RoutingOptions()
    body = chat("x" * 30_000)
    r = route_request(
        "chat", body, namespace="t", session_id="s", tenant_priority=0.7, request_id="rid"
    )
    k = text_key(
        "chat",
        body,
        model="m",
        namespace="t",
        max_blocks=opts.max_blocks,
        tail_ratio=opts.tail_ratio,
        tail_blocks=opts.tail_blocks,
    )
    assert k.tail_ends and len(k.chain) > k.dense_blocks  # a tail, so every field is distinct
    assert r == RouteRequest(
        model="m",
        request_id="rid",
        tenant_priority=0.7,
        chain=tuple(k.chain),
        block_tokens=k.block_tokens,
        prompt_tokens=round(k.prompt_tokens),
        session_id="1:t\x00s",  # length-prefixed scope (scoped_session_id)
        dense_blocks=k.dense_blocks,
        tail_ends=k.tail_ends,
        block_chain=(),
    )


def test_session_id_from_header_then_user_then_prompt_cache_key() -> None:
    assert session_id_from({"x-session-id": "h"}, {"user": "u"}) == "h"
    assert session_id_from({}, {"user": "u", "prompt_cache_key": "k"}) == "u"
    assert session_id_from({}, {"prompt_cache_key": "k"}) == "k"
    assert session_id_from({"X-Conv": "c"}, {}, header="X-Conv") == "c"
    assert session_id_from({}, {"user": 7}) is None and session_id_from({}, {}) is None
    long = session_id_from({}, {"user": "x" * 10_000})
    assert long is not None and len(long) < 64
    assert long == session_id_from({}, {"user": "x" * 10_000})


# -- kv_aware ----------------------------------------------------------------------------------------
def test_kv_aware_sends_a_hit_to_its_holder_when_loads_are_equal() -> None:
    p = KVAware(rng=random.Random(0))
    warm(p, "b", chat("earlier question"))
    d = p.choose(idle("a", "b", "c"), key(p, chat("new question")))
    assert d.worker.name == "b" and d.reason == "affinity"
    a, b = (render_chat(chat(q)["messages"]).encode() for q in ("earlier question", "new question"))
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    matched = key(p, chat("new question")).matched_tokens(d.matched_blocks) * 4
    assert shared * 15 / 16 - 64 <= matched <= shared
    assert 0.9 < d.scores["prefix"] <= 1.0
    assert d.prefill_tokens < 30  # only the new question is left to prefill


# The yield mechanism at the break-even slack (the default keeps affinity longer).
TIGHT_SLACK = RoutingOptions(affinity_slack=1.0)


def test_kv_aware_leaves_an_overloaded_holder_for_an_idle_worker() -> None:
    p = KVAware(options=TIGHT_SLACK, rng=random.Random(0))
    warm(p, "b", chat("earlier question"))
    views = [
        *idle("a", "c"),
        WorkerView("b", running=4, waiting=5, in_flight=9, in_flight_at_scrape=9),
    ]
    d = p.choose(views, key(p, chat("new question")))
    assert d.worker.name in ("a", "c") and d.reason == "load_fallback"
    assert d.scores["prefix"] == 0.0


def test_a_hot_prefix_spreads_over_the_fleet_instead_of_piling_onto_its_holder() -> None:
    """A burst sharing one long system prompt, nothing finishing: SGLang sent 400/400 to one."""
    in_flight: dict[str, Counter[str]] = {}
    for name in ("kv_aware", "prefix"):
        p = make_policy(name, rng=random.Random(1))
        sent: Counter[str] = Counter()
        for i in range(40):
            views = [WorkerView(w, in_flight=sent[w], in_flight_at_scrape=0) for w in "abcd"]
            r = key(p, chat(f"question number {i}"))
            d = p.choose(views, r)
            p.on_dispatch(d.worker.name, r)
            sent[d.worker.name] += 1
        in_flight[name] = sent
    assert max(in_flight["kv_aware"].values()) <= 20  # no worker above 50%
    assert len(in_flight["kv_aware"]) == 4
    # The affinity-only baseline piles up until its load guard (32 above the least loaded).
    assert max(in_flight["prefix"].values()) == 33 and len(in_flight["prefix"]) > 1


def test_the_prefix_is_replicated_so_later_hits_find_several_holders() -> None:
    p = KVAware(options=TIGHT_SLACK, rng=random.Random(2))
    sent: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    for i in range(24):
        views = [WorkerView(w, in_flight=sent[w], in_flight_at_scrape=0) for w in "abcd"]
        r = key(p, chat(f"q{i}"))
        d = p.choose(views, r)
        p.on_dispatch(d.worker.name, r)
        sent[d.worker.name] += 1
        reasons[d.reason] += 1
    holders = p.state.index.match(key(p, chat("anything")).chain)
    assert set(holders) == set("abcd")
    assert reasons["affinity"] > reasons["load_fallback"] > 0


def test_ties_are_spread_at_random_not_by_position() -> None:
    p = KVAware(rng=random.Random(7))
    views = idle("a", "b", "c", "d")
    picks = Counter(p.choose(views, RouteRequest("m")).worker.name for _ in range(400))
    assert set(picks) == set("abcd") and min(picks.values()) > 60
    assert p.choose(views, RouteRequest("m")).reason == "load"


def test_saturated_workers_are_excluded_while_any_worker_has_room() -> None:
    p = KVAware(rng=random.Random(0))
    warm(p, "busy", chat("x"))
    views = [
        WorkerView("full", kv_usage=0.95, in_flight_at_scrape=0),  # KV nearly full, holds nothing
        WorkerView("busy", waiting=9, in_flight_at_scrape=0),  # long queue, holds the prefix
        WorkerView("cold", kv_usage=0.7, running=20, in_flight_at_scrape=0),
    ]
    for _ in range(20):
        d = p.choose(views, key(p, chat("y")))
        assert d.worker.name == "cold" and not d.saturated and d.reason == "load_fallback"
    all_full = [views[0], views[1], WorkerView("cold", kv_usage=0.99, in_flight_at_scrape=0)]
    d = p.choose(all_full, key(p, chat("y")))
    assert d.saturated and d.worker.name in ("full", "busy")


def test_a_holder_saturated_on_kv_only_keeps_its_prefix() -> None:
    # The request adds only its uncached tail to the holder's KV; a cold worker would have to
    # prefill (and store) the whole prompt.
    p = KVAware(rng=random.Random(0))
    warm(p, "hot", chat("x"))
    views = [
        WorkerView("hot", kv_usage=0.95, in_flight_at_scrape=0),
        WorkerView("cold", kv_usage=0.5, in_flight_at_scrape=0),
    ]
    for _ in range(20):
        d = p.choose(views, key(p, chat("y")))
        assert d.worker.name == "hot" and d.reason == "affinity" and not d.saturated
    # The same holder with a long queue is left out while another worker has room.
    queued = [WorkerView("hot", kv_usage=0.95, waiting=9, in_flight_at_scrape=0), views[1]]
    d = p.choose(queued, key(p, chat("y")))
    assert d.worker.name == "cold" and d.reason == "load_fallback"


# 4,096 blocks of 16 tokens (65k tokens of KV), as weka-agentic's small-cache cell.
_CAP: dict[str, Any] = {"num_blocks": 4096, "block_size": 16, "in_flight_at_scrape": 0}


def _hot_and_cold(**hot: Any) -> tuple[KVAware, list[WorkerView]]:
    """A session ("s") whose prompt "hot" holds, beside an empty worker "cold"."""
    p = KVAware(rng=random.Random(0))
    p.on_dispatch("hot", key(p, chat("x"), session_id="s"))
    return p, [WorkerView("hot", **hot, **_CAP), WorkerView("cold", **_CAP)]


def test_a_full_holder_without_room_for_the_tail_yields_to_a_worker_with_room() -> None:
    # 4,096 blocks of 16 tokens; the holder's running requests fill 95% of them. A ~60-token tail
    # fits beside them, a ~3,000-token one does not: that request would wait there for a running
    # decode to end (no queue shows it), however long it takes, while the empty worker starts it.
    p, views = _hot_and_cold(kv_usage=0.95, running=2)
    short = p.choose(views, key(p, chat("y" * 240), session_id="s"))
    assert short.worker.name == "hot" and short.reason == "affinity"
    long = p.choose(views, key(p, chat("y" * 12_000), session_id="s"))
    assert long.worker.name == "cold" and long.reason == "load_fallback"
    assert long.scores["session"] == 0.0
    # When no other worker could take the whole prompt beside its live sessions, waiting on the
    # holder is still the better bet: it keeps its prefix.
    other = key(p, chat("other tenant " * 4_000), session_id="t")  # ~13k tokens, live at "cold"
    p.on_dispatch("cold", other)
    crowded = [views[0], WorkerView("cold", kv_usage=0.85, running=4, **_CAP)]
    d = p.choose(crowded, key(p, chat("y" * 12_000), session_id="s"))
    assert d.worker.name == "hot" and d.reason == "affinity"


def test_a_full_holder_keeps_a_tail_that_fits_and_yields_once_requests_queue_there() -> None:
    # An agent's turns share one long context, and its parallel calls all run on its holder, so
    # the holder's KV is nearly full of that context. A turn whose tail still fits beside them
    # starts there at once (sent elsewhere, it prefilled the whole context on a cold worker:
    # weka-agentic on 8 x 4,096 blocks lost 2 points of hit rate that way).
    p, views = _hot_and_cold(kv_usage=0.975, running=8)
    # ~650 tokens (1% of the cache) beyond what the holder has: 98.5% full with it.
    fits = p.choose(views, key(p, chat("y" * 2_600), session_id="s"))
    assert fits.worker.name == "hot" and fits.reason == "affinity"
    # A request already waiting there means vLLM found no blocks for it: the next one would
    # wait behind it for a running decode to end, while the empty worker starts it now.
    queued = [WorkerView("hot", kv_usage=0.975, running=8, waiting=1, **_CAP), views[1]]
    d = p.choose(queued, key(p, chat("y" * 2_600), session_id="s"))
    assert d.worker.name == "cold" and d.reason == "load_fallback"


def test_tenant_priority_buys_a_shorter_queue_at_the_cost_of_kv_headroom() -> None:
    p = KVAware(rng=random.Random(0))
    views = [
        WorkerView("short-queue", kv_usage=0.6, in_flight_at_scrape=0),
        WorkerView("headroom", kv_usage=0.3, waiting=2, in_flight=2, in_flight_at_scrape=2),
    ]
    picks = {
        prio: p.choose(views, RouteRequest("m", tenant_priority=prio)).worker.name
        for prio in (0.0, 0.2, 0.8, 1.0)
    }
    assert picks == {0.0: "headroom", 0.2: "headroom", 0.8: "short-queue", 1.0: "short-queue"}


def test_session_bonus_keeps_a_conversation_on_its_worker_but_yields_to_overload() -> None:
    p = KVAware(rng=random.Random(0))
    r = RouteRequest("m", session_id="conv-1")
    p.on_dispatch("b", r)
    for _ in range(10):
        d = p.choose(idle("a", "b", "c"), r)
        assert d.worker.name == "b" and d.reason == "session" and d.scores["session"] == 1.0
    slightly = [*idle("a", "c"), WorkerView("b", running=20, in_flight=20, in_flight_at_scrape=20)]
    assert p.choose(slightly, r).worker.name == "b"  # 40 ms extra wait: still worth it
    overloaded = [*idle("a", "c"), WorkerView("b", waiting=6, in_flight=6, in_flight_at_scrape=6)]
    d = p.choose(overloaded, r)
    assert d.worker.name in ("a", "c") and d.scores["session"] == 0.0
    gone = p.choose(idle("a", "c"), r)  # the worker left: no error, no pin
    assert gone.worker.name in ("a", "c")


def test_a_long_agent_session_stays_put_through_a_queue_a_short_chat_would_avoid() -> None:
    """The session worker is credited with its last turn's prompt: 60k tokens of cache are worth
    a second of queueing (they take ~4 s to prefill); a 300-token chat's are not."""
    p = KVAware(rng=random.Random(0))
    # ~1 s of queue on b: 16k tokens of prompts waiting to prefill
    b = WorkerView("b", waiting=4, in_flight=4, in_flight_at_scrape=4, prefill_tokens=16_000)
    busy_b = [*idle("a", "c"), b]
    for tokens, expected in ((60_000, {"b"}), (300, {"a", "c"})):
        p.on_dispatch("b", RouteRequest("m", prompt_tokens=tokens - 200, session_id=f"s{tokens}"))
        r = RouteRequest("m", prompt_tokens=tokens, session_id=f"s{tokens}")
        d = p.choose(busy_b, r)
        assert d.worker.name in expected
        if tokens == 60_000:
            assert d.reason == "session" and d.prefill_tokens == 200
            assert d.scores["prefix"] == pytest.approx((tokens - 200) / tokens)


@pytest.mark.parametrize(
    ("policy", "moved"), [(KVAware, "load_fallback"), (PrefixAffinity, "balance")]
)
def test_new_sessions_spread_off_a_preamble_holder_that_carries_many_contexts(
    policy: type[KVAware | PrefixAffinity], moved: str
) -> None:
    """The agentic pile-up: every new session matches the shared system prompt on ``a`` only;
    counted as a plain cache hit, all of them would go there and grow there. With the sessions
    already pinned to ``a`` weighed, new ones go to the other workers (``moved``: a hit was
    there, and was not taken), while a session already living on ``a`` stays. kv_aware weighs the
    commitment in its score, prefix leaves such a holder out of its guard."""
    now = [0.0]
    views = [WorkerView("a", running=2, in_flight=2, in_flight_at_scrape=2), *idle("b", "c")]
    for slack, spread in ((4.0, True), (0.0, False)):
        p = policy(rng=random.Random(0), clock=lambda: now[0])
        p.set_options(RoutingOptions(commitment_slack=slack))
        for i in range(6):  # six long sessions live on a, each 60k tokens so far
            r = key(p, chat(f"task {i}"), session_id=f"old{i}")
            p.on_dispatch("a", dataclasses.replace(r, prompt_tokens=60_000))
        new = [
            p.choose(views, key(p, chat(f"new task {i}"), session_id=f"new{i}")) for i in range(8)
        ]
        if spread:
            assert {d.worker.name for d in new} <= {"b", "c"}
            assert {d.reason for d in new} == {moved}
        else:
            assert {(d.worker.name, d.reason) for d in new} == {("a", "affinity")}
        cont = p.choose(views, key(p, chat("task 0 continued"), session_id="old0"))
        assert cont.worker.name == "a"
    now[0] = 61.0  # past session_active_s: nothing is committed any more, the hit counts again
    assert p.choose(views, key(p, chat("late"), session_id="late")).worker.name == "a"


def test_commitment_yield_fades_past_the_ratio_and_the_slack() -> None:
    assert commitment_yield(0, 0, 1_000, 4.0, 2.0) == 1.0
    assert commitment_yield(3_000, 2_000, 1_000, 4.0, 2.0) == 1.0  # within 2x the floor
    assert commitment_yield(2_000, 0, 1_000, 4.0, 2.0) == pytest.approx(0.5)
    assert commitment_yield(9_000, 0, 1_000, 4.0, 2.0) == 0.0
    assert commitment_yield(9_000, 0, 1_000, 0.0, 2.0) == 1.0  # off


def test_set_weights_applies_to_the_next_decision_and_keeps_the_learned_index() -> None:
    p = KVAware(rng=random.Random(0))
    warm(p, "b", chat("earlier"))
    size = p.state.index.size("b")
    views = [
        WorkerView("a", in_flight_at_scrape=0),
        WorkerView("b", running=10, in_flight=10, in_flight_at_scrape=10),
    ]
    r = key(p, chat("now"))
    assert p.choose(views, r).worker.name == "b"
    p.set_weights(Weights(prefix=0.0, queue=1.0, kv=0.0, tenant=0.0, session=0.0))
    assert p.choose(views, r).worker.name == "a"
    assert p.state.index.size("b") == size
    swapped = make_policy("prefix", state=p.state)  # a policy switch keeps it too
    assert swapped.choose(views, r).worker.name == "b"


def test_changing_the_block_size_resets_the_index_other_options_do_not() -> None:
    p = KVAware()
    warm(p, "a", chat("x"))
    p.set_options(RoutingOptions(saturation_waiting=4))
    assert p.state.index.size("a") > 0
    p.set_options(RoutingOptions(block_chars=128))
    assert p.state.index.size("a") == 0


def test_worker_removal_forgets_its_blocks_and_sessions() -> None:
    p = KVAware(rng=random.Random(0))
    r = key(p, chat("x"), session_id="s")
    p.on_dispatch("a", r)
    p.on_worker_removed("a")
    assert p.state.index.match(r.chain) == {} and len(p.state.sessions) == 0


def test_a_replaced_view_is_scored_afresh_and_the_per_worker_memo_stays_bounded() -> None:
    # kv_aware memoises each worker's load per view; a new view of the same worker (its load
    # moved) must be scored on its own numbers, however often views are replaced.
    p = KVAware(rng=random.Random(0))
    views = idle("a", "b")
    assert p.choose(views, RouteRequest("m")).worker.name in ("a", "b")
    busy = WorkerView("a", running=30, waiting=6, in_flight=36, in_flight_at_scrape=36)
    for i in range(200):
        views = [busy if i % 2 else WorkerView("a", in_flight_at_scrape=0), views[1]]
        views[1] = WorkerView("b", running=20, in_flight=20, in_flight_at_scrape=20)
        want = "b" if i % 2 else "a"
        assert p.choose(views, RouteRequest("m")).worker.name == want
    assert len(p._memo) <= 2  # one entry per worker, not one per view ever seen
    p.on_worker_removed("a")
    assert "a" not in p._memo


def test_index_capacity_follows_the_workers_reported_kv_cache() -> None:
    p = KVAware(rng=random.Random(0))
    tiny = WorkerView("a", num_blocks=4, block_size=16, in_flight_at_scrape=0)  # 64 tokens
    r = key(p, chat("x"))
    d = p.choose([tiny], r)
    p.on_dispatch(d.worker.name, r)
    assert p.state.index.size("a") == 4  # 64 tokens / 16 tokens per 64-byte block
    assert p.choose([tiny], r).matched_blocks == 4


def test_large_fleets_sample_but_never_miss_holders_sessions_or_the_last_free_worker() -> None:
    p = KVAware(rng=random.Random(5))  # 64 workers > 2 * sample_size: sampled
    fleet = [WorkerView(f"w{i}", in_flight_at_scrape=0) for i in range(64)]
    warm(p, "w50", chat("x"))
    d = p.choose(fleet, key(p, chat("y")))
    assert d.worker.name == "w50" and d.reason == "affinity"
    r = RouteRequest("m", session_id="s")
    p.on_dispatch("w7", r)
    assert p.choose(fleet, r).worker.name == "w7"
    full = [WorkerView(f"w{i}", waiting=20, in_flight_at_scrape=0) for i in range(63)]
    free = [*full[:31], WorkerView("free", in_flight_at_scrape=0), *full[31:]]
    for _ in range(20):
        assert p.choose(free, RouteRequest("m")).worker.name == "free"


def test_sampled_choice_still_avoids_loaded_workers_and_spreads_ties() -> None:
    p = KVAware(rng=random.Random(9))
    fleet = [
        WorkerView(f"w{i}", running=30, waiting=4, in_flight=34, in_flight_at_scrape=34)
        if i % 2
        else WorkerView(f"w{i}", in_flight_at_scrape=0)
        for i in range(64)
    ]
    picks = Counter(p.choose(fleet, RouteRequest("m")).worker.name for _ in range(640))
    assert all(int(name[1:]) % 2 == 0 for name in picks)  # never a loaded one
    assert len(picks) == 32  # and every idle one gets a share


# -- prefix and session baselines ------------------------------------------------------------------
def test_prefix_policy_picks_the_longest_holder_and_spreads_misses_and_ties() -> None:
    p = PrefixAffinity(rng=random.Random(0))
    warm(p, "a", chat("x", system=SYSTEM[:1000]))  # shares ~1000 chars of the system prompt
    warm(p, "b", chat("x"))
    busy = [WorkerView("a"), WorkerView("b", waiting=30), WorkerView("c")]
    d = p.choose(busy, key(p, chat("y")))
    assert d.worker.name == "b" and d.reason == "affinity"  # below the guard: load is no reason
    miss = Counter(p.choose(busy, key(p, chat("y", system="other"))).reason for _ in range(30))
    assert miss == {"random": 30}
    warm(p, "c", chat("x"))
    picks = Counter(p.choose(busy, key(p, chat("y"))).worker.name for _ in range(200))
    assert set(picks) == {"b", "c"} and min(picks.values()) > 50


def test_prefix_policy_yields_a_holder_far_above_the_least_loaded() -> None:
    p = PrefixAffinity(rng=random.Random(0))
    warm(p, "b", chat("x"))
    over = [WorkerView("a", in_flight=10), WorkerView("b", in_flight=43), WorkerView("c")]
    d = p.choose(over, key(p, chat("y")))
    assert d.reason == "balance" and d.worker.name in {"a", "c"}
    # Both thresholds must be passed: 33 above a floor of 40 is less than twice it.
    near = [WorkerView("a", in_flight=40), WorkerView("b", in_flight=73)]
    assert p.choose(near, key(p, chat("y"))).worker.name == "b"


def test_one_shared_first_block_spreads_over_the_fleet_under_the_prefix_policy() -> None:
    """Every request shares its system prompt (the collapse: all to one worker, forever). With
    requests finishing at a fixed rate per worker, the guard keeps every worker busy and no
    queue far above the others."""
    p = PrefixAffinity(rng=random.Random(1))
    names = [f"w{i}" for i in range(8)]
    load = dict.fromkeys(names, 0)
    rng = random.Random(2)
    for i in range(4000):
        views = [WorkerView(n, in_flight=load[n]) for n in names]
        d = p.choose(views, key(p, chat(f"question {i} " * 5)))
        p.on_dispatch(d.worker.name, key(p, chat(f"question {i} " * 5)))
        load[d.worker.name] += 1
        for n in names:  # each worker finishes about one request per arrival / 8
            if load[n] and rng.random() < 0.13:
                load[n] -= 1
    assert min(load.values()) > 0, load
    assert max(load.values()) - min(load.values()) <= 2 * 32 + 8, load


def test_session_policy_is_sticky_until_its_worker_saturates() -> None:
    p = SessionAffinity(rng=random.Random(0))
    r = RouteRequest("m", session_id="s")
    first = p.choose([WorkerView("a", in_flight=3), WorkerView("b")], r)
    assert first.worker.name == "b" and first.reason == "least_loaded"
    p.on_dispatch("b", r)
    d = p.choose([WorkerView("a"), WorkerView("b", in_flight=5, running=5)], r)
    assert d.worker.name == "b" and d.reason == "session"
    d = p.choose([WorkerView("a"), WorkerView("b", waiting=9)], r)
    assert d.worker.name == "a" and d.reason == "load_fallback"


def test_blind_policies_ignore_the_hooks() -> None:
    for p in (RoundRobin(), LeastLoaded(random.Random(0))):
        assert not p.needs_chain and p.state is None
        p.on_dispatch("a", RouteRequest("m"))
        p.on_worker_removed("a")
        p.set_weights(Weights())
        assert p.choose(idle("a", "b"), RouteRequest("m")).scores == {}


@pytest.mark.parametrize("name", ["kv_aware", "prefix", "session"])
def test_a_dispatch_the_worker_refused_teaches_the_policy_nothing(name: str) -> None:
    # A turn whose prompt the worker rejects (over the model's context, say) must not credit
    # that worker with the prompt, pin the session there or reach the other replicas.
    p = make_policy(name, rng=random.Random(0))
    p.state.journal = journal = Journal()
    turn1 = key(p, chat("turn 1"), session_id="s")
    p.on_dispatch("a", turn1)
    huge = key(p, chat("turn 1 " + "and a pasted log line " * 4000), session_id="s")
    receipt = p.on_dispatch("b", huge)
    if p.needs_chain:
        assert p.state.index.match(huge.chain).get("b") == len(huge.chain)
    p.on_refused("b", huge, receipt)
    now = time.monotonic()
    if p.needs_chain:
        assert "b" not in p.state.index.match(huge.chain)
        assert p.state.index.match(turn1.chain)["a"] == len(turn1.chain)
    assert p.state.sessions.get("s", now) == "a"
    assert [e.worker for e in journal.take(10)] == ["a"]
    d = p.choose(idle("a", "b"), key(p, chat("turn 2"), session_id="s"))
    assert d.worker.name == "a"
    p.on_refused("a", turn1, None)  # no receipt (a stateless caller): nothing happens
    assert p.state.sessions.get("s", now) == "a"


def test_a_holder_with_a_long_queue_of_cheap_turns_keeps_the_next_one() -> None:
    # An agent's parallel calls queue on the worker holding its context; each is mostly a cache
    # hit, so the queue's prefill is short against what moving (re-prefilling ~10k tokens on a
    # cold worker) would cost. Only a queue whose prefill outweighs the hit sends it elsewhere.
    p = make_policy("kv_aware", rng=random.Random(0))
    body = chat("next tool call", system=SYSTEM * 10)  # ~10k tokens
    warm(p, "a", body)

    def queued(prefill_tokens: int) -> list[WorkerView]:
        a = WorkerView(
            "a", in_flight=12, running=2, waiting=10, in_flight_at_scrape=12,
            prefill_tokens=prefill_tokens,
        )  # fmt: skip
        return [a, *idle("b", "c")]

    stay = p.choose(queued(3_000), key(p, body))
    assert stay.worker.name == "a" and stay.reason == "affinity"
    moved = p.choose(queued(100_000), key(p, body))
    assert moved.worker.name != "a" and moved.reason == "load_fallback"
