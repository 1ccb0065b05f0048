"""The simulated vLLM engine: continuous batching over a paged, prefix-cached KV cache.

Pure and clock-agnostic: the caller passes `now` in and advances time by the duration each `step`
returns. The real-time loop (`workers.sim.realtime`) sleeps that duration; the virtual clock
(`workers.sim.vclock`) jumps over it. Both therefore exercise the very same scheduling code.

CONTRACT (shared with workers/sim/realtime.py, workers/sim/worker.py and bench/):
- `Engine(config, profile)`
- `add_request(req: SimRequest, now: float) -> None`  (queues it as waiting)
- `abort(request_id: str) -> bool`                       (frees its blocks, True if it existed)
- `has_work() -> bool`
- `step(now: float) -> StepOutput`: schedules one step at `now`; `StepOutput.duration` is how long
  the step takes; its `outputs` become visible at `now + duration`.
- `stats() -> EngineStats` for /metrics (counters are cumulative).
"""

from __future__ import annotations

import hashlib
import random
from collections import deque
from dataclasses import dataclass, field

from workers.sim.profiles import TimingProfile, get_profile


@dataclass(slots=True)
class EngineConfig:
    num_blocks: int = 2048
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 32768
    enable_prefix_caching: bool = True
    # Record BlockStored/BlockRemoved for `take_kv_events` (the server publishes them over ZMQ).
    enable_kv_events: bool = False


@dataclass(slots=True)
class SimRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    cache_salt: str | None = None
    # Token ids the engine "generates"; when None the engine derives them deterministically.
    output_token_ids: list[int] | None = None


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request (vLLM's RequestOutput, reduced)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "length" | "stop" | "abort"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0  # times this request was preempted so far


@dataclass(slots=True)
class StepOutput:
    duration: float
    outputs: list[RequestOutput] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_preempted: int = 0


@dataclass(slots=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # fraction 0..1 of blocks held by running requests
    prefix_cache_queries: int = 0  # prompt tokens looked up (cumulative)
    prefix_cache_hits: int = 0  # prompt tokens found cached (cumulative)
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    # vllm:request_success_total by finished_reason ("stop", "length", "abort")
    request_success: dict[str, int] = field(default_factory=dict)
    num_blocks_used: int = 0  # blocks with a reference from a live request
    num_blocks_cached: int = 0  # blocks holding a reusable prefix (in use or evictable)


@dataclass(slots=True)
class KVEvent:
    """A change to the set of reusable blocks, in the shape of vLLM's KV events.

    `block_hashes` are this engine's own 64-bit chained hashes; `parent_block_hash` is the hash of
    the block before the first one (None at the start of a prompt); `token_ids` are the stored
    blocks' tokens, concatenated, so a subscriber can key blocks by content as the gateway does.
    """

    kind: str  # "BlockStored" | "BlockRemoved" | "AllBlocksCleared"
    block_hashes: list[int] = field(default_factory=list)
    parent_block_hash: int | None = None
    token_ids: list[int] = field(default_factory=list)
    # BlockStored only, as vLLM fills them: tokens per block, and one entry per stored block of the
    # extra inputs folded into its hash (None where there are none). The cache salt is folded into
    # a prompt's first block only, so only an event starting there carries it, as `(salt,)`.
    block_size: int = 0
    extra_keys: list[tuple[str, ...] | None] | None = None
    lora_name: str | None = None  # the simulator serves no LoRA adapters


_MASK64 = (1 << 64) - 1
_ROOT = 0x6B7673696D  # chain seed for unsalted prompts ("kvsim")
_VOCAB = range(1000)  # generated ids stay in the sim tokenizer's word range


def _salt_root(cache_salt: str | None) -> int:
    """Chain seed: folding the salt into the first block's parent isolates tenants completely.

    A digest rather than `hash(str)` keeps the values stable across processes (PYTHONHASHSEED), so
    KV events and logs from two runs can be compared.
    """
    if not cache_salt:
        return _ROOT
    return int.from_bytes(hashlib.blake2b(cache_salt.encode(), digest_size=8).digest(), "little")


def generated_token_ids(request_id: str, n: int) -> list[int]:
    """The ids a request "generates" when the caller gave none: a pure function of its id."""
    seed = int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")
    return random.Random(seed).choices(_VOCAB, k=n)


class _Req:
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
        self.root = _salt_root(req.cache_salt)
        self.salt = req.cache_salt or None  # "" salts nothing, in the hash and in KV events
        self.tail: list[int] = []  # tokens after the last full prompt block, then the outputs
        self.num_cached = -1  # prompt tokens served from cache at first admission
        self.num_preemptions = 0


class Engine:
    """One simulated vLLM engine core: V1 scheduler + KV cache manager + a timing model.

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

    def __init__(self, config: EngineConfig | None = None, profile: TimingProfile | None = None):
        self.config = config or EngineConfig()
        self.profile = profile or get_profile("default")
        c = self.config
        if c.num_blocks <= 0 or c.block_size <= 0 or c.max_num_seqs <= 0:
            raise ValueError("num_blocks, block_size and max_num_seqs must be positive")
        if c.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be positive")
        self._bs = c.block_size
        self._caching = c.enable_prefix_caching
        self._requests: dict[str, _Req] = {}
        self._waiting: deque[_Req] = deque()
        self._running: list[_Req] = []
        self._fresh = c.num_blocks
        self._num_used = 0
        self._cached: dict[int, int] = {}  # block hash -> refcount, or -(queue position + 1)
        self._queue: deque[int | None] = deque()  # the free queue, stale entries included
        self._qhead = 0  # position of _queue[0]
        self._num_queued = 0  # live (non-stale) entries in the free queue
        self._events: list[KVEvent] | None = [] if c.enable_kv_events else None
        self._stats = EngineStats()

    # ---- contract -------------------------------------------------------------------------------

    def add_request(self, req: SimRequest, now: float) -> None:
        """Validate like vLLM's front end (so the server can answer 400) and queue as waiting."""
        c = self.config
        rid = req.request_id
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in the engine")
        prompt_len = len(req.prompt_token_ids)
        if prompt_len == 0:
            raise ValueError("the prompt must contain at least one token")
        if req.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if prompt_len + req.max_tokens > c.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {c.max_model_len} tokens. However, you "
                f"requested {prompt_len + req.max_tokens} tokens ({prompt_len} in the messages, "
                f"{req.max_tokens} in the completion). Please reduce the length of the messages "
                "or completion."
            )
        if -(-(prompt_len + req.max_tokens) // self._bs) > c.num_blocks:
            raise ValueError(
                f"request needs {prompt_len + req.max_tokens} tokens of KV cache but the engine "
                f"holds only {c.num_blocks * self._bs}"
            )
        if req.output_token_ids is None:
            out_ids = generated_token_ids(rid, req.max_tokens)
            limit, reason = req.max_tokens, "length"
        else:
            out_ids = list(req.output_token_ids[: req.max_tokens])
            limit = len(out_ids)
            reason = "stop" if len(req.output_token_ids) < req.max_tokens else "length"
        r = _Req(req, out_ids, limit, reason)
        bs = self._bs
        nfull = prompt_len // bs
        r.tail = req.prompt_token_ids[nfull * bs :] + out_ids
        if self._caching:
            r.hashes = self._hash_prompt(req.prompt_token_ids, nfull, r.root)
        self._requests[rid] = r
        self._waiting.append(r)

    def abort(self, request_id: str) -> bool:
        r = self._requests.pop(request_id, None)
        if r is None:
            return False
        if r.blocks:  # running (a waiting request holds no blocks)
            self._running.remove(r)
            self._free(r)
        else:
            try:
                self._waiting.remove(r)
            except ValueError:
                self._running.remove(r)
        self._count_finished("abort")
        return True

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def step(self, now: float) -> StepOutput:
        """One scheduler iteration plus its (modelled) forward pass, as vLLM V1 does it.

        Running requests go first, in admission order, each taking what it still needs (a decode
        token or its next prefill chunk) from the token budget; a request that cannot get a block
        preempts the newest running request, possibly itself. Only when nothing was preempted are
        waiting requests admitted FCFS (a preempted request re-enters at the head of the queue).
        """
        bs = self._bs
        budget = self.config.max_num_batched_tokens
        running = self._running
        scheduled: list[tuple[_Req, int]] = []
        num_preempted = 0

        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            n = r.num_tokens - r.num_computed
            if n > budget:
                n = budget
            # Fast path: a decode token inside the current block needs no allocation.
            if n == 1 and r.num_computed % bs and (r.num_computed + 1) % bs:
                ok = True
            else:
                ok = self._grow(r, n)
                while not ok:
                    victim = running.pop()
                    self._preempt(victim)
                    num_preempted += 1
                    if victim is r:
                        break
                    ok = self._grow(r, n)
            if not ok:
                break
            scheduled.append((r, n))
            budget -= n
            i += 1

        if not num_preempted:
            waiting = self._waiting
            max_seqs = self.config.max_num_seqs
            while waiting and budget > 0 and len(running) < max_seqs:
                r = waiting[0]
                n = self._admit(r, budget)
                if not n:
                    break
                waiting.popleft()
                running.append(r)
                scheduled.append((r, n))
                budget -= n

        return self._execute(scheduled, num_preempted)

    def stats(self) -> EngineStats:
        s = self._stats
        s.num_running = len(self._running)
        s.num_waiting = len(self._waiting)
        s.kv_usage = self._num_used / self.config.num_blocks
        s.num_blocks_used = self._num_used
        s.num_blocks_cached = len(self._cached)
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_usage=s.kv_usage,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            prompt_tokens=s.prompt_tokens,
            generation_tokens=s.generation_tokens,
            request_success=dict(s.request_success),
            num_blocks_used=s.num_blocks_used,
            num_blocks_cached=s.num_blocks_cached,
        )

    # ---- cheap accessors (the fleet snapshot reads these for every routing decision) ------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_usage(self) -> float:
        return self._num_used / self.config.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation could take now: never used, or free and possibly still cached."""
        return self.config.num_blocks - self._num_used

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self._cached

    def prompt_block_hashes(
        self, prompt_token_ids: list[int], cache_salt: str | None = None
    ) -> list[int]:
        """This engine's chained hashes of a prompt's full blocks (for tests, KV-event users)."""
        return self._hash_prompt(
            prompt_token_ids, len(prompt_token_ids) // self._bs, _salt_root(cache_salt)
        )

    def cached_block_hashes(self) -> set[int]:
        """Every reusable block hash (held or evictable): what a KV-event subscriber should hold."""
        return set(self._cached)

    def take_kv_events(self) -> list[KVEvent]:
        """Events recorded since the last call (empty unless `enable_kv_events`)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def reset_prefix_cache(self) -> bool:
        """Drop every reusable block not held by a live request (vLLM's /reset_prefix_cache).

        Like vLLM, refuse while requests hold blocks: their hashes must stay valid.
        """
        if self._num_used:
            return False
        self._fresh = self.config.num_blocks
        self._cached.clear()
        self._queue.clear()
        self._qhead = 0
        self._num_queued = 0
        if self._events is not None:
            self._events.append(KVEvent("AllBlocksCleared"))
        return True

    def check_consistency(self) -> None:
        """Recount the block pool from the live requests and raise if the books disagree.

        O(blocks); for tests and debugging, where a leaked or double-freed block would otherwise
        only surface much later as a wrong hit rate.
        """
        refs: dict[int, int] = {}
        anon = 0
        for r in self._running:
            for key in r.blocks:
                if key is None:
                    anon += 1
                else:
                    refs[key] = refs.get(key, 0) + 1
        for r in self._waiting:
            if r.blocks:
                raise AssertionError(f"waiting request {r.rid} holds blocks")
        live = {k: v for k, v in self._cached.items() if v > 0}
        if live != refs:
            raise AssertionError("cached refcounts disagree with the running requests' blocks")
        if self._num_used != len(refs) + anon:
            raise AssertionError(f"num_used {self._num_used} != {len(refs) + anon} held blocks")
        idle_cached = {k for k, v in self._cached.items() if v < 0}
        queued = [
            key
            for pos, key in enumerate(self._queue, self._qhead)
            if key is None or self._cached.get(key) == -(pos + 1)
        ]
        if idle_cached != {k for k in queued if k is not None}:
            raise AssertionError("free cached blocks and the free queue disagree")
        if len(queued) != self._num_queued:
            raise AssertionError(f"{len(queued)} live queue entries, expected {self._num_queued}")
        total = self._fresh + self._num_queued + self._num_used
        if total != self.config.num_blocks:
            raise AssertionError(f"{total} blocks accounted for, expected {self.config.num_blocks}")

    # ---- KV cache manager -----------------------------------------------------------------------

    def _hash_prompt(self, tokens: list[int], nfull: int, root: int) -> list[int]:
        bs = self._bs
        out = []
        parent = root
        for k in range(0, nfull * bs, bs):
            parent = hash((parent, *tokens[k : k + bs])) & _MASK64
            out.append(parent)
        return out

    def _block_hash(self, r: _Req, k: int) -> int:
        """Hash of the request's block k, extending its chain into generated tokens on demand."""
        hashes = r.hashes
        while len(hashes) <= k:
            j = len(hashes)
            parent = hashes[j - 1] if j else r.root
            hashes.append(hash((parent, *self._block_tokens(r, j))) & _MASK64)
        return hashes[k]

    def _block_tokens(self, r: _Req, k: int) -> list[int]:
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

    def _register(self, r: _Req, upto: int) -> None:
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

    def _emit_stored(self, r: _Req, first: int, hashes: list[int]) -> None:
        assert self._events is not None
        tokens: list[int] = []
        for k in range(first, first + len(hashes)):
            tokens += self._block_tokens(r, k)
        parent = r.hashes[first - 1] if first else None
        extra: list[tuple[str, ...] | None] = [None] * len(hashes)
        if not first and r.salt is not None:
            extra[0] = (r.salt,)
        self._events.append(KVEvent("BlockStored", hashes, parent, tokens, self._bs, extra))

    def _grow(self, r: _Req, n: int) -> bool:
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

    def _admit(self, r: _Req, budget: int) -> int:
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

    def _free(self, r: _Req) -> None:
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

    def _preempt(self, r: _Req) -> None:
        """Recompute-style preemption: drop the KV, requeue at the head, keep generated tokens."""
        self._free(r)
        r.num_computed = 0
        r.num_preemptions += 1
        self._stats.num_preemptions += 1
        self._waiting.appendleft(r)

    # ---- the modelled forward pass ---------------------------------------------------------------

    def _execute(self, scheduled: list[tuple[_Req, int]], num_preempted: int) -> StepOutput:
        outputs: list[RequestOutput] = []
        prefill_tokens = 0
        context_pairs = 0  # prefill tokens x the tokens already computed before them
        decode_seqs = 0
        finished = False
        stats = self._stats
        # KV usage while the step runs: blocks of requests finishing in it are still held.
        kv_usage = self._num_used / self.config.num_blocks
        for r, n in scheduled:
            before = r.num_computed
            r.num_computed += n
            if r.num_computed < r.num_tokens:  # a prefill chunk that does not reach the end
                prefill_tokens += n
                context_pairs += n * before
                continue
            if n == 1 and r.num_out:
                decode_seqs += 1
            else:
                prefill_tokens += n
                context_pairs += n * before
            if r.num_out == 0:
                stats.prompt_tokens += r.prompt_len
            if r.num_out < r.limit:
                new = [r.out_ids[r.num_out]]
                r.num_out += 1
                r.num_tokens += 1
                stats.generation_tokens += 1
            else:  # an empty scripted output: finish on the "EOS" without a visible token
                new = []
            done = r.num_out >= r.limit
            if done:
                finished = True
                self._free(r)
                del self._requests[r.rid]
                self._count_finished(r.finish_reason)
            outputs.append(
                RequestOutput(
                    r.rid,
                    new,
                    done,
                    r.finish_reason if done else None,
                    r.prompt_len,
                    r.num_cached,
                    r.num_preemptions,
                )
            )
        if finished:
            self._running = [r for r in self._running if r.rid in self._requests]
        if scheduled:
            duration = self.profile.step_seconds(
                prefill_tokens, decode_seqs, kv_usage, context_pairs
            )
        else:  # cannot happen for validated requests; never let a caller's clock stand still
            duration = max(self.profile.floor_ms, 1.0) / 1000.0
        return StepOutput(duration, outputs, prefill_tokens, decode_seqs, num_preempted)

    def _count_finished(self, reason: str) -> None:
        success = self._stats.request_success
        success[reason] = success.get(reason, 0) + 1
