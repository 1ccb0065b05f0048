"""Routing decisions pinned on seeded synthetic traces: speed work must not change a decision.

The hot path of ``kv_aware`` (render, hash, match, sample, scan) is tuned for microseconds, and a
tuning slip (a reordered pool, a tie list built in another order, a float summed differently, a
memo serving a stale view) changes *which* worker wins only now and then, which no behavioural test
would notice. These traces exercise every branch that decides: sampled and full fleets, holders
and misses, tails past the dense head, sessions, saturated workers (queue and KV), ties broken at
random, views replaced as load moves, workers leaving and coming back. The expected sequences were
recorded with the scorer as it stood before the hot-path speed work (commit 3364923) and every
decision since must reproduce them exactly, scores included (a SHA-256 over their ``repr``).

If a change is *meant* to change decisions, regenerate with ``python -m tests.scoring.
test_pinned_decisions`` and say why in the commit; ``bench simulate`` should show the change pays.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import string
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from scoring.policy import make_policy
from scoring.route_key import route_request
from scoring.views import WorkerView

FIXTURE = Path(__file__).with_name("pinned_decisions.json")

# (fleet size, seed, decisions): 8 scores every worker, 64 and 200 sample (fleets > 32).
SCENARIOS = {"fleet8": (8, 1, 300), "fleet64": (64, 2, 400), "fleet200": (200, 3, 300)}


def _words(rng: random.Random, n: int) -> str:
    vocab = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 8))) for _ in range(300)]
    out: list[str] = []
    size = 0
    while size < n:
        w = rng.choice(vocab)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n]


def _view(rng: random.Random, name: str) -> WorkerView:
    kind = rng.random()
    if kind < 0.3:  # idle and identical: ties broken at random
        return WorkerView(name, block_size=16, num_blocks=1_000, in_flight_at_scrape=0)
    if kind < 0.4:  # saturated by its queue
        return WorkerView(
            name, running=40, waiting=9, in_flight=40, in_flight_at_scrape=40, kv_usage=0.5
        )
    if kind < 0.5:  # one prompt from saturated on KV
        return WorkerView(
            name,
            running=8,
            in_flight=8,
            in_flight_at_scrape=8,
            kv_usage=0.86,
            block_size=16,
            num_blocks=4_000,
        )
    running = rng.randint(0, 30)
    return WorkerView(
        name,
        in_flight=running + rng.randint(0, 3),
        running=running,
        waiting=rng.choice([0, 0, 1, 3]),
        kv_usage=rng.uniform(0.0, 0.88),
        block_size=16,
        num_blocks=rng.choice([400, 2_000, 60_000]),
        weight=rng.choice([1.0, 1.0, 2.0]),
        in_flight_at_scrape=running,
        prefill_tokens=rng.randint(0, 3_000),
    )


def _scraped(v: WorkerView) -> WorkerView:
    cap = (v.num_blocks or 0) * (v.block_size or 0)
    kv = v.kv_usage + (v.sent_tokens_since_scrape / cap if cap else 0.0)
    return replace(
        v,
        kv_usage=min(0.97, kv),
        running=v.in_flight,
        waiting=0,
        in_flight_at_scrape=v.in_flight,
        sent_tokens_since_scrape=0,
    )


@functools.cache  # each trace is replayed once per test session
def decisions(workers: int, seed: int, n: int) -> list[tuple[Any, ...]]:
    """``n`` kv_aware decisions on a seeded trace: (worker, reason, matched, prefill, score...)."""
    rng = random.Random(seed)
    now = [0.0]
    policy = make_policy("kv_aware", rng=random.Random(seed), clock=lambda: now[0])
    opts = policy.options
    views = [_view(rng, f"w{i}") for i in range(workers)]
    # System prompts from ~300 chars (inside the dense head) to ~20k (deep into the tail).
    systems = [_words(rng, rng.choice([300, 2_000, 6_000, 20_000])) for _ in range(6)]
    convs: dict[str, list[dict[str, str]]] = {}
    out: list[tuple[Any, ...]] = []
    for i in range(n):
        now[0] += rng.uniform(0.0, 2.0)
        sid = f"s{rng.randrange(12)}" if rng.random() < 0.4 else None
        if sid is not None and sid in convs and rng.random() < 0.8:  # the next turn
            msgs = convs[sid]
            msgs += [
                {"role": "assistant", "content": _words(rng, rng.randint(50, 800))},
                {"role": "user", "content": _words(rng, rng.randint(20, 400))},
            ]
        else:
            msgs = []
            if rng.random() < 0.85:
                msgs.append({"role": "system", "content": rng.choice(systems)})
            msgs.append({"role": "user", "content": _words(rng, rng.randint(20, 3_000))})
            if sid is not None:
                convs[sid] = msgs
        route = route_request(
            "chat",
            {"model": "m", "messages": msgs},
            session_id=sid,
            tenant_priority=rng.choice([0.0, 0.5, 0.5, 1.0]),
            options=opts,
        )
        if rng.random() < 0.05:  # a saturated burst: every worker over its queue
            cands = [replace(v, waiting=v.waiting + 20) for v in views]
        else:
            cands = views
        d = policy.choose(cands, route)
        s = d.scores
        out.append(
            (
                d.worker.name,
                d.reason,
                d.matched_blocks,
                d.prefill_tokens,
                d.saturated,
                d.match_source,
                *(s[k] for k in sorted(s)),
            )
        )
        policy.on_dispatch(d.worker.name, route)
        k = int(d.worker.name[1:])
        v = views[k]
        views[k] = replace(
            v,
            in_flight=v.in_flight + 1,
            prefill_tokens=v.prefill_tokens + d.prefill_tokens,
            sent_tokens_since_scrape=v.sent_tokens_since_scrape + d.prefill_tokens,
        )
        # Something finishes: often that one (short requests), else anywhere.
        j = k if rng.random() < 0.5 else rng.randrange(workers)
        views[j] = replace(views[j], in_flight=max(0, views[j].in_flight - 1), prefill_tokens=0)
        if i % 40 == 39:  # a scrape: what was sent shows in the gauges now
            views = [_scraped(v) for v in views]
        if rng.random() < 0.02:  # a worker restarts: its cache and sessions are gone
            gone = rng.randrange(workers)
            policy.on_worker_removed(f"w{gone}")
            views[gone] = _view(rng, f"w{gone}")
    return out


def _summary(rows: list[tuple[Any, ...]]) -> dict[str, str]:
    return {
        "workers": ",".join(str(r[0])[1:] for r in rows),
        "reasons": "".join(str(r[1])[0] for r in rows),
        "sha256": hashlib.sha256(repr(rows).encode()).hexdigest(),
    }


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_kv_aware_decisions_match_the_recorded_trace(scenario: str) -> None:
    want = json.loads(FIXTURE.read_text())[scenario]
    got = _summary(decisions(*SCENARIOS[scenario]))
    assert got["workers"] == want["workers"]  # readable diff first: which decision moved
    assert got["reasons"] == want["reasons"]
    assert got["sha256"] == want["sha256"]  # then everything, scores to the last bit


def test_the_traces_exercise_every_kind_of_decision() -> None:
    reasons = "".join(v["reasons"] for v in json.loads(FIXTURE.read_text()).values())
    assert set(reasons) == {"a", "s", "l"}  # affinity, session, load / load_fallback
    rows = decisions(*SCENARIOS["fleet64"])
    assert any(r[4] for r in rows)  # a saturated decision
    assert {r[1] for r in rows} >= {"affinity", "session", "load", "load_fallback"}


if __name__ == "__main__":
    FIXTURE.write_text(
        json.dumps({k: _summary(decisions(*v)) for k, v in SCENARIOS.items()}, indent=1) + "\n"
    )
