from __future__ import annotations

import itertools
from types import MappingProxyType

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scoring import prefix
from scoring.prefix import (
    chain_hashes_text,
    chain_hashes_tokens,
    render_chat,
    render_completion,
    request_chain,
    seed_for,
    tail_layout,
    text_key,
)

SYSTEM = "You are a meticulous assistant for the billing team. " * 20  # ~1,000 chars
SEED = seed_for("m")


def chain(messages: list[dict], **kw: object) -> list[int]:
    body = {"messages": messages, **kw}
    return request_chain("chat", body, model="m", max_blocks=10_000)


def test_roles_change_the_rendered_text_and_the_chain() -> None:
    as_user = [{"role": "user", "content": SYSTEM}]
    as_system = [{"role": "system", "content": SYSTEM}]
    as_assistant = [{"role": "assistant", "content": SYSTEM}]
    texts = {render_chat(m) for m in (as_user, as_system, as_assistant)}
    assert len(texts) == 3
    chains = [chain(m) for m in (as_user, as_system, as_assistant)]
    assert chains[0][0] != chains[1][0] != chains[2][0]


def test_message_order_changes_the_chain() -> None:
    a = {"role": "user", "content": "alpha " * 40}
    b = {"role": "assistant", "content": "beta " * 40}
    assert render_chat([a, b]) != render_chat([b, a])
    assert chain([a, b])[0] != chain([b, a])[0]


def test_message_boundaries_matter_not_just_the_concatenated_contents() -> None:
    # The SGLang/production-stack peers join contents with spaces: these two would collide there.
    one = [{"role": "user", "content": "hello world"}]
    two = [{"role": "user", "content": "hello"}, {"role": "user", "content": "world"}]
    assert render_chat(one) != render_chat(two)


def test_identical_requests_agree_and_a_shared_system_prompt_shares_the_leading_chain() -> None:
    a = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "refund order 17"}]
    b = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "where is invoice 9"}]
    assert chain(a) == chain([dict(m) for m in a])
    ca, cb = chain(a), chain(b)
    shared_bytes = len(render_chat(a[:1], add_generation_prompt=False).encode())
    k = shared_bytes // 64
    assert k >= 10
    assert ca[:k] == cb[:k]
    assert ca[k:] != cb[k:]
    assert not set(ca[k + 1 :]) & set(cb[k + 1 :])


def test_next_turn_extends_the_previous_turns_chain() -> None:
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "q1 " * 30}]
    turn2 = [
        *turn1,
        {"role": "assistant", "content": "a1 " * 50},
        {"role": "user", "content": "q2"},
    ]
    c1, c2 = chain(turn1), chain(turn2)
    assert len(c1) > 10
    assert c2[: len(c1)] == c1


def test_model_namespace_and_cache_salt_seed_disjoint_chains() -> None:
    body = {"messages": [{"role": "user", "content": SYSTEM}]}
    base = request_chain("chat", body, model="m")
    others = [
        request_chain("chat", body, model="other-model"),
        request_chain("chat", body, model="m", namespace="tenant-b"),
        request_chain("chat", body, model="m", cache_salt="salt"),
        request_chain("chat", {**body, "cache_salt": "from-body"}, model="m"),
    ]
    for other in others:
        assert len(other) == len(base)
        assert not set(other) & set(base)
    assert len({seed_for("m"), seed_for("m", "t"), seed_for("m", "", "t"), seed_for("m2")}) == 4


def test_tools_and_tool_calls_are_part_of_the_prompt() -> None:
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "weather?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    with_tools = render_chat(msgs, tools)
    assert "get_weather" in with_tools and with_tools != render_chat(msgs)
    # tools live inside the system block, after its text: the system text still leads
    system_block = render_chat(msgs[:1], add_generation_prompt=False)
    assert with_tools.startswith(system_block.removesuffix("<|im_end|>\n"))
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}}
        ],
    }
    other = {**call, "tool_calls": [{**call["tool_calls"][0], "function": {"name": "g"}}]}
    assert render_chat([call]) != render_chat([other])
    res_a = {"role": "tool", "tool_call_id": "c1", "content": "42"}
    res_b = {"role": "tool", "tool_call_id": "c2", "content": "42"}
    assert render_chat([call, res_a]) != render_chat([call, res_b])


def test_text_parts_render_like_a_string_and_images_by_a_short_digest() -> None:
    as_str = [{"role": "user", "content": "look at this"}]
    as_parts = [{"role": "user", "content": [{"type": "text", "text": "look at this"}]}]
    assert render_chat(as_str) == render_chat(as_parts)
    big = "data:image/png;base64," + "A" * 200_000
    img = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": big}}]}]
    img2 = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": big + "B"}}]}]
    rendered = render_chat(img)
    assert len(rendered) < 200 and rendered != render_chat(img2)


def test_malformed_input_never_raises() -> None:
    lone_surrogate = [{"role": "user", "content": "x\ud800y" * 40}]  # json.loads accepts this
    assert len(chain(lone_surrogate)) > 0
    odd = [{"role": "user", "content": [{"type": ["?"]}, 7, "raw"]}, "not a dict"]
    assert render_chat(odd)
    responses_style = [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
    assert render_chat(responses_style) == render_chat([{"role": "user", "content": "hi"}])


def test_generation_prompt_options() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    assert render_chat(msgs).endswith("assistant\n")
    assert not render_chat(msgs, add_generation_prompt=False).endswith("assistant\n")
    partial = [*msgs, {"role": "assistant", "content": "Once upon"}]
    assert render_chat(partial, continue_final_message=True).endswith("Once upon")


def test_render_completion_forms() -> None:
    assert render_completion("abc") == "abc"
    assert render_completion([1, 2, 3]) == [1, 2, 3]
    assert render_completion(["first", "second"]) == "first"
    assert render_completion([[5, 6], [7]]) == [5, 6]
    assert render_completion(None) == "" and render_completion([]) == ""


def test_text_chain_hashes_only_full_blocks_up_to_the_window() -> None:
    assert chain_hashes_text("x" * 63, seed=SEED) == []
    assert len(chain_hashes_text("x" * 64 * 5 + "y" * 10, seed=SEED)) == 5
    assert len(chain_hashes_text("x" * 64 * 500, seed=SEED, max_blocks=256)) == 256
    assert len(chain_hashes_text("x" * 100, seed=SEED, block_chars=10, max_blocks=256)) == 10
    with pytest.raises(ValueError):
        chain_hashes_text("abc", seed=SEED, block_chars=0)


def test_chain_is_chained_a_change_alters_its_block_and_every_later_one() -> None:
    text = "".join(chr(97 + i % 26) for i in range(64 * 8))
    edited = text[: 64 * 3 + 5] + "#" + text[64 * 3 + 6 :]
    a, b = chain_hashes_text(text, seed=SEED), chain_hashes_text(edited, seed=SEED)
    assert a[:3] == b[:3]
    assert all(x != y for x, y in zip(a[3:], b[3:], strict=True))
    # identical blocks at different positions hash differently (the parent is in the seed)
    same = chain_hashes_text("z" * 64 * 4, seed=SEED)
    assert len(set(same)) == 4


def test_token_chain_uses_full_blocks_of_ids() -> None:
    ids = list(range(1000, 1000 + 16 * 3 + 7))
    c = chain_hashes_tokens(ids, block_size=16, seed=SEED, max_blocks=256)
    assert len(c) == 3
    assert chain_hashes_tokens(ids[:48], block_size=16, seed=SEED) == c
    changed = [*ids[:20], 7, *ids[21:]]
    c2 = chain_hashes_tokens(changed, block_size=16, seed=SEED)
    assert c2[0] == c[0] and c2[1] != c[1]
    assert chain_hashes_tokens(ids, block_size=16, seed=SEED, max_blocks=2) == c[:2]


def test_text_key_sizes_the_whole_prompt_even_beyond_the_window() -> None:
    body = {"prompt": "w" * 64 * 1000}
    key = text_key("completion", body, model="m", max_blocks=256, chars_per_token=4.0)
    assert len(key.chain) == 256 and key.dense_blocks == 256 and key.tail_ends == ()
    assert key.prompt_tokens == pytest.approx(16_000) and key.block_tokens == pytest.approx(16.0)
    ids = text_key("completion", {"prompt": list(range(100))}, model="m", token_block_size=16)
    assert len(ids.chain) == 6 and ids.prompt_tokens == 100 and ids.block_tokens == 16


def test_tail_spans_grow_with_depth_for_a_constant_relative_resolution() -> None:
    ends = tail_layout(64, 16, 100)
    spans = [b - a for a, b in zip((64, *ends[:-1]), ends, strict=True)]
    assert spans[0] == 4 and all(b >= a for a, b in itertools.pairwise(spans))
    starts = (64, *ends[:-1])
    assert all(s <= start / 16 + 1 for s, start in zip(spans, starts, strict=True))


def test_the_tail_covers_long_prompts_in_growing_spans_still_chained() -> None:
    text = "".join(chr(97 + i * 7 % 26) for i in range(64 * 2000))
    dense = chain_hashes_text(text, seed=SEED, max_blocks=64)
    full = chain_hashes_text(text, seed=SEED, max_blocks=64, tail_ratio=16, tail_blocks=1000)
    ends = tail_layout(64, 16, 1000)
    n_tail = sum(1 for e in ends if e <= 2000)
    assert full[:64] == dense and len(full) == 64 + n_tail
    assert ends[n_tail - 1] > 2000 * 15 / 16  # covers all but the last ~1/16
    short = chain_hashes_text(text, seed=SEED, max_blocks=64, tail_ratio=16, tail_blocks=5)
    assert short == full[:69]
    # a change deep in alters the tail from its span on, nothing before
    at = 64 * 1000 + 5
    k = 64 + sum(1 for e in ends if e <= 1000)  # entries ending at or before block 1000
    edited = text[:at] + "#" + text[at + 1 :]
    other = chain_hashes_text(edited, seed=SEED, max_blocks=64, tail_ratio=16, tail_blocks=1000)
    assert other[:k] == full[:k]
    assert all(a != b for a, b in zip(other[k:], full[k:], strict=True))
    # short texts never get a tail: it starts only once the dense head is full
    assert len(chain_hashes_text(text[:3000], seed=SEED, max_blocks=64, tail_ratio=16)) == 46


def test_token_chains_have_the_same_tail_layout() -> None:
    ids = [1000 + i % 3000 for i in range(16 * 78 + 5)]
    c = chain_hashes_tokens(
        ids, block_size=16, seed=SEED, max_blocks=64, tail_ratio=16, tail_blocks=9
    )
    assert len(c) == 64 + 3  # tail spans end at blocks 68, 72, 76; the next (80) is not full
    assert c[:64] == chain_hashes_tokens(ids, block_size=16, seed=SEED, max_blocks=64)


@given(st.text(min_size=0, max_size=600), st.text(min_size=0, max_size=600))
def test_chains_agree_exactly_on_the_blocks_of_the_common_prefix(a: str, b: str) -> None:
    ea, eb = a.encode(), b.encode()
    lcp = 0
    while lcp < min(len(ea), len(eb)) and ea[lcp] == eb[lcp]:
        lcp += 1
    ca = chain_hashes_text(a, seed=SEED, block_chars=16)
    cb = chain_hashes_text(b, seed=SEED, block_chars=16)
    k = lcp // 16
    assert ca[:k] == cb[:k]
    if k < min(len(ca), len(cb)):
        assert ca[k] != cb[k]


def test_a_memoised_dense_head_hashes_exactly_as_a_fresh_one() -> None:
    # Full dense heads are memoised from their second sighting on; the chain must never depend on
    # what was hashed before.
    text = ("".join(chr(97 + i * 5 % 26) for i in range(64 * 300))).encode()
    prefix._HEADS.clear()
    kw = {"seed": SEED, "max_blocks": 64, "tail_ratio": 16, "tail_blocks": 128}
    fresh = chain_hashes_text(text, **kw)
    assert not prefix._HEADS  # seen once: not kept yet
    assert chain_hashes_text(text, **kw) == fresh
    assert len(prefix._HEADS) == 1  # seen twice: kept
    again = chain_hashes_text(text, **kw)  # served from the memo
    assert again == fresh and again is not chain_hashes_text(text, **kw)  # a copy each time
    again.append(0)  # ... which the caller may extend without touching the memo
    assert chain_hashes_text(text, **kw) == fresh
    # The last byte of the head differs: the last dense block and everything after change.
    edited = text[: 64 * 64 - 1] + b"#" + text[64 * 64 :]
    other = chain_hashes_text(edited, **kw)
    assert other[:63] == fresh[:63] and all(
        a != b for a, b in zip(other[63:], fresh[63:], strict=True)
    )
    assert chain_hashes_text(edited, **kw) == other  # memoised: the same
    # Another seed (model, namespace, salt) or block size never reuses the entry.
    assert not set(chain_hashes_text(text, **{**kw, "seed": SEED + 1})) & set(fresh)
    half = chain_hashes_text(text, block_chars=32, seed=SEED, max_blocks=64)
    assert half[0] != fresh[0]
    # Token chains go through the same memo and agree with an unmemoised (short) computation.
    ids = [1000 + i % 3000 for i in range(16 * 100)]
    t1 = chain_hashes_tokens(ids, block_size=16, seed=SEED, max_blocks=64)
    assert chain_hashes_tokens(ids, block_size=16, seed=SEED, max_blocks=64) == t1
    assert chain_hashes_tokens(ids, block_size=16, seed=SEED, max_blocks=65)[:64] == t1
    # Only full heads are kept: a prompt shorter than the head is all head, rarely sent twice.
    kept = len(prefix._HEADS)
    for _ in range(3):
        chain_hashes_tokens(ids, block_size=16, seed=SEED, max_blocks=256)
        chain_hashes_text(text[:5000], seed=SEED, max_blocks=256)
    assert len(prefix._HEADS) == kept


def test_the_head_memo_is_bounded_and_keeps_only_heads_seen_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(prefix, "HEAD_MEMO_BYTES", 10 * (64 * 64 + 48 * 64))
    prefix._HEADS.clear()
    heads = [f"{i:05d}".encode() * 1000 for i in range(35)]
    for text in heads:  # one-off heads: nothing kept
        chain_hashes_text(text, seed=SEED, max_blocks=64)
    assert not prefix._HEADS
    for text in heads:  # seen again: kept, 10 at most, and still hashed right
        want = chain_hashes_text(text, seed=SEED, max_blocks=64)
        assert len(prefix._HEADS) <= 10
        assert chain_hashes_text(text, seed=SEED, max_blocks=64) == want
    assert len(prefix._HEADS) == 10
    prefix._HEADS.clear()


def test_render_chat_reads_any_mapping_and_str_subclass_like_dicts_and_strs() -> None:
    class Text(str):
        pass

    msgs = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]},
        {"role": "tool", "content": [{"type": "text", "text": "ok"}], "tool_call_id": "c1"},
    ]
    want = render_chat(msgs, [{"type": "function"}])
    proxied = [MappingProxyType(m) for m in msgs]
    assert render_chat(proxied, [{"type": "function"}]) == want
    subclassed = [{k: Text(v) if isinstance(v, str) else v for k, v in m.items()} for m in msgs]
    assert render_chat(subclassed, [{"type": "function"}]) == want
