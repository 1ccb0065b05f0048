"""`python -m bench TOOL ...`: one entry point for the bench tools (what `kvgate bench` calls).

`kvgate bench --help` lists the tools; `kvgate bench TOOL --help` shows a tool's options.
Sample traces ship in bench/data/traces/; outputs go to bench/out/ (git-ignored).
"""

from __future__ import annotations

import importlib
import signal
import sys
from types import FrameType
from typing import TextIO

PROG = "kvgate bench"

# name -> (module, one line). The one-liners live here, not in the modules' docstrings, so that
# listing the tools imports none of them (simulate pulls in numpy and the scoring core).
TOOLS: dict[str, tuple[str, str]] = {
    "traces": ("bench.traces", "convert a trace to the normalized schema; info: rate, bound"),
    "simulate": ("bench.simulate", "policies x trace x simulated fleet on a virtual clock"),
    "capacity": ("bench.capacity", "highest request rate a fleet holds within SLOs, per policy"),
    "tune": ("bench.tune", "search kv_aware's weights/options offline, print the TOML to paste"),
    "replay": ("bench.replay", "open-loop HTTP replay of a trace against any OpenAI-style URL"),
    "compare": ("bench.compare", "kvgate policies vs peer routers on one local simulated fleet"),
    "spike": ("bench.spike", "overload: a spike to 5x capacity, admission on vs off"),
    "soak": ("bench.soak", "80% of capacity for 10 min: RSS growth, latency drift, leftovers"),
    "overhead": ("bench.overhead", "latency kvgate adds, relay capacity, quotas on vs off"),
    "instructions": ("bench.instructions", "instructions per request (callgrind), vs peers"),
    "routing_speed": ("bench.routing_speed", "routing decision time per fleet size and prompt"),
    "quota_speed": ("bench.quota_speed", "cost of a quota check (memory and Redis stores)"),
    "sim_speed": ("bench.sim_speed", "how fast the virtual clock replays a whole trace"),
    "sim_capacity": ("bench.sim_capacity", "how many simulated workers one CPU core sustains"),
    "redis_server": ("bench.redis_server", "a throwaway redis-server on 127.0.0.1 (local runs)"),
}

EXAMPLES = """\
examples (from the repository root, after `make test` or `make run` has built .venv):
  .venv/bin/kvgate bench simulate --policies round_robin,kv_aware
  .venv/bin/kvgate bench traces info bench/data/traces/azure/AzureLLMInferenceTrace_code.csv
  .venv/bin/kvgate bench simulate --help"""


def usage(out: TextIO) -> None:
    """The tool list: one line each, then examples."""
    print(f"usage: {PROG} TOOL [options]   ({PROG} TOOL --help: that tool's options)", file=out)
    print("\ntools:", file=out)
    width = max(map(len, TOOLS))
    for name, (_, line) in TOOLS.items():
        print(f"  {name:<{width}}  {line}", file=out)
    print(f"\n{EXAMPLES}", file=out)


def main(argv: list[str] | None = None) -> int:
    """Dispatch to a tool's own `main(argv)`, imported lazily so each tool starts fast.

    `--help` (or `-h`) lists the tools and exits 0; no tool, or one that does not exist, prints
    why and the list on stderr and exits 2 (an unknown name must not look like a usage screen
    the user asked for)."""
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-h", "--help", "help"):
        usage(sys.stdout)
        return 0
    if not args:
        print(f"{PROG}: error: which tool?", file=sys.stderr)
        usage(sys.stderr)
        return 2
    if args[0] not in TOOLS:
        print(f"{PROG}: error: unknown tool {args[0]!r}", file=sys.stderr)
        usage(sys.stderr)
        return 2
    try:
        module = importlib.import_module(TOOLS[args[0]][0])
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] in ("bench", "gateway", "workers", "scoring"):
            raise
        # `pip install .` installs the gateway only; the bench tools need their extras.
        print(
            f"{PROG}: error: {args[0]} needs the bench extras (no module {e.name!r}): "
            "pip install '.[bench]'",
            file=sys.stderr,
        )
        return 2
    # A bench stopped by SIGTERM or SIGHUP (`timeout`, `kill`, a closed terminal) runs the
    # clean-up Ctrl-C runs: the fleets, gateways and files it started must not outlive it.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    try:
        return int(module.main(args[1:]) or 0)
    except KeyboardInterrupt as e:  # its clean-up has run on the way out
        print(f"\n{PROG}: {args[0]} stopped ({e or 'SIGINT'})", file=sys.stderr)
        return 130


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


if __name__ == "__main__":
    sys.exit(main())
