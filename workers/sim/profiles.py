"""Timing profiles: how long one engine step takes, as a function of what the step computes.

Routing only matters through latency, so the simulator's clock must react to the two things a router
can change: how many prompt tokens a worker has to compute (cache misses) and how loaded/full its KV
cache is. A profile is a pair of small closed-form curves; every coefficient is a dataclass field so
`kvgate sim` flags and the benches can override any of them without new code.

`default` uses the curves that NVIDIA Dynamo's "mocker" engine (ai-dynamo/dynamo, its vLLM-like mock
engine) fitted on vLLM, with the mocker's own coefficients:

    prefill_ms(T) = 4.21e-7 * T^2 + 1.518e-2 * T + 16.5     T = uncached prompt tokens in the step
    decode_ms(u)  = -25.74 * u^2 + 54.01 * u + 5.74         u = KV-cache usage fraction (0..1)

plus two terms of our own. The context term: new tokens attend to every token before them, and
the mocker's quadratic was fitted on prompts computed from scratch, where a prompt of T tokens
forms T^2/2 such (new, earlier) pairs and costs prefill_a * T^2, i.e. 2 * prefill_a per pair.
A chunk of n tokens computed after p tokens already in the KV cache (a prefix-cache hit, or the
earlier chunks of a chunked prefill) forms n * p more pairs, so it costs

    prefill_ctx_ms = prefill_ctx_a * sum(n * p)    prefill_ctx_a = 2 * prefill_a (8.42e-7)

Without it the uncached tail of a 150k-token agent context cost the same as that tail on an empty
context (~32 ms for 1k tokens instead of ~158 ms), which understated what a miss or a preemption
costs on long contexts and so flattered affinity. And `decode_ms_per_seq` (0.01 ms per decoding
sequence): the mocker's decode curve
depends on KV usage only, which already carries most of the batch effect (more sequences hold more
blocks), but a batch of many *short* sequences still costs more than one, mostly in the sampler and
the per-sequence bookkeeping. The term is small on purpose so that the fitted curve dominates.

A step that both prefills and decodes (chunked prefill mixes them in one forward pass) costs the sum
of the two: the prefill part already includes the fixed per-step overhead (16.5 ms intercept) and
decoding sequences add their marginal cost. This slightly overestimates mixed steps, which errs on
the side of penalising cache misses, the effect routing is judged on.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace


@dataclass(slots=True, frozen=True)
class TimingProfile:
    name: str = "default"
    # prefill_ms(T) = prefill_a*T^2 + prefill_b*T + prefill_c, only for steps with T > 0
    prefill_a: float = 4.21e-7
    prefill_b: float = 1.518e-2
    prefill_c: float = 16.5
    # + prefill_ctx_a * (new tokens x tokens already in the KV cache before them), see above
    prefill_ctx_a: float = 8.42e-7
    # decode_ms(u, n) = decode_a*u^2 + decode_b*u + decode_c + decode_ms_per_seq*n, when n > 0
    decode_a: float = -25.74
    decode_b: float = 54.01
    decode_c: float = 5.74
    decode_ms_per_seq: float = 0.01
    # No step is shorter than this (also keeps the real-time loop from spinning).
    floor_ms: float = 0.0
    # Multiplies the whole step: > 1 emulates a slower GPU or bigger model without refitting.
    scale: float = 1.0

    def prefill_ms(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        return self.prefill_a * tokens * tokens + self.prefill_b * tokens + self.prefill_c

    def decode_ms(self, kv_usage: float, num_seqs: int) -> float:
        if num_seqs <= 0:
            return 0.0
        u = kv_usage
        return (
            self.decode_a * u * u
            + self.decode_b * u
            + self.decode_c
            + self.decode_ms_per_seq * num_seqs
        )

    def step_seconds(
        self, prefill_tokens: int, decode_seqs: int, kv_usage: float, context_pairs: int = 0
    ) -> float:
        """Duration of one step in seconds (the engine's clocks work in seconds).

        ``context_pairs``: sum over the step's prefill chunks of (chunk tokens x tokens already in
        the KV cache before the chunk)."""
        ms = self.prefill_ms(prefill_tokens) + self.decode_ms(kv_usage, decode_seqs)
        if prefill_tokens > 0:
            ms += self.prefill_ctx_a * context_pairs
        ms *= self.scale
        return max(ms, self.floor_ms) / 1000.0

    def with_overrides(self, **overrides: float) -> TimingProfile:
        """A copy with some coefficients changed; unknown names fail loudly (typos in CLI flags)."""
        known = {f.name for f in fields(self)}
        unknown = set(overrides) - known
        if unknown:
            raise ValueError(f"unknown timing profile field(s): {sorted(unknown)}")
        return replace(self, **overrides)


PROFILES: dict[str, TimingProfile] = {
    "default": TimingProfile(),
    # Steps of about 1-2 ms whatever the batch, so HTTP tests stream quickly yet still interleave.
    "fast": TimingProfile(
        name="fast",
        prefill_a=0.0,
        prefill_b=1e-4,
        prefill_c=1.0,
        prefill_ctx_a=0.0,
        decode_a=0.0,
        decode_b=0.5,
        decode_c=1.0,
        decode_ms_per_seq=0.0,
        floor_ms=1.0,
    ),
    # No modelled compute at all: measures the gateway's own overhead against a worker that answers
    # as fast as the event loop allows. The floor keeps steps strictly positive so that virtual time
    # still advances.
    "instant": TimingProfile(
        name="instant",
        prefill_a=0.0,
        prefill_b=0.0,
        prefill_c=0.0,
        prefill_ctx_a=0.0,
        decode_a=0.0,
        decode_b=0.0,
        decode_c=0.0,
        decode_ms_per_seq=0.0,
        floor_ms=0.01,
    ),
}


def get_profile(name: str) -> TimingProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown timing profile {name!r}; known: {sorted(PROFILES)}") from None
