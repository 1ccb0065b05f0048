"""A conversation-style synthetic trace: chat sessions whose every turn resends the whole history.

Why a generator of its own: on multi-turn traffic (each prompt = the previous prompt + the answer
+ a new user message) the router's job is to send turn N+1 where turn N's KV still lives, while
the fleet stays balanced; the shared-prefix workload of `bench.traces.synthetic` (groups x users,
a request picks a user at random) has no think times, no session lengths and no growth, so it
cannot show how a policy keeps a conversation together. The shape follows what public chat traces
report (Mooncake's conversation trace, LMSYS-Chat): a few shared system prompts with skewed
popularity, session lengths with a heavy tail (Zipf over 1..max_turns), user messages and answers
with lognormal lengths, and a user who reads the answer and thinks before the next turn.

    kvgate bench traces info "conversation:sessions=200,session_rate=0.5"
    kvgate bench simulate --trace "conversation:sessions=300,think_s=10" ...

Every value is a parameter (`ConversationSpec`); one seed is one trace, identical in every run.
Block ids come from `bench.traces._segment_block_ids`, so two turns share exactly the blocks made
of the same history, and a block straddling the history and the new message is new, as on an
engine.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from dataclasses import dataclass
from typing import Any

from bench.specs import parse_spec

# Bounds of a spec's values that a trace can still be made from: a Zipf exponent this large
# already puts every draw on one rank (|s| = 1000 overflowed into a ZeroDivisionError or an
# OverflowError), and a session of more turns is no conversation (the cumulative weights are
# a list of `max_turns`). The same Zipf bound holds for `synthetic:zipf_s` (bench.traces).
MAX_ZIPF_S = 10.0
MAX_TURNS = 10_000
MAX_BLOCK_SIZE = 1 << 20  # bench.traces.MAX_BLOCK_SIZE (imported from here: no import cycle)

PREFIX = "conversation"


@dataclass(slots=True, frozen=True)
class ConversationSpec:
    """Sessions arrive as a Poisson process; each runs its turns one after the other."""

    sessions: int = 300
    session_rate: float = 0.5  # new conversations per second
    max_turns: int = 40
    turns_s: float = 1.1  # Zipf exponent of the number of turns (1..max_turns): heavy-tailed
    system_prompts: int = 8
    system_s: float = 1.0  # Zipf popularity of the system prompts (0 = uniform)
    system_tokens: int = 1500
    user_tokens: int = 200  # mean; lognormal, sigma 0.8
    output_tokens: int = 350  # mean; lognormal, sigma 0.6
    think_s: float = 15.0  # mean pause after reading an answer (exponential)
    read_s_per_token: float = 0.02  # the answer streams this fast before the user can reply
    max_input: int = 32_768  # a session ends at the turn whose prompt would pass it
    block_size: int = 64
    seed: int = 0

    def describe(self) -> str:
        return (
            f"conversation: {self.sessions} sessions at {self.session_rate:g}/s, turns "
            f"Zipf(s={self.turns_s}) up to {self.max_turns}, {self.system_prompts} system "
            f"prompts of {self.system_tokens} tokens (Zipf s={self.system_s}), user ~"
            f"{self.user_tokens} / answer ~{self.output_tokens} tokens, think ~{self.think_s:g} s,"
            f" max input {self.max_input}, block {self.block_size}, seed {self.seed}"
        )

    @classmethod
    def parse(cls, text: str) -> ConversationSpec:
        """`conversation:sessions=100,think_s=5` -> a spec (unknown keys fail loudly)."""
        spec = parse_spec(cls, text, "conversation")
        if spec.sessions < 1 or spec.max_turns < 1 or spec.block_size < 1:
            raise ValueError("sessions, max_turns and block_size must be >= 1")
        if spec.max_turns > MAX_TURNS:
            raise ValueError(f"max_turns must be <= {MAX_TURNS}, not {spec.max_turns}")
        if spec.block_size > MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be <= {MAX_BLOCK_SIZE}, not {spec.block_size}")
        for name in ("turns_s", "system_s"):
            v = getattr(spec, name)
            if not (math.isfinite(v) and -MAX_ZIPF_S <= v <= MAX_ZIPF_S):
                raise ValueError(
                    f"{name} (a Zipf exponent) must be within -{MAX_ZIPF_S:g}..{MAX_ZIPF_S:g}, "
                    f"not {v:g}"
                )
        if spec.session_rate <= 0 or spec.system_prompts < 1:
            raise ValueError("session_rate must be > 0 and system_prompts >= 1")
        # A turn is at least its user message (so no prompt is empty), and a session at least
        # its first turn; what a user reads and thinks cannot take negative time.
        if spec.user_tokens < 1 or spec.max_input < 1:
            raise ValueError("user_tokens and max_input must be >= 1")
        if spec.system_tokens < 0 or spec.output_tokens < 0:
            raise ValueError("system_tokens and output_tokens must be >= 0")
        if spec.think_s < 0 or spec.read_s_per_token < 0:
            raise ValueError("think_s and read_s_per_token must be >= 0")
        return spec


def _zipf_cum(n: int, s: float) -> list[float]:
    return list(itertools.accumulate(1.0 / (k + 1) ** s for k in range(n)))


def _lognormal(rng: random.Random, mean: float, sigma: float) -> int:
    """A positive length with the given mean (mu = ln(mean) - sigma^2 / 2)."""
    if mean <= 0:
        return 0
    return max(1, round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)))


def conversation(spec: ConversationSpec) -> Any:
    """Generate the trace (a `bench.traces.Trace`, requests sorted by arrival)."""
    from bench.traces import Trace, TraceRequest, _segment_block_ids, sort_requests

    rng = random.Random(spec.seed)
    turns_cum = _zipf_cum(spec.max_turns, spec.turns_s)
    sys_cum = _zipf_cum(spec.system_prompts, spec.system_s)
    reqs: list[TraceRequest] = []
    start = 0.0
    for s in range(spec.sessions):
        start += rng.expovariate(spec.session_rate)
        k = bisect.bisect_left(sys_cum, rng.random() * sys_cum[-1])
        turns = 1 + bisect.bisect_left(turns_cum, rng.random() * turns_cum[-1])
        history: list[tuple[str, int]] = [(f"conv-sys-{spec.seed}-{k}", spec.system_tokens)]
        history = [h for h in history if h[1] > 0]
        t = start
        for turn in range(turns):
            user = (f"conv-{spec.seed}-{s}-u{turn}", _lognormal(rng, spec.user_tokens, 0.8))
            answer = _lognormal(rng, spec.output_tokens, 0.6)
            segments = [*history, user]
            total = sum(n for _, n in segments)
            if total > spec.max_input:
                break
            reqs.append(
                TraceRequest(
                    arrival_s=t,
                    request_id=f"conv-{s}-{turn}",
                    input_length=total,
                    output_length=answer,
                    block_size=spec.block_size,
                    block_ids=list(_segment_block_ids(segments, spec.block_size)),
                    tenant=f"app-{k}",
                    session_id=f"conv-{spec.seed}-{s}",
                )
            )
            history = [*segments, (f"conv-{spec.seed}-{s}-a{turn}", answer)]
            t += answer * spec.read_s_per_token + rng.expovariate(1.0 / max(spec.think_s, 1e-9))
    return Trace(sort_requests(reqs), "conversation", PREFIX, [spec.describe()])
