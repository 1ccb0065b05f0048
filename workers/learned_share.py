"""The wire form of what replicas learn from their dispatches (`scoring.learned`), for Redis.

One batch per replica per sync interval (a backlog goes as several, each at most ~1 MB:
`gateway.cluster`), one stream entry per batch: a msgpack map

    {"v": 2, "k": [routing key fields], "t": publisher's clock at publish,
     "e": [[worker, chain, dense, tail_ends, session_id, prompt_tokens, at, block_chain, done],
           ...],
     "u": {worker: URL}, "m": [models keyed in token mode]}

``chain`` (and ``block_chain``, KV-event mode's worker-block keys) is packed as little-endian
uint64 (8 bytes a block, a third of its
decimal text and no float rounding); the rest are plain msgpack values. ``k`` is what makes a chain
mean something (block size, block cap, tail ratio): a peer hashing under other options (a rollout
in progress) still takes the batch's sessions but not its chains.

Times: ``at`` (dispatch) and ``t`` (publish) are on the publisher's monotonic clock, which nobody
else can read; the reader only uses their difference, plus the time the entry spent in Redis
(the stream id's milliseconds against Redis' own ``TIME``: both on Redis' clock), to place each
dispatch on its own clock. No two hosts' clocks are compared for that. The stream id's
milliseconds also place a note on the epoch scale (``id - (t - at)``), where `gateway.cluster`
compares it with the worker's ``process_start_time_seconds`` (NTP-synced hosts, with a slack)
to tell notes about an earlier process of a worker that restarted.

A worker name is the operator's label, its URL the server (as in `workers.load_view`): during a
rollout that points a name at a new server, a replica still routing it to the old one published
notes about the old server's cache, and a reloaded peer replayed them into its new, cold one (the
index credited it with prefixes it never saw, sessions were pinned to it as warm). So a batch
names the URL of each worker its rows are about (``u``), and a reader takes a row only into its
own worker of that name and URL. Once a batch, not once a row: a batch holds thousands of rows
about a handful of workers. ``k`` says how chains are hashed but not what from: a model keyed in
token mode (`[routing.token_mode]`) hashes token ids, in text mode the rendered text, and the two
never match, so during a rollout of token mode a peer's chains only took index capacity (and
evicted entries that did match). ``m`` lists the models the publisher keys by tokens; a reader
keeps the chains of rows about workers serving a model both key alike. Both fields are ones that
older readers ignore (``v`` stays 2, a rolling upgrade keeps sharing both ways); a batch without
them (an older publisher) is taken by worker name and ``k`` alone, as that version did.
"""

from __future__ import annotations

import math
import operator
import sys
from array import array
from collections.abc import Collection, Mapping, Sequence
from typing import NamedTuple

import msgpack

from scoring.learned import MAX_NOTE_AGE_S, Learned

__all__ = [
    "Batch",
    "decode_batch",
    "decode_frame",
    "encode_batch",
    "frame_batch",
    "pack_chain",
    "pack_entry",
    "unpack_chain",
]

_VERSION = 2
_SWAP = sys.byteorder != "little"
# A prompt's tokens, at most: a session's note adds them to its worker's commitment
# (`SessionTable.committed`), and one peer's 2**62 would weigh that worker down fleet-wide.
MAX_PROMPT_TOKENS = 1 << 32


def pack_chain(chain: Sequence[int]) -> bytes:
    a = array("Q", chain)
    if _SWAP:  # pragma: no cover - big-endian hosts
        a.byteswap()
    return a.tobytes()


def unpack_chain(raw: bytes) -> tuple[int, ...]:
    a = array("Q")
    a.frombytes(raw)
    if _SWAP:  # pragma: no cover - big-endian hosts
        a.byteswap()
    return tuple(a)


def pack_entry(e: Learned) -> bytes:
    """One dispatch's row on its own: a publisher packs each once, sizes its batches by their
    bytes, and keeps rows (8 bytes a block) instead of the request's tuples (~40 bytes a block)
    while Redis is away; ``frame_batch`` puts rows in a batch."""
    return msgpack.packb(
        [
            e.worker,
            pack_chain(e.chain),
            e.dense,
            list(e.tail_ends),
            e.session_id,
            e.prompt_tokens,
            e.at,
            pack_chain(e.block_chain),
            e.done,
        ],
        use_bin_type=True,
    )


class Batch(NamedTuple):
    """One decoded batch. ``urls``: the URL of each worker its rows name, None from an older
    publisher (its rows match by name); ``token_models``: the models the publisher keys in token
    mode, None from a publisher that does not say (an older one)."""

    key: tuple[float, ...]
    entries: list[Learned]
    urls: dict[str, str] | None = None
    token_models: frozenset[str] | None = None


def frame_batch(
    key: Sequence[float],
    rows: Sequence[bytes],
    sent: float,
    urls: Mapping[str, str] | None = None,
    token_models: Collection[str] | None = None,
) -> bytes:
    """A batch of rows from ``pack_entry``, byte for byte what ``encode_batch`` writes (readers of
    every version take it). ``sent`` is stamped here, per send: a batch re-sent after an outage
    must be placed by when it went out, not by when its rows were packed. ``urls`` and
    ``token_models`` None leave their field out (what an older version wrote)."""
    p = msgpack.Packer(use_bin_type=True)
    extra = b""
    fields = 4
    if urls is not None:
        fields += 1
        extra += p.pack("u") + p.pack(dict(urls))
    if token_models is not None:
        fields += 1
        extra += p.pack("m") + p.pack(sorted(token_models))
    head = (
        p.pack_map_header(fields)
        + p.pack("v")
        + p.pack(_VERSION)
        + p.pack("k")
        + p.pack(list(key))
        + p.pack("t")
        + p.pack(sent)
        + extra
        + p.pack("e")
        + p.pack_array_header(len(rows))
    )
    return b"".join((head, *rows))


def encode_batch(
    key: Sequence[float],
    entries: Sequence[Learned],
    sent: float,
    urls: Mapping[str, str] | None = None,
    token_models: Collection[str] | None = None,
) -> bytes:
    return frame_batch(key, [pack_entry(e) for e in entries], sent, urls, token_models)


def decode_batch(raw: bytes, now: float | None) -> tuple[tuple[float, ...], list[Learned]] | None:
    """``decode_frame``'s key and entries: for callers that match rows by name and ``k`` alone
    (tools, tests of the row format)."""
    got = decode_frame(raw, now)
    return None if got is None else (got.key, got.entries)


def decode_frame(raw: bytes, now: float | None) -> Batch | None:
    """The batch, with every ``at`` moved onto the reader's clock: ``now`` is the
    reader's estimate of when the batch was published (its clock, less the entry's age in Redis).
    None: the reader's own batch read back, whose times are on its clock already and are kept
    exact (its session turns are matched by them: `SessionTable.learn`).
    None for bytes this version does not read (a newer replica, or garbage): skipped, not
    trusted. A malformed entry drops the batch: a peer that writes one wrong entry is not to be
    trusted on the others either. Well-typed is not enough: the index weighs a tail entry by the
    difference of its neighbours in ``tail_ends`` and reads as many of them as the chain has tail
    entries (`PrefixIndex.record`), so a short list raised out of the replay and a flat or
    decreasing one weighed entries at 0 or less, which no capacity ever evicted (2,000 notes:
    2,000,000 index entries on a 16,384-block worker). ``at`` far from ``t`` is a clock this
    version did not write (it fed ~1e300 into the lag histogram's sum). A ``u`` or ``m`` of
    another shape drops the batch too: read as absent, its rows would match by name alone,
    which is what the field is there to prevent."""
    try:
        d = msgpack.unpackb(raw, raw=False, strict_map_key=True)
        if not isinstance(d, dict) or d.get("v") != _VERSION:
            return None
        key, sent, rows = d["k"], d["t"], d["e"]
        if not isinstance(key, list) or not isinstance(rows, list) or not _is_time(sent):
            return None
        if not all(_is_time(k) for k in key):
            return None
        urls = d.get("u")
        if urls is not None and not (
            isinstance(urls, dict)
            and all(isinstance(n, str) and isinstance(u, str) for n, u in urls.items())
        ):
            return None
        models = d.get("m")
        if models is not None and not (
            isinstance(models, list) and all(isinstance(m, str) for m in models)
        ):
            return None
        shift = 0.0 if now is None else now - sent
        out: list[Learned] = []
        # Every row of a text-mode batch carries the same layout (`tail_layout`, 128 ends by
        # default): each distinct one is checked once a batch.
        layouts: dict[tuple[int, ...], bool] = {}
        for row in rows:
            worker, chain, dense, tails, session, tokens, at, blocks, done = row
            if not (
                isinstance(worker, str)
                and isinstance(chain, bytes)
                and len(chain) % 8 == 0
                and isinstance(blocks, bytes)
                and len(blocks) % 8 == 0
                and isinstance(done, bool)
                and _is_count(dense)
                and isinstance(tails, list)
                and (session is None or isinstance(session, str))
                and _is_count(tokens)
                and _is_time(at)
                and abs(sent - at) <= MAX_NOTE_AGE_S
            ):
                return None
            ends = tuple(tails)
            if ends:
                ok = layouts.get(ends)
                if ok is None:
                    ok = layouts[ends] = _is_layout(ends)
                # The local path sends the whole layout with a chain that may stop short of it
                # (or of the dense head: a short prompt, whose tail the index ignores).
                if not ok or ends[0] <= dense or len(chain) // 8 - dense > len(ends):
                    return None
            out.append(
                Learned(
                    worker,
                    unpack_chain(chain),
                    dense,
                    ends,
                    session or None,
                    min(tokens, MAX_PROMPT_TOKENS),
                    at if now is None else min(at + shift, now),
                    unpack_chain(blocks),
                    done,
                )
            )
        return Batch(tuple(key), out, urls, None if models is None else frozenset(models))
    except (msgpack.UnpackException, ValueError, TypeError, KeyError):
        return None


def _is_layout(ends: tuple[int, ...]) -> bool:
    """Counts, strictly increasing: every tail entry spans at least one block."""
    return all(map(_is_count, ends)) and all(map(operator.lt, ends, ends[1:]))


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_time(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
