"""vLLM KV-cache events on the wire: the event types and the msgpack batch codec.

Formats drift between vLLM releases, so decoding is strict about structure (a malformed batch is
an error, never a half-applied guess) but tolerant of growth (unknown event types and trailing
fields are skipped). Pure: no sockets, no event loop; ``workers.kv_events`` subscribes to a
worker's stream and hands what this module decodes to the index.

Payload (see tests/fixtures/vllm-0.32/README.md): msgpack ``[ts, [event, ...],
data_parallel_rank]``; events are maps tagged by ``"type"`` (0.32) or positional arrays with the
tag first (0.11).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

import msgpack

__all__ = [
    "FULL_ATTENTION",
    "MAX_LORA_NAME_CHARS",
    "MAX_SALT_CHARS",
    "SKIP_TAGS_MAX",
    "SKIP_TAG_OTHER",
    "UNKEYABLE_LORA_NAME",
    "UNKEYABLE_SALT",
    "UNKEYABLE_SALT_UNKNOWN",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EngineHash",
    "KVEvent",
    "KVEventDecodeError",
    "count_skipped",
    "decode_batch",
    "decode_batch_steps",
    "encode_batch",
]

EngineHash: TypeAlias = int | bytes
FULL_ATTENTION = "full_attention"
# KV-cache kinds whose blocks hold a whole prefix, reusable by any request that shares it:
# vLLM's plain full attention, DeepSeek's MLA and full attention with sink tokens. A sliding
# window, chunked-local or mamba group keeps only recent state, not a reusable prefix.
PREFIX_KINDS = frozenset({FULL_ATTENTION, "mla_attention", "sink_full_attention"})
Layout: TypeAlias = Literal["0.32", "0.11"]
# Unknown event types are counted by tag, but a publisher can name every event differently (a
# hostile one, or a skewed version with an id in the tag): the first SKIP_TAGS_MAX tags are kept
# by name (cut to _SKIP_TAG_LEN characters), every other one under SKIP_TAG_OTHER.
SKIP_TAGS_MAX = 32
SKIP_TAG_OTHER = "<other>"
_SKIP_TAG_LEN = 64
# A chain's root seed is built from the LoRA name and the salt, and seeds are memoised
# (``scoring.prefix.seed_for``): strings no real request can carry must not reach it, or a publisher
# could park megabytes in that cache with every store. vLLM refuses a ``cache_salt`` over 128
# characters (so does the gateway, for its clients); adapter names are short identifiers.
MAX_SALT_CHARS = 128
MAX_LORA_NAME_CHARS = 256
# Why a first block's root seed cannot be rebuilt from its event (``BlockStored.unkeyable``).
# 0.11 arrays have no extra_keys, so a salted request's blocks arrive looking unsalted: keying them
# under the shared seed would credit an isolated tenant's prompt to every unsalted request.
UNKEYABLE_SALT_UNKNOWN = "salt_unknown"
UNKEYABLE_SALT = "salt_too_long"
UNKEYABLE_LORA_NAME = "lora_name_too_long"


# --------------------------------------------------------------------------- events


@dataclass(slots=True, frozen=True)
class BlockStored:
    """Full blocks the engine just cached, as one parent-linked chain.

    ``cache_salt`` is lifted out of ``extra_keys`` because it is the only extra key the index
    needs to rebuild a chain's root seed. ``group_idx`` is the engine's KV-cache group: only the
    full-attention group holds reusable prefix KV, so other groups are kept for the consumer to
    skip rather than dropped here (``is_full_attention`` decides with the spec kind when the
    event carries it, since a hybrid model's full-attention group need not be group 0).
    """

    engine_hashes: tuple[EngineHash, ...]
    parent: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None
    medium: str | None
    cache_salt: str | None
    group_idx: int = 0
    kv_cache_spec_kind: str | None = None
    lora_id: int | None = None
    # Set on a chain's first blocks when the event cannot say what they are seeded with (one of
    # the UNKEYABLE_* reasons; an over-long salt or name is dropped, not carried). Not compared:
    # it records what the wire left unsaid, not what the engine stored.
    unkeyable: str | None = field(default=None, compare=False)

    @property
    def is_full_attention(self) -> bool:
        if self.kv_cache_spec_kind is not None:
            return self.kv_cache_spec_kind in PREFIX_KINDS
        return self.group_idx == 0


@dataclass(slots=True, frozen=True)
class BlockRemoved:
    """Blocks evicted from ``medium``; ``group_idx`` because hybrid models evict per group and
    the same engine hash can live in several groups."""

    engine_hashes: tuple[EngineHash, ...]
    medium: str | None
    group_idx: int = 0


@dataclass(slots=True, frozen=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache (e.g. ``/reset_prefix_cache``)."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventDecodeError(ValueError):
    """A payload that is not a KV-event batch; raised instead of guessing at a partial one."""


# --------------------------------------------------------------------------- decoding


def _fail(msg: str) -> KVEventDecodeError:
    return KVEventDecodeError(msg)


def _is_int(v: object) -> bool:
    return type(v) is int  # bool is an int subclass but never a valid field here


def _hash(v: object, what: str) -> EngineHash:
    if _is_int(v) or isinstance(v, bytes):
        return v  # type: ignore[return-value]
    raise _fail(f"{what}: expected int or bytes, got {type(v).__name__}")


# Element types checked a list at a time (`set(map(type, v))` runs in C): a stored event carries
# a hash per block and a token id per token, and a per-element Python check was most of the
# decode's cost (bool is an int subclass but never valid here, hence `type`, not isinstance).
_INT_ONLY = frozenset({int})
_HASH_TYPES = frozenset({int, bytes})


def _hashes(v: object) -> tuple[EngineHash, ...]:
    if not isinstance(v, list):
        raise _fail(f"block_hashes: expected a list, got {type(v).__name__}")
    if not _HASH_TYPES.issuperset(map(type, v)):
        for h in v:
            _hash(h, "block_hashes")  # names the offending type
    return tuple(v)


def _opt_hash(v: object) -> EngineHash | None:
    return None if v is None else _hash(v, "parent_block_hash")


def _token_ids(v: object) -> tuple[int, ...]:
    if not isinstance(v, list) or not _INT_ONLY.issuperset(map(type, v)):
        raise _fail("token_ids: expected a list of ints")
    return tuple(v)


def _int(v: object, what: str) -> int:
    if not _is_int(v):
        raise _fail(f"{what}: expected an int, got {type(v).__name__}")
    return v  # type: ignore[return-value]


def _group(v: object) -> int:
    # Absent (0.11, or omitted as a default) means the only group there is.
    return 0 if v is None else _int(v, "group_idx")


def _soft_str(v: object) -> str | None:
    # Descriptive metadata: a type we do not expect is dropped, not fatal.
    return v if isinstance(v, str) else None


def _soft_int(v: object) -> int | None:
    return v if _is_int(v) else None  # type: ignore[return-value]


# What a 0.11 array, which has no extra_keys field, passes for it. Unlike None: a release that has
# the field sends None (or, msgspec's omit_defaults, leaves it out) only when no block has any
# extra key, so never for a salted chain.
_ABSENT: Any = object()


def _salt(extra_keys: object, parent: EngineHash | None, lora_name: str | None) -> str | None:
    """vLLM hashes ``cache_salt`` into the first block of a request only, after the LoRA name
    (then multimodal ids), so it is the last string of that block's extra keys."""
    if parent is not None or not isinstance(extra_keys, list) or not extra_keys:
        return None
    first = extra_keys[0]
    if not isinstance(first, list | tuple):
        return None
    keys = [k for k in first if isinstance(k, str)]
    if lora_name is not None and keys and keys[0] == lora_name:
        keys = keys[1:]
    return keys[-1] if keys else None


def stored_event(
    hashes: object,
    parent: object,
    token_ids: object,
    block_size: object,
    lora_id: object,
    medium: object,
    lora_name: object,
    extra_keys: object,
    group_idx: object,
    kind: object,
) -> BlockStored:
    p = _opt_hash(parent)
    name = _soft_str(lora_name)
    unkeyable = None
    if name is not None and len(name) > MAX_LORA_NAME_CHARS:
        name, unkeyable = None, UNKEYABLE_LORA_NAME
    salt = None
    if extra_keys is _ABSENT:
        unkeyable = unkeyable or UNKEYABLE_SALT_UNKNOWN
    else:
        salt = _salt(extra_keys, p, name)
        if salt is not None and len(salt) > MAX_SALT_CHARS:
            salt, unkeyable = None, unkeyable or UNKEYABLE_SALT
    return BlockStored(
        engine_hashes=_hashes(hashes),
        parent=p,
        token_ids=_token_ids(token_ids),
        block_size=_int(block_size, "block_size"),
        lora_name=name,
        medium=_soft_str(medium),
        cache_salt=salt,
        group_idx=_group(group_idx),
        kv_cache_spec_kind=_soft_str(kind),
        lora_id=_soft_int(lora_id),
        # Only a chain's first blocks are seeded by name and salt; later ones by their parent.
        unkeyable=unkeyable if p is None else None,
    )


def _required(m: dict[Any, Any], *keys: str) -> list[Any]:
    missing = [k for k in keys if k not in m]
    if missing:
        raise _fail(f"missing {', '.join(missing)}")
    return [m[k] for k in keys]


def _stored_from_map(m: dict[Any, Any]) -> BlockStored:
    hashes, token_ids, block_size = _required(m, "block_hashes", "token_ids", "block_size")
    return stored_event(
        hashes,
        m.get("parent_block_hash"),
        token_ids,
        block_size,
        m.get("lora_id"),
        m.get("medium"),
        m.get("lora_name"),
        m.get("extra_keys"),
        m.get("group_idx"),
        m.get("kv_cache_spec_kind"),
    )


def _removed_from_map(m: dict[Any, Any]) -> BlockRemoved:
    (hashes,) = _required(m, "block_hashes")
    return BlockRemoved(_hashes(hashes), _soft_str(m.get("medium")), _group(m.get("group_idx")))


def _at(a: list[Any], i: int) -> Any:
    return a[i] if len(a) > i else None


def _stored_from_array(a: list[Any]) -> BlockStored:
    # ["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, (later releases
    # append, in struct order:) lora_name, extra_keys, group_idx, kv_cache_spec_kind, ...]
    if len(a) < 5:
        raise _fail(f"BlockStored array of {len(a)} fields, need at least 5")
    group = a[9] if len(a) > 9 and _is_int(a[9]) else None
    extra_keys = a[8] if len(a) > 8 else _ABSENT
    return stored_event(
        a[1], a[2], a[3], a[4], _at(a, 5), _at(a, 6), _at(a, 7), extra_keys, group, _at(a, 10)
    )


def _removed_from_array(a: list[Any]) -> BlockRemoved:
    if len(a) < 2:
        raise _fail("BlockRemoved array without block_hashes")
    group = a[3] if len(a) > 3 and _is_int(a[3]) else None
    return BlockRemoved(_hashes(a[1]), _soft_str(_at(a, 2)), _group(group))


def _cleared(_ev: Any) -> AllBlocksCleared:
    return AllBlocksCleared()


_FROM_MAP: dict[str, Callable[[Any], KVEvent]] = {
    "BlockStored": _stored_from_map,
    "BlockRemoved": _removed_from_map,
    "AllBlocksCleared": _cleared,
}
_FROM_ARRAY: dict[str, Callable[[Any], KVEvent]] = {
    "BlockStored": _stored_from_array,
    "BlockRemoved": _removed_from_array,
    "AllBlocksCleared": _cleared,
}


def count_skipped(table: Counter[str], tag: str, n: int = 1) -> None:
    """Counts ``n`` events of the unknown type ``tag`` into ``table``, which stays bounded: at
    most ``SKIP_TAGS_MAX`` tags by name plus ``SKIP_TAG_OTHER``."""
    tag = tag[:_SKIP_TAG_LEN]
    if tag not in table and len(table) >= SKIP_TAGS_MAX:
        tag = SKIP_TAG_OTHER
    table[tag] += n


# A batch is decoded in steps of about this many events or payload bytes (the caller may let other
# work run at each): a 4 MiB batch can hold a million tiny events, ~3 s of decoding in one piece.
DECODE_STEP_EVENTS = 512
DECODE_STEP_BYTES = 64 << 10
# msgpack's array headers: fixarray, array 16, array 32.
_ARRAY_HEADS = frozenset(range(0x90, 0xA0)) | {0xDC, 0xDD}


def decode_batch(
    payload: bytes | bytearray | memoryview, *, skipped: Counter[str] | None = None
) -> tuple[float, list[KVEvent], int | None]:
    """``(ts, events, data_parallel_rank)`` of one published batch, either layout.

    Event types this module does not know are left out (counted into ``skipped`` by type when
    given, bounded as ``count_skipped`` does) so a newer vLLM that adds one does not blind the
    index to the types it does know.
    """
    steps = decode_batch_steps(payload, skipped=skipped)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


def decode_batch_steps(
    payload: bytes | bytearray | memoryview, *, skipped: Counter[str] | None = None
) -> Generator[None, None, tuple[float, list[KVEvent], int | None]]:
    """``decode_batch`` with a pause (a ``yield``) every ``DECODE_STEP_EVENTS`` events or
    ``DECODE_STEP_BYTES`` bytes; its result is the generator's return value. The usual
    ``[ts, events, rank]`` array is read an event at a time, so neither unpacking nor checking
    a big batch is one piece; it is still all or nothing (an error after any number of pauses
    means no events)."""
    data = bytes(payload)
    if not data or data[0] not in _ARRAY_HEADS:  # a map-encoded batch struct, or no batch
        ts, events, rank = _batch_fields(_unpack_all(data))
        out, _ = yield from _decode_events(events, skipped, None)
        return ts, out, rank
    u = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=len(data))
    u.feed(data)
    n = _stream(u.read_array_header)
    if n < 2:
        raise _fail("not a [ts, events, rank] batch: list")
    ts = _stream(u.unpack)
    _check_ts(ts)
    if u.tell() >= len(data) or data[u.tell()] not in _ARRAY_HEADS:
        raise _fail(f"events: expected a list, got {type(_stream(u.unpack)).__name__}")
    count = _stream(u.read_array_header)
    out, _ = yield from _decode_events((_stream(u.unpack) for _ in range(count)), skipped, u)
    rank = _stream(u.unpack) if n > 2 else None
    for _ in range(n - 3):
        _stream(u.skip)
    if u.tell() != len(data):
        raise _fail("not msgpack: extra data after the batch")
    _check_rank(rank)
    return float(ts), out, rank


def _stream(read: Callable[[], Any]) -> Any:
    try:
        return read()
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise _fail(f"not msgpack: {e!r}") from e


def _unpack_all(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise _fail(f"not msgpack: {e}") from e


def _check_ts(ts: object) -> None:
    if not (isinstance(ts, float) or _is_int(ts)):
        raise _fail(f"ts: expected a number, got {type(ts).__name__}")


def _check_rank(rank: object) -> None:
    if rank is not None and not _is_int(rank):
        raise _fail(f"data_parallel_rank: expected an int, got {type(rank).__name__}")


def _batch_fields(raw: object) -> tuple[float, list[Any], int | None]:
    if isinstance(raw, dict):  # a server that encodes the batch struct as a map
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], _at(raw, 2)
    else:
        raise _fail(f"not a [ts, events, rank] batch: {type(raw).__name__}")
    _check_ts(ts)
    if not isinstance(events, list):
        raise _fail(f"events: expected a list, got {type(events).__name__}")
    _check_rank(rank)
    return float(ts), events, rank


def _decode_events(
    events: Iterable[Any], skipped: Counter[str] | None, u: msgpack.Unpacker | None
) -> Generator[None, None, tuple[list[KVEvent], None]]:
    """The known events of ``events``, pausing every DECODE_STEP_EVENTS events or (reading from
    ``u``) DECODE_STEP_BYTES bytes. Unknown types are counted into ``skipped`` only once the
    whole batch decoded, so a batch that fails counts nothing."""
    out: list[KVEvent] = []
    unknown: Counter[str] = Counter()
    pause_at = DECODE_STEP_BYTES
    for i, ev in enumerate(events):
        if i and not i % DECODE_STEP_EVENTS:
            yield
            if u is not None:
                pause_at = u.tell() + DECODE_STEP_BYTES
        elif u is not None and u.tell() >= pause_at:
            yield
            pause_at = u.tell() + DECODE_STEP_BYTES
        if isinstance(ev, dict):
            tag, table = ev.get("type"), _FROM_MAP
        elif isinstance(ev, list) and ev:
            tag, table = ev[0], _FROM_ARRAY
        else:
            raise _fail(f"event {i}: neither a tagged map nor a tagged array")
        if not isinstance(tag, str):
            raise _fail(f"event {i}: no type tag")
        decode = table.get(tag)
        if decode is None:
            if skipped is not None:
                count_skipped(unknown, tag)
            continue
        try:
            out.append(decode(ev))
        except KVEventDecodeError as e:
            raise _fail(f"event {i} ({tag}): {e}") from None
    if skipped is not None:
        for tag, n in unknown.items():
            count_skipped(skipped, tag, n)
    return out, None


# --------------------------------------------------------------------------- encoding


def _extra_keys(ev: BlockStored) -> list[list[str] | None]:
    # vLLM's per-block extra keys: the LoRA name on every block, the salt on a request's first.
    out: list[list[str] | None] = []
    for i in range(len(ev.engine_hashes)):
        keys = [ev.lora_name] if ev.lora_name else []
        if i == 0 and ev.parent is None and ev.cache_salt:
            keys.append(ev.cache_salt)
        out.append(keys or None)
    return out


def _to_map(ev: KVEvent) -> dict[str, Any]:
    if isinstance(ev, BlockStored):
        m: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": list(ev.engine_hashes),
            "parent_block_hash": ev.parent,
            "token_ids": list(ev.token_ids),
            "block_size": ev.block_size,
            "lora_id": ev.lora_id,
            "medium": ev.medium,
            "lora_name": ev.lora_name,
            "extra_keys": _extra_keys(ev),
            "group_idx": ev.group_idx,
        }
        kind = ev.kv_cache_spec_kind
        if kind is None and ev.group_idx == 0:
            kind = FULL_ATTENTION  # what a non-hybrid vLLM 0.32 always sends
        if kind is not None:  # msgspec's omit_defaults leaves a None kind out
            m["kv_cache_spec_kind"] = kind
        return m
    if isinstance(ev, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": list(ev.engine_hashes),
            "medium": ev.medium,
            "group_idx": ev.group_idx,
        }
    if isinstance(ev, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {ev!r}")


def _to_array(ev: KVEvent) -> list[Any]:
    if isinstance(ev, BlockStored):
        return [
            "BlockStored",
            list(ev.engine_hashes),
            ev.parent,
            list(ev.token_ids),
            ev.block_size,
            ev.lora_id,
            ev.medium,
        ]
    if isinstance(ev, BlockRemoved):
        return ["BlockRemoved", list(ev.engine_hashes), ev.medium]
    if isinstance(ev, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {ev!r}")


def encode_batch(
    ts: float, events: Iterable[KVEvent], layout: Layout = "0.32", rank: int | None = 0
) -> bytes:
    """One batch in the exact shape a vLLM of that layout publishes, so a simulated worker is
    indistinguishable from a real one to any subscriber (ours or a third party's). The 0.11
    layout has no place for a salt, LoRA name or group: those are dropped."""
    if layout == "0.32":
        encoded: list[Any] = [_to_map(e) for e in events]
    elif layout == "0.11":
        encoded = [_to_array(e) for e in events]
    else:
        raise ValueError(f"unknown layout {layout!r}")
    return msgpack.packb([float(ts), encoded, rank], use_bin_type=True)
