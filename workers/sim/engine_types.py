"""The simulated engine's data types: its config, the request it takes, what a step returns, its
stats and the KV events it records.

Plain dataclasses, apart from `workers.sim.engine` so that the layers around the engine (config
parsing, the real-time loop and virtual clock, metrics, the KV-event publisher) name what crosses
its contract without importing the engine itself. No I/O, like the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    # How requests ended, by finished_reason ("stop", "length", "abort": aborted by the caller).
    # /metrics exports it as vllm:request_success_total *without* "abort", as vLLM 0.32 counts a
    # client's abort nowhere (workers.sim.metrics.exported_success).
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
