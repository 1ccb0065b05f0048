"""Shared-prefix runs through the gateway, measured with real vLLM prefix-cache counters.

Why a helper and not just a test: the same experiment is the evidence for every routing policy.
Cache-blind policies (`round_robin`, `least_loaded`) prefill a shared prefix once per worker it
lands on; `kv_aware` keeps it on the worker that holds it. Each policy's test adds its own claim
on top of the policy-independent checks below (`assert_cache_follows_routing`).

Ground truth comes from the workers, not the gateway: `usage.prompt_tokens_details.cached_tokens`
per request and `vllm:prefix_cache_hits_total` per worker, which count the same tokens.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass, field

from tests.integration.conftest import (
    BLOCK_SIZE,
    LOG_DIR,
    MODEL,
    VllmFleet,
    gateway_over,
    metric,
    openai_client,
    worker_metrics,
)

# ~25 tokens each with the tiny tokenizer: 28 sections make a ~700-token shared prefix, well
# over the brief's 500 and with room for the question and answer in the 1,024-token context.
PREFIX_SECTIONS = 28


@dataclass
class PrefixRequest:
    """One request of a run: where the gateway sent it and what the worker reported."""

    worker: str
    prompt_tokens: int
    cached_tokens: int


@dataclass
class SharedPrefixRun:
    """A run's per-request facts and each worker's real prefix-cache counter growth."""

    policy: str
    requests: list[PrefixRequest] = field(default_factory=list)
    hits: dict[str, float] = field(default_factory=dict)  # vllm:prefix_cache_hits_total delta
    queries: dict[str, float] = field(default_factory=dict)  # ..._queries_total delta

    @property
    def workers_used(self) -> list[str]:
        return sorted({r.worker for r in self.requests})

    @property
    def misses(self) -> int:
        return sum(1 for r in self.requests if r.cached_tokens == 0)

    @property
    def hit_ratio(self) -> float:
        """Cached prompt tokens / prompt tokens over the run (1.0 is unreachable: see vLLM)."""
        return sum(r.cached_tokens for r in self.requests) / sum(
            r.prompt_tokens for r in self.requests
        )

    def cached_on(self, worker: str) -> int:
        return sum(r.cached_tokens for r in self.requests if r.worker == worker)

    def save(self) -> str:
        """Write the run to .build/logs/integration/ (the affinity evidence for reports)."""
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        path = LOG_DIR / f"affinity-{self.policy}.json"
        doc = asdict(self) | {"hit_ratio": round(self.hit_ratio, 4), "misses": self.misses}
        path.write_text(json.dumps(doc, indent=2) + "\n")
        return str(path)


def shared_prefix_messages(nonce: str, i: int) -> list[dict[str, str]]:
    """A long system prompt shared by every request of a run, then a short distinct question.

    The nonce comes first so a run never hits blocks cached by an earlier run or test.
    """
    sections = " ".join(
        f"Section {s}: the gateway routes request {s} to the worker that holds its prefix cache."
        for s in range(PREFIX_SECTIONS)
    )
    return [
        {"role": "system", "content": f"Run {nonce}. {sections}"},
        {"role": "user", "content": f"Question {i}: which worker answers this one?"},
    ]


async def run_shared_prefix(fleet: VllmFleet, *, policy: str, n_requests: int) -> SharedPrefixRun:
    """Send `n_requests` shared-prefix chats one after another through a gateway using `policy`.

    Sequential on purpose: each request's blocks are cached before the next one is routed, so
    the outcome depends on routing alone, not on two prefills racing.
    """
    run = SharedPrefixRun(policy)
    nonce = uuid.uuid4().hex[:10]
    async with gateway_over(fleet, policy) as g, openai_client(g.url) as client:
        before = {w.name: await worker_metrics(w.url) for w in fleet.workers}
        for i in range(n_requests):
            async with client.chat.completions.with_streaming_response.create(
                model=MODEL,
                messages=shared_prefix_messages(nonce, i),  # type: ignore[arg-type]
                max_tokens=2,
                temperature=0.0,
                stream=True,
                stream_options={"include_usage": True},
            ) as resp:
                worker = resp.headers["x-kvgate-worker"]
                chunks = [c async for c in await resp.parse()]
            usage = chunks[-1].usage
            assert usage is not None and usage.prompt_tokens_details is not None
            run.requests.append(
                PrefixRequest(
                    worker, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0
                )
            )
        for w in fleet.workers:
            after = await worker_metrics(w.url)
            for name, out in (("hits", run.hits), ("queries", run.queries)):
                family = f"vllm:prefix_cache_{name}_total"
                out[w.name] = metric(after, family) - metric(before[w.name], family)
    return run


def assert_cache_follows_routing(run: SharedPrefixRun) -> None:
    """Checks that hold for every policy: the worker kvgate named is the one whose cache hit.

    * the first request on a worker misses (the nonce makes the prefix new), every later one
      on the same worker hits at least the shared prefix's full blocks;
    * each worker's `vllm:prefix_cache_hits_total` grew by exactly the `cached_tokens` of the
      requests the gateway says it sent there (so `x-kvgate-worker` is the truth);
    * workers the run did not use saw no prefix-cache queries at all.
    """
    seen: set[str] = set()
    shared = min(r.prompt_tokens for r in run.requests) - 40  # prefix tokens, conservatively
    for i, r in enumerate(run.requests):
        if r.worker in seen:
            assert r.cached_tokens >= (shared // BLOCK_SIZE) * BLOCK_SIZE - BLOCK_SIZE, (i, run)
            assert r.cached_tokens % BLOCK_SIZE == 0, (i, run)  # only full blocks are cached
        else:
            assert r.cached_tokens == 0, (i, run)
        seen.add(r.worker)
    for name, hits in run.hits.items():
        assert hits == run.cached_on(name), (name, run)
        if name not in seen:
            assert run.queries[name] == 0, (name, run)
