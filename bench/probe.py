"""A live capacity probe: the request rate a running fleet sustains on a trace's own requests.

`bench replay --load F` replays a trace at F x this rate. A trace's own timestamps (or a rate
guessed once) overload one fleet and leave another idle, and a replay only says something about
routing near saturation. `bench compare` owns its simulated fleet and searches its capacity
offline; `replay` targets any URL, so it measures: closed loops of the trace's requests at
concurrency 1, 2, 4, ... (each level `per_level` x its concurrency requests, at least
`min_requests`, none sent after `level_s` or 3x the previous level's mean E2E), each level's
rate by Little's law (its concurrency over its mean E2E), until doubling the concurrency adds
less than `min_gain` or errors pass `max_error_share`. The capacity is the best level's rate
(saturation throughput: 0.9 of it keeps a queue from growing without bound).

The probe's requests are copies re-scoped to other content (block ids prefixed, text prompts
marked) with the same lengths and the same sharing among themselves, so the probe does not warm
the fleet's caches for the replay that follows. Token-id prompts cannot be re-scoped and are sent
as they are (stated in the result).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.replay import ReplayOptions, replay
from bench.traces import Trace, TraceRequest

__all__ = ["ProbeLevel", "ProbeResult", "probe_capacity", "probe_requests"]


@dataclass(slots=True, frozen=True)
class ProbeLevel:
    concurrency: int
    requests: int  # sent (a level stops sending after its window)
    ok: int
    req_s: float


@dataclass(slots=True, frozen=True)
class ProbeResult:
    req_s: float  # the capacity: the best level's completed requests per second
    levels: list[ProbeLevel]
    rescoped: bool  # False when token-id prompts were sent as they are (they warm the cache)
    at_least: bool  # still growing at the concurrency bound: a lower bound (raise it)

    def to_json(self) -> dict[str, Any]:
        return {
            "capacity_req_s": round(self.req_s, 4),
            "at_least": self.at_least,
            "rescoped": self.rescoped,
            "levels": [
                {**dataclasses.asdict(lv), "req_s": round(lv.req_s, 4)} for lv in self.levels
            ],
        }


def _rescoped(r: TraceRequest, tag: str) -> TraceRequest:
    return dataclasses.replace(
        r,
        arrival_s=0.0,
        request_id=f"{tag}-{r.request_id}",
        block_ids=[f"{tag}:{b}" for b in r.block_ids],
        session_id=f"{tag}-{r.session_id}" if r.session_id else None,
        prompt=f"[{tag}] {r.prompt}" if r.prompt is not None else None,
    )


def probe_requests(trace: Trace, n: int, start: int, tag: str = "probe") -> Trace:
    """``n`` of the trace's requests from index ``start`` on (wrapping), re-scoped, all at t=0:
    a closed loop once the replay's concurrency bound holds them back."""
    reqs = trace.requests
    if not reqs:
        raise ValueError("the trace has no requests to probe with")
    out = [_rescoped(reqs[(start + i) % len(reqs)], tag) for i in range(n)]
    return trace.replace(out, f"capacity probe: {n} requests from #{start}")


def _level_rate(records: list[Any], k: int) -> tuple[int, float]:
    """(completed, req/s) of one closed-loop level: Little's law, concurrency over mean E2E.
    Completions over the level's span would count its ramp-up and its draining tail, when fewer
    than ``k`` are in flight: a bias that grows with ``k`` and swamps the gain on long requests."""
    e2es = [r.e2e for r in records if r.ok and r.e2e is not None]
    if not e2es:
        return 0, 0.0
    return len(e2es), k * len(e2es) / sum(e2es)


async def probe_capacity(
    trace: Trace,
    opts: ReplayOptions,
    *,
    max_concurrency: int,
    per_level: int = 4,
    min_requests: int = 8,
    level_s: float = 15.0,
    min_gain: float = 1.1,
    max_error_share: float = 0.1,
    log: Callable[[str], None] = lambda _m: None,
) -> ProbeResult:
    levels: list[ProbeLevel] = []
    best = 0.0
    start = 0
    k = 1
    saturated = False
    window = level_s
    while k <= max_concurrency and not saturated:
        n = max(min_requests, per_level * k)
        batch = probe_requests(trace, n, start, tag=f"probe{k}")
        start += n
        o = dataclasses.replace(opts, max_concurrency=k, duration_s=window)
        records = await replay(batch, o)
        sent = sum(r.sent_s is not None for r in records)
        ok, rate = _level_rate(records, min(k, sent))
        levels.append(ProbeLevel(k, sent, ok, rate))
        log(f"probe: concurrency {k}: {ok}/{sent} ok, {rate:.3g} req/s")
        saturated = sent - ok > max_error_share * sent or rate < min_gain * best
        best = max(best, rate)
        if rate > 0:  # long requests need a longer window for several to complete
            window = max(level_s, 3.0 * min(k, sent) / rate)
        k *= 2
    rescoped = not any(r.prompt_token_ids is not None for r in trace.requests)
    return ProbeResult(best, levels, rescoped, at_least=not saturated)


def run_probe(trace: Trace, opts: ReplayOptions, **kw: Any) -> ProbeResult:
    """Blocking wrapper for the CLI."""
    return asyncio.run(probe_capacity(trace, opts, **kw))
