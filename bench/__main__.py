"""`python -m bench <tool> ...`: one entry point for the bench tools (what `kvgate bench` calls).

python -m bench simulate --trace ../shared/traces/mooncake/synthetic_trace.jsonl --workers 8
python -m bench capacity --slo-ttft-p95 2 --slo-tpot-p95 0.1
python -m bench replay --url http://127.0.0.1:8000 --trace my_trace.jsonl
python -m bench compare
python -m bench traces info ../shared/traces/azure/AzureLLMInferenceTrace_code.csv
python -m bench spike                      # overload: 5x capacity, admission on vs off
python -m bench soak --duration 600        # 80% of capacity for 10 min: RSS, drift, leftovers
"""

from __future__ import annotations

import importlib
import sys

TOOLS = {
    "traces": "bench.traces",
    "simulate": "bench.simulate",
    "capacity": "bench.capacity",
    "replay": "bench.replay",
    "compare": "bench.compare",
    "spike": "bench.spike",
    "soak": "bench.soak",
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch to a tool's own `main(argv)`; imported lazily so each tool starts fast."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in TOOLS:
        print(__doc__.strip(), file=sys.stderr)
        print(f"\ntools: {', '.join(TOOLS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(TOOLS[args[0]])
    return int(module.main(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
