"""Open-loop HTTP replay of a trace against any OpenAI-compatible server (kvgate, a peer router,
one vLLM), with `vllm bench serve`-style results.

    .venv/bin/kvgate bench replay --url http://127.0.0.1:8000 --api-key kvg-demo-team-a \\
        --trace bench/data/traces/mooncake/synthetic_trace.jsonl --sample 200 --time-scale 0.5 \\
        --max-concurrency 64 --duration 120                # report: bench/out/replay.json

Why open loop: production traffic does not wait for the server, so a closed loop (next request when
one finishes) hides queueing exactly when it matters. Requests are sent at the trace's timestamps
(times `--time-scale`), or at `--rate` with gamma-distributed gaps (`--burstiness`, 1 = Poisson),
bounded by `--max-concurrency` (a request over the bound waits; its lateness is recorded as
`schedule_lag`), `--duration` (no new request after it) and `--num-requests`.

Each request streams `/v1/completions` with the trace's prompt as token ids (exact length, no
tokenizer drift) or, with `--endpoint chat`, `/v1/chat/completions` with a text prompt of one
common word per token; `max_tokens = output_length`, `ignore_eos`, `stream_options.include_usage`.
Timing follows `vllm bench serve` (bench.sse_client, parse mode, defines it): TTFT = first SSE
chunk with choices, ITL = gaps between such chunks, TPOT = (E2E - TTFT) / (output tokens - 1),
output tokens from `usage.completion_tokens`.
The prompt length the server saw (`usage.prompt_tokens`) is checked against the trace within a
stated tolerance (token ids: exact; chat: the template adds a few tokens).

Several base URLs (`--url http://127.0.0.1:8000,http://127.0.0.1:8001`, e.g. gateway replicas)
spread the requests over them uniformly at random, as an L4 balancer in front of replicas would:
each request's target is drawn once, in trace order, from a generator seeded by `--seed`, so
the same flags send every request to the same URL in every run. The result counts requests per
URL (`per_url`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.argtypes import count, goodput, positive
from bench.metrics import SLO, balance, dist, machine, tpot
from bench.paths import out_path, shown
from bench.sse_client import StreamResult, stream
from bench.traces import (
    SAMPLE_BY,
    Trace,
    TraceError,
    TraceRequest,
    exit_on_trace_error,
    head,
    load_trace,
    prompt_text,
    prompt_token_ids,
    rate_time_scale,
    retime_gamma,
    sample,
    scale_time,
)

MAX_ERROR_CHARS = 300  # an error body kept per request (bounded result files)


@dataclass(slots=True)
class RequestRecord:
    """What happened to one replayed request (times in seconds, relative to the replay start)."""

    request_id: str
    scheduled_s: float  # when the trace says it should be sent
    sent_s: float | None = None  # when it was actually sent (concurrency bound, event loop)
    status: int = 0  # HTTP status; 0 = no response (connection error, timeout, cancelled)
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    input_length: int = 0  # what the trace asked for
    prompt_tokens: int | None = None  # what the server counted (usage.prompt_tokens)
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    output_tokens: int = 0  # usage.completion_tokens, else chunks with content
    expected_output: int = 0
    worker: str | None = None  # x-kvgate-worker, when the server is kvgate
    session_id: str | None = None
    url: str = ""  # the base URL it was sent to (one of several: `ReplayOptions.urls`)

    @property
    def tpot(self) -> float | None:
        return tpot(self.e2e, self.ttft, self.output_tokens)


@dataclass(slots=True)
class ReplayOptions:
    url: str  # a base URL, or several comma-separated (requests spread over them at random)
    model: str = "sim-llama"
    endpoint: str = "completions"  # completions (token ids) | text (completions, text) | chat
    api_key: str | None = None
    max_concurrency: int = 64
    duration_s: float | None = None
    request_timeout_s: float = 300.0
    drain_timeout_s: float = 120.0  # after the last send, longest wait for in-flight requests
    session_header: str = "x-session-id"
    prompt_tolerance: float = 0.02  # relative, for the prompt-length check (chat)
    prompt_tolerance_tokens: int = 32  # absolute, added to the relative part (chat)
    extra_body: dict[str, Any] = field(default_factory=dict)
    spread_seed: int = 0  # which URL each request goes to, when there are several

    @property
    def urls(self) -> list[str]:
        """The base URLs, without trailing slashes."""
        return split_urls(self.url)

    def tolerance(self, n: int) -> int:
        """Allowed |usage.prompt_tokens - input_length|: 0 for token ids, else a stated slack
        (a text prompt is one common word per token, but a real tokenizer may merge or split a
        few, and a chat template adds its own tokens)."""
        if self.endpoint == "completions":
            return 0
        return int(self.prompt_tolerance * n) + self.prompt_tolerance_tokens


def split_urls(text: str) -> list[str]:
    """`http://a:1, http://b:2/` -> two base URLs; a URL named twice gets twice the traffic."""
    return [u.strip().rstrip("/") for u in text.split(",") if u.strip()]


def spread(n: int, urls: Sequence[str], seed: int) -> list[str]:
    """The URL each of `n` requests goes to: uniform at random and independent of timing, as an
    L4 balancer spreads connections (not round-robin, which would be a kinder, rarer balancer);
    seeded, so two targets in one comparison get the same assignment."""
    if not urls:
        raise ValueError("no URL to send to")
    if len(urls) == 1:
        return [urls[0]] * n
    rng = random.Random(seed ^ 0x5EED)
    return [urls[rng.randrange(len(urls))] for _ in range(n)]


def build_body(req: TraceRequest, opts: ReplayOptions) -> dict[str, Any]:
    """The request body for one trace request (prompt materialised deterministically)."""
    body: dict[str, Any] = {
        "model": opts.model,
        "max_tokens": max(1, req.output_length),
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if opts.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt_text(req)}]
    elif opts.endpoint == "text":
        body["prompt"] = prompt_text(req)
    else:
        body["prompt"] = prompt_token_ids(req) if req.prompt is None else req.prompt
    body.update(opts.extra_body)
    return body


async def _one(
    http: aiohttp.ClientSession,
    req: TraceRequest,
    rec: RequestRecord,
    opts: ReplayOptions,
    t0: float,
) -> None:
    """Send one request and fill its record; never raises (errors are recorded)."""
    path = "/v1/chat/completions" if opts.endpoint == "chat" else "/v1/completions"
    res = StreamResult()
    res.sent_at = time.perf_counter()  # `stream` sets it on sending; this if it never does
    cancelled = False
    try:
        headers = {"content-type": "application/json", "x-request-id": req.request_id}
        if opts.api_key:
            headers["authorization"] = f"Bearer {opts.api_key}"
        if req.session_id:
            headers[opts.session_header] = req.session_id
        data = orjson.dumps(build_body(req, opts))
        await stream(http, rec.url + path, data, headers, parse=True, result=res)
    except asyncio.CancelledError:
        cancelled = True
        raise
    except Exception as e:
        # One request that cannot be built or sent (a record no validation caught, a client
        # error `stream` does not catch) is that request's error: raised, it would end the
        # whole replay and lose every other record.
        res.exc = e
        res.error = f"{type(e).__name__}: {e}"
    finally:
        _record(rec, res, t0)
        if cancelled:
            rec.error = "cancelled (duration/drain bound)"


def _record(rec: RequestRecord, res: StreamResult, t0: float) -> None:
    """`res` (bench.sse_client, parse mode: its timing definitions) into the request's record:
    an error body for a status other than 200, otherwise the stream's error; e2e, `ok` and the
    output-token fallback (events with choices) only for a stream read to its `[DONE]` without
    an error (a stream cut before it, even after tokens, failed)."""
    rec.sent_s = res.sent_at - t0
    rec.status = res.status
    rec.worker = res.worker
    rec.ttft = res.ttft
    rec.itl = res.itl
    rec.prompt_tokens = res.prompt_tokens
    rec.cached_tokens = res.cached_tokens
    rec.output_tokens = res.output_tokens or 0
    error = res.text if res.status not in (0, 200) and res.exc is None else res.error
    rec.error = None if error is None else error[:MAX_ERROR_CHARS]
    if res.status == 200 and res.e2e is not None:
        rec.e2e = res.e2e
        if not rec.output_tokens:
            rec.output_tokens = res.chunks
        rec.ok = res.ttft is not None and res.error is None


async def replay(
    trace: Trace,
    opts: ReplayOptions,
    progress: Callable[[int, int], None] | None = None,
) -> list[RequestRecord]:
    """Replay every request of `trace` at its arrival time (seconds from now); records in order."""
    reqs = trace.requests
    t_first = reqs[0].arrival_s if reqs else 0.0
    targets = spread(len(reqs), opts.urls, opts.spread_seed)
    records = [
        RequestRecord(
            r.request_id,
            r.arrival_s - t_first,
            input_length=r.input_length,
            expected_output=max(1, r.output_length),
            session_id=r.session_id,
            url=url,
        )
        for r, url in zip(reqs, targets, strict=True)
    ]
    sem = asyncio.Semaphore(max(1, opts.max_concurrency))
    connector = aiohttp.TCPConnector(limit=max(1, opts.max_concurrency), force_close=False)
    timeout = aiohttp.ClientTimeout(total=opts.request_timeout_s)
    done = 0
    tasks: list[asyncio.Task[None]] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        t0 = time.perf_counter()

        async def run(req: TraceRequest, rec: RequestRecord) -> None:
            nonlocal done
            try:
                async with sem:
                    # Held back by the concurrency bound past --duration: not sent either.
                    if opts.duration_s is not None and time.perf_counter() - t0 > opts.duration_s:
                        rec.error = "not sent (past --duration)"
                        return
                    await _one(http, req, rec, opts, t0)
            finally:
                done += 1
                if progress is not None:
                    progress(done, len(records))

        for req, rec in zip(reqs, records, strict=True):
            if opts.duration_s is not None and rec.scheduled_s > opts.duration_s:
                rec.error = "not sent (past --duration)"
                done += 1
                continue
            delay = rec.scheduled_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(run(req, rec)))
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=opts.drain_timeout_s)
            for t in pending:
                t.cancel()
            for t in pending:
                with contextlib.suppress(asyncio.CancelledError):
                    await t
    return records


def summarize(
    records: Sequence[RequestRecord],
    opts: ReplayOptions,
    slo: SLO,
    *,
    trace: Trace | None = None,
    extra: dict[str, Any] | None = None,
    keep_records: bool = True,
) -> dict[str, Any]:
    """`vllm bench serve`-style result (ms for latencies) plus kvgate's cache and routing fields."""
    sent = [r for r in records if r.sent_s is not None]
    ok = [r for r in sent if r.ok]
    if sent:
        start = min(r.sent_s for r in sent if r.sent_s is not None)
        end = max((r.sent_s or 0.0) + (r.e2e or 0.0) for r in sent)
        duration = max(end - start, 1e-9)
    else:
        duration = 1e-9
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens or r.input_length for r in ok)
    good = sum(1 for r in ok if slo.met(r.ttft, r.tpot, r.e2e))
    res: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if opts.endpoint == "chat" else "openai",
        "base_url": opts.url,
        "base_urls": opts.urls,
        "endpoint": "/v1/chat/completions" if opts.endpoint == "chat" else "/v1/completions",
        "model_id": opts.model,
        "num_prompts": len(records),
        "max_concurrency": opts.max_concurrency,
        "duration": duration,
        "completed": len(ok),
        "failed": len(sent) - len(ok),
        "not_sent": len(records) - len(sent),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "request_goodput": good / duration,
        "goodput_slo": slo.to_json(),
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
    }
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [t for r in ok if (t := r.tpot) is not None]
    itls = [g for r in ok for g in r.itl]
    e2els = [r.e2e for r in ok if r.e2e is not None]
    for name, vals in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        d = dist(vals)
        ms = {k: (None if v is None else v * 1000.0) for k, v in d.items() if k != "count"}
        res[f"mean_{name}_ms"] = ms["mean"]
        res[f"median_{name}_ms"] = ms["p50"]
        res[f"std_{name}_ms"] = _std(vals) * 1000.0 if vals else None
        for q in ("p90", "p95", "p99"):
            res[f"{q}_{name}_ms"] = ms[q]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    workers = Counter(r.worker for r in ok if r.worker)
    mismatched = [
        r
        for r in ok
        if r.prompt_tokens is None
        or abs(r.prompt_tokens - r.input_length) > opts.tolerance(r.input_length)
    ]
    res.update(
        {
            "hit_rate": cached / prompt if prompt else None,
            "cached_tokens": cached,
            "status_counts": {
                str(k): v for k, v in sorted(Counter(r.status for r in sent).items())
            },
            "errors": dict(
                Counter((r.error or "")[:80] for r in records if r.error).most_common(10)
            ),
            "workers": dict(sorted(workers.items())),
            "worker_balance": balance(list(workers.values())) if workers else None,
            "per_url": per_url(records, opts.urls),
            "prompt_length_check": {
                "tolerance": "exact (token ids)"
                if opts.endpoint == "completions"
                else f"{opts.prompt_tolerance:.0%} + {opts.prompt_tolerance_tokens} tokens",
                "checked": len(ok),
                "mismatched": len(mismatched),
                "max_abs_diff": max(
                    (abs((r.prompt_tokens or 0) - r.input_length) for r in ok), default=0
                ),
            },
            "output_length_mismatched": sum(1 for r in ok if r.output_tokens != r.expected_output),
            "schedule_lag_s": dist(
                [r.sent_s - r.scheduled_s for r in sent if r.sent_s is not None]
            ),
            "machine": machine(),
        }
    )
    if trace is not None:
        res["trace"] = {**trace.meta(), "describe": trace.describe()}
    if extra:
        res.update(extra)
    if keep_records:
        res["records"] = [asdict(r) for r in records]
    return res


def per_url(records: Sequence[RequestRecord], urls: Sequence[str]) -> dict[str, dict[str, int]]:
    """Per base URL: requests assigned, sent, answered ok (every URL listed, even one that got
    nothing, so a dead replica shows as zeros rather than disappearing)."""
    out = {u: {"requests": 0, "sent": 0, "ok": 0} for u in urls}
    for r in records:
        c = out.setdefault(r.url, {"requests": 0, "sent": 0, "ok": 0})
        c["requests"] += 1
        c["sent"] += r.sent_s is not None
        c["ok"] += r.ok
    return out


def _std(vals: Sequence[float]) -> float:
    m = sum(vals) / len(vals)
    return math.sqrt(sum((v - m) ** 2 for v in vals) / len(vals))


def prepare_trace(args: argparse.Namespace) -> Trace:
    """Load, cut and time the trace as the flags say (every step lands in the trace's notes)."""
    trace = load_trace(args.trace, args.format)
    if not trace.requests:
        raise TraceError(f"{args.trace}: the trace has no request")
    if args.limit is not None:
        trace = head(trace, args.limit)
    # The transforms check their own ranges (ValueError): for a caller that built `args`
    # without this parser's types, that is a bad trace option, one line like any TraceError.
    try:
        if args.sample is not None:
            trace = sample(trace, args.sample, args.seed, by=args.sample_by, keep_times=False)
        if args.rate is not None:
            trace = retime_gamma(trace, args.rate, args.burstiness, args.seed)
        else:
            trace = scale_time(trace, 1.0 if args.time_scale is None else args.time_scale)
    except TraceError:
        raise
    except (ValueError, OverflowError) as e:
        raise TraceError(str(e)) from e
    if args.num_requests is not None:
        trace = head(trace, args.num_requests)
    return trace


def run_replay(
    trace: Trace,
    opts: ReplayOptions,
    slo: SLO,
    show_progress: bool = True,
    console: Console | None = None,
    extra: dict[str, Any] | None = None,
    keep_records: bool = True,
) -> dict[str, Any]:
    """Blocking wrapper: replay with a progress bar, then summarize."""
    progress = Progress(
        TextColumn("replay"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not show_progress,
    )
    with progress:
        bar = progress.add_task("replay", total=len(trace.requests))
        records = asyncio.run(replay(trace, opts, lambda d, n: progress.update(bar, completed=d)))
    return summarize(records, opts, slo, trace=trace, extra=extra, keep_records=keep_records)


def parse_goodput(items: Sequence[str] | None) -> SLO:
    """`vllm bench serve --goodput ttft:2000 tpot:100` (milliseconds) -> an SLO in seconds."""
    kw: dict[str, float | None] = {"ttft": None, "tpot": None, "e2e": None}
    for it in items or ():
        k, _, v = it.partition(":")
        k = {"e2el": "e2e"}.get(k.strip().lower(), k.strip().lower())
        if k not in kw:
            raise ValueError(f"goodput metric must be ttft, tpot or e2el, not {k!r}")
        try:
            ms = float(v)
        except ValueError:
            raise ValueError(f"goodput {it!r}: {v.strip()!r} is not a number of ms") from None
        if not math.isfinite(ms) or ms <= 0:
            raise ValueError(f"goodput {it!r}: milliseconds must be a finite number > 0")
        kw[k] = ms / 1000.0
    if not items:
        return SLO()
    return SLO(**kw)


def add_replay_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("trace")
    g.add_argument("--trace", required=True, help="trace file/dir or synthetic:k=v,...")
    g.add_argument("--format", default=None)
    g.add_argument("--limit", type=count, default=None, help="first N requests, before sampling")
    g.add_argument("--sample", type=positive, default=None, help="fraction (<=1) or count (>1)")
    g.add_argument("--sample-by", default="auto", choices=SAMPLE_BY)
    g.add_argument("--num-requests", type=count, default=None, help="send at most N")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("timing")
    g.add_argument(
        "--time-scale", type=positive, default=None, help="x trace times (0.5 = 2x rate; default 1)"
    )
    g.add_argument("--rate", type=positive, default=None, help="ignore trace times: req/s")
    g.add_argument(
        "--load",
        type=positive,
        default=None,
        help="replay at this fraction of the target's capacity (the trace's arrival pattern, "
        "its clock scaled): measured first by a closed-loop probe (bench/probe.py), or --capacity",
    )
    g.add_argument("--capacity", type=positive, default=None, help="with --load: req/s, no probe")
    g.add_argument("--burstiness", type=positive, default=1.0, help="gamma shape (1 = Poisson)")
    g.add_argument("--max-concurrency", type=int, default=64)
    g.add_argument("--duration", type=float, default=None, help="send nothing after N s")
    g.add_argument("--request-timeout", type=float, default=300.0)
    g.add_argument("--drain-timeout", type=float, default=120.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvgate bench replay", description=__doc__.split("\n")[0])
    p.add_argument(
        "--url",
        required=True,
        help="base URL, e.g. http://127.0.0.1:8000; several comma-separated (gateway replicas): "
        "each request goes to one of them at random (seeded by --seed), as an L4 balancer would",
    )
    p.add_argument("--model", default="sim-llama")
    p.add_argument(
        "--endpoint",
        choices=["completions", "text", "chat"],
        default="completions",
        help="completions: token-id prompts (exact); text: completions with a text prompt; chat",
    )
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--goodput", nargs="*", type=goodput, default=None, help="ttft:MS tpot:MS e2el:MS"
    )
    p.add_argument("--json", type=Path, default=out_path("replay.json"), help="%(default)s")
    p.add_argument("--no-records", action="store_true", help="leave per-request records out")
    p.add_argument("--quiet", action="store_true")
    add_replay_args(p)
    args = p.parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=160)
    if not split_urls(args.url):
        p.error("--url: no URL given")
    if sum(x is not None for x in (args.rate, args.time_scale, args.load)) > 1:
        p.error("give one of --rate, --time-scale and --load")
    if args.capacity is not None and args.load is None:
        p.error("--capacity goes with --load")
    try:
        trace = prepare_trace(args)
    except TraceError as e:
        exit_on_trace_error(p.prog, e)
    opts = ReplayOptions(
        url=args.url,
        model=args.model,
        endpoint=args.endpoint,
        api_key=args.api_key,
        max_concurrency=args.max_concurrency,
        duration_s=args.duration,
        request_timeout_s=args.request_timeout,
        drain_timeout_s=args.drain_timeout,
        spread_seed=args.seed,
    )
    pacing = None
    if args.load is not None:
        try:
            trace, pacing = pace_to_capacity(trace, opts, args.load, args.capacity, console)
        except TraceError as e:  # a trace without a span has no rate to scale
            exit_on_trace_error(p.prog, e)
    urls = opts.urls
    where = urls[0] if len(urls) == 1 else f"{len(urls)} URLs at random ({', '.join(urls)})"
    console.print(f"replaying {trace.describe()} against {where}", markup=False)
    res = run_replay(
        trace,
        opts,
        parse_goodput(args.goodput),
        not args.quiet,
        console,
        keep_records=not args.no_records,
        extra={"pacing": pacing} if pacing else None,
    )
    print_summary(res, console)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
        console.print(f"wrote {shown(args.json)}", markup=False)
    return 0 if res["failed"] == 0 else 1


def pace_to_capacity(
    trace: Trace, opts: ReplayOptions, load: float, capacity: float | None, console: Console
) -> tuple[Trace, dict[str, Any]]:
    """``--load``: the trace's clock scaled so it arrives at ``load`` x the target's capacity
    (given, or probed live on re-scoped copies of its requests)."""
    info: dict[str, Any] = {"by": "load", "load": load}
    if capacity is None:
        from bench.probe import run_probe

        console.print("pacing: probing the target's capacity (closed loops) ...", markup=False)
        probe = run_probe(
            trace,
            opts,
            max_concurrency=opts.max_concurrency,
            log=lambda m: console.print(m, markup=False),
        )
        if probe.req_s <= 0:
            raise SystemExit("pacing: the probe completed no request; check --url and the fleet")
        capacity = probe.req_s
        info["probe"] = probe.to_json()
        if probe.at_least:
            console.print(
                "pacing: still growing at --max-concurrency: the capacity is a lower bound",
                markup=False,
            )
    rate = load * capacity
    try:
        scale = rate_time_scale(trace, rate)
        paced = scale_time(trace, scale)
    except TraceError:
        raise
    except ValueError as e:  # a product past any float (--load 1e300 --capacity 1e10)
        raise TraceError(f"--load {load:g} x capacity {capacity:g}: {e}") from e
    info.update(capacity_req_s=round(capacity, 4), rate=round(rate, 4), time_scale=round(scale, 6))
    console.print(
        f"pacing: capacity {capacity:.3g} req/s; replaying at {rate:.3g} req/s ({load:g}x)",
        markup=False,
    )
    return paced, info


def print_summary(res: dict[str, Any], console: Console) -> None:
    """The `vllm bench serve` block, plus cache/routing lines."""

    def f(v: Any, d: int = 2) -> str:
        return "-" if v is None else f"{v:.{d}f}"

    lines = [
        f"requests: {res['completed']} ok, {res['failed']} failed, {res['not_sent']} not sent; "
        f"statuses {res['status_counts']}",
        f"duration {f(res['duration'])} s; {f(res['request_throughput'])} req/s, "
        f"goodput {f(res['request_goodput'])} req/s, {f(res['output_throughput'], 1)} output tok/s",
    ]
    for name in ("ttft", "tpot", "itl", "e2el"):
        lines.append(
            f"{name.upper():5} ms: mean {f(res[f'mean_{name}_ms'])}  median "
            f"{f(res[f'median_{name}_ms'])}  p90 {f(res[f'p90_{name}_ms'])}  p99 "
            f"{f(res[f'p99_{name}_ms'])}"
        )
    hr = res["hit_rate"]
    lines.append(
        f"prefix hit rate {'-' if hr is None else f'{hr:.1%}'}; workers {res['workers'] or '-'}; "
        f"prompt length check ({res['prompt_length_check']['tolerance']}): "
        f"{res['prompt_length_check']['mismatched']} mismatched"
    )
    if len(res.get("per_url") or {}) > 1:
        lines.append(
            "per URL (requests/ok): "
            + ", ".join(f"{u} {c['requests']}/{c['ok']}" for u, c in res["per_url"].items())
        )
    if res["errors"]:
        lines.append(f"errors: {res['errors']}")
    for line in lines:
        console.print(line, markup=False)


if __name__ == "__main__":
    sys.exit(main())
