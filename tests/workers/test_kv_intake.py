"""KV events into the precise index (`workers.kv_intake.PreciseSink`): which KV-cache groups an
eviction applies to, and which blocks can be keyed to a model at all."""

from __future__ import annotations

from scoring.precise import PreciseIndex
from scoring.prefix import chain_hashes_tokens, seed_for
from workers.kv_intake import PreciseSink
from workers.kv_wire import FULL_ATTENTION, BlockRemoved, BlockStored, decode_batch, encode_batch

BS = 4
TOKENS = tuple(range(1, 4 * BS + 1))
HASHES = (101, 102, 103, 104)
SWA = "sliding_window"


def _stored(
    group: int = 0,
    kind: str | None = FULL_ATTENTION,
    lora_name: str | None = None,
    lora_id: int | None = None,
) -> BlockStored:
    return BlockStored(
        engine_hashes=HASHES,
        parent=None,
        token_ids=TOKENS,
        block_size=BS,
        lora_name=lora_name,
        medium="GPU",
        cache_salt=None,
        group_idx=group,
        kv_cache_spec_kind=kind,
        lora_id=lora_id,
    )


def _sink(model: str = "m") -> tuple[PreciseIndex, PreciseSink]:
    idx = PreciseIndex()
    sink = PreciseSink(idx, lambda _w: model, lambda _w: BS, clock=lambda: 1.0)
    sink.set_live("w0", True)
    return idx, sink


def _held(idx: PreciseIndex, model: str) -> int:
    """Leading blocks of TOKENS that a request on ``model`` is credited with on w0."""
    chain = chain_hashes_tokens(TOKENS, block_size=BS, seed=seed_for(model), max_blocks=4)
    return idx.match(chain, 1.0).get("w0", 0)


# --------------------------------------------------------------------------- KV-cache groups


def test_eviction_in_a_full_attention_group_other_than_0_removes_its_blocks() -> None:
    idx, sink = _sink()
    sink.apply("w0", [_stored(0, SWA), _stored(1, FULL_ATTENTION)])
    assert idx.size("w0") == 4 and sink.skipped["w0"] == 1  # the sliding-window copy is not
    sink.apply("w0", [BlockRemoved(HASHES, "GPU", group_idx=1)])
    assert idx.size("w0") == 0


def test_eviction_in_a_sliding_window_group_0_keeps_the_full_attention_blocks() -> None:
    idx, sink = _sink()
    sink.apply("w0", [_stored(0, SWA), _stored(1, FULL_ATTENTION)])
    sink.apply("w0", [BlockRemoved(HASHES, "GPU", group_idx=0)])  # only the window's copies
    assert idx.size("w0") == 4 and _held(idx, "m") == 4


def test_eviction_in_any_of_several_full_attention_groups_removes_the_blocks() -> None:
    # vLLM may split full-attention layers over several groups; a block evicted from one of them
    # can no longer be a prefix hit.
    idx, sink = _sink()
    sink.apply("w0", [_stored(0, FULL_ATTENTION), _stored(1, SWA), _stored(2, FULL_ATTENTION)])
    sink.apply("w0", [BlockRemoved(HASHES[2:], "GPU", group_idx=2)])
    assert idx.size("w0") == 2
    sink.apply("w0", [BlockRemoved(HASHES[:2], "GPU", group_idx=0)])
    assert idx.size("w0") == 0


def test_removals_without_group_info_apply_to_a_plain_decoder() -> None:
    # vLLM 0.11 arrays carry neither a group nor a spec kind, on stores or removals. The store
    # goes in as a map without group info: a 0.11 array store carries no salt either, so its
    # root blocks are not keyed (tests/workers/test_kv_intake_bounds.py, tenant isolation).
    idx, sink = _sink()
    sink.apply("w0", [_stored(kind=None)])
    removed = encode_batch(0.0, [BlockRemoved(HASHES[2:], "GPU")], layout="0.11")
    _ts, decoded, _rank = decode_batch(removed)
    sink.apply("w0", decoded)
    assert idx.size("w0") == 2 and _held(idx, "m") == 2


def test_a_restarted_worker_learns_its_kv_groups_anew() -> None:
    idx, sink = _sink()
    sink.apply("w0", [_stored(kind=None)])  # a plain decoder: group 0 is full attention
    sink.reset("w0", "restart")  # now a hybrid model whose full-attention group is 1
    sink.apply("w0", [_stored(0, SWA), _stored(1, FULL_ATTENTION)])
    sink.apply("w0", [BlockRemoved(HASHES, "GPU", group_idx=0)])
    assert idx.size("w0") == 4


# --------------------------------------------------------------------------- LoRA


def test_lora_blocks_known_only_by_id_are_skipped_and_counted() -> None:
    # vLLM 0.11 publishes a LoRA request's blocks as ["BlockStored", hashes, parent, token_ids,
    # block_size, lora_id, medium]: an id, no name to seed the chain with.
    ev = _stored(kind=None, lora_id=1)
    _ts, decoded, _rank = decode_batch(encode_batch(0.0, [ev], layout="0.11"))
    assert isinstance(decoded[0], BlockStored)
    assert (decoded[0].lora_id, decoded[0].lora_name) == (1, None)
    idx, sink = _sink("base-model")
    sink.apply("w0", decoded)
    assert _held(idx, "base-model") == 0 and idx.size("w0") == 0
    assert sink.skipped["w0"] == 1


def test_lora_blocks_with_a_name_are_indexed_under_the_adapter() -> None:
    idx, sink = _sink("base-model")
    sink.apply("w0", [_stored(lora_name="my-lora", lora_id=1)])
    assert _held(idx, "my-lora") == 4 and _held(idx, "base-model") == 0
    assert sink.skipped["w0"] == 0


# --------------------------------------------------------------------------- offload placeholders

# Encoded by vLLM 0.32's own msgspec structs: a GPU store of two 32-token blocks, the
# OffloadingConnector's placeholder stores of both on CPU (self_describing_kv_events off, its
# default: hash only, token_ids [], block_size 0), then the GPU copies' eviction.
GPU_STORE_032 = bytes.fromhex(
    "93cb3ff0000000000000918aa474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cff5f9cb"
    "19a952ca02cfcbf304cebedbdb6db1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc00400102"
    "030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f202122232425262728292a2b2c2d2e2f303132"
    "333435363738393a3b3c3d3e3f40aa626c6f636b5f73697a6520a76c6f72615f6964c0a66d656469756da3475055a96c"
    "6f72615f6e616d65c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474"
    "656e74696f6e00"
)
CPU_PLACEHOLDERS_032 = bytes.fromhex(
    "93cb3ff00000000000009289a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cff5f9cb19"
    "a952ca02b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647390aa626c6f636b5f73697a6500a76c"
    "6f72615f6964c0a66d656469756da3435055a96c6f72615f6e616d65c0a967726f75705f6964780089a474797065ab42"
    "6c6f636b53746f726564ac626c6f636b5f68617368657391cfcbf304cebedbdb6db1706172656e745f626c6f636b5f68"
    "617368c0a9746f6b656e5f69647390aa626c6f636b5f73697a6500a76c6f72615f6964c0a66d656469756da3435055a9"
    "6c6f72615f6e616d65c0a967726f75705f6964780000"
)
GPU_EVICT_032 = bytes.fromhex(
    "93cb3ff00000000000009184a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657392cff5f9cb"
    "19a952ca02cfcbf304cebedbdb6da66d656469756da3475055a967726f75705f6964780000"
)


def test_vllm_offload_placeholders_keep_blocks_held_on_cpu_after_gpu_eviction() -> None:
    idx = PreciseIndex(offload_weight=0.5)
    sink = PreciseSink(idx, lambda _w: "m", lambda _w: 32, clock=lambda: 1.0)
    sink.set_live("w0", True)
    toks = list(range(1, 65))
    chain = chain_hashes_tokens(toks, block_size=32, seed=seed_for("m"), max_blocks=2)
    for payload in (GPU_STORE_032, CPU_PLACEHOLDERS_032):
        sink.apply("w0", decode_batch(payload)[1])
    assert idx.match(chain, 1.0) == {"w0": 2} and idx.unkeyed == {}
    sink.apply("w0", decode_batch(GPU_EVICT_032)[1])  # the CPU copies remain
    assert idx.size("w0") == 2
    assert idx.match(chain, 1.0) == {"w0": 1}  # 2 blocks off GPU only, at 0.5 each
    assert sink.skip_counts("w0") == dict.fromkeys(sink.skip_counts("w0"), 0)


def _placeholder(group: int, medium: str = "CPU") -> BlockStored:
    return BlockStored(HASHES, None, (), 0, None, medium, None, group_idx=group)


def test_a_placeholder_needs_neither_model_nor_block_size_and_follows_the_indexed_groups() -> None:
    idx = PreciseIndex()
    models = {"w0": "m"}
    sink = PreciseSink(idx, models.get, lambda _w: 0, clock=lambda: 1.0)
    sink.set_live("w0", True)
    # A hybrid model whose full-attention group is 1: the same hashes in the window group 0.
    sink.apply("w0", [_stored(0, SWA), _stored(1, FULL_ATTENTION)])
    del models["w0"]  # the model and block size are unknown now: a placeholder needs neither
    sink.apply("w0", [_placeholder(0)])  # the window group's copy: not the indexed blocks
    sink.apply("w0", [BlockRemoved(HASHES, "GPU", group_idx=1)])
    assert idx.size("w0") == 0
    sink.apply("w0", [_stored(1, FULL_ATTENTION, lora_name="m")])  # back, keyed by its name
    sink.apply("w0", [_placeholder(1)])
    sink.apply("w0", [BlockRemoved(HASHES, "GPU", group_idx=1)])
    assert idx.size("w0") == 4  # still on CPU
    assert sink.skip_counts("w0")["unknown_model"] == 0 and idx.unkeyed == {}
