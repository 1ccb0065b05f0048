"""Routing-core review findings, each reproduced as it was found (the test fails on the code
before the fix):

- a session back after `session_active_s` (still within its TTL) had its expired last turn
  subtracted from its worker's commitment anyway: the least committed figure went negative and
  every other holder lost its cache credit (kv_aware) or was left out (prefix);
- the prefix policy's two guards could leave no candidate (an IndexError, a 500);
- a reload that changed the index's capacities neither evicted nor restated `fill`;
- a refused dispatch cut a concurrent same-prefix dispatch's pending KV-event keys.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

import pytest

from scoring.kv_aware import KVAware
from scoring.policy import PrefixAffinity, make_policy
from scoring.precise import PreciseIndex
from scoring.prefix import block_keys
from scoring.route_key import route_request
from scoring.state import RoutingState
from scoring.views import RouteRequest, RoutingOptions, WorkerView

SYSTEM = "You are the support assistant of ACME. Follow the policy below exactly. " * 60


def chat(user: str, system: str = SYSTEM) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }


def keyer(p: Any) -> Callable[..., RouteRequest]:
    def key(body: dict[str, Any], **kw: Any) -> RouteRequest:
        return route_request("chat", body, options=p.options, hash_prefix=True, **kw)

    return key


@pytest.mark.parametrize("policy", [KVAware, PrefixAffinity])
def test_a_returning_sessions_expired_turn_takes_no_holders_credit(policy: Any) -> None:
    now = [0.0]
    p = policy(rng=random.Random(0), clock=lambda: now[0])
    key = keyer(p)
    # Session S's last turn (20k tokens, another prompt) went to c at t=0.
    r = key(chat("hello", system="Another assistant entirely. " * 50), session_id="S")
    p.on_dispatch("c", dataclasses.replace(r, prompt_tokens=20_000))
    now[0] = 100.0  # past session_active_s (60 s): out of c's commitment; within the TTL
    assert p.state.sessions.committed(now[0]).get("c", 0) == 0
    assert p.state.sessions.lookup("S", now[0]) == ("c", 20_000)
    # a holds the shared preamble; b carries a small active session.
    p.on_dispatch("a", key(chat("warm-up")))
    t = key(chat("x", system="zzz " * 40), session_id="T")
    p.on_dispatch("b", dataclasses.replace(t, prompt_tokens=100))
    assert p.state.sessions.committed(now[0]) == {"b": 100}
    views = [WorkerView(n, in_flight_at_scrape=0) for n in ("a", "b", "c")]
    d = p.choose(views, key(chat("next turn of S"), session_id="S"))
    # a carries no commitment at all: nothing may take its hit away.
    assert d.worker.name == "a" and d.reason == "affinity", (d.worker.name, d.reason, d.scores)


def test_the_prefix_policy_always_returns_a_worker() -> None:
    now = [0.0]
    p = PrefixAffinity(rng=random.Random(0), clock=lambda: now[0])
    key = keyer(p)
    for i in range(6):  # six long agent sessions live on a; their requests are done
        r = key(chat(f"task {i}"), session_id=f"old{i}")
        p.on_dispatch("a", dataclasses.replace(r, prompt_tokens=60_000))
    views = [
        WorkerView("a", in_flight_at_scrape=0),  # idle holder, left out for its commitment
        WorkerView("b", in_flight=100, running=100, in_flight_at_scrape=100),  # over the limit
    ]
    d = p.choose(views, key(chat("a new session"), session_id="new"))
    assert d.worker.name == "a"  # the least loaded, as with no guard


def test_a_reload_that_shrinks_capacity_evicts_and_restates_fill() -> None:
    st = RoutingState(RoutingOptions(default_capacity_blocks=1_000, max_capacity_blocks=1_000))
    st.index.record("a", list(range(1, 801)))
    assert st.index.fill["a"] == 0.8
    st.configure(RoutingOptions(default_capacity_blocks=1_000, max_capacity_blocks=400))
    assert st.index.size("a") <= st.index.capacity("a") == 400
    assert st.index.fill["a"] == 1.0


def test_a_reload_that_grows_capacity_restates_fill() -> None:
    st = RoutingState(RoutingOptions(default_capacity_blocks=1_000, max_capacity_blocks=4_000))
    st.index.record("a", list(range(1, 1_001)))
    assert st.index.fill["a"] == 1.0
    st.configure(RoutingOptions(default_capacity_blocks=2_000, max_capacity_blocks=4_000))
    assert st.index.fill["a"] == st.index.size("a") / st.index.capacity("a") == 0.5


def test_a_refused_dispatch_keeps_a_concurrent_dispatchs_pending_keys() -> None:
    # Two calls of one prefix to worker a, the second still queued for its prefill when the
    # first is refused: the refusal had cut the shared pending keys to settle_s (1 s), so the
    # prefix looked cold on a while the second call was about to compute it.
    t = [100.0]
    idx = PreciseIndex(pending_ttl_s=300.0, settle_s=1.0)
    opts = RoutingOptions(token_block_size=16, block_chars=16, chars_per_token=1.0)
    p = make_policy("kv_aware", options=opts, state=RoutingState(opts, idx), clock=lambda: t[0])
    idx.set_live("a", True, t[0])
    keys = tuple(block_keys(list(range(64 * 16)), 16, "m", "", 1_000))
    req = RouteRequest(
        model="m", chain=keys[:8], block_tokens=16.0, prompt_tokens=64 * 16, block_chain=keys
    )
    first = p.on_dispatch("a", req)
    t[0] = 100.5
    second = p.on_dispatch("a", req)
    t[0] = 101.0
    p.on_refused("a", req, first)
    t[0] = 105.0
    assert idx.match(keys, t[0]) == {"a": 64}  # the second call's pending stands
    p.on_prefill_done("a", req)  # ... until its own prefill is over (then settle_s)
    t[0] = 106.5
    assert idx.match(keys, t[0]) == {}
    assert second is not None
