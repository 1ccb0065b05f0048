"""The conversation generator (bench.conversations): every turn resends the whole history, so
the blocks a session's turns share are exactly its history's; sessions follow their own clock."""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest

from bench.conversations import ConversationSpec, conversation
from bench.traces import TraceRequest, cache_bound, load_trace


def by_session(reqs: list[TraceRequest]) -> dict[str, list[TraceRequest]]:
    out: dict[str, list[TraceRequest]] = defaultdict(list)
    for r in reqs:
        assert r.session_id is not None
        out[r.session_id].append(r)
    for turns in out.values():
        turns.sort(key=lambda r: int(r.request_id.rsplit("-", 1)[1]))
    return out


def test_each_turn_extends_the_previous_turn_and_arrives_after_its_answer() -> None:
    spec = ConversationSpec(sessions=60, think_s=5, seed=3)
    trace = conversation(spec)
    for r in trace.requests:
        r.validate()
    assert [r.arrival_s for r in trace.requests] == sorted(r.arrival_s for r in trace.requests)
    multi = 0
    for turns in by_session(trace.requests).values():
        for prev, cur in itertools.pairwise(turns):
            multi += 1
            full = prev.input_length // prev.block_size
            # prompt = previous prompt + its answer + a new message: the full blocks carry over
            assert cur.block_ids[:full] == prev.block_ids[:full]
            assert cur.input_length > prev.input_length + prev.output_length
            # the user reads the answer before replying
            assert cur.arrival_s >= prev.arrival_s + prev.output_length * spec.read_s_per_token
    assert multi > 60  # sessions with several turns exist


def test_sessions_share_only_their_system_prompt_and_lengths_are_heavy_tailed() -> None:
    spec = ConversationSpec(sessions=400, system_prompts=4, seed=1)
    trace = conversation(spec)
    sessions = by_session(trace.requests)
    firsts = [turns[0] for turns in sessions.values()]
    sys_blocks = spec.system_tokens // spec.block_size
    heads = {tuple(r.block_ids[:sys_blocks]) for r in firsts}
    assert 1 < len(heads) <= 4  # a few shared system prompts
    # beyond the system prompt (from the block it shares with the first message) nothing is shared
    tails = [r.block_ids[sys_blocks] for r in firsts]
    assert len(set(tails)) == len(tails)
    lengths = sorted(len(t) for t in sessions.values())
    assert lengths[len(lengths) // 2] <= 5 and lengths[-1] >= 15  # Zipf: most short, some long
    assert all(r.input_length <= spec.max_input for r in trace.requests)
    # a cache that keeps everything reuses most of this traffic (the point of routing it well)
    assert cache_bound(trace.requests).token_hit_rate > 0.7


def test_seeded_parsed_and_loadable_like_any_trace() -> None:
    a = load_trace("conversation:sessions=20,seed=5,think_s=2")
    b = conversation(ConversationSpec(sessions=20, seed=5, think_s=2.0))
    assert [r.to_json() for r in a.requests] == [r.to_json() for r in b.requests]
    assert a.format == "conversation" and "20 sessions" in a.notes[0]
    c = conversation(ConversationSpec(sessions=20, seed=6, think_s=2.0))
    assert [r.block_ids for r in c.requests] != [r.block_ids for r in b.requests]
    with pytest.raises(ValueError, match="unknown conversation parameter"):
        ConversationSpec.parse("conversation:sesions=3")
    with pytest.raises(ValueError):
        ConversationSpec.parse("conversation:session_rate=0")
