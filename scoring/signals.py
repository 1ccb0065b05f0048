"""The kv_aware scorer's signals, each in [0, 1], with the formulas and why they look this way.

Units first. A cache hit and a queue are both worth *time to first token*, so the models below turn
request and token counts into seconds with two rough constants (``prefill_tokens_per_s``,
``mean_prompt_tokens``; a factor of two off is fine) and only then squash into [0, 1]. The common
unit is what lets the scorer decide when a hot prefix's holder is too busy to be worth its hit,
instead of hard-coded imbalance thresholds as in the peers (see ``affinity_yield``).

prefix_match = matched_tokens / prompt_tokens
    The share of this request's prefill the worker would skip. Relative to the whole prompt, not
    the hashed range: a 32k-token prompt whose first 4k tokens match is credited 4k/32k.

queue_delay = wait_s / (wait_s + queue_horizon_s), where
    queued = max(0, waiting + (in_flight - in_flight_at_scrape), in_flight - running)
    wait_s = (max(queued * mean_prompt_tokens, prefill_tokens) / prefill_tokens_per_s
              + running * decode_s_per_running) / weight
    Estimated seconds until this request would start. The scraped queue plus what this gateway
    sent since the scrape (so a burst between two scrapes does not all see the same idle worker:
    stale scores were a peer's hot-spot bug), or the gateway's own size-aware backlog of unstarted
    prompt tokens, whichever is larger (both estimate the same queue, so the max never double
    counts). Running sequences add a small per-step share.
    Normalised against a fixed horizon, not min-max across candidates: min-max turns 1-vs-0 waiting
    into a full-weight difference and 100-vs-99 into none, and reads an evenly overloaded fleet as
    0, hiding exactly the absolute overload at which a queue must outweigh a cache hit. The
    hyperbola never saturates (unlike min(1, x/h)): a deeper queue always scores worse.

kv_pressure = min(1, max(kv_used, index_fill) + uncached_tokens / capacity_tokens)
    kv_used = kv_usage + sent_tokens_since_scrape / capacity_tokens
    KV use *after* placing this request: the scraped fraction plus what the gateway sent since the
    scrape, plus this request's own uncached tokens (a holder adds fewer blocks than a cold worker).
    ``index_fill`` is the share of the worker's capacity the prefix index says holds cached
    prefixes: vLLM's usage gauge counts only blocks of running requests, so a worker whose cache
    is full of idle conversations reads near-empty, yet new blocks there evict those conversations
    while an empty cache next door absorbs them for free. (Replaying the weka-agentic sessions,
    15 agents sharing a 16k-token preamble on 4 simulated workers, it cut p99 TTFT from 2.17 s to
    1.72 s.) With no capacity known (no ``num_gpu_blocks``) the own tokens are left out.

tenant = tenant_priority * (1 - queue_delay)
    A per-request constant would not change which worker wins, so priority buys headroom instead:
    latency-sensitive tenants are pulled harder towards short queues, batch tenants follow the cache
    and KV headroom. (Who dispatches first on a saturated fleet is the admission queue's call;
    ``Decision.saturated`` tells it.)

session = 1 on the session's last worker while its wait is the best, falling linearly to 0 at
    ``queue_horizon_s`` of extra wait over the best candidate: a bonus, never a pin. Besides, when
    the index holds all of this request's chain on that worker (the prompt outgrew the hashed
    range, ~2M tokens by default, or the request was not hashed), its matched_tokens extends to
    the session's previous prompt, capped at this one: the worker that served the last turn holds
    it. Within the hashed range the index is trusted instead: it also knows about evictions.

affinity_yield = clamp(1 - extra_wait_s / (affinity_slack * saved_s), 0, 1), multiplies prefix_match
    ``saved_s = matched_tokens / prefill_tokens_per_s`` is what the hit is worth; ``extra_wait_s``
    is how much longer this worker's wait is than the best candidate's. Once the extra wait reaches
    the prefill time saved, the holder no longer gives a lower TTFT and its cache credit is gone:
    the queue pulls a hot prefix off an overloaded holder smoothly and the prefix gets replicated
    to the next worker, instead of 400 of 400 requests landing on one (SGLang, peers.md).
"""

from __future__ import annotations

from scoring.views import RoutingOptions, WorkerView

__all__ = [
    "affinity_yield",
    "is_saturated",
    "kv_capacity_tokens",
    "kv_pressure",
    "load_estimate",
    "prefix_signal",
    "queue_signal",
    "queued_requests",
    "session_signal",
    "tenant_signal",
]


def queued_requests(w: WorkerView) -> int:
    """Requests waiting to start on ``w``, counting this gateway's sends since the last scrape."""
    q = w.waiting
    if w.in_flight_at_scrape is not None:
        q += w.in_flight - w.in_flight_at_scrape
    own = w.in_flight - w.running
    if own > q:
        q = own
    return q if q > 0 else 0


def kv_capacity_tokens(w: WorkerView) -> int | None:
    if w.num_blocks and w.block_size:
        return w.num_blocks * w.block_size
    return None


def load_estimate(w: WorkerView, o: RoutingOptions) -> tuple[float, int, float]:
    """``(wait_s, queued, kv_used)`` for one worker; the one per-worker call on the hot path.

    ``kv_used`` is the scraped KV fraction plus what was sent since the scrape (before this
    request). A plain tuple: this runs once per candidate per decision.
    """
    queued = queued_requests(w)
    backlog = queued * o.mean_prompt_tokens
    if w.prefill_tokens > backlog:
        backlog = w.prefill_tokens
    weight = w.weight if w.weight > 0 else 1e-9
    wait = (backlog / o.prefill_tokens_per_s + w.running * o.decode_s_per_running) / weight
    kv = w.kv_usage
    if w.sent_tokens_since_scrape and w.num_blocks and w.block_size:
        kv += w.sent_tokens_since_scrape / (w.num_blocks * w.block_size)
    return wait, queued, kv


def queue_signal(wait_s: float, horizon_s: float) -> float:
    return wait_s / (wait_s + horizon_s) if wait_s > 0 else 0.0


def prefix_signal(matched_tokens: float, prompt_tokens: float) -> float:
    if matched_tokens <= 0 or prompt_tokens <= 0:
        return 0.0
    s = matched_tokens / prompt_tokens
    return s if s < 1.0 else 1.0


def kv_pressure(
    kv_used: float, own_tokens: float, capacity_tokens: int | None, fill: float = 0.0
) -> float:
    if fill > kv_used:
        kv_used = fill
    if capacity_tokens:
        kv_used += own_tokens / capacity_tokens
    return 0.0 if kv_used < 0 else (kv_used if kv_used < 1.0 else 1.0)


def affinity_yield(extra_wait_s: float, saved_s: float, slack: float) -> float:
    if extra_wait_s <= 0:
        return 1.0
    budget = slack * saved_s
    if budget <= 0:
        return 0.0
    y = 1.0 - extra_wait_s / budget
    return y if y > 0 else 0.0


def commitment_yield(
    committed: float, floor: float, matched_tokens: float, slack: float, ratio: float
) -> float:
    """What is left of a hit's credit on a worker carrying ``committed`` tokens of active
    sessions (other than the request's own) when the least committed candidate carries
    ``floor``: full until the excess is both positive and more than ``ratio`` times the floor,
    then fading to 0 at ``slack`` x the tokens the hit saves (kv_aware inlines it)."""
    excess = committed - floor
    if excess <= 0 or committed <= ratio * floor or slack <= 0:
        return 1.0
    y = 1.0 - excess / (slack * matched_tokens) if matched_tokens > 0 else 0.0
    return y if y > 0 else 0.0


def session_signal(extra_wait_s: float, horizon_s: float) -> float:
    if extra_wait_s <= 0:
        return 1.0
    y = 1.0 - extra_wait_s / horizon_s
    return y if y > 0 else 0.0


def tenant_signal(priority: float, queue: float) -> float:
    p = 0.0 if priority < 0 else (priority if priority < 1.0 else 1.0)
    return p * (1.0 - queue)


def is_saturated(queued: float, kv_used: float, o: RoutingOptions) -> bool:
    return queued >= o.saturation_waiting or kv_used >= o.saturation_kv
