"""`kvgate sim`: run one or several simulated vLLM workers in one process.

One process serving N workers on consecutive ports is what makes an 8-32 worker fleet fit on a
laptop: each worker is a uvicorn server with its own engine loop, all sharing one event loop.

    kvgate sim --port 8101 --workers 4          # sim-1..sim-4 on 8101..8104
    kvgate sim --workers 2 --kv-events-port 5557  # + KV events: PUB 5557/5559, replay 5558/5560
    python -m workers.sim.cli --profile fast    # same, before the console script is wired
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import uvicorn

from workers.sim.config import SimWorkerConfig
from workers.sim.engine_types import EngineConfig
from workers.sim.faults import Faults, FaultValidationError
from workers.sim.kv_publisher import LAYOUTS
from workers.sim.profiles import PROFILES, get_profile
from workers.sim.server import bind_sockets, serve_workers

__all__ = ["add_sim_parser", "build_configs", "main", "run_sim"]

_DEFAULTS = EngineConfig()


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be within [0, 1], got {value}")
    return value


def _configure(p: argparse.ArgumentParser) -> None:
    net = p.add_argument_group("serving")
    net.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: %(default)s, local only)"
    )
    net.add_argument(
        "--port", type=int, default=8101, help="port of the first worker (default: %(default)s)"
    )
    net.add_argument(
        "--workers",
        type=_positive_int,
        default=1,
        help="number of workers, on consecutive ports, named sim-1..sim-N (default: %(default)s)",
    )
    net.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="send X-Request-Id on every response, the client's or a new one (vLLM's flag; off "
        "by default, as in vLLM)",
    )
    net.add_argument(
        "--model",
        "--served-model-name",
        dest="model",
        default="sim-llama",
        help="model name served and required in requests (default: %(default)s)",
    )

    eng = p.add_argument_group("engine")
    eng.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default="default",
        help="timing profile: default (GPU-like fitted curves), fast (1-2 ms steps, tests), "
        "instant (no modelled compute) (default: %(default)s)",
    )
    eng.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply every step's modelled duration, e.g. 2 for a GPU half as fast "
        "(default: %(default)s)",
    )
    eng.add_argument(
        "--num-blocks",
        type=_positive_int,
        default=_DEFAULTS.num_blocks,
        help="KV-cache blocks per worker (vLLM's num_gpu_blocks) (default: %(default)s)",
    )
    eng.add_argument(
        "--block-size",
        type=_positive_int,
        default=_DEFAULTS.block_size,
        help="tokens per KV block (default: %(default)s)",
    )
    eng.add_argument(
        "--max-num-seqs",
        type=_positive_int,
        default=_DEFAULTS.max_num_seqs,
        help="most requests running in one batch (default: %(default)s)",
    )
    eng.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int,
        default=_DEFAULTS.max_num_batched_tokens,
        help="token budget of one engine step; longer prefills are chunked (default: %(default)s)",
    )
    eng.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=_DEFAULTS.max_model_len,
        help="context length: prompt + output tokens (default: %(default)s)",
    )
    eng.add_argument(
        "--no-enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="disable prefix caching (on by default, as in vLLM V1)",
    )
    eng.add_argument(
        "--default-max-tokens",
        type=_positive_int,
        default=64,
        help="max_tokens for requests that set none, capped by max-model-len minus the prompt "
        "(default: %(default)s)",
    )

    kv = p.add_argument_group(
        "KV events (vLLM's --kv-events-config: ZMQ PUB of BlockStored/BlockRemoved, with replay)"
    )
    kv.add_argument(
        "--kv-events-port",
        type=_positive_int,
        default=None,
        metavar="BASE",
        help="publish KV events: worker i (from 0) binds its PUB socket on BASE+2i and its "
        "replay ROUTER socket on BASE+2i+1 (default: off)",
    )
    kv.add_argument(
        "--kv-events-host",
        default=None,
        help="address the KV-event sockets bind (default: the --host address)",
    )
    kv.add_argument(
        "--kv-events-layout",
        choices=LAYOUTS,
        default="0.32",
        help="wire layout: 0.32 (events are maps tagged by type) or 0.11 (positional arrays) "
        "(default: %(default)s)",
    )
    kv.add_argument(
        "--kv-events-topic", default="kv", help="ZMQ topic of every message (default: %(default)s)"
    )

    flt = p.add_argument_group("fault injection (also settable at runtime: POST /sim/faults)")
    flt.add_argument(
        "--error-rate",
        type=_fraction,
        default=0.0,
        help="fraction of generation requests answered with an error before any byte "
        "(default: %(default)s)",
    )
    flt.add_argument(
        "--error-status",
        type=int,
        default=500,
        help="HTTP status of injected errors, in vLLM's error envelope (default: %(default)s)",
    )
    flt.add_argument(
        "--added-latency-ms",
        type=float,
        default=0.0,
        help="delay before the first byte of every generation response (default: %(default)s)",
    )
    flt.add_argument(
        "--stall-after-tokens",
        type=_non_negative_int,
        default=None,
        help="streams stop sending after N tokens and never finish",
    )
    flt.add_argument(
        "--close-after-tokens",
        type=_non_negative_int,
        default=None,
        help="streams are cut (connection closed, no [DONE]) after N tokens",
    )
    flt.add_argument(
        "--unhealthy", action="store_true", help="GET /health answers 503 (generation still works)"
    )
    flt.add_argument(
        "--crash-after-requests",
        type=_positive_int,
        default=None,
        help="the whole process exits at once when a worker receives its N-th request",
    )


def add_sim_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `sim` on the `kvgate` command's subparsers; `run_sim` is its handler."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "sim",
        help="run simulated vLLM workers",
        description="Run simulated vLLM workers (vLLM 0.32's HTTP surface, a modelled engine) "
        "on consecutive ports in one process.",
    )
    _configure(p)
    p.set_defaults(func=run_sim)
    return p


def _faults_from_args(args: argparse.Namespace) -> Faults:
    f = Faults()
    f.update(
        {
            "error_rate": args.error_rate,
            "error_status": args.error_status,
            "added_latency_ms": args.added_latency_ms,
            "stall_after_tokens": args.stall_after_tokens,
            "close_after_tokens": args.close_after_tokens,
            "unhealthy": args.unhealthy,
            "crash_after_requests": args.crash_after_requests,
        }
    )
    return f


def build_configs(args: argparse.Namespace) -> list[SimWorkerConfig]:
    """One config per worker; each gets its own Faults so runtime changes stay per worker."""
    profile = get_profile(args.profile)
    if args.time_scale != 1.0:
        if args.time_scale <= 0:
            raise ValueError("--time-scale must be positive")
        profile = profile.with_overrides(scale=profile.scale * args.time_scale)
    engine = EngineConfig(
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    kv_base: int | None = getattr(args, "kv_events_port", None)
    if kv_base is not None:
        if kv_base + 2 * args.workers - 1 > 65535:
            raise ValueError(
                f"--kv-events-port {kv_base} leaves no room for {args.workers} worker(s)"
            )
        # Checked here because both binds set SO_REUSEADDR: an HTTP socket bound but not yet
        # listening would not stop ZMQ from taking its port.
        if kv_base < args.port + args.workers and args.port < kv_base + 2 * args.workers:
            raise ValueError(
                f"--kv-events-port {kv_base} (ports {kv_base}-{kv_base + 2 * args.workers - 1}) "
                f"overlaps the HTTP ports {args.port}-{args.port + args.workers - 1}"
            )
    kv_host = getattr(args, "kv_events_host", None) or args.host
    return [
        SimWorkerConfig(
            name=f"sim-{i + 1}",
            port=args.port + i,
            model=args.model,
            profile=profile,
            engine=replace(engine, enable_kv_events=kv_base is not None),
            default_max_tokens=args.default_max_tokens,
            faults=_faults_from_args(args),
            kv_events=kv_base is not None,
            kv_events_host=kv_host,
            kv_events_port=kv_base + 2 * i if kv_base is not None else 0,
            kv_replay_port=kv_base + 2 * i + 1 if kv_base is not None else 0,
            kv_events_topic=getattr(args, "kv_events_topic", "kv"),
            kv_events_layout=getattr(args, "kv_events_layout", "0.32"),
            enable_request_id_headers=getattr(args, "enable_request_id_headers", False),
        )
        for i in range(args.workers)
    ]


def _runner() -> asyncio.Runner:
    try:
        import uvloop
    except ImportError:
        return asyncio.Runner()
    return asyncio.Runner(loop_factory=uvloop.new_event_loop)


def run_sim(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; 0 on a clean stop, 2 for bad settings or a taken port."""
    try:
        cfgs = build_configs(args)
    except (ValueError, FaultValidationError) as e:
        print(f"kvgate sim: {e}", file=sys.stderr)
        return 2
    try:
        socks = bind_sockets(args.host, [c.port for c in cfgs])
    except OSError as e:
        print(f"kvgate sim: {e}", file=sys.stderr)
        return 2
    host_url = f"[{args.host}]" if ":" in args.host else args.host

    def announce(servers: list[uvicorn.Server]) -> None:
        for c, s in zip(cfgs, servers, strict=True):
            e = c.engine
            profile = c.profile if isinstance(c.profile, str) else c.profile.name
            line = (
                f"{c.name}: http://{host_url}:{c.port}  model={c.model} profile={profile} "
                f"kv={e.num_blocks}x{e.block_size} max_num_seqs={e.max_num_seqs}"
            )
            worker = s.config.app.state.worker
            if worker.kv_endpoint is not None:
                line += (
                    f"  kv_events={worker.kv_endpoint} replay={worker.kv_replay_endpoint} "
                    f"topic={c.kv_events_topic} layout={c.kv_events_layout}"
                )
            print(line, flush=True)

    try:
        with _runner() as runner:
            runner.run(
                serve_workers(
                    cfgs, args.host, sockets=socks, on_started=announce, handle_signals=True
                )
            )
    except OSError as e:  # e.g. a KV-event port is taken (bound before anything is served)
        print(f"kvgate sim: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workers.sim.cli",
        description="Run simulated vLLM workers on consecutive ports in one process.",
    )
    _configure(parser)
    return run_sim(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
