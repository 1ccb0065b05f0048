"""The TTFT floor of a trace: each request's time to first token with nothing left to route better.

The hit-rate bounds (`bench.traces.cache_bound`) say how much cache a router could reuse; they do
not say how low its TTFT could go, so a p99 of 2 s could be routing's fault or the prompts' own
length. The floor answers that: a request's TTFT alone on an idle worker that holds every block an
earlier request computed (the infinite-cache bound's hit, at trace-block granularity), i.e. only
its own uncached tokens to prefill, in chunks of `max_num_batched_tokens`, each chunk costing what
the simulator's timing profile charges a step (its context term included). No router can beat it
on the simulated fleet except by the engine's finer blocks reusing part of an earlier partial
trace block, so routers are compared against it: a p99 near the floor's p99 leaves nothing to
gain, and a target relative to another router ("0.7x its p99") cannot be met when that router
already sits on the floor.

Requests the fleet refuses (longer than the model's context or a worker's whole KV cache) have no
TTFT and are left out, as the simulation leaves them out of its TTFT figures.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from bench.traces import TraceRequest, bound_hits
from workers.sim.profiles import TimingProfile


def alone_ttft(
    uncached: int, cached: int, profile: TimingProfile, max_num_batched_tokens: int
) -> float:
    """Seconds to prefill `uncached` tokens after `cached` ones already in the KV cache, on an
    otherwise idle engine: one step per chunk of the batch budget, the last one emitting the
    first token (as vLLM's chunked prefill and the simulated engine do)."""
    t = 0.0
    before = cached
    left = uncached
    while left > 0:
        n = min(left, max_num_batched_tokens)
        t += profile.step_seconds(n, 0, 0.0, n * before)
        before += n
        left -= n
    return t


def ttft_floor(
    requests: Iterable[TraceRequest],
    profile: TimingProfile,
    *,
    max_num_batched_tokens: int,
    kv_tokens: int,
    max_model_len: int,
) -> list[float]:
    """Each servable request's floor TTFT, in arrival order (see the module docstring)."""
    out = []
    for r, _keys, matched in bound_hits(requests):
        need = r.input_length + max(1, r.output_length)
        if need > max_model_len or need > kv_tokens:
            continue
        cached = matched * r.block_size
        out.append(alone_ttft(r.input_length - cached, cached, profile, max_num_batched_tokens))
    return out


def floor_describe(trace: dict[str, Any]) -> str:
    """A report's floor as "p50 X, p99 Y" (seconds); "-" for reports written before it existed."""
    f = trace.get("ttft_floor")
    if not f or f.get("p99") is None:
        return "-"
    return f"p50 {f['p50']:.3f}, p99 {f['p99']:.3f}"
