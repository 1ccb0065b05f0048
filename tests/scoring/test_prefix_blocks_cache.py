"""`scoring.prefix` caches the Struct that cuts a prompt into blocks, per (block size, block count).
The count comes from prompt lengths (up to the precise index's 8,192 blocks) and from workers'
KV events (any length), at ~34 bytes per block of it: 120 distinct event lengths of ~100k blocks
left 543 MiB resident. Only short runs are cached now, and the chains must not change at all."""

from __future__ import annotations

import gc
import random
import tracemalloc

import pytest
import xxhash

from scoring import prefix
from scoring.prefix import block_keys, chain_hashes_text, chain_hashes_tokens, tail_layout

_MASK64 = (1 << 64) - 1


def _reference(
    data: bytes, block_chars: int, seed: int, max_blocks: int, tail_ratio: int, tail_blocks: int
) -> list[int]:
    """The chain as the module defines it, block by block with plain slices."""
    n = min(len(data) // block_chars, max_blocks)
    h = seed & _MASK64
    out = []
    for i in range(n):
        h = xxhash.xxh3_64_intdigest(data[i * block_chars : (i + 1) * block_chars], h)
        out.append(h)
    if n and n == max_blocks and tail_ratio > 0 and tail_blocks > 0:
        start = n
        for end in tail_layout(max_blocks, tail_ratio, tail_blocks):
            if end > len(data) // block_chars:
                break
            h = xxhash.xxh3_64_intdigest(data[start * block_chars : end * block_chars], h)
            out.append(h)
            start = end
    return out


@pytest.mark.parametrize("block_chars", [4, 64, 128])
@pytest.mark.parametrize("n", [1, 63, 64, 255, 256, 257, 300, 511, 512, 513, 1000, 4099, 8192])
def test_chains_are_the_same_for_any_number_of_blocks(block_chars: int, n: int) -> None:
    rng = random.Random(n * 131 + block_chars)
    data = rng.randbytes(n * block_chars + block_chars // 2)
    for max_blocks in (n, n + 5, 10_000):  # n == max_blocks takes the head-memo path
        for _ in range(2):  # the second time a full head is seen it is memoised
            got = chain_hashes_text(data, block_chars=block_chars, seed=77, max_blocks=max_blocks)
            assert got == _reference(data, block_chars, 77, max_blocks, 0, 0)


@pytest.mark.parametrize("dense", [64, 256, 257, 600])
def test_a_tail_after_a_long_dense_head_is_unchanged(dense: int) -> None:
    rng = random.Random(dense)
    data = rng.randbytes(64 * dense * 3 + 17)
    got = chain_hashes_text(
        data, block_chars=64, seed=5, max_blocks=dense, tail_ratio=16, tail_blocks=40
    )
    assert got == _reference(data, 64, 5, dense, 16, 40)
    assert len(got) > dense


def test_token_keys_are_unchanged_for_long_prompts() -> None:
    rng = random.Random(9)
    ids = [rng.randrange(1 << 20) for _ in range(16 * 8192)]
    for n in (255, 256, 257, 1000, 7777, 8192):
        arr = b"".join(i.to_bytes(4, "little") for i in ids[: 16 * n])
        seed = prefix.seed_for("m", "", "")
        assert block_keys(ids[: 16 * n], 16, "m", "", 8192) == _reference(arr, 64, seed, 8192, 0, 0)
        assert chain_hashes_tokens(ids[: 16 * n], block_size=16, seed=3, max_blocks=n) == (
            _reference(arr, 64, 3, n, 0, 0)
        )


def test_long_prompts_do_not_grow_the_struct_cache() -> None:
    # Distinct long lengths with one remainder past a multiple of 256: the cache gains the
    # 256-block Struct and the remainder's, whatever the lengths.
    prefix._blocks.cache_clear()
    ids = [7] * (16 * (1000 + 256 * 30))
    for k in range(30):
        block_keys(ids[: 16 * (1000 + 256 * k)], 16, "m", "", 16_384)
    assert prefix._blocks.cache_info().currsize <= 2


def test_what_long_prompts_leave_behind_is_small() -> None:
    ids = [5] * (16 * 8192)
    prefix._blocks.cache_clear()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for j in range(60):  # honest prompts of 60 lengths between 7,500 and 7,560 blocks
            block_keys(ids[: 16 * (7500 + j)], 16, "m", "", 8192)
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 2 << 20, kept  # was ~250 KiB per length: ~15 MiB here
