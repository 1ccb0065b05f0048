"""The simulated engine's KV cache manager: a paged block pool with vLLM's prefix cache (chained
block hashes, LRU eviction of freed blocks) and the KV events it records.

Kept apart from the scheduler and the timing model in `workers.sim.engine` because it is the
subtle part: the block books (refcounts, the free queue and its stale entries) must stay exact
for hit rates and KV events to mean anything, and `Engine.check_consistency` recounts them. No
I/O and no clock, like the engine. `Req`, one request's state, lives here because these methods
read and write its blocks and hashes; the scheduler owns the rest of it.
"""

from __future__ import annotations

import hashlib
from collections import deque

from workers.sim.engine_types import EngineConfig, EngineStats, KVEvent, SimRequest

_MASK64 = (1 << 64) - 1
_ROOT = 0x6B7673696D  # chain seed for unsalted prompts ("kvsim")


def salt_root(cache_salt: str | None) -> int:
    """Chain seed: folding the salt into the first block's parent isolates tenants completely.

    A digest rather than `hash(str)` keeps the values stable across processes (PYTHONHASHSEED), so
    KV events and logs from two runs can be compared.
    """
    if not cache_salt:
        return _ROOT
    return int.from_bytes(hashlib.blake2b(cache_salt.encode(), digest_size=8).digest(), "little")


class Req:
    """Scheduler-side state of one request (vLLM's `Request`, reduced to what the model needs)."""

    __slots__ = (
        "blocks",
        "finish_reason",
        "hashes",
        "limit",
        "num_cached",
        "num_computed",
        "num_out",
        "num_preemptions",
        "num_registered",
        "num_tokens",
        "out_ids",
        "prompt",
        "prompt_len",
        "rid",
        "root",
        "salt",
        "tail",
    )

    def __init__(self, req: SimRequest, out_ids: list[int], limit: int, reason: str) -> None:
        self.rid = req.request_id
        self.prompt = req.prompt_token_ids
        self.prompt_len = len(req.prompt_token_ids)
        self.out_ids = out_ids
        self.limit = limit  # tokens to emit before finishing
        self.finish_reason = reason
        self.num_out = 0
        # Tokens known so far (prompt + sampled); the last sampled one is not in the KV cache yet.
        self.num_tokens = self.prompt_len
        self.num_computed = 0  # tokens whose KV is (being) computed
        # One entry per allocated block: its hash when it is a registered cached block, else None.
        self.blocks: list[int | None] = []
        self.num_registered = 0  # leading blocks already considered for the prefix cache
        self.hashes: list[int] = []  # chained hashes of this request's full blocks, in order
        self.root = salt_root(req.cache_salt)
        self.salt = req.cache_salt or None  # "" salts nothing, in the hash and in KV events
        self.tail: list[int] = []  # tokens after the last full prompt block, then the outputs
        self.num_cached = -1  # prompt tokens served from cache at first admission
        self.num_preemptions = 0


class KVCacheManager:
    """The KV cache manager half of `Engine` (its base class: the scheduler calls these methods on
    the hot path, so they stay methods on one object). The state is the engine's, set up in
    `Engine.__init__`; the annotations below name what these methods use.

    KV blocks are not materialised one by one. The pool is `fresh` never-used blocks, the
    blocks held by live requests, and one "free queue" of every free block that was used before,
    oldest first, as in vLLM's FreeKVCacheBlockQueue: a freed block keeps its hash (stays reusable)
    until an allocation pops it from the front (LRU eviction), and unhashed free blocks (None)
    sit in the same queue, so eviction order matches vLLM's when the two kinds mix.

    `_cached` maps each reusable block hash to its refcount (> 0) or, while free, to -(p + 1)
    where p is its position in the free queue. Reviving a free block just overwrites that value;
    its queue entry goes stale and is skipped when the front reaches it. This keeps every
    operation to plain dict and deque calls that can be done in bulk: a replayed trace moves
    millions of blocks through the queue.
    """

    config: EngineConfig
    _bs: int
    _caching: bool
    _fresh: int
    _num_used: int
    _cached: dict[int, int]
    _queue: deque[int | None]
    _qhead: int
    _num_queued: int
    _events: list[KVEvent] | None
    _stats: EngineStats

    def _hash_prompt(self, tokens: list[int], nfull: int, root: int) -> list[int]:
        bs = self._bs
        out = []
        parent = root
        for k in range(0, nfull * bs, bs):
            parent = hash((parent, *tokens[k : k + bs])) & _MASK64
            out.append(parent)
        return out

    def _block_hash(self, r: Req, k: int) -> int:
        """Hash of the request's block k, extending its chain into generated tokens on demand."""
        hashes = r.hashes
        while len(hashes) <= k:
            j = len(hashes)
            parent = hashes[j - 1] if j else r.root
            hashes.append(hash((parent, *self._block_tokens(r, j))) & _MASK64)
        return hashes[k]

    def _block_tokens(self, r: Req, k: int) -> list[int]:
        bs = self._bs
        start = k * bs
        if start + bs <= r.prompt_len:
            return r.prompt[start : start + bs]
        off = start - (r.prompt_len // bs) * bs
        return r.tail[off : off + bs]

    def _alloc_blocks(self, n: int, blocks: list[int | None]) -> None:
        """Append n new private blocks: never-used ones first, then the free queue's head (LRU).

        The caller has checked that n blocks are free.
        """
        fresh = self._fresh
        if fresh >= n:
            self._fresh = fresh - n
        else:
            self._fresh = 0
            self._pop_free(n - fresh)
        self._num_used += n
        blocks += [None] * n

    def _pop_free(self, n: int) -> None:
        """Take n live entries off the front of the free queue, evicting the cached ones."""
        queue = self._queue
        popleft = queue.popleft
        cached = self._cached
        evicted: list[int] = []
        self._num_queued -= n
        while n:
            head = self._qhead
            chunk = [popleft() for _ in range(min(n, len(queue)))]
            self._qhead = head + len(chunk)
            stamps = range(-head - 1, -head - 1 - len(chunk), -1)
            # A hashed entry is live only if the block is still free since that very free.
            hit = [
                k
                for k, st in zip(chunk, stamps, strict=True)
                if k is not None and cached.get(k) == st
            ]
            n -= len(hit) + chunk.count(None)
            evicted += hit
        if evicted:  # cached blocks: their reuse ends here
            deque(map(cached.__delitem__, evicted), maxlen=0)
            if self._events is not None:
                self._events.append(KVEvent("BlockRemoved", evicted))

    def _register(self, r: Req, upto: int) -> None:
        """Publish the request's newly full blocks [num_registered, upto) in the prefix cache.

        Like vLLM, this happens when the tokens are scheduled, so a request arriving while a long
        prompt is still prefilling already hits its finished chunks. A block whose hash is already
        cached (two identical prompts computed at once) stays private to its owner.
        """
        cached = self._cached
        blocks = r.blocks
        hashes = r.hashes
        start = r.num_registered
        r.num_registered = upto
        if upto > len(hashes):  # blocks that end in generated tokens: extend the chain
            self._block_hash(r, upto - 1)
        if self._events is None:
            new = hashes[start:upto]
            if cached.keys().isdisjoint(new):  # the common case, done in bulk
                cached.update(dict.fromkeys(new, 1))
                blocks[start:upto] = new
                return
            for k in range(start, upto):
                h = hashes[k]
                if h not in cached:
                    cached[h] = 1
                    blocks[k] = h
            return
        stored: list[int] = []
        for k in range(start, upto):
            h = hashes[k]
            if h in cached:
                if stored:
                    self._emit_stored(r, k - len(stored), stored)
                    stored = []
                continue
            cached[h] = 1
            blocks[k] = h
            stored.append(h)
        if stored:
            self._emit_stored(r, upto - len(stored), stored)

    def _emit_stored(self, r: Req, first: int, hashes: list[int]) -> None:
        assert self._events is not None
        tokens: list[int] = []
        for k in range(first, first + len(hashes)):
            tokens += self._block_tokens(r, k)
        parent = r.hashes[first - 1] if first else None
        extra: list[tuple[str, ...] | None] = [None] * len(hashes)
        if not first and r.salt is not None:
            extra[0] = (r.salt,)
        self._events.append(KVEvent("BlockStored", hashes, parent, tokens, self._bs, extra))

    def _grow(self, r: Req, n: int) -> bool:
        """Give a running request the blocks for n more tokens; False if the pool is short."""
        bs = self._bs
        end = r.num_computed + n
        need = -(-end // bs) - len(r.blocks)
        if need > self.config.num_blocks - self._num_used:
            return False
        if need > 0:
            self._alloc_blocks(need, r.blocks)
        if self._caching and end // bs > r.num_registered:
            self._register(r, end // bs)
        return True

    def _admit(self, r: Req, budget: int) -> int:
        """Prefix-match and allocate a waiting request; tokens scheduled, or 0 if it must wait."""
        bs = self._bs
        cached = self._cached
        matched = 0
        revived = 0  # matched blocks now in the free queue (they leave it when touched)
        if self._caching:
            limit = min((r.num_tokens - 1) // bs, len(r.hashes))
            hashes = r.hashes
            while matched < limit:
                rc = cached.get(hashes[matched])
                if rc is None:
                    break
                if rc < 0:
                    revived += 1
                matched += 1
        computed = matched * bs
        n = r.num_tokens - computed
        if n > budget:
            n = budget
        end = computed + n
        need = -(-end // bs) - matched
        if need + revived > self.config.num_blocks - self._num_used:
            return 0
        blocks: list[int | None] = r.hashes[:matched]
        if revived:
            for h in blocks:
                rc = cached[h]
                cached[h] = 1 if rc < 0 else rc + 1
            self._num_used += revived
            self._num_queued -= revived
        else:
            for h in blocks:
                cached[h] += 1
        r.blocks = blocks
        r.num_registered = matched
        if need > 0:
            self._alloc_blocks(need, blocks)
        r.num_computed = computed
        if self._caching and end // bs > matched:
            self._register(r, end // bs)
        if r.num_cached < 0:  # first admission: the per-request truth and the hit-rate counters
            r.num_cached = computed
            self._stats.prefix_cache_queries += r.num_tokens
            self._stats.prefix_cache_hits += computed
        return n

    def _free(self, r: Req) -> None:
        """Release a request's blocks, tail first, so its last blocks are the first evicted.

        Blocks only this request used join the free queue (hashed ones stay reusable there);
        shared ones just lose a reference.
        """
        cached = self._cached
        rev = r.blocks[::-1]
        released = [k for k in rev if k is None or cached[k] == 1]
        if len(released) != len(rev):
            for k in rev:
                if k is not None and cached[k] > 1:
                    cached[k] -= 1
        queue = self._queue
        start = self._qhead + len(queue)
        queue += released
        cached.update({k: -p for p, k in enumerate(released, start + 1) if k is not None})
        self._num_used -= len(released)
        self._num_queued += len(released)
        r.blocks = []
        r.num_registered = 0
        if len(queue) > 2 * self._num_queued + 4096:
            self._compact_queue()

    def _compact_queue(self) -> None:
        """Drop stale entries (blocks revived since they were freed) so the queue stays bounded."""
        cached = self._cached
        live = [
            k
            for pos, k in enumerate(self._queue, self._qhead)
            if k is None or cached.get(k) == -(pos + 1)
        ]
        start = self._qhead + len(self._queue)
        self._queue = deque(live)
        self._qhead = start
        cached.update({k: -p for p, k in enumerate(live, start + 1) if k is not None})
