"""KV-aware routing end to end: 4 simulated workers, real sockets, real engine prefix caches."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from pathlib import Path

import httpx

from gateway.config import load_settings
from tests.gateway.conftest import MODEL, run_gateway, settings_for, until

rng = random.Random(1234)
WORDS = ["alpha", "beta", "gamma", "delta", "kernel", "cache", "block", "prefix", "route"]


def system_prompt(group: int, chars: int = 6000) -> str:
    r = random.Random(group)
    return f"[group {group}] " + " ".join(r.choice(WORDS) for _ in range(chars // 6))


def chat(group: int, i: int) -> dict:
    return {
        "model": MODEL,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [
            {"role": "system", "content": system_prompt(group)},
            {"role": "user", "content": f"question {i}: {rng.random()}"},
        ],
    }


async def send_all(url: str, bodies: list[dict], concurrency: int = 4) -> list[tuple[str, int]]:
    """(worker, cached_tokens) per request, in order; every request must succeed."""
    sem = asyncio.Semaphore(concurrency)
    out: list[tuple[str, int]] = [("", 0)] * len(bodies)

    async def one(i: int, c: httpx.AsyncClient) -> None:
        async with sem:
            r = await c.post(url + "/v1/chat/completions", json=bodies[i])
            assert r.status_code == 200, r.text
            usage_line = [e for e in r.text.split("\n\n") if '"usage"' in e][-1]
            cached = int(usage_line.split('"cached_tokens":')[1].split("}")[0].split(",")[0])
            out[i] = (r.headers["x-kvgate-worker"], cached)

    async with httpx.AsyncClient(timeout=60) as c:
        await asyncio.gather(*(one(i, c) for i in range(len(bodies))))
    return out


GROUPS = 8


def workload() -> list[dict]:
    # 8 apps (system prompts) x 6 users in a seeded random order: the shape of several apps
    # sharing a fleet whose KV caches each hold about two of the prompts.
    order = [(g, i) for g in range(GROUPS) for i in range(6)]
    random.Random(7).shuffle(order)
    return [chat(g, i) for g, i in order]


async def test_shared_prefixes_concentrate_while_load_spreads_and_beat_round_robin(sims) -> None:  # type: ignore[no-untyped-def]
    bodies = workload()
    results = {}
    for policy in ("kv_aware", "round_robin"):
        fleet = sims(4, "--num-blocks", "320")  # fresh, small caches for each policy
        async with run_gateway(settings_for(fleet.urls, routing={"policy": policy})) as g:
            await g.wait_healthy(4)
            results[policy] = await send_all(g.url, bodies)
        fleet.kill()
    kv = results["kv_aware"]
    per_worker = Counter(w for w, _ in kv)
    assert max(per_worker.values()) <= len(kv) * 0.5, per_worker
    assert len(per_worker) >= 3, per_worker  # load spread over the fleet
    for g in range(GROUPS):
        group = Counter(w for (w, _), b in zip(kv, bodies, strict=True) if f"[group {g}]" in str(b))
        top2 = sum(n for _, n in group.most_common(2))
        assert top2 >= 0.8 * sum(group.values()), (g, group)  # each prefix lives on few workers
    cached_kv = sum(c for _, c in kv)
    cached_rr = sum(c for _, c in results["round_robin"])
    assert cached_kv >= 2 * cached_rr, (cached_kv, cached_rr)


def write_config(path: Path, urls: list[str], weights: str) -> None:
    workers = "".join(f'[[workers]]\nname = "w{i}"\nurl = "{u}"\n' for i, u in enumerate(urls))
    path.write_text(
        '[logging]\nlevel = "warning"\n[probes]\ninterval_s = 0.2\n'
        f'[routing]\npolicy = "kv_aware"\n[routing.weights]\n{weights}\n{workers}'
    )


STICKY = "prefix = 1.0\nqueue = 0.0\nkv = 0.0\ntenant = 0.0\nsession = 0.0\n"
BLIND = "prefix = 0.0\nqueue = 0.0\nkv = 0.0\ntenant = 0.0\nsession = 0.0\n"


async def test_weight_edits_apply_live_and_invalid_edits_change_nothing(
    sims, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    fleet = sims(4)
    cfg = tmp_path / "kvgate.toml"
    write_config(cfg, fleet.urls, STICKY)
    same = {**chat(7, 0), "stream": False}
    same.pop("stream_options")
    failures: list[int] = []
    stop = asyncio.Event()

    async def background(url: str) -> None:
        async with httpx.AsyncClient(timeout=30) as c:
            while not stop.is_set():
                r = await c.post(
                    url + "/v1/chat/completions",
                    json={**chat(9, 0), "stream": False, "stream_options": None}
                    | {"stream_options": None},
                )
                if r.status_code != 200:
                    failures.append(r.status_code)

    async def workers_for(url: str, n: int = 16) -> set[str]:
        async with httpx.AsyncClient(timeout=30) as c:
            rs = [await c.post(url + "/v1/chat/completions", json=same) for _ in range(n)]
        assert all(r.status_code == 200 for r in rs)
        return {r.headers["x-kvgate-worker"] for r in rs}

    async with run_gateway(load_settings(cfg), cfg) as g:
        await g.wait_healthy(4)
        bg = asyncio.create_task(background(g.url))
        assert len(await workers_for(g.url)) == 1  # pure affinity: one holder
        write_config(cfg, fleet.urls, BLIND)
        await until(lambda: g.gw.settings.routing.weights.prefix == 0.0, 10, "reload applied")
        assert len(await workers_for(g.url)) > 1  # blind scorer: random spread
        m = await g.metrics()
        assert m["kvgate_config_reloads_total"] == 1
        # An invalid edit (negative weight) is rejected whole: still the blind weights.
        write_config(cfg, fleet.urls, BLIND.replace("queue = 0.0", "queue = -1"))
        errors = "kvgate_config_reload_errors_total"
        await until(lambda: g.gw.metrics.registry.get_sample_value(errors) == 1, 10, "refused")
        m = await g.metrics()
        assert m["kvgate_config_reload_errors_total"] == 1
        assert g.gw.settings.routing.weights.queue == 0.0
        assert len(await workers_for(g.url)) > 1
        stop.set()
        await bg
    assert failures == []


async def test_canary_split_sends_its_share_to_the_labelled_pool(sims) -> None:  # type: ignore[no-untyped-def]
    fleet = sims(4)
    settings = settings_for(
        fleet.urls,
        routing={"splits": [{"model": MODEL, "labels": {"pool": "canary"}, "share": 0.10}]},
    )
    data = settings.model_dump()
    data["workers"][3]["labels"] = {"pool": "canary"}
    from gateway.config import Settings

    settings = Settings(**data)
    # Streams: the per-pool TTFT histogram counts them (a whole response has no first token).
    body = {
        "model": MODEL,
        "max_tokens": 1,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
    async with run_gateway(settings) as g:
        await g.wait_healthy(4)
        sem = asyncio.Semaphore(16)
        counts: Counter[str] = Counter()

        async def one(c: httpx.AsyncClient) -> None:
            async with sem:
                r = await c.post(g.url + "/v1/chat/completions", json=body)
                assert r.status_code == 200
                counts[r.headers["x-kvgate-worker"]] += 1

        async with httpx.AsyncClient(timeout=30) as c:
            await asyncio.gather(*(one(c) for _ in range(1000)))
        m = await g.metrics()
    assert 70 <= counts["w3"] <= 130, counts
    assert sum(counts.values()) == 1000
    assert (
        m[f'kvgate_time_to_first_token_seconds_count{{model="{MODEL}",pool="canary"}}']
        == counts["w3"]
    )


async def test_a_prompt_the_worker_refuses_leaves_no_routing_state(sims) -> None:  # type: ignore[no-untyped-def]
    # The worker answers a prompt over its context with vLLM's 400; the client gets it, and the
    # policy learned nothing from the attempt: no index entries, no session pin, no commitment.
    fleet = sims(2, "--max-model-len", "1024")
    async with run_gateway(settings_for(fleet.urls)) as g:
        await g.wait_healthy(2)
        state = g.gw.policy.state
        assert state is not None
        huge = chat(3, 0)  # ~6,000 characters of system prompt: ~1,500 tokens
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(
                g.url + "/v1/chat/completions", json=huge, headers={"x-session-id": "s1"}
            )
        assert r.status_code == 400, r.text
        assert "maximum context length" in r.json()["error"]["message"]
        assert [state.index.size(f"w{i}") for i in range(2)] == [0, 0]
        assert state.sessions.get("s1", time.monotonic()) is None
        assert state.sessions.committed(time.monotonic()) == {}
        small = {**huge, "messages": [{"role": "user", "content": "hello"}]}
        async with httpx.AsyncClient(timeout=30) as c:
            ok = await c.post(
                g.url + "/v1/chat/completions", json=small, headers={"x-session-id": "s1"}
            )
        assert ok.status_code == 200
        assert state.sessions.get("s1", time.monotonic()) == ok.headers["x-kvgate-worker"]
