"""The values routing works on: worker snapshots, request keys, decisions, weights and options.

All frozen: a policy reads a snapshot and returns a decision, it never mutates what it was given, so
the same objects can be shared by the request path, metrics and the offline simulator. Every field
added for the KV-aware policy has a default, so callers that know less (a bare simulator, an old
registry) still build valid views and get sensible, if less informed, routing.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, fields

__all__ = ["Decision", "RouteRequest", "RoutingOptions", "Weights", "WorkerView"]


@dataclass(slots=True, frozen=True)
class WorkerView:
    """What routing may know about one worker at decision time."""

    name: str
    in_flight: int = 0  # requests this gateway has sent and not yet seen finish
    running: int = 0  # vllm:num_requests_running at the last scrape
    waiting: int = 0  # vllm:num_requests_waiting at the last scrape
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc (0..1) at the last scrape
    block_size: int | None = None
    num_blocks: int | None = None
    weight: float = 1.0
    labels: dict[str, str] = field(default_factory=dict)
    # The gateway's own bookkeeping since the last scrape: a scrape is up to a probe interval old,
    # and a burst routed on stale numbers all lands on the same "idle" worker. None = not tracked.
    in_flight_at_scrape: int | None = None  # this gateway's in_flight when the scrape was taken
    # Estimated uncached prompt tokens of this gateway's requests on the worker that have not
    # produced a first token yet (sum of Decision.prefill_tokens, minus each at its first token).
    prefill_tokens: int = 0
    # Sum of Decision.prefill_tokens dispatched here since the last scrape: KV the scrape cannot
    # show yet.
    sent_tokens_since_scrape: int = 0


@dataclass(slots=True, frozen=True)
class RouteRequest:
    """The routing key of one request, computed once per request and reused across retries.

    Build it with ``scoring.route_key.route_request`` (which renders and hashes the prompt) rather
    than by hand, so the chain uses the same block size and seed as the index.
    """

    model: str
    request_id: str = ""
    tenant_priority: float = 0.5  # 0..1, higher = more latency-sensitive
    chain: tuple[int, ...] = ()  # chained prefix block hashes (scoring.prefix)
    block_tokens: float = 16.0  # estimated tokens per chain block
    prompt_tokens: int = 0  # estimated tokens of the whole prompt (may exceed what chain covers)
    session_id: str | None = None
    # Chain layout (scoring.prefix.tail_layout): entries from `dense_blocks` on are tail spans,
    # tail entry i ending `tail_ends[i]` blocks into the prompt. No tail: every entry is a block.
    dense_blocks: int = 0
    tail_ends: tuple[int, ...] = ()
    # Token mode only: one key per worker block (no tail), what a KV-event (precise) index is
    # keyed by; its first `dense_blocks` entries equal `chain`'s. Empty: no precise matching.
    block_chain: tuple[int, ...] = ()
    # Token mode: every prompt token of the request by the model's tokenizer (a completions
    # batch's every prompt, its suffix in each), what `max_input_tokens` is checked against
    # exactly; 0: not counted (text mode estimates).
    exact_tokens: int = 0

    def entries_for_blocks(self, blocks: int) -> int:
        """Chain entries wholly covered by the first ``blocks`` worker blocks (a precise match).

        Without a tail an entry is a block (``block_chain`` may reach past ``chain``: the match
        then counts more entries than the chain has, and ``matched_tokens`` stays right).
        """
        d = self.dense_blocks
        if not self.tail_ends or blocks <= d:
            return blocks
        return d + bisect.bisect_right(self.tail_ends, blocks)

    def matched_tokens(self, entries: int) -> float:
        """Tokens covered by the chain's first ``entries`` entries."""
        d = self.dense_blocks
        if entries > d and self.tail_ends:
            return self.tail_ends[entries - d - 1] * self.block_tokens
        return entries * self.block_tokens


@dataclass(slots=True, frozen=True)
class Decision:
    worker: WorkerView
    reason: str
    # Per-signal values for the chosen worker (metrics, the debug header); empty for blind policies.
    scores: dict[str, float] = field(default_factory=dict)
    matched_blocks: int = 0  # leading chain entries the index says the chosen worker holds
    # Estimated prompt tokens the chosen worker must prefill (not cached there). The gateway adds it
    # to the worker's WorkerView.prefill_tokens / sent_tokens_since_scrape bookkeeping.
    prefill_tokens: int = 0
    saturated: bool = False  # every candidate was over a saturation threshold
    # Where matched_blocks came from: "precise" (the worker's KV events), "approx" (the gateway's
    # own dispatch history) or "" (no match).
    match_source: str = ""


@dataclass(slots=True, frozen=True)
class Weights:
    """The kv_aware scorer's weights, ops-editable and swapped live (validated here, once).

    ``score = prefix*prefix_match - queue*queue_delay - kv*kv_pressure + tenant*tenant_priority
    + session*session_affinity``, each signal in [0, 1] as defined in ``scoring.signals`` (where the
    cache credit is yielded under load and priority buys queue headroom).
    """

    prefix: float = 0.45
    queue: float = 0.25
    kv: float = 0.20
    tenant: float = 0.10
    session: float = 0.15

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise ValueError(f"weight {f.name!r} must be a number, got {v!r}")
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"weight {f.name!r} must be finite and >= 0, got {v!r}")


def _finite(v: int | float) -> bool:
    """`math.isfinite`, but False for an int too large for a float (TOML takes any number of
    digits) instead of its OverflowError, which escaped the config's validation as a crash."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


@dataclass(slots=True, frozen=True)
class RoutingOptions:
    """Knobs of hashing, the signal models and saturation. Defaults are documented choices.

    Timing constants only need to be right within a factor of two: they convert request counts and
    token counts into one unit (seconds), which is what lets a queue be weighed against a cache hit.
    """

    # -- prefix keys (changing these invalidates the learned index) --
    block_chars: int = 64  # text mode: UTF-8 bytes per block, ~16 tokens = one vLLM block
    max_blocks: int = 64  # dense head: 4 KiB of text (~1k tokens) at 64-byte blocks, then ...
    tail_ratio: int = 16  # ... spans growing with depth, each 1/16 of what precedes it ...
    tail_blocks: int = 128  # ... up to 128 of them: 8 MiB (~2M tokens) hashed in all
    chars_per_token: float = 4.0
    token_block_size: int = 16  # token-id prompts: the workers' block_size
    # -- queue model --
    prefill_tokens_per_s: float = 16_000.0  # uncached prompt tokens a worker prefills per second
    mean_prompt_tokens: float = 1_024.0  # assumed size of a queued request we did not send
    decode_s_per_running: float = 0.002  # start delay each running sequence adds (batch share)
    queue_horizon_s: float = 0.5  # queue signal = wait / (wait + horizon): 0.5 at the horizon
    # A cache hit keeps its credit until the holder's extra wait reaches this multiple of the
    # prefill time the hit saves. 1.0 is the single request's TTFT break-even, but moving a request
    # also costs the fleet a prefill and a second copy of the prefix: on the Mooncake replay at 5x
    # load, 10 lifted the hit rate 20.8% -> 35.0% and cut p99 TTFT 1.99 s -> 1.51 s.
    affinity_slack: float = 10.0
    # A holder's cache credit also yields to the contexts it already carries, for a request whose
    # session does not live there: when the active sessions pinned to it (SessionTable.committed)
    # exceed the least committed candidate's by this multiple of the tokens the hit saves, and
    # by more than `affinity_max_ratio` times, the credit is gone. A 12k-token shared agent
    # preamble then stops drawing every new session onto its holders (4 of 8 workers idle, p99
    # TTFT 1.61 s against 0.80 s with it, bench simulate on an agentic conversation trace); a
    # session's own worker keeps its credit. 0 turns it off.
    commitment_slack: float = 4.0
    # The `prefix` policy's load guard: its holder yields when its outstanding requests exceed
    # the least loaded candidate's by more than this many AND this many times (both).
    affinity_max_excess: float = 32.0
    affinity_max_ratio: float = 2.0
    # -- saturation: such workers are left out while any worker is below both --
    saturation_kv: float = 0.90
    saturation_waiting: float = 8.0
    # -- tie-breaks, index and sessions --
    tie_tolerance: float = 1e-3  # scores this close are ties, broken at random
    # Fleets above 2x this score holders + the session's worker + this many random others
    # (power of d choices); 0 scores every candidate.
    sample_size: int = 16
    default_capacity_blocks: int = 16_384  # index budget for a worker that reports no num_blocks
    max_capacity_blocks: int = 32_768  # memory bound per worker (~6 MB), whatever it reports
    session_ttl_s: float = 600.0
    session_active_s: float = 60.0  # a session counts toward its worker's commitment this long
    session_max: int = 100_000
    # Token mode with KV events: worker blocks keyed per request for the precise index (8,192
    # blocks = 131k tokens at block size 16; ~0.45 ms of hashing at the cap).
    precise_max_blocks: int = 8_192

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not _finite(v):
                got = "an integer too large" if isinstance(v, int) else repr(v)
                raise ValueError(f"routing option {f.name!r} must be a finite number, got {got}")
            if f.name in _INT_OPTIONS and not isinstance(v, int):
                # Counts, sizes and slice bounds: `block_chars = 64.0` (TOML writes a float with
                # its point) would pass here and make every request hashing a prompt a 500
                # (a str times a float). A whole float is the number meant; any other is refused.
                if not v.is_integer():
                    raise ValueError(f"routing option {f.name!r} must be an integer, got {v!r}")
                v = int(v)
                object.__setattr__(self, f.name, v)  # frozen: only here, while being built
            if v < 0:
                raise ValueError(f"routing option {f.name!r} must be >= 0, got {v!r}")
        for name in (
            "block_chars",
            "max_blocks",
            "chars_per_token",
            "token_block_size",
            "prefill_tokens_per_s",
            "queue_horizon_s",
            "session_ttl_s",
            "session_max",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"routing option {name!r} must be > 0")

    @property
    def text_block_tokens(self) -> float:
        return self.block_chars / self.chars_per_token

    def key_fields(self) -> tuple[int, ...]:
        """The options that decide what a chain means; the index is reset when they change."""
        return (self.block_chars, self.token_block_size, self.max_blocks, self.tail_ratio)


# RoutingOptions fields declared `int` (annotations are strings here: `from __future__`).
_INT_OPTIONS = frozenset(f.name for f in fields(RoutingOptions) if f.type in ("int", int))
