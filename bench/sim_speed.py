"""How fast the virtual clock replays a whole trace: the offline simulator's own benchmark.

    .venv/bin/kvgate bench sim_speed --workers 8      # the Mooncake sample in bench/data/traces/

Replays every request of a Mooncake trace through N simulated engines with a blind routing policy
and reports the wall time next to what was simulated. The point is the simulator's speed (policy
studies replay the same trace many times), so the routing here is deliberately the baseline.

Defaults model a fleet of H100-80GB workers serving an 8B model: 32,768 blocks of 16 tokens
(~512k tokens of KV, about what vLLM leaves for the cache at 0.9 GPU memory utilisation), enough
for the trace's longest 191k-token prompts yet far below its 22M-token working set, so a blind
router sees real LRU eviction.
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import pstats
import time
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.paths import MOONCAKE_TRACE
from bench.traces import (
    TraceError,
    check_trace_path,
    exit_on_trace_error,
    infinite_cache_hit_rate,
    load_mooncake,
    tokens_for_blocks,
)
from scoring.policy import make_policy
from scoring.views import RouteRequest, WorkerView
from workers.sim.engine import Engine
from workers.sim.engine_types import EngineConfig, SimRequest
from workers.sim.profiles import get_profile
from workers.sim.vclock import Arrival, FleetSnapshot, Router, SimulationResult, VirtualFleet
from workers.sim.vclock import percentile as pct

DEFAULT_TRACE = MOONCAKE_TRACE


def policy_router(name: str) -> Router:
    """Adapt a gateway routing policy to the virtual fleet: snapshot -> WorkerViews -> index."""
    policy = make_policy(name)

    def route(arrival: Arrival, fleet: FleetSnapshot) -> int:
        views = [
            WorkerView(
                name=str(s.index),
                in_flight=s.in_flight,
                running=s.running,
                waiting=s.waiting,
                kv_usage=s.kv_usage,
                block_size=s.block_size,
                num_blocks=s.num_blocks,
            )
            for s in fleet.engines
        ]
        decision = policy.choose(
            views, RouteRequest(model="sim", request_id=arrival.request.request_id)
        )
        return int(decision.worker.name)

    return route


def arrivals_from_trace(path: Path, limit: int | None, block_tokens: int) -> Iterator[Arrival]:
    """Materialise prompts one at a time, as the replay reaches them (the trace holds ~60M ids)."""
    records = load_mooncake(path)
    if limit is not None:
        records = itertools.islice(records, limit)
    for i, rec in enumerate(records):
        prompt = tokens_for_blocks(rec.hash_ids, rec.input_length, block_tokens)
        req = SimRequest(f"mooncake-{i}", prompt, max(1, rec.output_length))
        yield Arrival(rec.arrival_s, req)


def run(args: argparse.Namespace) -> tuple[SimulationResult, float]:
    config = EngineConfig(
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
    )
    profile = get_profile(args.profile)
    engines = [Engine(config, profile) for _ in range(args.workers)]
    fleet = VirtualFleet(engines, policy_router(args.policy))
    t0, c0 = time.perf_counter(), time.process_time()
    result = fleet.run(arrivals_from_trace(args.trace, args.limit, args.trace_block_tokens))
    args.cpu_s = time.process_time() - c0  # next to wall time: the machine may be shared
    return result, time.perf_counter() - t0


def report(args: argparse.Namespace, result: SimulationResult, wall: float) -> None:
    done = [r for r in result.results if r.completion_time is not None]
    ttft = [r.ttft for r in done if r.ttft is not None]
    itl = [gap for r in done for gap in r.itl]
    e2e = [r.e2e for r in done if r.e2e is not None]
    prompt_tokens = sum(r.prompt_tokens for r in result.results)
    output_tokens = sum(r.output_tokens for r in result.results)
    records = list(load_mooncake(args.trace))
    if args.limit is not None:
        records = records[: args.limit]

    table = Table(title=f"virtual-clock replay: {args.trace.name}, {args.workers} x {args.profile}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("policy", args.policy),
        ("wall time (CPU time)", f"{wall:.2f} s ({args.cpu_s:.2f} s)"),
        ("simulated duration", f"{result.duration:.1f} s"),
        ("speed-up (simulated / wall)", f"{result.duration / wall:.0f}x" if wall else "-"),
        ("requests (completed)", f"{len(result.results)} ({len(done)})"),
        ("engine steps", f"{result.num_steps:,}"),
        ("prompt / output tokens", f"{prompt_tokens:,} / {output_tokens:,}"),
        ("fleet hit rate (cached / prompt tokens)", f"{result.hit_rate:.1%}"),
        ("trace bound (infinite cache, 512-token ids)", f"{infinite_cache_hit_rate(records):.1%}"),
        ("TTFT p50 / p99", f"{pct(ttft, 50):.3f} / {pct(ttft, 99):.3f} s"),
        ("ITL p50 / p99", f"{pct(itl, 50) * 1e3:.1f} / {pct(itl, 99) * 1e3:.1f} ms"),
        ("E2E p50 / p99", f"{pct(e2e, 50):.2f} / {pct(e2e, 99):.2f} s"),
        ("preempted requests", str(sum(1 for r in result.results if r.preempted))),
        ("KV config", f"{args.num_blocks} blocks x {args.block_size} tokens per worker"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvgate bench sim_speed", description=__doc__.split("\n")[0])
    p.add_argument(
        "--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format JSONL (%(default)s)"
    )
    p.add_argument("--workers", type=int, default=8, help="simulated engines (default 8)")
    p.add_argument("--policy", choices=["round_robin", "least_loaded"], default="round_robin")
    p.add_argument("--profile", default="default", help="timing profile (default: GPU-like)")
    p.add_argument("--num-blocks", type=int, default=32768, help="KV blocks per worker")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=262144, help="covers the 191k prompts")
    p.add_argument("--trace-block-tokens", type=int, default=512, help="tokens per trace hash id")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--cprofile", type=Path, default=None, help="write cProfile stats here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        check_trace_path(args.trace)
    except TraceError as e:
        exit_on_trace_error("python -m bench.sim_speed", e)
    if args.cprofile is not None:
        prof = cProfile.Profile()
        result, wall = prof.runcall(run, args)
        prof.dump_stats(str(args.cprofile))
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    else:
        result, wall = run(args)
    report(args, result, wall)


if __name__ == "__main__":
    main()
