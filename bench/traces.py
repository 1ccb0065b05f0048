"""Trace loading and synthetic prompt materialisation for the benches.

Mooncake-format traces (kvcache-ai/Mooncake) publish no text, only per-request lengths and
`hash_ids`: one id per 512-token block, equal ids meaning equal block contents (and, since the ids
are assigned along the prefix, equal prefixes). To replay them through an engine that hashes real
token ids we turn every id into a fixed pseudo-random block of tokens, so that shared ids give
byte-identical prefixes and distinct ids practically never collide.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

MOONCAKE_BLOCK_TOKENS = 512
TOKEN_LOW, TOKEN_HIGH = 1000, 50000  # below 1000 are the sim tokenizer's words/generated ids

# Blocks are two slices of one shared random pool added together: materialising a block is then a
# couple of array slices rather than a seeded RNG per id (Mooncake has 44k ids, 61M prompt tokens).
# Two independent 20-bit offsets make accidental equality of two different ids ~1e-12 per pair.
_POOL_BITS = 20
_pool: np.ndarray | None = None


class TraceRecord(NamedTuple):
    arrival_s: float  # seconds since the trace start
    input_length: int
    output_length: int
    hash_ids: list[int]


def load_mooncake(path: str | Path) -> Iterator[TraceRecord]:
    """Records of a Mooncake JSONL trace (`timestamp` in ms), in file order."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            yield TraceRecord(
                float(row["timestamp"]) / 1000.0,
                int(row["input_length"]),
                int(row["output_length"]),
                list(row.get("hash_ids", [])),
            )


def _get_pool(min_len: int) -> np.ndarray:
    global _pool
    if _pool is None or len(_pool) < (1 << _POOL_BITS) + min_len:
        rng = np.random.default_rng(0x6B76)  # fixed: the mapping must never change between runs
        _pool = rng.integers(0, TOKEN_HIGH - TOKEN_LOW, (1 << _POOL_BITS) + max(min_len, 4096))
    return _pool


def _block(pool: np.ndarray, scope: str, hash_id: int, block_tokens: int) -> np.ndarray:
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
