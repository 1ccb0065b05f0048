"""Traces for the benches: one normalized request schema, converters, sampling, prompts, bounds.

Why one schema: every bench (offline simulation, HTTP replay, capacity search, comparisons) must
replay the *same* requests whatever the source, so each source is converted once into
`TraceRequest`s and everything downstream reads only those. A team replays its own traffic by
writing that JSONL (see bench/README.md); nothing else in bench/ knows about source formats.

The schema (one JSON object per line; an optional first line ``{"kvgate_trace": 1, ...}`` carries
metadata):

    arrival_s       seconds since the trace start (float, non-decreasing after `sort`)
    request_id      unique string
    tenant          tenant / group name ("" when unknown)
    session_id      conversation or agent session (null when unknown)
    input_length    prompt tokens
    output_length   tokens to generate (replays send max_tokens = output_length, ignore_eos)
    block_size      tokens per block id
    block_ids       one id per block of the prompt, block i = tokens [i*bs, (i+1)*bs): equal ids
                    mean equal content *and* equal prefix (ids name a prefix-tree node). Ints, or
                    strings for ids scoped by the converter ("trace_0001:17"). At least
                    floor(input_length / bs) and at most ceil(input_length / bs) of them; tokens
                    past the last id are unique to the request.
    prompt          optional text prompt (replayed as-is through chat/completions)
    prompt_token_ids optional token ids (replayed as-is)

Prompts without text are materialised from block ids (`prompt_token_ids`, `prompt_text`): every
id maps to a fixed pseudo-random block of tokens, so identical ids give identical tokens in every
run and process, and the prompt has exactly `input_length` tokens.

Mooncake-format traces (kvcache-ai/Mooncake) publish no text, only per-request lengths and
`hash_ids`: one id per 512-token block. The functions `load_mooncake`, `tokens_for_blocks` and
`infinite_cache_hit_rate` below predate the schema and stay as they were (bench/sim_speed.py).
"""

from __future__ import annotations

import argparse
import bisect
import csv
import hashlib
import json
import math
import random
import re
import sys
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

import numpy as np
import xxhash

from bench.argtypes import positive
from bench.conversations import MAX_BLOCK_SIZE, MAX_ZIPF_S, ConversationSpec, conversation
from bench.conversations import PREFIX as CONVERSATION
from bench.specs import parse_spec

MOONCAKE_BLOCK_TOKENS = 512
TOKEN_LOW, TOKEN_HIGH = 1000, 50000  # below 1000 are the sim tokenizer's words/generated ids

# Blocks are two slices of one shared random pool added together: materialising a block is then a
# couple of array slices rather than a seeded RNG per id (Mooncake has 44k ids, 61M prompt tokens).
# Two independent 20-bit offsets make accidental equality of two different ids ~1e-12 per pair.
_POOL_BITS = 20
# MAX_BLOCK_SIZE (bench.conversations): the largest block a trace may declare (tokens per block
# id). Real traces use 16..512, and a block is one slice of the token pool, which grows to the
# largest block: an absurd one is a malformed trace, not an 8 GB allocation.
_pool: np.ndarray | None = None

SCHEMA_VERSION = 1
BlockId = int | str
_MASK64 = (1 << 64) - 1


class TraceError(ValueError):
    """A trace that cannot be read (missing, or of no known format).

    Its own class so every bench CLI can report it as one line (`exit_on_trace_error`) instead
    of a traceback: a wrong path is a user's typo, not a bug.
    """


class TraceNotFoundError(TraceError, FileNotFoundError):
    """The trace path does not exist (also a FileNotFoundError, for callers that catch that)."""


class TraceRecord(NamedTuple):
    arrival_s: float  # seconds since the trace start
    input_length: int
    output_length: int
    hash_ids: list[int]


def load_mooncake(path: str | Path) -> Iterator[TraceRecord]:
    """Records of a Mooncake JSONL trace (`timestamp` in ms), in file order.

    A line that is not a record (not JSON, a field missing or of the wrong type) is a
    `TraceError` naming the line: in a file of 20k lines, "Expecting value: line 1 column 2"
    does not say which one."""
    for _, rec in _mooncake_lines(path):
        yield rec


def _mooncake_lines(path: str | Path) -> Iterator[tuple[int, TraceRecord]]:
    """(line number, record) of every record of a Mooncake JSONL trace (`load_mooncake`)."""
    with open(path, encoding="utf-8-sig") as f:  # -sig: a BOM written by Windows tools
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise TypeError("a record must be a JSON object")
                rec = TraceRecord(
                    float(row["timestamp"]) / 1000.0,
                    int(row["input_length"]),
                    int(row["output_length"]),
                    block_id_list(row.get("hash_ids", []), "hash_ids"),  # type: ignore[arg-type]
                )
            except KeyError as e:
                raise TraceError(f"{path}:{n}: missing field {e}") from None
            except (TypeError, ValueError, OverflowError) as e:
                # OverflowError: `1e999` (inf) or a 400-digit timestamp in a number field.
                raise TraceError(f"{path}:{n}: {e}") from None
            except RecursionError:
                raise TraceError(f"{path}:{n}: JSON nested too deeply") from None
            yield n, rec


def _get_pool(min_len: int) -> np.ndarray:
    global _pool
    if _pool is None or len(_pool) < (1 << _POOL_BITS) + min_len:
        rng = np.random.default_rng(0x6B76)  # fixed: the mapping must never change between runs
        _pool = rng.integers(0, TOKEN_HIGH - TOKEN_LOW, (1 << _POOL_BITS) + max(min_len, 4096))
    return _pool


def _block(pool: np.ndarray, scope: str, hash_id: int | str, block_tokens: int) -> np.ndarray:
    digest = hashlib.blake2b(f"{scope}\x00{hash_id}".encode(), digest_size=8).digest()
    key = int.from_bytes(digest, "little")
    mask = (1 << _POOL_BITS) - 1
    a = key & mask
    b = (key >> 32) & mask
    return pool[a : a + block_tokens] + pool[b : b + block_tokens]


def tokens_for_blocks(
    hash_ids: Sequence[int],
    input_length: int,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    scope: str = "",
) -> list[int]:
    """Token ids of a prompt made of the given blocks, trimmed to `input_length`.

    Each (scope, hash_id) maps to the same `block_tokens` ids in [1000, 50000) in every call and
    every process; `scope` lets two traces (or tenants) reuse ids without sharing content.
    """
    if input_length > len(hash_ids) * block_tokens:
        raise ValueError(
            f"input_length {input_length} exceeds {len(hash_ids)} blocks of {block_tokens} tokens"
        )
    needed = -(-input_length // block_tokens)
    if needed == 0:
        return []
    pool = _get_pool(block_tokens)
    span = TOKEN_HIGH - TOKEN_LOW
    blocks = [_block(pool, scope, h, block_tokens) for h in hash_ids[:needed]]
    tokens = np.concatenate(blocks)[:input_length]
    tokens %= span
    tokens += TOKEN_LOW
    return tokens.tolist()


def infinite_cache_hit_rate(
    records: Sequence[TraceRecord], block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> float:
    """Upper bound on the fleet hit rate: one worker with an unbounded cache, at trace granularity.

    A block hits when its id was seen before in any earlier request, capped like vLLM at
    `input_length - 1` tokens per request.
    """
    seen: set[int] = set()
    hits = total = 0
    for rec in records:
        cap_blocks = (rec.input_length - 1) // block_tokens
        matched = 0
        for h in rec.hash_ids[:cap_blocks]:
            if h not in seen:
                break
            matched += 1
        hits += matched * block_tokens
        total += rec.input_length
        seen.update(rec.hash_ids[: rec.input_length // block_tokens])
    return hits / total if total else 0.0


# ==================================================================================================
# The normalized schema
# ==================================================================================================


@dataclass(slots=True)
class TraceRequest:
    """One request of a normalized trace (see the module docstring for the field contract)."""

    arrival_s: float
    request_id: str
    input_length: int
    output_length: int
    block_size: int
    block_ids: list[BlockId] = field(default_factory=list)
    tenant: str = ""
    session_id: str | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None

    def validate(self) -> None:
        """Raise ValueError on a record that would replay wrongly (checked at load, not per use).

        Types too, for records a converter or a generator built rather than `from_json`: a NaN
        or infinite time sorts anywhere, sums to NaN in every rate and sleeps forever in a
        replay; a block id that is neither an int nor a string has no key (`chain_keys`); a
        session id that is not a string is no header value and, as a list, no dict key."""
        rid = self.request_id
        if not math.isfinite(self.arrival_s):
            raise ValueError(f"{rid}: arrival_s must be a finite number, not {self.arrival_s}")
        if not isinstance(self.block_ids, list) or not all(
            isinstance(b, int | str) and not isinstance(b, bool) for b in self.block_ids
        ):
            raise ValueError(f"{rid}: block_ids must be a list of integers or strings")
        if self.session_id is not None and not isinstance(self.session_id, str):
            raise ValueError(f"{rid}: session_id must be a string or null")
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise ValueError(f"{rid}: prompt must be a string")
        if self.prompt_token_ids is not None and (
            not isinstance(self.prompt_token_ids, list)
            or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in self.prompt_token_ids
            )
        ):
            raise ValueError(f"{rid}: prompt_token_ids must be a list of integers")
        if self.input_length < 1:
            raise ValueError(f"{self.request_id}: input_length must be >= 1")
        if self.output_length < 0:
            raise ValueError(f"{self.request_id}: output_length must be >= 0")
        if not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            # A block's tokens are one slice of the shared token pool (`prompt_token_ids`), which
            # grows to the largest block: `block_size: 1e9` used to allocate ~8 GB.
            raise ValueError(
                f"{self.request_id}: block_size must be 1..{MAX_BLOCK_SIZE}, not {self.block_size}"
            )
        lo, hi = self.input_length // self.block_size, -(-self.input_length // self.block_size)
        if (
            self.prompt is None
            and self.prompt_token_ids is None
            and not (lo <= len(self.block_ids) <= hi)
        ):
            raise ValueError(
                f"{self.request_id}: {len(self.block_ids)} block ids for {self.input_length} "
                f"tokens in blocks of {self.block_size} (expected {lo}..{hi})"
            )
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) != self.input_length:
            raise ValueError(f"{self.request_id}: prompt_token_ids length != input_length")

    @property
    def full_blocks(self) -> int:
        """Block ids that cover a whole block of the prompt (the only ones a cache can reuse)."""
        return min(len(self.block_ids), self.input_length // self.block_size)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("prompt", "prompt_token_ids"):
            if d[k] is None:
                del d[k]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TraceRequest:
        return cls(
            arrival_s=float(d["arrival_s"]),
            request_id=str(d["request_id"]),
            input_length=int(d["input_length"]),
            output_length=int(d["output_length"]),
            block_size=int(d["block_size"]),
            block_ids=block_id_list(d.get("block_ids")),
            tenant=str(d.get("tenant") or ""),
            session_id=_session_id(d.get("session_id")),
            prompt=d.get("prompt"),
            prompt_token_ids=d.get("prompt_token_ids"),
        )


def block_id_list(value: Any, name: str = "block_ids") -> list[BlockId]:
    """A record's block ids as the schema has them: a list of ints and strings (null: none).

    An integral float is its int (a writer that passed the ids through a float: `3.0` is id 3,
    with the same key). Anything else is a ValueError rather than a guess: `list("ab")` would be
    two ids, and a float, null or nested id has no key."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ValueError(f"{name} must be a list, not {type(value).__name__}")
    if all(type(b) is int or type(b) is str for b in value):  # every real trace: no copy
        return value
    out: list[BlockId] = []
    for b in value:
        if isinstance(b, float) and b.is_integer():
            out.append(int(b))
        elif isinstance(b, int | str) and not isinstance(b, bool):
            out.append(b)
        else:
            raise ValueError(f"{name} must hold integers or strings, not {b!r}")
    return out


def _session_id(value: Any) -> str | None:
    """A record's session id as a string: a number names a session as well as its text does
    (`7` and `"7"` are one session), but a list or an object names none."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, int | float):
        return str(value)
    raise ValueError(f"session_id must be a string or a number, not {type(value).__name__}")


@dataclass(slots=True)
class Trace:
    """Requests in arrival order plus where they came from and every transform applied to them.

    `notes` accumulates one line per transform (sampling, time scaling, synthesis parameters), so
    any report can state exactly what was replayed.
    """

    requests: list[TraceRequest]
    source: str
    format: str
    notes: list[str] = field(default_factory=list)

    @property
    def block_size(self) -> int:
        return self.requests[0].block_size if self.requests else 0

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0

    def describe(self) -> str:
        parts = [f"{Path(self.source).name} ({self.format}, {len(self.requests)} requests)"]
        return "; ".join(parts + self.notes)

    def meta(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "format": self.format,
            "requests": len(self.requests),
            "duration_s": round(self.duration_s, 3),
            "block_size": self.block_size,
            "notes": list(self.notes),
        }

    def replace(self, requests: list[TraceRequest], note: str | None = None) -> Trace:
        return Trace(requests, self.source, self.format, [*self.notes, *([note] if note else [])])


def write_jsonl(path: str | Path, trace: Trace) -> None:
    """Write a trace in the normalized JSONL (header line, then one request per line)."""
    with open(path, "w", encoding="utf-8") as f:
        header = {"kvgate_trace": SCHEMA_VERSION, **trace.meta()}
        f.write(json.dumps(header) + "\n")
        for r in trace.requests:
            f.write(json.dumps(r.to_json(), separators=(",", ":")) + "\n")


def read_jsonl(path: str | Path) -> Trace:
    """Read a normalized JSONL trace (header optional), validating every request; a record that
    cannot be replayed is a `TraceError` naming its line."""
    reqs: list[TraceRequest] = []
    source, fmt, notes = str(path), "kvgate", []
    lines: dict[str, int] = {}  # request id -> its line, for a duplicate's message
    with open(path, encoding="utf-8-sig") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except ValueError as e:
                raise TraceError(f"{path}:{n}: not JSON: {e}") from None
            except RecursionError:
                raise TraceError(f"{path}:{n}: not JSON: nested too deeply") from None
            if not isinstance(d, dict):
                raise TraceError(f"{path}:{n}: a record must be a JSON object")
            if "kvgate_trace" in d:
                if d["kvgate_trace"] != SCHEMA_VERSION:
                    raise TraceError(f"{path}: schema version {d['kvgate_trace']} not supported")
                fmt = f"kvgate (from {d.get('format', '?')})"
                notes = d.get("notes") or []
                if isinstance(notes, str):  # one note, not one per character
                    notes = [notes]
                if not isinstance(notes, list):
                    raise TraceError(f"{path}:{n}: the header's notes must be a list of lines")
                notes = [str(x) for x in notes]
                continue
            try:
                r = TraceRequest.from_json(d)
                r.validate()
            except KeyError as e:
                raise TraceError(f"{path}:{n}: missing field {e}") from None
            except (TypeError, ValueError, OverflowError) as e:
                raise TraceError(f"{path}:{n}: {e}") from None
            except RecursionError:
                raise TraceError(f"{path}:{n}: a field nested too deeply") from None
            if r.request_id in lines:
                raise TraceError(
                    f"{path}:{n}: request_id {r.request_id!r} is already on line "
                    f"{lines[r.request_id]} (request ids must be unique)"
                )
            lines[r.request_id] = n
            reqs.append(r)
    return Trace(sort_requests(reqs), source, fmt, notes)


def sort_requests(reqs: list[TraceRequest]) -> list[TraceRequest]:
    """Stable sort by arrival: converters interleave sessions, replays need time order."""
    return sorted(reqs, key=lambda r: r.arrival_s)


# ==================================================================================================
# Converters
# ==================================================================================================


def from_mooncake(path: str | Path) -> Trace:
    """Mooncake JSONL: `timestamp` (ms), `input_length`, `output_length`, `hash_ids` (512 tokens).

    Ids are global to the file (a flattened prefix tree), so they stay plain ints.
    """
    reqs = []
    for i, (n, rec) in enumerate(_mooncake_lines(path)):
        r = TraceRequest(
            arrival_s=rec.arrival_s,
            request_id=f"mooncake-{i}",
            input_length=rec.input_length,
            output_length=rec.output_length,
            block_size=MOONCAKE_BLOCK_TOKENS,
            block_ids=list(rec.hash_ids),
        )
        try:
            r.validate()
        except ValueError as e:
            raise TraceError(f"{path}:{n}: {e}") from None
        reqs.append(r)
    return Trace(sort_requests(reqs), str(path), "mooncake")


def _segment_block_ids(segments: Sequence[tuple[str, int]], block_size: int) -> list[int]:
    """Block ids for a prompt made of named segments (key, tokens), e.g. system prompt + question.

    Id i is a chained hash of the segment pieces inside block i and id i-1, so two prompts get
    equal ids exactly as far as they are built of the same segments in the same order: a block
    straddling a shared system prompt and a per-request question is unique, as on a real engine.
    Ids are unsigned 63-bit ints (JSON-safe in most readers, compact in the JSONL).
    """
    total = sum(n for _, n in segments)
    starts: list[int] = []
    pos = 0
    for _, n in segments:
        starts.append(pos)
        pos += n
    ids: list[int] = []
    parent = 0
    nblocks = -(-total // block_size)
    seg = 0
    for b in range(nblocks):
        lo, hi = b * block_size, min((b + 1) * block_size, total)
        h = xxhash.xxh3_64(parent.to_bytes(8, "little"))
        while seg < len(segments) and starts[seg] + segments[seg][1] <= lo:
            seg += 1
        s = seg
        while s < len(segments) and starts[s] < hi:
            key, n = segments[s]
            a, z = max(lo, starts[s]) - starts[s], min(hi, starts[s] + n) - starts[s]
            h.update(f"{key}\x00{a}\x00{z}\x01".encode())
            s += 1
        parent = h.intdigest() >> 1
        ids.append(parent)
    return ids


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (k + 1) ** s for k in range(n)]


def _parse_azure_time(text: str) -> float:
    """`2023-11-16 18:17:03.9799600` -> POSIX seconds (7 fractional digits: parsed by hand).

    The trace's times are UTC (they carry no zone): read in the machine's local zone, a trace
    crossing a daylight-saving change gained or lost an hour of arrivals with `TZ`."""
    text = text.strip()
    base, _, frac = text.partition(".")
    t = datetime.strptime(base, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC).timestamp()
    return t + (float("0." + frac) if frac else 0.0)


@dataclass(slots=True, frozen=True)
class AzurePrefixModel:
    """How shared prefixes are synthesized for the Azure trace, which records none.

    Each request belongs to one of `tenants` tenants drawn with Zipf(`zipf_s`) popularity (tenant 0
    the most popular); tenant k has a system prompt of `sys_min..sys_max` tokens (log-uniform,
    drawn once per tenant). A request's prompt is the first min(system prompt, `max_share` x its
    context) tokens of its tenant's system prompt followed by unique tokens. Everything is drawn
    from `seed`, so one seed is one synthetic trace.
    """

    tenants: int = 32
    zipf_s: float = 1.0
    sys_min: int = 256
    sys_max: int = 4096
    max_share: float = 0.9
    block_size: int = 64
    seed: int = 0

    def describe(self) -> str:
        return (
            f"azure prefixes synthesized: {self.tenants} tenants, Zipf s={self.zipf_s}, system "
            f"prompts {self.sys_min}-{self.sys_max} tokens (log-uniform), at most "
            f"{self.max_share:.0%} of a prompt shared, block {self.block_size}, seed {self.seed}"
        )


def from_azure(path: str | Path, model: AzurePrefixModel | None = None) -> Trace:
    """Azure LLM inference trace CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`).

    Arrivals and lengths are real; prefixes are synthesized by `AzurePrefixModel` (documented
    there and recorded in the trace notes) because the trace has no prefix information.
    """
    m = model or AzurePrefixModel()
    rng = random.Random(m.seed)
    lo, hi = math.log(m.sys_min), math.log(m.sys_max)
    sys_len = [round(math.exp(rng.uniform(lo, hi))) for _ in range(m.tenants)]
    cum = list(np.cumsum(_zipf_weights(m.tenants, m.zipf_s)))
    rows: list[tuple[float, int, int]] = []
    with open(path, encoding="utf-8-sig", newline="") as f:  # -sig: Excel's BOM
        reader = csv.reader(f)
        header = next(reader, [])
        if [h.strip() for h in header[:3]] != ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
            raise TraceError(f"{path}: not an Azure trace header: {header}")
        for row in reader:
            if not row:
                continue
            if len(row) < 3:  # a truncated or hand-edited row: its line, not an IndexError
                raise TraceError(
                    f"{path}:{reader.line_num}: expected 3 columns "
                    f"(TIMESTAMP,ContextTokens,GeneratedTokens), found {len(row)}"
                )
            try:
                rows.append((_parse_azure_time(row[0]), int(row[1]), int(row[2])))
            except ValueError as e:
                raise TraceError(f"{path}:{reader.line_num}: {e}") from None
    t0 = min((r[0] for r in rows), default=0.0)
    reqs = []
    for i, (t, ctx, gen) in enumerate(rows):
        ctx = max(1, ctx)
        k = bisect.bisect_left(cum, rng.random() * cum[-1])
        shared = min(sys_len[k], int(ctx * m.max_share))
        segments = [(f"az-sys-{m.seed}-{k}", shared), (f"az-req-{i}", ctx - shared)]
        reqs.append(
            TraceRequest(
                arrival_s=t - t0,
                request_id=f"azure-{i}",
                input_length=ctx,
                output_length=max(0, gen),
                block_size=m.block_size,
                block_ids=list(_segment_block_ids([s for s in segments if s[1]], m.block_size)),
                tenant=f"tenant-{k}",
            )
        )
    return Trace(sort_requests(reqs), str(path), "azure", [m.describe()])


def from_weka(paths: str | Path | Sequence[str | Path], stagger_s: float = 60.0) -> Trace:
    """Agentic session JSON files (one session per file, ids local to the file).

    Each file is a session (`session_id` = the file's `id`), its ids are scoped by that id (two
    sessions' id 7 are unrelated), a sub-agent is its own session (`<id>/<agent_id>`) that starts at
    the parent's time plus its `t` and shares the file's id scope. Files carry no absolute start
    time, so session k (sorted by file name) starts at k x `stagger_s`.
    """
    files = _weka_files(paths)
    reqs: list[TraceRequest] = []
    sessions: set[str] = set()
    for k, fp in enumerate(files):
        # Every error names its file: a directory holds dozens of sessions.
        try:
            d = json.loads(Path(fp).read_text(encoding="utf-8-sig"))
            if not isinstance(d, dict):
                raise TypeError(f"a session file is a JSON object, not {type(d).__name__}")
            # Two files with one id (a copied session) are two sessions, each its own id scope.
            sid = _unique_session(str(d.get("id") or Path(fp).stem), sessions)
            bs = int(d["block_size"])
            _weka_session(reqs, d["requests"], sid, sid, bs, k * stagger_s, sessions)
        except KeyError as e:
            raise TraceError(f"{fp}: missing field {e}") from None
        except (TypeError, ValueError, OverflowError) as e:
            raise TraceError(f"{fp}: {e}") from None
        except RecursionError:
            raise TraceError(f"{fp}: JSON nested too deeply") from None
        except OSError as e:
            raise TraceError(f"{fp}: cannot read it: {e.strerror or e}") from None
    for r in reqs:
        r.validate()
    notes = [f"{len(files)} sessions staggered by {stagger_s:g} s, ids scoped per file"]
    src = str(paths) if isinstance(paths, str | Path) else f"{len(files)} files"
    return Trace(sort_requests(reqs), src, "weka-agentic", notes)


def _weka_files(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    """The session files of a directory (or the files given). Dotfiles are not sessions:
    macOS leaves a `._x.json` resource fork next to every file it copies, editors leave
    `.x.json` swaps; nor is a subdirectory that happens to end in `.json`."""
    if isinstance(paths, str | Path):
        p = Path(paths)
        if not p.is_dir():
            return [p]
        return sorted(f for f in p.glob("*.json") if not f.name.startswith(".") and f.is_file())
    return sorted(Path(p) for p in paths)


def _unique_session(name: str, taken: set[str]) -> str:
    """`name`, or `name~2`, `name~3`, ... when an earlier session of the trace has it (taken
    now). Request ids are `<session>#<n>`: two sub-agents run under one `agent_id`, or two
    files with one `id`, would otherwise give two requests one id, which every replay keys
    requests by."""
    out, k = name, 1
    while out in taken:
        k += 1
        out = f"{name}~{k}"
    taken.add(out)
    return out


def _weka_session(
    out: list[TraceRequest],
    requests: list[dict[str, Any]],
    scope: str,
    session: str,
    bs: int,
    start: float,
    sessions: set[str],
) -> None:
    if not isinstance(requests, list):
        raise TypeError(f"{session}: requests must be a list, not {type(requests).__name__}")
    n = 0
    for r in requests:
        if not isinstance(r, dict):
            raise TypeError(f"{session}: a request is a JSON object, not {type(r).__name__}")
        if r.get("type") == "subagent":
            sub = _unique_session(f"{session}/{r.get('agent_id', len(out))}", sessions)
            t = start + float(r["t"])
            _weka_session(out, r.get("requests", []), scope, sub, bs, t, sessions)
            continue
        out.append(
            TraceRequest(
                arrival_s=start + float(r["t"]),
                request_id=f"{session}#{n}",
                input_length=int(r["in"]),
                output_length=int(r["out"]),
                block_size=bs,
                block_ids=[f"{scope}:{h}" for h in block_id_list(r["hash_ids"], "hash_ids")],
                tenant=scope,
                session_id=session,
            )
        )
        n += 1


@dataclass(slots=True, frozen=True)
class SyntheticSpec:
    """A shared-prefix workload: groups x users, each group with its own system prompt.

    Requests arrive as a Poisson process at `rate` req/s; each picks a group with Zipf(`zipf_s`)
    popularity (0 = uniform) and a user in it uniformly. The prompt is the group's system prompt
    (`system_tokens`) then a fresh `question_tokens` question; with `multi_turn` the user's earlier
    questions and answers come in between (a growing conversation, `session_id` per user). This is
    the llm-d / SGLang shared-prefix benchmark shape (150 groups x 5 users, 6k system prompts).
    """

    groups: int = 150
    users: int = 5
    system_tokens: int = 6000
    question_tokens: int = 1200
    output_tokens: int = 200
    zipf_s: float = 0.0
    rate: float = 10.0
    num_requests: int = 2000
    multi_turn: bool = False
    block_size: int = 64
    seed: int = 0

    def describe(self) -> str:
        return (
            f"synthetic: {self.groups} groups x {self.users} users, system {self.system_tokens} + "
            f"question {self.question_tokens} tokens, output {self.output_tokens}, Zipf "
            f"s={self.zipf_s}, Poisson {self.rate:g} req/s, {self.num_requests} requests"
            f"{', multi-turn' if self.multi_turn else ''}, block {self.block_size}, "
            f"seed {self.seed}"
        )

    @classmethod
    def parse(cls, text: str) -> SyntheticSpec:
        """`synthetic:groups=8,users=4,rate=5` -> a spec (unknown keys fail loudly, and so do
        values no trace can have: they used to fail deep in `synthetic` as an IndexError or a
        ZeroDivisionError, or make records the reader refuses)."""
        spec = parse_spec(cls, text, "synthetic")
        if min(spec.groups, spec.users, spec.num_requests, spec.block_size) < 1:
            raise ValueError("synthetic: groups, users, num_requests and block_size must be >= 1")
        if spec.block_size > MAX_BLOCK_SIZE:
            raise ValueError(f"synthetic: block_size must be <= {MAX_BLOCK_SIZE}")
        if not (math.isfinite(spec.zipf_s) and -MAX_ZIPF_S <= spec.zipf_s <= MAX_ZIPF_S):
            raise ValueError(
                f"synthetic: zipf_s must be within -{MAX_ZIPF_S:g}..{MAX_ZIPF_S:g}, "
                f"not {spec.zipf_s:g}"
            )
        if spec.rate <= 0:
            raise ValueError("synthetic: rate must be > 0 (requests per second)")
        if min(spec.system_tokens, spec.question_tokens, spec.output_tokens) < 0:
            raise ValueError(
                "synthetic: system_tokens, question_tokens, output_tokens must be >= 0"
            )
        if spec.system_tokens + spec.question_tokens < 1:
            raise ValueError("synthetic: system_tokens + question_tokens must be >= 1 (a prompt)")
        return spec


def synthetic(spec: SyntheticSpec) -> Trace:
    """Generate the shared-prefix workload described by `spec` (deterministic for its seed)."""
    rng = random.Random(spec.seed)
    cum = list(np.cumsum(_zipf_weights(spec.groups, spec.zipf_s)))
    history: dict[tuple[int, int], list[tuple[str, int]]] = {}
    t = 0.0
    reqs = []
    for i in range(spec.num_requests):
        t += rng.expovariate(spec.rate) if spec.rate > 0 else 0.0
        g = bisect.bisect_left(cum, rng.random() * cum[-1])
        u = rng.randrange(spec.users)
        past = history.setdefault((g, u), []) if spec.multi_turn else []
        segments = [
            (f"syn-sys-{spec.seed}-{g}", spec.system_tokens),
            *past,
            (f"syn-q-{spec.seed}-{i}", spec.question_tokens),
        ]
        segments = [s for s in segments if s[1] > 0]
        total = sum(n for _, n in segments)
        reqs.append(
            TraceRequest(
                arrival_s=t,
                request_id=f"syn-{i}",
                input_length=total,
                output_length=spec.output_tokens,
                block_size=spec.block_size,
                block_ids=list(_segment_block_ids(segments, spec.block_size)),
                tenant=f"group-{g}",
                session_id=f"g{g}-u{u}",
            )
        )
        if spec.multi_turn:
            past += [segments[-1], (f"syn-a-{spec.seed}-{i}", spec.output_tokens)]
    return Trace(reqs, "synthetic", "synthetic", [spec.describe()])


# `synthetic`, `synthetic:k=v,...`, `conversation:...`: a generator's spec, not a file name
# (`conversations.jsonl` and `synthetic_trace.jsonl` are files).
_GENERATOR_SPEC = re.compile(rf"(synthetic|{CONVERSATION})(:|\Z)")

# How much of a file's first line format detection reads: a whole record however long (a
# weka session file is one line of ~100 kB; a Mooncake line of 20k hash ids is ~150 kB), but
# not a whole multi-GB file that has no newline.
_FIRST_LINE_CHARS = 8 << 20


def generator_of(path: str | Path) -> str | None:
    """`synthetic` or `conversation` when `path` is that generator's spec, else None (a path).

    Only the name itself or the name and a colon is a spec, and an existing path is a path
    whatever its name: `cd bench/data/traces/mooncake && ... info synthetic_trace.jsonl` reads
    the file rather than silently generating 2,000 synthetic requests in its place."""
    m = _GENERATOR_SPEC.match(str(path))
    if m is None or _exists(path):
        return None
    return m.group(1)


def _exists(path: str | Path) -> bool:
    """Whether `path` names something, where a name no file can have (a long generator spec
    is one 255+ character file name: ENAMETOOLONG) names nothing rather than raising."""
    try:
        return Path(path).exists()
    except OSError:
        return False


def detect_format(path: str | Path) -> str:
    """`mooncake` | `azure` | `weka-agentic` | `kvgate` | `synthetic` | `conversation`, from the
    file's content (the generators from their spec)."""
    gen = generator_of(path)
    if gen is not None:
        return gen
    p = Path(path)
    if p.is_dir():
        if _weka_files(p):
            return "weka-agentic"
        raise TraceError(f"{p}: a directory without *.json session files")
    with open(p, encoding="utf-8-sig") as f:  # -sig: a BOM is no format's first character
        first = f.readline(_FIRST_LINE_CHARS)
        while first and not first.strip():  # leading blank lines
            first = f.readline(_FIRST_LINE_CHARS)
        head = first + f.read(4096)  # a pretty-printed session file's keys follow its "{"
    first = first.strip()
    if first.upper().startswith("TIMESTAMP,"):
        return "azure"
    if first.startswith("{"):
        try:
            d = json.loads(first)
        except json.JSONDecodeError:  # one big (pretty-printed or long) object: a session file
            d = None
        except RecursionError:
            raise TraceError(f"{p}: its first line is JSON nested too deeply") from None
        if isinstance(d, dict):
            if "kvgate_trace" in d or ("arrival_s" in d and "input_length" in d):
                return "kvgate"
            if "hash_ids" in d and "timestamp" in d:
                return "mooncake"
            if "requests" in d and "block_size" in d:
                return "weka-agentic"
        if '"requests"' in head and '"block_size"' in head:
            return "weka-agentic"
    raise TraceError(f"{p}: cannot tell the trace format from its content")


def check_trace_path(path: str | Path) -> None:
    """Raise `TraceNotFoundError` (one readable line, naming the shipped samples) for a path that
    does not exist; `synthetic:...` and `conversation:...` specs are not paths."""
    if generator_of(path) is not None or _exists(path):
        return
    from bench.paths import TRACES_DIR, shown

    hint = f"; sample traces are in {shown(TRACES_DIR)}/" if TRACES_DIR.is_dir() else ""
    raise TraceNotFoundError(f"trace not found: {path}{hint}")


def exit_on_trace_error(prog: str, error: TraceError) -> NoReturn:
    """Print `prog: error: ...` as one line on stderr and exit 2, like an argparse usage error."""
    print(f"{prog}: error: {error}", file=sys.stderr)
    raise SystemExit(2)


def load_trace(path: str | Path, fmt: str | None = None, **options: Any) -> Trace:
    """Any supported trace, format detected unless given. `options` go to the converter.

    A trace that cannot be used (a malformed record, a bad generator spec such as
    `conversation:sessions=0`, an unreadable file, two requests with one id) is a `TraceError`
    (one line for the CLIs, `exit_on_trace_error`); the converter's own exception stays
    chained for a debugger. An IndexError or AttributeError is one too: a converter that trips
    on a shape it did not expect has still been given a file it cannot use, and the user needs
    its name, not a traceback."""
    check_trace_path(path)
    try:
        trace = _convert(path, fmt or detect_format(path), options)
    except TraceError:
        raise
    except KeyError as e:
        raise TraceError(f"{path}: missing field {e}") from e
    except (ValueError, TypeError, OverflowError) as e:
        raise TraceError(f"{path}: {e}") from e
    except RecursionError as e:
        raise TraceError(f"{path}: malformed trace (nested too deeply)") from e
    except (IndexError, AttributeError) as e:
        raise TraceError(f"{path}: malformed trace ({type(e).__name__}: {e})") from e
    except OSError as e:
        raise TraceError(f"{path}: cannot read it: {e}") from e
    seen: set[str] = set()
    for r in trace.requests:  # every format (read_jsonl names the line first)
        if r.request_id in seen:
            raise TraceError(
                f"{path}: request_id {r.request_id!r} appears twice (ids must be unique)"
            )
        seen.add(r.request_id)
    return trace


def _generated(spec: str, trace: Trace) -> Trace:
    """A generator's trace held to the reader's rules: a spec the range checks let through
    must still never make a record `read_jsonl` would refuse, nor a trace of no request that
    `traces info` would describe as if it were one."""
    for r in trace.requests:
        r.validate()
    if not trace.requests:
        hint = " (no first turn fits max_input)" if trace.format == CONVERSATION else ""
        raise TraceError(f"{spec}: the spec generates no request{hint}")
    return trace


def _convert(path: str | Path, fmt: str, options: dict[str, Any]) -> Trace:
    if fmt in ("synthetic", CONVERSATION) and generator_of(path) != fmt:
        # `convert real.jsonl --format synthetic` silently wrote the default synthetic trace
        # in the file's place: a generator reads a spec, never a file.
        raise TraceError(
            f"{path}: --format {fmt} generates a trace from a spec ({fmt}:k=v,...), "
            f"not from {'this existing file' if _exists(path) else 'a path'}"
        )
    if fmt == "mooncake":
        return from_mooncake(path)
    if fmt == "azure":
        return from_azure(path, AzurePrefixModel(**options) if options else None)
    if fmt == "weka-agentic":
        return from_weka(path, **options)
    if fmt == "kvgate":
        return read_jsonl(path)
    if fmt == "synthetic":
        spec = SyntheticSpec.parse(str(path))
        return _generated(str(path), synthetic(spec))
    if fmt == CONVERSATION:
        return _generated(str(path), conversation(ConversationSpec.parse(str(path))))
    raise TraceError(f"unknown trace format {fmt!r}")


# ==================================================================================================
# Sampling and time
# ==================================================================================================


SAMPLE_BY = ("auto", "request", "session", "prefix", "window")


def sample(
    trace: Trace, amount: float, seed: int = 0, by: str = "auto", keep_times: bool = True
) -> Trace:
    """A seeded random subset, in time order: `amount` <= 1 is a fraction, > 1 a count.

    The unit sampled decides what sharing survives: `by="session"` keeps or drops whole sessions
    (a conversation cut in the middle loses the prefix sharing it is replayed for), `"prefix"`
    whole prefix families (requests whose first block is the same: Mooncake's shared documents),
    `"request"` single requests (which thins every family and so the hit-rate bound), `"window"`
    one contiguous run of requests at a seeded offset (a slice of production time: its rate,
    burstiness and the overlap of conversations stay as they were; sessions in progress at its
    edges are cut). `"auto"` picks session when every request has one, else prefix when block
    ids exist.
    A count counts units (sessions, families or requests). Arrival times are kept, so a fraction
    also scales the rate (stated in the note); `keep_times=False` re-bases the sample at 0.
    """
    reqs = trace.requests
    if not (math.isfinite(amount) and amount > 0):  # inf: no count; NaN: no fraction
        raise ValueError(f"sample must be a finite number > 0, not {amount:g}")
    if by == "auto":
        if reqs and all(r.session_id for r in reqs):
            by = "session"
        elif reqs and any(r.full_blocks for r in reqs):
            by = "prefix"
        else:
            by = "request"
    rng = random.Random(seed)
    if by in ("session", "prefix"):
        unit = _session_unit if by == "session" else _prefix_unit
        units = sorted({unit(r) for r in reqs}, key=str)
        k = _amount(amount, len(units))
        keep = set(rng.sample(units, k))
        out = [r for r in reqs if unit(r) in keep]
        what = f"{k} of {len(units)} {'sessions' if by == 'session' else 'prefix families'}"
    elif by == "request":
        k = _amount(amount, len(reqs))
        idx = sorted(rng.sample(range(len(reqs)), k))
        out = [reqs[i] for i in idx]
        what = f"{k} of {len(reqs)} requests"
    elif by == "window":
        k = _amount(amount, len(reqs))
        start = rng.randrange(len(reqs) - k + 1)
        out = reqs[start : start + k]
        what = f"requests {start}-{start + k - 1} of {len(reqs)}, contiguous"
    else:
        raise ValueError(f"sample by one of {', '.join(SAMPLE_BY)}, not {by!r}")
    if not keep_times and out:
        t0 = out[0].arrival_s
        out = [_with_time(r, r.arrival_s - t0) for r in out]
    return trace.replace(out, f"sample: {what} (seed {seed})")


def _session_unit(r: TraceRequest) -> str:
    return r.session_id or r.request_id


def _prefix_unit(r: TraceRequest) -> str:
    return str(r.block_ids[0]) if r.full_blocks else r.request_id


def _amount(amount: float, n: int) -> int:
    k = round(amount * n) if amount <= 1 else int(amount)
    return max(1, min(n, k))


def head(trace: Trace, n: int) -> Trace:
    """The first n requests (a time window that keeps every prefix relation inside it)."""
    return trace.replace(trace.requests[:n], f"first {min(n, len(trace.requests))} requests")


def window(trace: Trace, start_s: float, duration_s: float) -> Trace:
    """Requests arriving in [start, start + duration), re-based to start at 0."""
    out = [
        _with_time(r, r.arrival_s - start_s)
        for r in trace.requests
        if start_s <= r.arrival_s < start_s + duration_s
    ]
    return trace.replace(out, f"window {start_s:g}-{start_s + duration_s:g} s")


def check_time_scale(trace: Trace, time_scale: float) -> None:
    """ValueError unless `time_scale` is a finite number > 0 that keeps every arrival of `trace`
    finite (`--rate-scale 1e-320` is a time scale of inf; x1e300 overflows a long trace), so a
    tool can check the scale it will run before it forks anything."""
    if not (math.isfinite(time_scale) and time_scale > 0):
        raise ValueError(f"time scale must be a finite number > 0, not {time_scale:g}")
    reqs = trace.requests
    if reqs and not all(math.isfinite(r.arrival_s * time_scale) for r in (reqs[0], reqs[-1])):
        raise ValueError(f"time scale x{time_scale:g} puts arrivals past any finite time")


def scale_time(trace: Trace, time_scale: float) -> Trace:
    """Multiply every arrival time by `time_scale` (0.5 = twice the request rate)."""
    check_time_scale(trace, time_scale)
    if time_scale == 1.0:
        return trace
    out = [_with_time(r, r.arrival_s * time_scale) for r in trace.requests]
    return trace.replace(out, f"time scale x{time_scale:g} (rate x{1 / time_scale:.3g})")


def mean_rate(trace: Trace) -> float | None:
    """The trace's mean arrival rate, req/s: (n - 1) / span, one over the mean gap between
    arrivals. The one definition every bench uses (`rate_time_scale`, `bench.capacity`'s rates),
    so a rate one tool reports is the rate another replays. None for a trace without a span
    (fewer than two requests, or all at one instant), whose rate no time scale can change."""
    n, span = len(trace.requests), trace.duration_s
    if n < 2 or span <= 0:
        return None
    return (n - 1) / span


def rate_time_scale(trace: Trace, rate: float) -> float:
    """The time scale that replays `trace` at `rate` requests/s on average (`mean_rate`; its
    arrivals keep their shape: bursts stay bursts, only the clock runs faster or slower).

    A trace without a span has no rate to scale: asking for one is a `TraceError` rather than a
    replay that silently ignores the rate asked for."""
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a finite number > 0, not {rate:g}")
    base = mean_rate(trace)
    if base is None:
        raise TraceError(
            f"a trace of {len(trace.requests)} requests arriving at one instant has no rate to "
            "scale: give a time scale, or a trace spanning some time"
        )
    return base / rate


def cap_output(trace: Trace, max_tokens: int) -> Trace:
    """Clamp output lengths: on a small machine an HTTP replay's cost is its SSE events."""
    out = []
    for r in trace.requests:
        if r.output_length > max_tokens:
            r = _with_time(r, r.arrival_s)
            r.output_length = max_tokens
        out.append(r)
    return trace.replace(out, f"outputs capped at {max_tokens} tokens")


def retime_gamma(trace: Trace, rate: float, burstiness: float = 1.0, seed: int = 0) -> Trace:
    """Replace arrival times by a gamma renewal process at `rate` req/s, as `vllm bench serve`.

    `burstiness` is the gamma shape: 1 is Poisson, < 1 burstier, > 1 more regular; the mean gap
    stays 1/rate. Request order is kept.
    """
    if not all(math.isfinite(x) and x > 0 for x in (rate, burstiness)):
        raise ValueError(
            f"rate and burstiness must be finite numbers > 0, not {rate:g}, {burstiness:g}"
        )
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), len(trace.requests))
    times = np.concatenate([[0.0], np.cumsum(gaps)[:-1]]) if len(gaps) else gaps
    if len(times) and not np.isfinite(times[-1]):  # a rate so low a gap overflows
        raise ValueError(f"gamma arrivals at {rate:g} req/s run past any finite time")
    out = [_with_time(r, float(t)) for r, t in zip(trace.requests, times, strict=True)]
    return trace.replace(out, f"gamma arrivals {rate:g} req/s, burstiness {burstiness:g}")


def _with_time(r: TraceRequest, t: float) -> TraceRequest:
    return TraceRequest(
        t,
        r.request_id,
        r.input_length,
        r.output_length,
        r.block_size,
        r.block_ids,
        r.tenant,
        r.session_id,
        r.prompt,
        r.prompt_token_ids,
    )


# ==================================================================================================
# Prompts and keys
# ==================================================================================================


def _id_key(block_id: BlockId) -> tuple[str, str]:
    """(scope, id) for the pool mapping: ints keep the legacy empty scope (tokens_for_blocks)."""
    if isinstance(block_id, int):
        return "", str(block_id)
    return "\x01s", block_id


_TAIL_CHUNK = 4096  # a tail is drawn in pieces of at most this many tokens (the pool's spare)


def _tail(pool: np.ndarray, request_id: str, n: int) -> list[np.ndarray]:
    """`n` tokens unique to the request, in pieces no longer than the pool's spare end (one
    slice of any length could run past it); the first piece is what a short tail always was."""
    out = []
    for k in range(-(-n // _TAIL_CHUNK)):
        key = request_id if k == 0 else f"{request_id}\x00{k}"
        out.append(_block(pool, "\x02tail", key, min(_TAIL_CHUNK, n - k * _TAIL_CHUNK)))
    return out


def prompt_token_ids(req: TraceRequest) -> list[int]:
    """The request's prompt as exactly `input_length` token ids.

    `prompt_token_ids` given: those. Otherwise identical block ids give identical tokens in
    [1000, 50000) (an int id gives what `tokens_for_blocks` gives), and tokens past the last id
    are drawn from the request id, so they are unique to the request. A record with a text
    `prompt` (and no block ids, which the schema allows) starts with the simulated tokenizer's
    ids of its text, as the simulated worker sees it when a replay sends the text: records that
    share a text prefix share those tokens. The trace's `input_length` (the real model's count)
    stays the length: a longer tokenization is cut, a shorter one continues with unique tokens.
    """
    if req.prompt_token_ids is not None:
        return list(req.prompt_token_ids)
    bs = req.block_size
    n = req.input_length
    pool = _get_pool(max(bs, _TAIL_CHUNK))
    ids = req.block_ids[: -(-n // bs)]
    parts = [_block(pool, *_id_key(h), bs) for h in ids]
    covered = len(ids) * bs
    head: list[int] = []
    if not ids and req.prompt is not None:
        from workers.sim.tokenizer import encode

        head = encode(req.prompt)[:n]
        covered = len(head)
    if covered < n:
        parts.extend(_tail(pool, req.request_id, n - covered))
    tokens = np.concatenate(parts)[: n - len(head)] if parts else np.zeros(0, dtype=np.int64)
    tokens %= TOKEN_HIGH - TOKEN_LOW
    tokens += TOKEN_LOW
    return head + tokens.tolist()


def prompt_text(req: TraceRequest) -> str:
    """A text prompt of `input_length` common English words, each one token on the simulated
    tokenizer and almost always one on real BPE vocabularies (" the", " of", ...).

    For chat replays: the worker adds its chat template's tokens, so `usage.prompt_tokens`
    exceeds `input_length` by a few tokens (replay checks it within a tolerance).
    """
    if req.prompt is not None:
        return req.prompt
    from workers.sim.tokenizer import VOCAB

    return "".join([VOCAB[t % len(VOCAB)] for t in prompt_token_ids(req)])


def chain_keys(req: TraceRequest, root: int = 0) -> list[int]:
    """Chained 64-bit keys of the request's full blocks: key i names block i *and* its prefix.

    The same kind of key as scoring.prefix builds for the gateway (xxh3-64 chained through the
    seed), so a routing index can be fed straight from a trace without materialising prompts.
    The chain starts from the request's block size: the same id at 16 and at 64 tokens names
    different content (a trace may mix block sizes: the schema has one per record), so their
    keys never match, in the bounds or in a routing index.
    """
    out = []
    h64 = xxhash.xxh3_64_intdigest
    parent = h64(b"\x03bs" + req.block_size.to_bytes(8, "little"), seed=root)
    for b in req.block_ids[: req.full_blocks]:
        data = (b & _MASK64).to_bytes(8, "little") if isinstance(b, int) else b"\x01" + b.encode()
        parent = h64(data, seed=parent)
        out.append(parent)
    return out


# ==================================================================================================
# The infinite-cache bound
# ==================================================================================================


@dataclass(slots=True, frozen=True)
class CacheBound:
    """What one worker with an unbounded prefix cache would hit: the ceiling for any router.

    A block hits when the same block at the same prefix was a *full* block of an earlier request
    (vLLM caches full blocks only); per request at most `input_length - 1` tokens hit (vLLM always
    computes the last prompt token). Counted at trace-block granularity: an engine with smaller
    blocks can slightly exceed it by reusing the full engine blocks of an earlier partial block.
    """

    hit_tokens: int
    prompt_tokens: int
    hit_blocks: int
    blocks: int
    requests: int

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "token_hit_rate": self.token_hit_rate,
            "block_hit_rate": self.block_hit_rate,
            "hit_tokens": self.hit_tokens,
            "prompt_tokens": self.prompt_tokens,
            "hit_blocks": self.hit_blocks,
            "blocks": self.blocks,
            "requests": self.requests,
        }


def bound_hits(
    requests: Iterable[TraceRequest], capacity_tokens: int | None = None
) -> Iterator[tuple[TraceRequest, list[int], int]]:
    """Per request in arrival order: its chain keys and how many of its leading blocks one cache
    holds when it arrives (unbounded, or `capacity_tokens` of LRU; see `cache_bound`).

    Every request given is taken as computed: a caller bounding what a fleet can hit passes
    only the requests it serves (`bench.simulate.FleetSpec.servable`), since a refused
    request's blocks are in no cache."""
    seen: OrderedDict[int, int] | set[int] = OrderedDict() if capacity_tokens else set()
    held = 0  # tokens in the LRU (block sizes may differ between requests)
    for r in requests:
        keys = chain_keys(r)
        cap = (r.input_length - 1) // r.block_size
        matched = 0
        for k in keys[:cap]:
            if k not in seen:
                break
            matched += 1
        yield r, keys, matched
        if isinstance(seen, OrderedDict):
            limit = max(0, capacity_tokens or 0)
            for k in reversed(keys):
                if k not in seen:
                    held += r.block_size
                seen[k] = r.block_size
                seen.move_to_end(k)
            while held > limit:
                held -= seen.popitem(last=False)[1]
        else:
            seen.update(keys)


def cache_bound(requests: Iterable[TraceRequest], capacity_tokens: int | None = None) -> CacheBound:
    """The infinite-cache bound of a trace, in arrival order (see `CacheBound`).

    With `capacity_tokens`, the same single cache limited to that many tokens with LRU eviction
    (blocks touched tail first, so a prefix outlives its extensions, as in vLLM). Given the whole
    fleet's KV capacity it is the *pooled-cache reference*: what a router could hit if the fleet
    were one big cache and it never duplicated a block. It is not a strict bound (LRU is not the
    optimal eviction), but it separates "the router misplaces prefixes" from "the fleet is too
    small for this trace's working set", which the infinite bound cannot.
    """
    hit_tokens = prompt = hit_blocks = blocks = n = 0
    for r, keys, matched in bound_hits(requests, capacity_tokens):
        hit_tokens += matched * r.block_size
        hit_blocks += matched
        blocks += len(keys)
        prompt += r.input_length
        n += 1
    return CacheBound(hit_tokens, prompt, hit_blocks, blocks, n)


# ==================================================================================================
# CLI: convert, describe, synthesize
# ==================================================================================================


def _summary(trace: Trace) -> dict[str, Any]:
    reqs = trace.requests
    b = cache_bound(reqs)
    ins = sorted(r.input_length for r in reqs) or [0]
    outs = sorted(r.output_length for r in reqs) or [0]
    return {
        **trace.meta(),
        "rate_req_s": round(len(reqs) / trace.duration_s, 3) if trace.duration_s else None,
        "tenants": len({r.tenant for r in reqs}),
        "sessions": len({r.session_id for r in reqs if r.session_id}),
        "input_tokens": {"mean": round(sum(ins) / len(ins)), "p50": ins[len(ins) // 2]},
        "output_tokens": {"mean": round(sum(outs) / len(outs)), "p50": outs[len(outs) // 2]},
        "bound": b.to_json(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvgate bench traces", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="any supported trace -> normalized JSONL")
    c.add_argument("trace", help="file, weka session directory, or synthetic:k=v,...")
    c.add_argument("--out", required=True, type=Path, help="e.g. bench/out/my_trace.jsonl")
    c.add_argument("--format", default=None, help="skip detection")
    c.add_argument("--sample", type=positive, default=None, help="fraction (<=1) or count (>1)")
    c.add_argument("--time-scale", type=positive, default=1.0)
    c.add_argument("--seed", type=int, default=0)
    i = sub.add_parser("info", help="counts, lengths and the infinite-cache bound of a trace")
    i.add_argument("trace")
    i.add_argument("--format", default=None)
    args = p.parse_args(argv)
    try:
        trace = load_trace(args.trace, args.format)
        if args.cmd == "convert":
            if args.sample is not None:
                trace = sample(trace, args.sample, args.seed)
            trace = scale_time(trace, args.time_scale)
    except TraceError as e:
        exit_on_trace_error(p.prog, e)
    except ValueError as e:  # a transform's range, for a caller that skipped the flag types
        exit_on_trace_error(p.prog, TraceError(str(e)))
    if args.cmd == "convert":
        try:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            write_jsonl(args.out, trace)
        except OSError as e:  # a directory, a read-only place, a full disk: one line
            reason = e.strerror or str(e)
            exit_on_trace_error(p.prog, TraceError(f"--out {args.out}: cannot write it: {reason}"))
        print(f"wrote {len(trace.requests)} requests to {args.out}")
    else:
        json.dump(_summary(trace), sys.stdout, indent=2)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
