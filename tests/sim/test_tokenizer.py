"""The simulator's tokenizer: reversible, deterministic, total on ids, and prefix-stable for chat."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from workers.sim import tokenizer as tok

ROOT = Path(__file__).resolve().parents[2]
ENGLISH = (
    "The report said that the new system would help people find their way around the city. "
    "Many of the children were playing in the park while their parents talked about work, "
    "money and the weather. After a long day the family came home, made some food and went "
    "to sleep early because they had to travel again the next morning."
)


@given(st.text())
@settings(max_examples=300, deadline=None)
def test_round_trip_any_text(text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


@given(st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=50))
@settings(max_examples=200, deadline=None)
def test_any_ids_decode_without_error(ids: list[int]) -> None:
    assert isinstance(tok.decode(ids), str)
    for t in ids:
        assert isinstance(tok.token_str(t), str)


def test_word_ids_are_readable_words() -> None:
    assert tok.VOCAB_SIZE == 1000
    assert len(set(tok.VOCAB)) == 1000
    assert tok.decode([0, 1, 2]) == " the of and"
    for i in range(1000):
        word = tok.token_str(i)
        assert word.startswith(" ") and word[1:].isalpha()
        assert tok.encode(word) == [i], "a vocabulary word encodes back to its own id"


def test_out_of_range_ids_become_replacement_char() -> None:
    assert tok.decode([-1]) == "\ufffd"
    assert tok.decode([tok.MAX_TOKEN_ID + 1]) == "\ufffd"
    assert tok.MAX_TOKEN_ID < 2**31, "ids fit an int32 like a real vocabulary"
    # "é日" is 5 bytes: the first 3-byte chunk ends inside 日, yet it still decodes.
    first, second = tok.encode("é日")
    assert tok.decode_bytes([first]) == "é日".encode()[:3]
    assert tok.decode([first]) == "é\ufffd"
    assert tok.decode([first, second]) == "é日"


def test_deterministic_across_processes() -> None:
    code = (
        "from workers.sim.tokenizer import encode;"
        f"print(encode({ENGLISH!r} + ' 日本語 {{\"k\": 1}}'))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONPATH": str(ROOT), "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1
    assert outs.pop().strip() == str(tok.encode(ENGLISH + ' 日本語 {"k": 1}'))


def test_density_on_english() -> None:
    ratio = len(ENGLISH) / len(tok.encode(ENGLISH))
    assert 3.5 <= ratio <= 6.0, ratio


def test_long_prompt_is_fast() -> None:
    text = (ENGLISH + " Some_identifier=42; {json: [1, 2, 3]} ünïcödé\n") * 150
    assert len(text) > 40_000
    tok._piece_ids.cache_clear()
    t0 = time.perf_counter()
    ids = tok.encode(text)
    elapsed = time.perf_counter() - t0
    assert tok.decode(ids) == text
    # A few ms in practice; the bound only catches a quadratic regression (at this length,
    # minutes), so it is generous enough for a loaded host.
    assert elapsed < 5.0


def test_chat_template_renders_roles_parts_tools_and_generation_prompt() -> None:
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f"}}],
        },
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    out = tok.render_chat(msgs, tools)
    assert out.startswith("<|im_start|>system\n# Tools\n[")
    assert '"name":"f"' in out
    assert "<|im_start|>system\nBe brief.<|im_end|>\n" in out
    assert "<|im_start|>user\na\nb<|im_end|>\n" in out
    assert out.endswith("<|im_start|>assistant\n")
    assert not tok.render_chat(msgs, add_generation_prompt=False).endswith("assistant\n")


def test_chat_history_is_a_token_prefix_of_the_next_turn() -> None:
    """Multi-turn prefix caching needs turn N's tokens to start turn N+1's tokens."""
    turn1 = [{"role": "user", "content": "Tell me about caches."}]
    turn2 = [
        *turn1,
        {"role": "assistant", "content": " the cache holds blocks"},
        {"role": "user", "content": "And eviction?"},
    ]
    history = tok.encode(tok.render_chat(turn2[:2], add_generation_prompt=False))
    full = tok.encode(tok.render_chat(turn2))
    assert full[: len(history)] == history


def test_render_chat_rejects_malformed_messages() -> None:
    for bad in ([{"content": "x"}], ["not a dict"], [{"role": 1, "content": "x"}]):
        try:
            tok.render_chat(bad)  # type: ignore[arg-type]
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad!r}")
