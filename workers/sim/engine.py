"""The simulated vLLM engine: continuous batching over a paged, prefix-cached KV cache.

Pure and clock-agnostic: the caller passes `now` in and advances time by the duration each `step`
returns. The real-time loop (`workers.sim.realtime`) sleeps that duration; the virtual clock
(`workers.sim.vclock`) jumps over it. Both therefore exercise the very same scheduling code.
The types the contract names are in `workers.sim.engine_types`, and the KV cache manager (block
pool, prefix cache, KV events), the engine's base class, in `workers.sim.kv_cache`.

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

from workers.sim.engine_types import (
    EngineConfig,
    EngineStats,
    KVEvent,
    RequestOutput,
    SimRequest,
    StepOutput,
)
from workers.sim.kv_cache import KVCacheManager, Req, salt_root
from workers.sim.profiles import TimingProfile, get_profile

_VOCAB = range(1000)  # generated ids stay in the sim tokenizer's word range


def generated_token_ids(request_id: str, n: int) -> list[int]:
    """The ids a request "generates" when the caller gave none: a pure function of its id."""
    seed = int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")
    return random.Random(seed).choices(_VOCAB, k=n)


def admitted_max_tokens(config: EngineConfig, prompt_len: int, max_tokens: int) -> int:
    """The `max_tokens` a request runs with, or ValueError with the 400's message: vLLM 0.32's
    front-end rule, the one servability test of the engine, the HTTP worker and bench/.

    vLLM refuses only a prompt that leaves no room for one output token (`prompt_len >=
    max_model_len`) and *clamps* an explicit `max_tokens` to `max_model_len - prompt_len`
    (`get_max_tokens`; recorded: tests/fixtures/vllm-0.32/max_tokens_clamped.json). vLLM never
    starts with a context longer than its KV cache (it fails at startup, or fits `max_model_len`
    to the cache), so a simulated engine configured that way behaves as the fitted one: the
    context is also bounded by the KV cache, a prompt that cannot fit it with one output token is
    refused (a message naming the KV cache), and the output is clamped to what fits.
    """
    if prompt_len == 0:
        raise ValueError("the prompt must contain at least one token")
    if max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    max_len = config.max_model_len
    if prompt_len >= max_len:
        raise ValueError(
            f"This model's maximum context length is {max_len} tokens. However, your prompt "
            f"contains {prompt_len} input tokens, which exceeds this limit even without any "
            "output tokens. Please reduce the length of the input prompt."
        )
    kv_tokens = config.num_blocks * config.block_size
    if prompt_len >= kv_tokens:
        raise ValueError(
            f"request needs {prompt_len + 1} tokens of KV cache (its prompt and one output "
            f"token) but the engine holds only {kv_tokens}"
        )
    return min(max_tokens, max_len - prompt_len, kv_tokens - prompt_len)


class Engine(KVCacheManager):
    """One simulated vLLM engine core: V1 scheduler + KV cache manager (`KVCacheManager`, the base
    class, which describes the block pool) + a timing model.
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
        self._requests: dict[str, Req] = {}
        self._waiting: deque[Req] = deque()
        self._running: list[Req] = []
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
        """Validate like vLLM's front end (so the server can answer 400; `admitted_max_tokens`:
        an output that does not fit is clamped, not refused) and queue as waiting."""
        c = self.config
        rid = req.request_id
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in the engine")
        prompt_len = len(req.prompt_token_ids)
        max_tokens = admitted_max_tokens(c, prompt_len, req.max_tokens)
        if req.output_token_ids is None:
            out_ids = generated_token_ids(rid, max_tokens)
            limit, reason = max_tokens, "length"
        else:
            out_ids = list(req.output_token_ids[:max_tokens])
            limit = len(out_ids)
            reason = "stop" if len(req.output_token_ids) < max_tokens else "length"
        r = Req(req, out_ids, limit, reason)
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
        scheduled: list[tuple[Req, int]] = []
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
            prompt_token_ids, len(prompt_token_ids) // self._bs, salt_root(cache_salt)
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

    # ---- scheduler ------------------------------------------------------------------------------

    def _preempt(self, r: Req) -> None:
        """Recompute-style preemption: drop the KV, requeue at the head, keep generated tokens."""
        self._free(r)
        r.num_computed = 0
        r.num_preemptions += 1
        self._stats.num_preemptions += 1
        self._waiting.appendleft(r)

    # ---- the modelled forward pass ---------------------------------------------------------------

    def _execute(self, scheduled: list[tuple[Req, int]], num_preempted: int) -> StepOutput:
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
