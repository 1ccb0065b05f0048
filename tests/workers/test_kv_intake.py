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
    # vLLM 0.11 arrays carry neither a group nor a spec kind, on stores or removals.
    idx, sink = _sink()
    events = [_stored(kind=None), BlockRemoved(HASHES[2:], "GPU")]
    _ts, decoded, _rank = decode_batch(encode_batch(0.0, events, layout="0.11"))
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
