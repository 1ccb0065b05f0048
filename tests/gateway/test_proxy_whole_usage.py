"""A whole (non-streaming) answer's usage is read without parsing all of a big answer on the event
loop (review finding 8: a 46 MB ``prompt_logprobs`` answer was parsed whole, 0.72 s of loop time,
to read ``usage``).

Small answers are parsed whole (exact). Big ones have their top-level ``usage`` object located by
bytes and only it parsed; the tests use bodies whose unparsed tail is not even valid JSON, count
the bytes handed to the parser, and check every shape a client can steer (decoded tokens as
``top_logprobs`` keys, quotes and braces in content) against the whole parse.
"""

from __future__ import annotations

import hashlib
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.requests import Request
from starlette.responses import Response

import gateway.proxy as proxy_mod
from gateway.call import Usage
from gateway.config import Settings
from gateway.proxy import WHOLE_PARSE_MAX, _usage_of
from tests.gateway.conftest import MODEL, run_gateway, serve_app, settings_for, stub_app

USAGE = {
    "prompt_tokens": 32_000,
    "total_tokens": 32_001,
    "completion_tokens": 1,
    "prompt_tokens_details": {"cached_tokens": 16, "multimodal_tokens": {"image": 3}},
}
WANT = Usage(32_000, 1, 16)


def doc(choices: list[dict[str, Any]] | None = None, **top: Any) -> dict[str, Any]:
    """A vLLM 0.32 ChatCompletionResponse, fields in its order (usage before prompt_logprobs)."""
    return {
        "id": "chatcmpl-x",
        "object": "chat.completion",
        "created": 1,
        "model": MODEL,
        "choices": choices
        or [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": USAGE,
        **top,
    }


def prompt_logprobs(n: int) -> list[Any]:
    entry = {
        str(1000 + i): {"logprob": -1.25, "rank": i + 1, "decoded_token": f"t{i}"}
        for i in range(21)
    }
    return [None] + [entry] * (n - 1)


def big(d: dict[str, Any]) -> bytes:
    body = orjson.dumps(d)
    assert len(body) > WHOLE_PARSE_MAX
    return body


class CountingOrjson:
    """orjson, recording the size of everything the proxy parses."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def loads(self, b: bytes) -> Any:
        self.sizes.append(len(b))
        return orjson.loads(b)

    def __getattr__(self, name: str) -> Any:
        return getattr(orjson, name)


def test_a_big_answer_is_not_parsed_beyond_its_usage(monkeypatch: pytest.MonkeyPatch) -> None:
    counting = CountingOrjson()
    monkeypatch.setattr(proxy_mod, "orjson", counting)
    body = big(doc(prompt_logprobs=prompt_logprobs(2_000)))
    assert _usage_of(body) == WANT
    assert max(counting.sizes) < 1024, counting.sizes
    # What follows the usage object is never parsed: not even valid JSON there changes nothing.
    cut = body[:-200] + b'\x00garbage{["\\'
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(cut)
    assert _usage_of(cut) == WANT


def test_small_answers_are_parsed_whole_as_before() -> None:
    assert _usage_of(orjson.dumps(doc())) == WANT
    assert _usage_of(orjson.dumps({**doc(), "usage": None})) is None
    assert _usage_of(orjson.dumps([1, 2])) is None  # not an object: no usage, no error
    assert _usage_of(b'{"usage": {"prompt_tokens": 2, "completion_tokens": 1}}') == Usage(2, 1, 0)
    assert _usage_of(b'not json, but mentions "usage"') is None
    d = doc()
    del d["usage"]  # a nested object called usage is not the answer's
    d["choices"][0]["usage"] = {"prompt_tokens": 0, "completion_tokens": 0}
    assert _usage_of(orjson.dumps(d)) is None


def test_client_steered_bytes_before_the_usage_do_not_fool_the_search() -> None:
    # Completions `echo` + `logprobs`: the big part is in choices, before usage, and its
    # top_logprobs dicts are keyed by decoded tokens, which a prompt chooses.
    tops = [{"usage": -0.5, '"usage': -1.0, '"usage":{': -2.0, "}": -3.0} for _ in range(1_000)]
    content = 'say "usage":{"prompt_tokens":0,"completion_tokens":0} \\"usage\\":{ } {'
    choice = {
        "index": 0,
        "text": content,
        "logprobs": {"tokens": ["usage"] * 1_000, "top_logprobs": tops},
        "finish_reason": "length",
    }
    body = big(doc([choice]))
    assert _usage_of(body) == WANT == Usage.from_json(orjson.loads(body)["usage"])


@pytest.mark.parametrize(
    "case",
    [
        "no usage",
        "usage null",
        "ambiguous",
        "key ending in quote-usage",
        "unterminated",
        "bad counts",
    ],
)
def test_what_cannot_be_read_safely_is_no_usage(case: str) -> None:
    pad = {"prompt_logprobs": prompt_logprobs(200)}
    if case == "no usage":
        d = doc(**pad)
        del d["usage"]
    elif case == "usage null":
        d = doc(usage=None, **pad)
    elif case == "ambiguous":  # another object keyed usage (not vLLM's, but possible elsewhere)
        d = doc(kv_transfer_params={"usage": {"prompt_tokens": 0, "completion_tokens": 0}}, **pad)
    elif case == "key ending in quote-usage":  # `\"usage":{`: a key that only ends in "usage
        d = doc(**pad)
        del d["usage"]
        d["kv_transfer_params"] = {'x"usage': {"prompt_tokens": 0, "completion_tokens": 0}}
    elif case == "bad counts":
        d = doc(usage={"prompt_tokens": -5, "completion_tokens": 1}, **pad)
    else:
        d = doc(**pad)
    body = big(d)
    if case == "unterminated":  # no closing brace within reach
        at = body.index(b'"usage":{') + 9
        body = body[:at] + b'"pad":"' + b"x" * 8192 + b'",' + body[at:]
    assert _usage_of(body) is None


def test_braces_inside_the_usage_object_are_handled() -> None:
    # A string holding a brace inside usage: the slice ends at the object's own closing brace.
    d = doc(
        usage={"note": "}{}", "prompt_tokens": 7, "completion_tokens": 2},
        prompt_logprobs=prompt_logprobs(200),
    )
    assert _usage_of(big(d)) == Usage(7, 2, 0)


_PIECES = ['"', "\\", "{", "}", ":", ",", "usage", '"usage":{', "u", " ", "é", "\n", "x"]
_TEXT = st.lists(st.sampled_from(_PIECES), max_size=12).map("".join)


@settings(max_examples=60, deadline=None)
@given(content=_TEXT, tokens=st.lists(_TEXT, min_size=1, max_size=6), n=st.integers(0, 5))
def test_the_search_agrees_with_the_whole_parse_on_vllm_shaped_answers(
    content: str, tokens: list[str], n: int
) -> None:
    top = {t: -float(i) for i, t in enumerate(tokens)}
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": content, "reasoning": content},
        "logprobs": {
            "content": [{"token": t, "logprob": -1.0, "top_logprobs": [top]} for t in tokens]
        },
        "finish_reason": "stop",
    }
    d = doc([choice] * (n + 1), prompt_logprobs=prompt_logprobs(60), prompt_text=content)
    d["choices"].append({"index": 1, "text": content, "logprobs": {"top_logprobs": [top] * 300}})
    body = big(d)
    assert _usage_of(body) == Usage.from_json(orjson.loads(body)["usage"]) == WANT


async def test_the_gateway_charges_a_big_answers_usage_without_parsing_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    key = "kvg-big-answer"
    # The answer vLLM gives `prompt_logprobs: 20` on a long prompt, its tail not even valid
    # JSON: a whole parse could not read its usage at all.
    body = big(doc(prompt_logprobs=prompt_logprobs(4_000)))
    raw = body[:-100] + b"]]]\x00"

    async def chat(request: Request) -> Response:
        await request.body()
        return Response(raw, media_type="application/json")

    counting = CountingOrjson()
    monkeypatch.setattr(proxy_mod, "orjson", counting)
    usage_file = tmp_path / "usage.jsonl"
    async with serve_app(stub_app(chat)) as url:
        data = settings_for([url]).model_dump()
        data["quota"] = {"backend": "memory", "usage_file": str(usage_file)}
        data["tenants"] = {"t": {"keys_sha256": [hashlib.sha256(key.encode()).hexdigest()]}}
        async with run_gateway(Settings(**data)) as g:
            await g.wait_healthy(1)
            async with httpx.AsyncClient(timeout=30) as c:
                r = await c.post(
                    g.url + "/v1/chat/completions",
                    headers={"authorization": f"Bearer {key}"},
                    json={
                        "model": MODEL,
                        "max_tokens": 1,
                        "prompt_logprobs": 20,
                        "messages": [{"role": "user", "content": "hi"}],
                    },
                )
    assert r.status_code == 200 and r.content == raw  # relayed byte for byte
    assert max(counting.sizes, default=0) < 1024, counting.sizes
    rec = orjson.loads(usage_file.read_bytes().splitlines()[-1])
    assert (rec["prompt_tokens"], rec["completion_tokens"], rec["cached_tokens"]) == (32_000, 1, 16)
