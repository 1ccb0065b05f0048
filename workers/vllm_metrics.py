"""vLLM's Prometheus text -> the few numbers routing needs.

Parsed with `prometheus_client.parser` (never by hand). Current names first (vLLM >= 0.12), the
removed `gpu_*` names only as a fallback for older servers. Every series is summed over the
`engine` label (data-parallel ranks) and over models, so a server reads as one worker.

Only the lines of the families read here reach the parser: a real vLLM 0.32 exposition is ~59 KB
and 688 lines, mostly histogram buckets, and the pure-Python parser took 21 ms of event loop per
scrape for all of it (64 workers probed every 2 s: two thirds of a core, in 21 ms stalls that
every stream in flight waited out). Picking the ~30 lines first by name costs ~0.4 ms; the whole
parse is ~1.3 ms (tests/workers: same result as the full parse).

Bounded for an odd server's text too (the prober caps it at a few MiB and parses it in a thread):
the lines are found with `str.find` of each family's name, never by splitting the whole text, so
only the lines kept are ever made (`splitlines` on 4 MiB of short lines made 80 MiB of strings
and held the GIL, the prober's event loop with it, for 0.3 s). The parser costs ~20 us per line
it reads, so more than `MAX_RELEVANT_LINES` of them is refused: `MetricsTooLarge`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(slots=True, frozen=True)
class WorkerMetrics:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # 0..1
    block_size: int | None = None
    num_blocks: int | None = None
    prefix_cache_queries: float = 0.0  # tokens, cumulative
    prefix_cache_hits: float = 0.0  # tokens, cumulative
    preemptions: float = 0.0
    # process_start_time_seconds: a change means the server restarted (its cache and its KV
    # event sequence are new), even when no probe failed in between.
    process_start: float | None = None


_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
}
_KV = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_QUERIES = ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries")
_HITS = ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits")


# The most lines of the families read that are looked at (~0.1 s of the prober's thread to parse).
# A real vLLM 0.32 exposition has 37 for one engine (24 of them HELP/TYPE lines, once per family),
# and each further data-parallel rank adds 12 samples: room for ~300 engines.
MAX_RELEVANT_LINES = 4096


class MetricsTooLarge(ValueError):
    """More lines of the families read than `MAX_RELEVANT_LINES`: not parsed."""


# Every family the parse below reads (counters also as `<name>_total`: a prefix covers both).
_READ = (
    "process_start_time_seconds",
    "vllm:cache_config_info",
    *_GAUGES,
    *_KV,
    *_QUERIES,
    *_HITS,
    "vllm:num_preemptions",
)


def relevant_lines(text: str) -> str:
    """The samples, HELP and TYPE lines of the families in ``_READ``; the parser needs no more.
    A family whose name merely starts like one of them passes too, and is ignored by name.
    Lines are split at "\n" only, as the parser splits them. Raises MetricsTooLarge past
    `MAX_RELEVANT_LINES` names found, without looking further."""
    found: dict[int, str] = {}  # where a line starts -> the line, to keep their order
    seen = 0  # every place a name is found costs a turn of the loop: all count
    for name in _READ:
        i = text.find(name)
        while i >= 0:
            seen += 1
            if seen > MAX_RELEVANT_LINES:
                raise MetricsTooLarge(
                    f"over {MAX_RELEVANT_LINES} lines of the families read; not parsed"
                )
            at = _line_start(text, i)
            if at < 0:  # the name inside another line (a HELP text, a label value)
                i = text.find(name, i + len(name))
                continue
            end = text.find("\n", i)
            line = text[at:] if end < 0 else text[at:end]
            if not _metric_name(line).endswith("_created"):  # counters' creation times
                found[at] = line
            i = -1 if end < 0 else text.find(name, end)
    keep = [found[at] for at in sorted(found)]
    keep.append("")
    return "\n".join(keep)


def _line_start(text: str, i: int) -> int:
    """Where the line begins whose family name is at ``i`` (a sample's, or a HELP or TYPE
    line's after its 7 characters), or -1 where the name at ``i`` is not one."""
    if i == 0 or text[i - 1] == "\n":
        return i
    at = i - 7
    if (
        at >= 0
        and text.startswith(("# HELP ", "# TYPE "), at)
        and (at == 0 or text[at - 1] == "\n")
    ):
        return at
    return -1


def _metric_name(line: str) -> str:
    """The name alone: a label value may hold anything, "_created" included (a served model
    named "ft_created-llama" must not hide that worker's load). Only lines that start like a
    family read get here, ~30 of a scrape's ~700."""
    if line.startswith("#"):  # "# HELP name ..." / "# TYPE name type"
        return line[7:].partition(" ")[0]
    return line.partition("{")[0].partition(" ")[0]


# Bounds on the cache geometry a worker reports (labels: any text): past them it is unknown.
# A 400-digit `num_gpu_blocks` overflowed the float of every load figure built on it: each
# request for its model was a 500, and the autoscale series of every model were gone (review).
# Requests a worker may report running or waiting: past it the figure is no count (a 1e306
# made every load figure infinite, the scores NaN, and each request for its model a 500).
_MAX_REQUESTS = 1 << 31
_MAX_BLOCK_SIZE = 1 << 16
_MAX_BLOCKS = 1 << 40


def _label_int(v: str | None, bound: int) -> int | None:
    """A label's non-negative integer up to ``bound`` (ASCII digits only: `isdigit` also takes
    `²`, which `int` refuses), else None."""
    if not v or len(v) > 20 or not (v.isascii() and v.isdigit()):
        return None
    n = int(v)
    return n if n <= bound else None


def parse_vllm_metrics(text: str) -> WorkerMetrics:
    text = relevant_lines(text)
    sums: dict[str, float] = {}
    kv_samples: dict[str, list[float]] = {}
    block_size: int | None = None
    num_blocks: int | None = None
    start: float | None = None
    for family in text_string_to_metric_families(text):
        name = family.name
        if name == "process_start_time_seconds":
            if family.samples and math.isfinite(family.samples[0].value):
                start = family.samples[0].value
            continue
        if name == "vllm:cache_config_info":
            for s in family.samples:
                bs = _label_int(s.labels.get("block_size"), _MAX_BLOCK_SIZE)
                nb = _label_int(s.labels.get("num_gpu_blocks"), _MAX_BLOCKS)
                if bs is not None:
                    block_size = bs
                if nb is not None:
                    num_blocks = min((num_blocks or 0) + nb, _MAX_BLOCKS)
            continue
        if not name.startswith("vllm:"):
            continue
        for s in family.samples:
            # Counters come back as family "x" with samples "x_total"; skip "_created".
            # Nor +Inf/NaN: int() of one raises (OverflowError, not a ValueError, for +Inf), and
            # the sums would carry it into every load figure; the other samples still count.
            if s.name.endswith("_created") or not math.isfinite(s.value):
                continue
            if name in _KV:
                kv_samples.setdefault(name, []).append(s.value)
            else:
                sums[name] = sums.get(name, 0.0) + s.value
    kv = next((kv_samples[n] for n in _KV if n in kv_samples), [])

    def first(names: tuple[str, ...]) -> float:
        return next((sums[n] for n in names if n in sums), 0.0)

    return WorkerMetrics(
        running=_requests(sums.get("vllm:num_requests_running", 0)),
        waiting=_requests(sums.get("vllm:num_requests_waiting", 0)),
        # Data-parallel ranks each report their own fraction: the worker is as full as their mean.
        kv_usage=min(1.0, max(0.0, sum(kv) / len(kv))) if kv else 0.0,
        block_size=block_size,
        num_blocks=num_blocks,
        prefix_cache_queries=first(_QUERIES),
        prefix_cache_hits=first(_HITS),
        preemptions=sums.get("vllm:num_preemptions", 0.0),
        process_start=start,
    )


def _requests(v: float) -> int:
    """A request count as reported, within [0, _MAX_REQUESTS]."""
    return int(min(max(v, 0.0), _MAX_REQUESTS))
