"""The text-mode prompt estimate against what vLLM renders, and token mode's empty text parts.

Review findings (tiny-llama, vLLM 0.32, a tenant capped at 500 input tokens): content parts were
charged their text without the newline vLLM joins them with (1,000 one-byte parts, ~8x the tokens
charged); tool-call `arguments` strings were charged as sent, though vLLM parses them and
templates print them back with `tojson` (``", "``, ``": "``, ``1e15`` as ``1000000000000000.0``:
8-16x); and token mode joined the empty text parts vLLM drops (600 of them and "hello": 609
tokens where vLLM counted 9). vLLM's behaviour is modelled by ``chat_inputs`` (string content
format: truthy parts joined by newlines) and, for arguments, ``json.dumps(json.loads(s))``.
"""

from __future__ import annotations

import hashlib
import json
import types
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import scoring.chat_inputs as ci
from gateway.config import Settings
from gateway.tokenizers import ChatTemplate, sim_token_keyer
from scoring.chat_inputs import (
    _indented_bytes,
    _json_bytes,
    body_bytes,
    chat_inputs,
    json_str_bytes,
    rendered_bytes,
    utf8_len,
)
from tests.gateway.conftest import MODEL, chat_completion, run_gateway, serve_app, settings_for
from tests.gateway.conftest import stub_app as worker_stub


def user(content: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}]}


# What a user message of content parts costs before its content: role markers and the role.
NO_PARTS = rendered_bytes(user([]))


def joined(body: dict[str, Any]) -> str:
    """The content vLLM's string content format hands the template (as chat_inputs models it)."""
    content = chat_inputs(body)[0][0]["content"]
    assert isinstance(content, str)
    return content


def text(t: str, kind: str = "text") -> dict[str, Any]:
    return {"type": kind, ci._TEXT_PART_KEYS[kind]: t}


# -- content parts: joined by newlines, empty ones dropped ------------------------------------------
PARTS: dict[str, list[Any]] = {
    "one-byte parts": [text("a")] * 1000,
    "control-character parts": [text("\x01")] * 1000,
    "bare strings": ["ab"] * 500,
    "empty parts between": [text(""), text("a"), text(""), "", text("b"), text("")] * 200,
    "only empty parts": [text("")] * 300,
    "text part kinds": [text("xy", k) for k in ("text", "input_text", "output_text")] * 100
    + [text("r", "refusal"), text("t", "thinking")] * 100,
    "non-ascii": [text("漢字")] * 300,
}


@pytest.mark.parametrize("case", sorted(PARTS))
def test_parts_are_estimated_as_the_text_vllm_joins_them_into(case: str) -> None:
    body = user(PARTS[case])
    assert rendered_bytes(body) == NO_PARTS + utf8_len(joined(body))


def test_a_thousand_one_byte_parts_cost_their_newlines() -> None:
    # The review's case: 1,000 parts of "a" render "a\na\n...a" (1,999 bytes), charged 1,000.
    assert rendered_bytes(user([text("a")] * 1000)) == NO_PARTS + 1999


def test_media_parts_are_joined_like_text() -> None:
    image = {"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}}
    body = user([text("look"), image, image])
    # Each placeholder is a part of its own: 4 bytes of text, two images, two newlines.
    assert rendered_bytes(body, {"image": 100}) == NO_PARTS + 4 + 200 + 2
    assert rendered_bytes(body) == NO_PARTS + 4  # a kind left free costs nothing, as it did


# -- token mode: string content format drops empty text parts, openai keeps them -------------------
def test_string_format_drops_empty_text_parts() -> None:
    parts = [text("")] * 600 + [text("hello")]
    assert joined(user(parts)) == "hello"
    assert joined(user(["", text("a"), text(""), "b", ""])) == "a\nb"


def test_openai_format_keeps_empty_text_parts() -> None:
    # As vLLM's wrap_dicts: {"type": "text", "text": ""} is truthy, so the template sees it.
    parts = [text("")] * 3 + [text("hello")]
    msgs = chat_inputs(user(parts), content_format="openai")[0]
    assert msgs[0]["content"] == [{"type": "text", "text": t} for t in ("", "", "", "hello")]


def test_empty_parts_tokenize_as_the_text_alone() -> None:
    # The review's count: 600 empty parts and "hello" were 609 tokens, vLLM's 9. The same ids
    # also keep the route key on the chain the worker caches.
    keyer = sim_token_keyer(cache_tokens=0)
    parts = user([text("")] * 600 + [text("hello")])
    assert list(keyer.token_ids("chat", parts)) == list(keyer.token_ids("chat", user("hello")))


# -- tool-call arguments: parsed by vLLM, printed back by `tojson` ---------------------------------
def printed(args: str) -> int:
    """What a `tojson` template prints for an `arguments` string vLLM has parsed."""
    return utf8_len(json.dumps(json.loads(args), ensure_ascii=False))


def compact(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


ARGS: dict[str, str] = {
    "zeros": compact({"a": [0] * 600}),
    "empty lists": compact({"a": [[]] * 410}),
    "1e15 floats": '{"a":[' + ",".join(["1e15"] * 170) + "]}",
    "exponent mix": '{"a":[' + ",".join(["-1E15", "1.5e15", "1e-7", "1e400", "7E2"] * 40) + "]}",
    "17-digit floats": '{"a":[' + ",".join(["12345678901234567.0"] * 100) + "]}",
    "nested objects": compact({"k": [{"x": i, "y": [True, None, {"z": []}]} for i in range(200)]}),
    "space before comma": '{"a":[' + " ,".join(["0"] * 500) + "]}",
}


@pytest.mark.parametrize("case", sorted(ARGS))
def test_arguments_are_sized_as_tojson_prints_them(case: str) -> None:
    args = ARGS[case]
    size, left = ci._arguments_bytes(args, ci._ARGS_PARSE_BUDGET)
    assert size == max(json_str_bytes(args), printed(args))  # parsed: exact
    assert left == ci._ARGS_PARSE_BUDGET - len(args)
    bound, left = ci._arguments_bytes(args, 0)  # no budget left: the bound, never below the print
    assert bound >= printed(args) and left == 0


BOUND_CASES = [
    "1e15",  # not an object: vLLM renders `{}`
    "[1,2]",
    '{"a":NaN,"b":-Infinity}',
    '{"s":"\\u00e9\\ud83d\\ude00\\/\\n"}',  # escapes only shrink
    '{"s":"\\ud800"}',  # a lone surrogate
    '{"a":' + "9" * 400 + "}",  # a big int
    '{"a" : 1 ,"b":[ 1e15 ]}',
    '{"a":{"b":{"c":[0.0001,1e-4,-0.0,1E+2]}}}',
    "not json at all, 1e15: yes",
    "",
    "{}",
]


@pytest.mark.parametrize("args", BOUND_CASES)
def test_the_bound_covers_what_any_arguments_string_prints(args: str) -> None:
    try:
        want = printed(args)
    except ValueError:
        want = 0  # unparseable: vLLM coerces it to {}
    for budget in (0, ci._ARGS_PARSE_BUDGET):
        size, _ = ci._arguments_bytes(args, budget)
        assert size >= max(want, json_str_bytes(args)), (args, budget)


def tool_call_body(args: str, calls: int = 1) -> dict[str, Any]:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}
    return {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call] * calls},
            {"role": "user", "content": "ok"},
        ]
    }


# The reviewer's template (Hermes-like): each call's arguments printed with `tojson`.
TOOLS_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% endif %}"
    "{% if message.tool_calls is defined and message.tool_calls %}"
    "{% for tool_call in message.tool_calls %}"
    "{% if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}"
    '{{ \'\\n<tool_call>\\n{"name": "\' }}{{ tool_call.name }}'
    "{{ '\", \"arguments\": ' }}{{ tool_call.arguments | tojson }}{{ '}\\n</tool_call>' }}"
    "{% endfor %}{% endif %}{{ '<|end|>\\n' }}{% endfor %}"
)


def render(body: dict[str, Any]) -> int:
    msgs, tools, kw = chat_inputs(body)
    return len(ChatTemplate({"default": TOOLS_TEMPLATE}, {})(msgs, tools, **kw).encode())


@pytest.mark.parametrize("case", sorted(ARGS))
def test_a_tool_call_is_estimated_at_least_at_what_its_template_prints(case: str) -> None:
    body = tool_call_body(ARGS[case])
    assert rendered_bytes(body) >= 0.95 * render(body), (rendered_bytes(body), render(body))


def test_past_the_parse_budget_calls_are_sized_by_the_bound() -> None:
    args = compact({"a": [0] * 4000})  # 8 kB of body, 12 kB printed
    body = tool_call_body(args, calls=3 * ci._ARGS_PARSE_BUDGET // len(args))
    assert rendered_bytes(body) >= render(body)


def test_only_arguments_that_may_outgrow_their_size_are_parsed_within_a_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The estimate runs on every chat request: a parse costs up to ~100 ns a character, a
    # request's worth of it is bounded, and the usual call (prose, code, already spaced JSON)
    # costs no parse at all.
    parsed: list[str] = []

    def loads(s: str) -> Any:
        parsed.append(s)
        return json.loads(s)

    monkeypatch.setattr(ci, "json", types.SimpleNamespace(loads=loads, dumps=json.dumps))
    usual = [
        compact({"location": "Boston, MA", "unit": "celsius", "days": 3}),
        json.dumps({"query": "weather", "ids": [1, 2, 3], "when": "12:30"}),
        json.dumps({"path": "a.py", "content": "def f(a, b):\n    return {'a': a}\n" * 200}),
    ]
    for args in usual:
        rendered_bytes(tool_call_body(args))
    assert parsed == []
    numbers = compact({"a": [0] * 4000})
    rendered_bytes(tool_call_body(numbers, calls=50))
    assert 0 < sum(map(len, parsed)) <= ci._ARGS_PARSE_BUDGET


# -- JSON objects as `tojson` prints them: ", " and ": " -------------------------------------------
OBJECTS: dict[str, Any] = {
    "zeros": {"a": [0] * 600},
    "empty lists": {"a": [[]] * 410},
    "many keys": {str(i): 0 for i in range(1500)},
    "nested": {"k": [{"x": i, "y": [True, None, {"z": "s"}]} for i in range(200)]},
}


@pytest.mark.parametrize("case", sorted(OBJECTS))
def test_json_is_sized_with_tojson_separators(case: str) -> None:
    obj = OBJECTS[case]
    tojson = len(json.dumps(obj))
    # Over by a separator a container at most (its last item's).
    assert tojson <= _json_bytes(obj) <= 1.2 * tojson
    # Arguments sent as an object: the same print.
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": obj}}
    body = tool_call_body("{}")
    body["messages"][1]["tool_calls"] = [call]
    assert rendered_bytes(body) >= render(body)
    # The body itself is compact JSON, sized so (the render-ratio guard of token mode).
    size = len(compact(obj))
    assert size <= body_bytes(obj) <= 1.1 * size < _json_bytes(obj)


def test_indented_keys_pay_their_comma() -> None:
    # tojson(indent=4) writes `"k": v,` on each line: the comma was not charged.
    obj = OBJECTS["many keys"]
    assert _indented_bytes([obj]) >= len(json.dumps(obj, indent=4))


# -- end to end: a gateway in text mode, a tenant capped ---------------------------------------------
KEY = "kvg-rendered-size"
CAP = 400


def capped(url: str) -> Settings:
    data = settings_for([url]).model_dump()
    data["tenants"] = {
        "t": {"keys_sha256": [hashlib.sha256(KEY.encode()).hexdigest()], "max_input_tokens": CAP}
    }
    return Settings(**data)


async def test_the_gateway_refuses_parts_and_arguments_past_the_cap() -> None:
    # Both render ~2 kB (~500 tokens at 4 bytes a token) and were charged ~1 kB, under CAP.
    seen: list[bytes] = []

    async def ok(request: Request) -> Response:
        seen.append(await request.body())
        return JSONResponse(chat_completion())

    over = {
        "parts": user([text("a")] * 1000),
        "arguments": tool_call_body(compact({"a": [0] * 600})),
    }
    under = user("a" * 1000)
    async with (
        serve_app(worker_stub(ok)) as url,
        run_gateway(capped(url)) as g,
        httpx.AsyncClient(timeout=30) as c,
    ):
        await g.wait_healthy(1)
        auth = {"authorization": f"Bearer {KEY}"}
        for name, body in over.items():
            r = await c.post(
                g.url + "/v1/chat/completions",
                json={"model": MODEL, "max_tokens": 1, **body},
                headers=auth,
            )
            assert r.status_code == 400, (name, r.text)
        assert seen == []
        r = await c.post(
            g.url + "/v1/chat/completions",
            json={"model": MODEL, "max_tokens": 1, **under},
            headers=auth,
        )
        assert r.status_code == 200, r.text
        assert len(seen) == 1
