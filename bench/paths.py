"""Where the bench tools read their sample traces and write their outputs, in one place.

Why one module: every default must work from a fresh clone, so the sample traces the docs use
ship inside the repository (`bench/data/traces/`, with their licences; see its README) and every
tool's default points there, never to a path next to the clone. Outputs default to `bench/out/`
(git-ignored) so that no run litters the repository root or the current directory.

Paths are absolute, anchored at this checkout, so a tool gives the same answer from any working
directory. Installed without a checkout (`pip install .` into site-packages) the sample traces are
absent (they are not package data: the gateway image does not need 2 MB of traces) and outputs
go to `./bench-out/` instead of into site-packages.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRACES_DIR = REPO / "bench" / "data" / "traces"
MOONCAKE_TRACE = TRACES_DIR / "mooncake" / "synthetic_trace.jsonl"
AZURE_TRACE = TRACES_DIR / "azure" / "AzureLLMInferenceTrace_code.csv"
WEKA_TRACES = TRACES_DIR / "weka-agentic"


def _in_checkout() -> bool:
    return (REPO / "pyproject.toml").is_file() and (REPO / "bench" / "__init__.py").is_file()


OUT_DIR = REPO / "bench" / "out" if _in_checkout() else Path("bench-out")


def out_path(*parts: str) -> Path:
    """A default output path under `OUT_DIR` (created by the tool when it writes)."""
    return OUT_DIR.joinpath(*parts)


def shown(path: Path) -> str:
    """`path` relative to the working directory when it is below it (shorter in reports)."""
    try:
        return os.path.relpath(path) if path.resolve().is_relative_to(Path.cwd()) else str(path)
    except ValueError:  # another drive (Windows)
        return str(path)
