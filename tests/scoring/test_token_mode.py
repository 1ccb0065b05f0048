"""Token mode: the worker's template + tokenizer, cut into the worker's blocks.

Every tokenizer here is trained in the test (a tiny byte-level BPE on a few sentences) and saved
the way a model directory holds it, so the loader, the template rendering and the keyer run for
real with no download.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from gateway.tokenizers import TokenizerLoadError, load_token_keyer
from scoring.chat_inputs import chat_inputs
from scoring.prefix import chain_hashes_tokens, seed_for, tail_layout, text_key
from scoring.route_key import route_request
from scoring.token_mode import TokenKeyer, TokenKeyError, with_key

SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
# ChatML with the system prompt (and tools) first: a shared system prompt is a shared token prefix.
CHATML = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}"
    "{% if m.tool_calls is defined %}"
    "{% for c in m.tool_calls %}<call>{{ c.function.arguments | tojson }}</call>{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if thinking is defined and not thinking %}<think></think>{% endif %}{% endif %}"
)
CORPUS = [
    "You are a careful assistant for the billing team of a large company.",
    "Refund order 17 and tell the customer where invoice 9 went.",
    "The gateway routes each request to the worker that holds its prefix cache.",
    "Explain how a hash map works, with keys, buckets and collisions.",
    'def route(x, y):\n    return {"worker": x, "score": y}\n',
    "1234567890 , . ! ? : ; ( ) [ ] { } < > | = + - * / _ \n\n\t",
] * 20
SYSTEM = "You are a careful assistant for the billing team. Refund orders politely. " * 12
BS = 4  # small blocks so short test prompts span many of them
MODEL = "tiny"


def train(tmp: Path, pre: Any = None, *, rstrip_end: bool = False) -> Path:
    """A tiny byte-level BPE saved as a model directory (tokenizer.json + tokenizer_config.json)."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre or pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    tmp.mkdir(parents=True, exist_ok=True)
    spec = json.loads(tok.to_str())
    if rstrip_end:
        for t in spec["added_tokens"]:
            if t["content"] == "<|im_end|>":
                t["rstrip"] = True
    (tmp / "tokenizer.json").write_text(json.dumps(spec))
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": CHATML}
    (tmp / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def keyer(model_dir: Path) -> TokenKeyer:
    return load_token_keyer(model_dir, cache_min_chars=64)


@pytest.fixture(scope="module")
def plain(model_dir: Path) -> TokenKeyer:
    """The same tokenizer with no prefix-ids cache: the reference the cache must agree with."""
    return load_token_keyer(model_dir, cache_tokens=0)


@pytest.fixture(scope="module")
def raw(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def chat(*msgs: tuple[str, str], **kw: Any) -> dict[str, Any]:
    return {"messages": [{"role": r, "content": c} for r, c in msgs], **kw}


def chain(k: TokenKeyer, body: dict[str, Any], **kw: Any) -> list[int]:
    args: dict[str, Any] = {"model": MODEL, "block_size": BS, "max_blocks": 10_000} | kw
    return k.key("chat" if "messages" in body else "completion", body, **args).chain


def common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# -- what the worker sees ----------------------------------------------------------------------------
def test_chat_ids_are_the_template_rendering_encoded_without_added_specials(
    keyer: TokenKeyer, raw: Tokenizer
) -> None:
    body = chat(("system", "Be brief."), ("user", "Refund order 17."))
    text = keyer.render(body)
    assert text == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nRefund order 17.<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = list(keyer.token_ids("chat", body))
    assert ids == raw.encode(text, add_special_tokens=False).ids
    assert ids.count(raw.token_to_id("<s>")) == 1  # BOS from the template only, as vLLM does
    assert (
        list(keyer.token_ids("chat", {**body, "add_special_tokens": True}))[:2]
        == [raw.token_to_id("<s>")] * 2
    )


def test_string_prompts_are_encoded_with_specials_and_without_the_template(
    keyer: TokenKeyer, raw: Tokenizer
) -> None:
    p = "Explain how a hash map works."
    ids = list(keyer.token_ids("completion", {"prompt": p}))
    assert ids == raw.encode(p).ids
    assert ids[0] == raw.token_to_id("<s>")
    assert raw.token_to_id("<|im_start|>") not in ids
    no_bos = list(keyer.token_ids("completion", {"prompt": p, "add_special_tokens": False}))
    assert no_bos == ids[1:]
    assert list(keyer.token_ids("completion", {"prompt": [p, "other"]})) == ids  # batch: first


def test_token_id_prompts_hash_their_ids_exactly_as_text_mode_does(keyer: TokenKeyer) -> None:
    ids = [random.Random(3).randrange(50_000) for _ in range(203)]
    k = keyer.key("completion", {"prompt": ids}, model=MODEL, namespace="t", block_size=16)
    assert k.chain == chain_hashes_tokens(ids, block_size=16, seed=seed_for(MODEL, "t"))
    assert len(k.chain) == 203 // 16
    assert k.prompt_tokens == 203 and k.block_tokens == 16
    # The same ids key the same chain in either mode: a model moving to token mode keeps them.
    assert k._replace(input_tokens=0) == text_key(  # text mode counts nothing exactly
        "completion", {"prompt": ids}, model=MODEL, namespace="t", token_block_size=16
    )
    batch = keyer.key("completion", {"prompt": [ids, [1, 2]]}, model=MODEL, block_size=16)
    assert batch.chain == chain_hashes_tokens(ids, block_size=16, seed=seed_for(MODEL))
    with pytest.raises(TokenKeyError):
        keyer.key("completion", {"prompt": [5, -1]}, model=MODEL)


# -- the chain -----------------------------------------------------------------------------------------
def test_identical_prompts_give_identical_chains(keyer: TokenKeyer, plain: TokenKeyer) -> None:
    body = chat(("system", SYSTEM), ("user", "where is invoice 9"))
    copy = json.loads(json.dumps(body))
    assert chain(keyer, body) == chain(keyer, copy) == chain(plain, body)
    assert len(chain(keyer, body)) > 20


@pytest.mark.parametrize("bs", [1, 3, 4, 16, 32])
def test_chain_covers_full_blocks_only(keyer: TokenKeyer, bs: int) -> None:
    body = chat(("user", "Refund order 17 and tell the customer where invoice 9 went."))
    n = len(keyer.token_ids("chat", body))
    k = keyer.key("chat", body, model=MODEL, block_size=bs, max_blocks=10_000)
    assert len(k.chain) == n // bs
    assert k.prompt_tokens == n and k.block_tokens == bs
    # Exactly k blocks of ids -> k entries; one id short -> the last block is not hashed.
    ids = list(range(4 * bs))
    assert len(keyer.key("completion", {"prompt": ids}, model=MODEL, block_size=bs).chain) == 4
    short = keyer.key("completion", {"prompt": ids[:-1]}, model=MODEL, block_size=bs)
    assert len(short.chain) == 3


def test_max_blocks_and_tail_follow_text_modes_layout(keyer: TokenKeyer) -> None:
    ids = list(range(5000))
    k = keyer.key(
        "completion",
        {"prompt": ids},
        model=MODEL,
        block_size=16,
        max_blocks=64,
        tail_ratio=16,
        tail_blocks=128,
    )
    assert k.dense_blocks == 64 and k.tail_ends == tail_layout(64, 16, 128)
    assert k.chain[:64] == chain_hashes_tokens(
        ids, block_size=16, seed=seed_for(MODEL), max_blocks=64
    )
    assert 64 < len(k.chain) < 5000 // 16


def test_roles_order_namespace_and_salt_change_the_chain(keyer: TokenKeyer) -> None:
    text = "Refund order 17 and tell the customer where invoice 9 went. " * 3
    by_role = [chain(keyer, chat((r, text))) for r in ("system", "user", "assistant")]
    assert len({c[0] for c in by_role}) == 3  # the role is in the first block
    a, b = ("user", "Refund order 17 please."), ("assistant", "Where is invoice 9?")
    assert chain(keyer, chat(a, b))[0] != chain(keyer, chat(b, a))[0]
    body = chat(("system", SYSTEM), ("user", "hello"))
    base = chain(keyer, body)
    others = [
        chain(keyer, body, namespace="tenant-a"),
        chain(keyer, body, namespace="tenant-b"),
        chain(keyer, body, cache_salt="s1"),
        chain(keyer, {**body, "cache_salt": "s1"}),  # the body's own cache_salt
        chain(keyer, body, model="other-model"),
    ]
    for o in others:
        assert len(o) == len(base) and not set(o) & set(base)  # no entry shared at all
    assert others[2] == others[3]


def test_a_shared_system_prompt_shares_exactly_its_full_leading_blocks(keyer: TokenKeyer) -> None:
    a = chat(("system", SYSTEM), ("user", "Refund order 17."))
    b = chat(("system", SYSTEM), ("user", "Where is invoice 9?"))
    ia, ib = list(keyer.token_ids("chat", a)), list(keyer.token_ids("chat", b))
    shared_tokens = common(ia, ib)
    system_tokens = len(
        keyer.token_ids("chat", chat(("system", SYSTEM), add_generation_prompt=False))
    )
    assert shared_tokens >= system_tokens  # the template puts the system prompt first
    ca, cb = chain(keyer, a), chain(keyer, b)
    assert common(ca, cb) == shared_tokens // BS >= 20
    assert ca[shared_tokens // BS] != cb[shared_tokens // BS]


def test_tools_and_template_kwargs_reach_the_template(keyer: TokenKeyer) -> None:
    tool = {"type": "function", "function": {"name": "refund", "parameters": {"type": "object"}}}
    base = chat(("user", "Refund order 17."))
    text = keyer.render({**base, "tools": [tool]})
    # vLLM hands the template its model_dump of the tool: unset description becomes null.
    assert '"description": null' in text and '"name": "refund"' in text
    assert keyer.render({**base, "chat_template_kwargs": {"thinking": False}}).endswith(
        "<think></think>"
    )
    assert not keyer.render(base).endswith("<think></think>")


def test_continue_final_message_renders_an_open_last_turn(keyer: TokenKeyer) -> None:
    body = chat(
        ("user", "Refund order 17."),
        ("assistant", "Sure, the refund"),
        continue_final_message=True,
        add_generation_prompt=False,
    )
    assert keyer.render(body).endswith("<|im_start|>assistant\nSure, the refund")


def test_a_request_the_template_rejects_raises_token_key_error(keyer: TokenKeyer) -> None:
    with pytest.raises(TokenKeyError, match="unknown role"):
        keyer.key("chat", chat(("wizard", "hi")), model=MODEL)
    with pytest.raises(TokenKeyError):
        keyer.key("chat", {"messages": "not a list"}, model=MODEL)


def test_with_key_puts_the_token_chain_on_a_route(keyer: TokenKeyer) -> None:
    body = chat(("system", SYSTEM), ("user", "hello"))
    route = route_request(
        "chat", body, model=MODEL, session_id="u1", namespace="t", hash_prefix=False
    )
    k = keyer.key("chat", body, model=MODEL, namespace="t", block_size=32, max_blocks=64)
    r = with_key(route, k)
    assert r.chain == tuple(k.chain) and r.block_tokens == 32.0
    assert r.prompt_tokens == int(k.prompt_tokens) and r.dense_blocks == 64
    assert r.session_id == route.session_id == "1:t\x00u1"
    assert r.matched_tokens(3) == 96.0


# -- vLLM's message normalisation ------------------------------------------------------------------
def test_chat_inputs_follow_vllm() -> None:
    body = {
        "messages": [
            {
                "role": "developer",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "system", "content": "c"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "x"},
                    {"type": "image_url", "image_url": {"url": "data:1"}},
                ],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "1",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"k": 1}'},
                    },
                    {
                        "id": "2",
                        "type": "function",
                        "function": {"name": "g", "arguments": "not json"},
                    },
                ],
            },
            {
                "role": "tool",
                "tool_call_id": "1",
                "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}],
            },
        ],
        "add_generation_prompt": False,
        "chat_template_kwargs": {"enable_thinking": False, "tokenize": True},
    }
    before = json.dumps(body)
    msgs, tools, kw = chat_inputs(body, developer_role=False)
    assert json.dumps(body) == before  # never mutated
    assert msgs[0] == {"role": "system", "content": "a\nb\n\nc"}  # developer -> system, merged
    assert msgs[1]["content"].startswith("x\n<|image_url:")
    assert [c["function"]["arguments"] for c in msgs[2]["tool_calls"]] == [{"k": 1}, {}]
    assert msgs[2]["content"] == ""
    assert msgs[3] == {"role": "tool", "content": "r1\nr2", "tool_call_id": "1"}
    assert tools is None
    assert kw == {
        "enable_thinking": False,
        "add_generation_prompt": False,
        "continue_final_message": False,
    }
    kept, _, _ = chat_inputs(body, developer_role=True, content_format="openai")
    assert kept[0]["role"] == "developer"
    assert kept[0]["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert kept[2]["content"][1] == {"type": "image"}


def test_templates_that_iterate_content_get_parts(tmp_path: Path) -> None:
    d = train(tmp_path / "parts")
    tpl = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% for p in m['content'] %}{% if p['type'] == 'text' %}[{{ p['text'] }}]{% endif %}"
        "{% endfor %}<|im_end|>\n{% endfor %}"
    )
    (d / "chat_template.jinja").write_text(tpl)  # the .jinja file wins over the config's
    k = load_token_keyer(d)
    assert k.content_format == "openai"
    text = k.render({"messages": [{"role": "user", "content": "hi"}]})
    assert text == "<|im_start|>user\n[hi]<|im_end|>\n"


def test_tool_use_template_serves_requests_with_tools(tmp_path: Path) -> None:
    d = train(tmp_path / "named")
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "D{{ messages[0]['content'] }}"},
        {"name": "tool_use", "template": "T{{ messages[0]['content'] }}"},
    ]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    k = load_token_keyer(d)
    body = chat(("user", "hi"))
    assert k.render(body) == "Dhi"
    assert k.render({**body, "tools": [{"type": "function", "function": {"name": "f"}}]}) == "Thi"


# -- the prefix-ids cache ------------------------------------------------------------------------------
def test_the_cache_is_exact_and_hits_shared_system_prompts_and_next_turns(
    model_dir: Path, plain: TokenKeyer
) -> None:
    k = load_token_keyer(model_dir, cache_min_chars=64)
    assert k.cache_enabled and not plain.cache_enabled
    rng = random.Random(7)
    words = " ".join(CORPUS).split()
    conv: list[tuple[str, str]] = [("system", SYSTEM)]
    for _ in range(12):
        conv.append(("user", " ".join(rng.choice(words) for _ in range(rng.randint(1, 40)))))
        body = chat(*conv)
        assert k.token_ids("chat", body) == plain.token_ids("chat", body)
        conv.append(("assistant", " ".join(rng.choice(words) for _ in range(30))))
    stats = k.cache_stats()
    assert stats["hits"] >= 11  # every turn after the first reuses the one before
    other_user = chat(("system", SYSTEM), ("user", "Refund order 17."))
    assert k.token_ids("chat", other_user) == plain.token_ids("chat", other_user)
    assert k.cache_stats()["hits"] == stats["hits"] + 1  # the system prompt's ids


def test_the_cache_stays_within_its_token_budget(model_dir: Path, plain: TokenKeyer) -> None:
    k = load_token_keyer(model_dir, cache_tokens=2_000, cache_min_chars=64)
    for i in range(40):
        body = chat(("system", f"{i} {SYSTEM}"), ("user", f"question {i}"))
        assert k.token_ids("chat", body) == plain.token_ids("chat", body)
        assert k.cache_stats()["held_tokens"] <= 2_000


_PIECES = [*"ab ,.\n\t{}", "<|im_end|>", "<|im_start|>", "<s>", "é", "日", "refund ", "  "]
_TEXT = st.lists(st.sampled_from(_PIECES), max_size=40).map("".join)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["system", "user", "assistant"]), _TEXT), min_size=1, max_size=6
    )
)
def test_cached_ids_equal_plain_ids_for_any_chat(
    model_dir: Path, plain: TokenKeyer, msgs: list[tuple[str, str]]
) -> None:
    # Special-token strings inside content, whitespace around cut points, repeated prefixes:
    # a cache that ever cut where the tokenizer does not would show up here.
    k = _hyp_keyer(model_dir)
    for n in range(1, len(msgs) + 1):
        body = chat(("system", SYSTEM[:80]), *msgs[:n])
        assert k.token_ids("chat", body) == plain.token_ids("chat", body)


_KEYERS: dict[Path, TokenKeyer] = {}


def _hyp_keyer(d: Path) -> TokenKeyer:
    # One cache across examples, so later examples really hit what earlier ones stored.
    if d not in _KEYERS:
        _KEYERS[d] = load_token_keyer(d, cache_min_chars=1)
    return _KEYERS[d]


def test_unsafe_cut_points_are_not_used(tmp_path: Path) -> None:
    # rstrip: <|im_end|> swallows the newline after it, so ids cannot restart right after it.
    k = load_token_keyer(train(tmp_path / "rstrip", rstrip_end=True), cache_min_chars=1)
    ref = load_token_keyer(tmp_path / "rstrip", cache_tokens=0)
    body = chat(("system", SYSTEM), ("user", "hi"))
    for _ in range(2):
        assert k.token_ids("chat", body) == ref.token_ids("chat", body)
    assert "<|im_end|>" not in k._cache._safe and "<|im_start|>" in k._cache._safe
    # A Metaspace that prepends only to the very first piece makes every cut unsafe.
    meta = pre_tokenizers.Metaspace(prepend_scheme="first")
    k2 = load_token_keyer(train(tmp_path / "meta", pre=meta), cache_min_chars=1)
    assert not k2.cache_enabled
    raw = Tokenizer.from_file(str(tmp_path / "meta" / "tokenizer.json"))
    assert (
        list(k2.token_ids("chat", body))
        == raw.encode(k2.render(body), add_special_tokens=False).ids
    )


def test_loading_a_directory_without_a_tokenizer_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match=r"tokenizer\.json"):
        load_token_keyer(tmp_path)


def test_a_model_without_chat_template_still_keys_completions(tmp_path: Path) -> None:
    d = train(tmp_path / "base")
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    k = load_token_keyer(d)
    assert k.key("completion", {"prompt": "hello world"}, model=MODEL, block_size=1).chain
    with pytest.raises(TokenKeyError, match="no chat template"):
        k.key("chat", chat(("user", "hi")), model=MODEL)
