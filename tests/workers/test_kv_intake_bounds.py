"""What one worker's KV events may cost the gateway, and which tenant they may credit
(`workers.kv_intake.PreciseSink`, `workers.kv_wire`): KV-cache groups are a bounded set, salts and
LoRA names no real request could carry are refused before they reach the memoised root seed, and
a vLLM 0.11 worker, whose events do not say a chain's salt, never credits an isolated tenant's
blocks to anyone else."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

import scoring.precise as precise
from scoring.precise import PreciseIndex
from scoring.prefix import block_keys, chain_hashes_tokens, seed_for
from tests.workers.test_kv_events import recorded_batches
from workers.kv_intake import PreciseSink
from workers.kv_wire import FULL_ATTENTION, BlockStored, decode_batch, encode_batch

BS = 4
MAX_SALT_CHARS = 128  # vLLM refuses a longer cache_salt
MAX_LORA_NAME_CHARS = 256
TOKENS = tuple(range(1, 4 * BS + 1))
HASHES = (101, 102, 103, 104)


def _sink(model: str = "m", **index: Any) -> tuple[PreciseIndex, PreciseSink]:
    idx = PreciseIndex(**index)
    sink = PreciseSink(idx, lambda _w: model, lambda _w: BS, clock=lambda: 1.0)
    sink.set_live("w0", True)
    return idx, sink


def _held(idx: PreciseIndex, tokens: tuple[int, ...] = TOKENS, salt: str = "") -> int:
    chain = chain_hashes_tokens(tokens, block_size=BS, seed=seed_for("m", "", salt), max_blocks=64)
    return idx.match(chain, 1.0).get("w0", 0)


def _map_store(hashes: list[int], tokens: list[int], **fields: Any) -> dict[str, Any]:
    """A 0.32 BlockStored map as vLLM publishes it; ``fields`` override the defaults."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None] * len(hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": FULL_ATTENTION,
    } | fields


def _decode(*events: Any) -> list[Any]:
    return decode_batch(msgpack.packb([1.0, list(events), 0]))[1]


# --------------------------------------------------------------------------- KV-cache groups


def test_a_worker_learns_a_bounded_set_of_groups_and_counts_the_rest() -> None:
    # Each store naming a new group rebuilt the worker's whole set, and the set had no bound: a
    # batch of 40,000 stores with distinct group_idx held the event loop for 44 s.
    _idx, sink = _sink()
    stores = [
        ["BlockStored", [], None, [], 1, None, None, None, None, g, FULL_ATTENTION]
        for g in range(5_000)
    ]
    sink.apply("w0", _decode(*stores))
    assert len(sink._groups["w0"]) == 16
    assert sink.skip_counts("w0")["bad_group"] == 5_000 - 16
    # and it stays bounded across batches
    sink.apply("w0", _decode(*stores[:100]))
    assert len(sink._groups["w0"]) == 16


def test_a_group_idx_out_of_range_is_skipped_and_the_rest_still_indexed() -> None:
    idx, sink = _sink()
    hashes = list(HASHES)
    events = _decode(
        _map_store(hashes, list(TOKENS), group_idx=1_000_000),
        _map_store(hashes, list(TOKENS), group_idx=-1),
        _map_store(hashes, list(TOKENS), group_idx=0),
    )
    sink.apply("w0", events)
    assert sink._groups["w0"] == frozenset({0})
    assert sink.skip_counts("w0")["bad_group"] == 2
    assert _held(idx) == 4


def test_the_common_reasons_are_exported_from_the_start_the_rare_once_they_happen() -> None:
    _idx, sink = _sink()
    assert set(sink.skip_counts("w0")) == {
        "not_full_attention",
        "lora_id_only",
        "unknown_model",
        "unknown_block_size",
    }
    sink.apply("w0", _decode(_map_store([1], [1, 2, 3, 4], group_idx=64)))
    assert sink.skip_counts("w0")["bad_group"] == 1


# --------------------------------------------------------------------------- salts and names


def test_a_salt_longer_than_vllm_accepts_is_not_keyed_nor_memoised() -> None:
    # Salts reach scoring.prefix.seed_for, an lru_cache of 4,096: 210 distinct 1 MiB salts kept
    # 231 MiB alive after the index had forgotten every block.
    idx, sink = _sink()
    seed_for.cache_clear()
    long_salts = [f"{i}-" + "s" * (1 << 16) for i in range(20)]
    sink.apply(
        "w0",
        _decode(
            *(
                _map_store([500 + i], [1, 2, 3, 4], extra_keys=[[salt]])
                for i, salt in enumerate(long_salts)
            )
        ),
    )
    assert idx.size("w0") == 0
    assert sink.skip_counts("w0")["salt_too_long"] == 20
    assert seed_for.cache_info().currsize == 0
    # The longest salt vLLM accepts is keyed as before.
    ok = "t" * MAX_SALT_CHARS
    sink.apply(
        "w0", _decode(_map_store(list(HASHES), list(TOKENS), extra_keys=[[ok], *[None] * 3]))
    )
    assert _held(idx, salt=ok) == 4 and _held(idx) == 0


def test_an_overlong_lora_name_is_not_keyed_under_it_nor_under_the_base_model() -> None:
    idx, sink = _sink()
    seed_for.cache_clear()
    name = "a" * (MAX_LORA_NAME_CHARS + 1)
    sink.apply("w0", _decode(_map_store(list(HASHES), list(TOKENS), lora_name=name, lora_id=3)))
    assert seed_for.cache_info().currsize == 0
    assert idx.size("w0") == 0 and _held(idx) == 0
    assert sink.skip_counts("w0")["lora_name_too_long"] == 1
    [ev] = _decode(_map_store([1], [1, 2, 3, 4], lora_name="b" * MAX_LORA_NAME_CHARS))
    assert isinstance(ev, BlockStored) and ev.unkeyable is None


# --------------------------------------------------------------------------- vLLM 0.11: no salt


SALT_B = "isolated-tenant-b"


def test_011_blocks_whose_salt_is_not_sent_are_credited_to_no_tenant() -> None:
    # vLLM 0.11's BlockStored array has no extra_keys: an isolated tenant's salted prompt arrives
    # looking unsalted. Keyed under the shared seed, every unsalted request matched it (and was
    # routed to it, telling its sender that tenant B had sent that prompt).
    idx, sink = _sink()
    ev = ["BlockStored", list(HASHES), None, list(TOKENS), BS, None, "GPU"]
    sink.apply("w0", _decode(ev))
    assert _held(idx) == 0 and _held(idx, salt=SALT_B) == 0
    assert idx.size("w0") == 0
    assert sink.skip_counts("w0")["salt_unknown"] == 1
    # Its later blocks chain from ones that could not be keyed: nothing to credit either.
    child = ["BlockStored", [105], HASHES[-1], list(range(100, 100 + BS)), BS, None, "GPU"]
    sink.apply("w0", _decode(child))
    assert idx.size("w0") == 0


def test_011_with_lora_name_and_no_extra_keys_is_still_salt_unknown() -> None:
    [ev] = _decode(["BlockStored", list(HASHES), None, list(TOKENS), BS, 4, "GPU", "my-lora"])
    assert isinstance(ev, BlockStored) and ev.unkeyable == "salt_unknown"
    [ev] = _decode(["BlockStored", [1], 7, [1, 2, 3, 4], BS, None, "GPU"])
    assert ev.unkeyable is None  # a later block is seeded by its parent, not by a salt


def test_a_worker_whose_salts_are_unknown_is_not_trusted_until_they_are() -> None:
    # Its precise state can hold none of its chains: trusted, it would be credited with no cache
    # at all, where the gateway's own guess (the approximate index) still knows something.
    idx, sink = _sink()
    assert idx.trusted(1.0) == {"w0"}
    _ts, events, _rank = decode_batch(
        encode_batch(0.0, [BlockStored(HASHES, None, TOKENS, BS, None, "GPU", None)], "0.11")
    )
    sink.apply("w0", events)
    assert idx.trusted(1.0) == frozenset()
    sink.set_live("w0", False)
    sink.set_live("w0", True)  # a reconnect does not make its events keyable
    assert idx.trusted(1.0) == frozenset()
    # The same worker restarted as a newer vLLM: its chains carry their extra keys again.
    sink.apply("w0", _decode(_map_store(list(HASHES), list(TOKENS))))
    assert idx.trusted(1.0) == {"w0"} and _held(idx) == 4


def test_011_placeholders_and_blocks_already_keyed_keep_working() -> None:
    # A block this worker already holds keeps its key when an event without extra keys names it
    # again (a tier added): only blocks that would need the unknown salt are left out.
    idx, sink = _sink()
    sink.apply("w0", _decode(_map_store(list(HASHES), list(TOKENS), medium="GPU")))
    again = ["BlockStored", list(HASHES), None, list(TOKENS), BS, None, "CPU"]
    sink.apply("w0", _decode(again))
    assert idx.size("w0") == 4 and sink.skip_counts("w0").get("salt_unknown", 0) == 0
    sink.apply("w0", _decode(["BlockRemoved", list(HASHES), "GPU"]))
    assert idx.size("w0") == 4  # still on CPU


def test_032_recorded_batches_key_exactly_as_the_requests_that_sent_them() -> None:
    # The recorded vLLM 0.32 stream: the same 480-token prompt unsalted and salted
    # ("tenant-b"). Every block is keyed, under the salt its first block carries.
    idx = PreciseIndex()
    sink = PreciseSink(idx, lambda _w: "tiny-llama", lambda _w: 32, clock=lambda: 1.0)
    sink.set_live("w0", True)
    salted: list[BlockStored] = []
    roots: list[BlockStored] = []
    for channel, _seq, payload, _d in recorded_batches():
        if channel != "pub":
            continue
        events = decode_batch(payload)[1]
        sink.apply("w0", events)
        for e in events:
            if isinstance(e, BlockStored) and e.parent is None:
                roots.append(e)
                if e.cache_salt:
                    salted.append(e)
    assert sink.skip_counts("w0") == dict.fromkeys(sink.skip_counts("w0"), 0)
    assert idx.unkeyed == {} and salted and all(e.cache_salt == "tenant-b" for e in salted)
    for e in roots:
        keys = block_keys(e.token_ids, 32, "tiny-llama", e.cache_salt or "", 8192)
        assert [idx.key_of("w0", h) for h in e.engine_hashes] == keys
    ids = salted[0].token_ids
    only_b = PreciseIndex()
    sink_b = PreciseSink(only_b, lambda _w: "tiny-llama", lambda _w: 32, clock=lambda: 1.0)
    sink_b.set_live("w0", True)
    sink_b.apply("w0", salted)
    for salt, want in (("tenant-b", {"w0": 15}), ("", {}), ("tenant-a", {})):
        assert only_b.match(block_keys(ids, 32, "tiny-llama", salt, 8192), 1.0) == want


# --------------------------------------------------------------------------- per-worker bound


def test_what_a_worker_may_claim_is_bounded_when_its_capacity_is_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One 4 MiB batch can name 650,000 one-token blocks; three of them made one worker claim
    # 1,950,000 blocks (+432 MiB) while its engine had 4,096.
    monkeypatch.setattr(precise, "MAX_WORKER_BLOCKS", 3_000, raising=False)
    idx, sink = _sink()
    n = 10_000
    for k in range(3):
        base = 1_000_000 + k * n
        ev = _map_store(list(range(base, base + n)), [k + 1] * n, block_size=1, extra_keys=None)
        sink.apply("w0", _decode(ev))
    assert idx.size("w0") == 3_000 and len(idx._e2k[idx._slot["w0"]]) == 3_000
    assert idx.overflow == {"w0": 3 * n - 3_000}
    # The newest blocks are the ones kept: the last chain's tail, not a prefix of anything.
    assert idx.key_of("w0", 1_000_000 + 3 * n - 1) is not None
    assert idx.key_of("w0", 1_000_000) is None


def test_a_reported_capacity_bounds_what_the_worker_may_claim() -> None:
    idx = PreciseIndex()
    sink = PreciseSink(
        idx, lambda _w: "m", lambda _w: BS, clock=lambda: 1.0, capacity_of=lambda _w: 100
    )
    sink.set_live("w0", True)
    n = 5_000
    toks = list(range(1, n * BS + 1))
    sink.apply("w0", _decode(_map_store(list(range(10_000, 10_000 + n)), toks)))
    cap = 100 * precise.OFFLOAD_SLACK
    assert idx.capacity("w0") == cap and idx.size("w0") == cap
    assert idx.overflow["w0"] == n - cap
