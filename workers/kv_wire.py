"""vLLM KV-cache events on the wire: the event types and the msgpack batch codec.

Formats drift between vLLM releases, so decoding is strict about structure (a malformed batch is
an error, never a half-applied guess) but tolerant of growth (unknown event types and a few trailing
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
    "MAX_BATCH_EXTRA_FIELDS",
    "MAX_HASH_BYTES",
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
# An engine hash sent as bytes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) is a digest: 32 bytes for
# vLLM's sha256 and sha256_cbor, 16 for xxhash (xxh3_128), 36 with a group id left on. The
# index keeps each one as a key and bounds a worker by entries, not bytes: a longer "hash" let a
# publisher park kilobytes per entry (64 KiB ones: 9.8 GiB at one worker's cap).
MAX_HASH_BYTES = 64


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
    if _is_int(v):
        return v  # type: ignore[return-value]
    if isinstance(v, bytes):
        if len(v) > MAX_HASH_BYTES:
            raise _fail(f"{what}: a {len(v)}-byte hash, over {MAX_HASH_BYTES}")
        return v
    raise _fail(f"{what}: expected int or bytes, got {type(v).__name__}")


# Element types checked a list at a time (`set(map(type, v))` runs in C): a stored event carries
# a hash per block and a token id per token, and a per-element Python check was most of the
# decode's cost (bool is an int subclass but never valid here, hence `type`, not isinstance).
_INT_ONLY = frozenset({int})
_BYTES_ONLY = {bytes}


def _hashes(v: object) -> tuple[EngineHash, ...]:
    if not isinstance(v, list):
        raise _fail(f"block_hashes: expected a list, got {type(v).__name__}")
    types = set(map(type, v))
    if not _INT_ONLY.issuperset(types):
        if types == _BYTES_ONLY:
            if max(map(len, v)) > MAX_HASH_BYTES:
                raise _fail(f"block_hashes: a {max(map(len, v))}-byte hash, over {MAX_HASH_BYTES}")
        else:
            for h in v:
                _hash(h, "block_hashes")  # names the offending type or length
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


def _fail_missing(m: dict[Any, Any], *keys: str) -> KVEventDecodeError:
    return _fail(f"missing {', '.join(k for k in keys if k not in m)}")


def _stored_from_map(m: dict[Any, Any]) -> BlockStored:
    try:  # no helper: this runs for every stored event
        hashes, token_ids, block_size = m["block_hashes"], m["token_ids"], m["block_size"]
    except KeyError:
        raise _fail_missing(m, "block_hashes", "token_ids", "block_size") from None
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
    try:
        hashes = m["block_hashes"]
    except KeyError:
        raise _fail_missing(m, "block_hashes") from None
    return BlockRemoved(_hashes(hashes), _soft_str(m.get("medium")), _group(m.get("group_idx")))


def _at(a: list[Any], i: int) -> Any:
    return a[i] if len(a) > i else None


def _stored_from_array(a: list[Any]) -> BlockStored:
    # ["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, (later releases
    # append, in struct order:) lora_name, extra_keys, group_idx, kv_cache_spec_kind, ...]
    n = len(a)
    if n < 5:
        raise _fail(f"BlockStored array of {n} fields, need at least 5")
    if n == 7:  # vLLM 0.11's shape, spelt out: this runs for every stored event
        return stored_event(a[1], a[2], a[3], a[4], a[5], a[6], None, _ABSENT, None, None)
    group = a[9] if n > 9 and _is_int(a[9]) else None
    extra_keys = a[8] if n > 8 else _ABSENT
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
# Fields a batch may carry past ``[ts, events, rank]`` (keys past those three, in a map-encoded
# one): vLLM sends 2 or 3 and a later release may add a few, but each is skipped by a Python call
# of its own, so 4 million one-byte ones held the event loop for 0.9 s.
MAX_BATCH_EXTRA_FIELDS = 8
# Arrays and maps (lists and dicts, decoded) a batch may hold: one per _BYTES_PER_CONTAINER bytes
# of it, and _CONTAINERS_MIN whatever its size. An empty one is one byte on the wire but ~70 as a
# Python object: a 4 MiB batch of them took 250 MiB to decode, only to be skipped. vLLM's are far
# sparser: an event is one or two (its hashes, tokens and extra keys), tens of bytes each; a block's
# extra keys (a LoRA name, a salt) come with the block's hash and token ids, 12 bytes at least.
_BYTES_PER_CONTAINER = 6
_CONTAINERS_MIN = 64
# msgpack's array headers (fixarray, array 16, array 32) and map headers (fixmap, map 16, map 32).
_ARRAY_HEADS = frozenset(range(0x90, 0xA0)) | {0xDC, 0xDD}
_MAP_HEADS = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}
_BATCH_KEYS = frozenset({"ts", "events", "data_parallel_rank"})


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
    ``DECODE_STEP_BYTES`` bytes; its result is the generator's return value. The batch, the usual
    ``[ts, events, rank]`` array or a struct encoded as a map, is read an event at a time, so
    neither unpacking nor checking a big batch is one piece; it is still all or nothing (an error
    after any number of pauses means no events)."""
    data = bytes(payload)
    u = _unpacker(data)
    head = data[0] if data else None
    if head in _ARRAY_HEADS:  # inline, not a helper: the usual case, and many batches are small
        n = _stream(u.read_array_header)
        if n < 2:
            raise _fail("not a [ts, events, rank] batch: list")
        if n > 3 + MAX_BATCH_EXTRA_FIELDS:
            raise _fail(f"a batch of {n} fields, over {3 + MAX_BATCH_EXTRA_FIELDS}")
        ts = _stream(u.unpack)
        _check_ts(ts)
        out = yield from _decode_events(u, data, skipped)
        rank = _stream(u.unpack) if n > 2 else None
        for _ in range(n - 3):
            _stream(u.skip)
    elif head in _MAP_HEADS:
        ts, out, rank = yield from _map_batch(u, data, skipped)
    else:
        raise _fail(f"not a [ts, events, rank] batch: {type(_stream(u.unpack)).__name__}")
    if u.tell() != len(data):
        raise _fail("not msgpack: extra data after the batch")
    _check_ts(ts)
    _check_rank(rank)
    return float(ts), out, rank


def _unpacker(data: bytes) -> msgpack.Unpacker:
    """An unpacker fed ``data`` that refuses more containers than a batch of its size can hold."""
    left = len(data) // _BYTES_PER_CONTAINER + _CONTAINERS_MIN

    def count(obj: Any) -> Any:
        nonlocal left
        left -= 1
        if left < 0:
            raise _fail(f"over {len(data) // _BYTES_PER_CONTAINER + _CONTAINERS_MIN} arrays/maps")
        return obj

    u = msgpack.Unpacker(
        raw=False,
        strict_map_key=False,
        max_buffer_size=max(len(data), 1),
        list_hook=count,
        object_hook=count,
    )
    u.feed(data)
    return u


def _map_batch(
    u: msgpack.Unpacker, data: bytes, skipped: Counter[str] | None
) -> Generator[None, None, tuple[Any, list[KVEvent], Any]]:
    """A server that encodes the batch struct as a map: its three fields in any order, other
    keys skipped, the events read one at a time as in the array layout."""
    n = _stream(u.read_map_header)
    if n > len(_BATCH_KEYS) + MAX_BATCH_EXTRA_FIELDS:
        raise _fail(f"a batch of {n} fields, over {len(_BATCH_KEYS) + MAX_BATCH_EXTRA_FIELDS}")
    got: dict[str, Any] = {}
    for _ in range(n):
        key = _stream(u.unpack)
        if not (isinstance(key, str) and key in _BATCH_KEYS):
            _stream(u.skip)
        elif key in got:
            raise _fail(f"{key} given twice")
        elif key == "events":
            got[key] = yield from _decode_events(u, data, skipped)
        else:
            got[key] = _stream(u.unpack)
    if "events" not in got:
        raise _fail("events: expected a list, got NoneType")
    return got.get("ts"), got["events"], got.get("data_parallel_rank")


def _stream(read: Callable[[], Any]) -> Any:
    try:
        return read()
    except KVEventDecodeError:
        raise
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise _fail(f"not msgpack: {e!r}") from e


def _check_ts(ts: object) -> None:
    if not (isinstance(ts, float) or _is_int(ts)):
        raise _fail(f"ts: expected a number, got {type(ts).__name__}")


def _check_rank(rank: object) -> None:
    if rank is not None and not _is_int(rank):
        raise _fail(f"data_parallel_rank: expected an int, got {type(rank).__name__}")


def _decode_events(
    u: msgpack.Unpacker, data: bytes, skipped: Counter[str] | None
) -> Generator[None, None, list[KVEvent]]:
    """The known events of the array next in ``u`` (reading ``data``), pausing every
    DECODE_STEP_EVENTS events or DECODE_STEP_BYTES bytes. Unknown types are counted into
    ``skipped`` only once the whole batch decoded, so a batch that fails counts nothing."""
    if u.tell() >= len(data) or data[u.tell()] not in _ARRAY_HEADS:
        raise _fail(f"events: expected a list, got {type(_stream(u.unpack)).__name__}")
    count = _stream(u.read_array_header)
    out: list[KVEvent] = []
    unknown: Counter[str] = Counter()
    unpack, tell = u.unpack, u.tell
    pause_at = tell() + DECODE_STEP_BYTES
    for i in range(count):
        if (i and not i % DECODE_STEP_EVENTS) or tell() >= pause_at:
            yield
            pause_at = tell() + DECODE_STEP_BYTES
        try:  # _stream, inline: this runs for every event
            ev = unpack()
        except KVEventDecodeError:
            raise
        except Exception as e:
            raise _fail(f"not msgpack: {e!r}") from e
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
    return out


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
