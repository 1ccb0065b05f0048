"""Fuzzing the edge: OpenAI request bodies, valid and hostile, through a real gateway.

One gateway with two simulated workers and two tenants (memory quota backend) serves the whole
module. Every response must be a 200 or an intended refusal (never a 500 or a 502), every refusal
the OpenAI error envelope, every streamed 200 a well-formed SSE stream ending in `data: [DONE]`,
and after every single example nothing may be left in flight: no worker slot, no tenant lease or
open reservation, no engine request, no running request task.

Requests go out as one write on a fresh connection (raw HTTP/1.1), which keeps each example to a
few milliseconds and lets the hostile cases send exactly the bytes they mean.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import re
from typing import Any

import orjson
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.errors import APIError
from gateway.validate import MAX_DEPTH, parse_request
from tests.faults.conftest import (
    BODY_LIMIT,
    KEY_CAPPED,
    KEY_OPEN,
    MAX_CONCURRENT,
    MODEL,
    RawResponse,
    Stack,
    assert_openai_error,
    http_request,
    raw_exchange,
    run_stack,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# What the gateway (or the worker behind it) may answer a client's mistake with. 503 is not here:
# both workers stay healthy, so "no capacity" would be a bug too.
INTENDED = {200, 400, 401, 404, 413, 415, 422, 429}
_RID_OK = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_serial = itertools.count()

FUZZ = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack():  # type: ignore[no-untyped-def]
    async with run_stack(2, sim={"max_model_len": 4096}) as s:
        yield s


# -- sending and checking ---------------------------------------------------------------------------
async def exchange(
    s: Stack,
    path: str,
    body: bytes,
    headers: dict[str, str],
    *,
    stream: bool | None = None,
    expect_ok: bool = False,
) -> RawResponse:
    """One request; the response checked against the module's invariants; then no leaks."""
    rid = headers.get("x-request-id")
    if rid is not None and _RID_OK.match(rid):
        # Unique per request, so a failed check names exactly one request in the logs.
        headers = {**headers, "x-request-id": f"{rid[:100]}.{next(_serial)}"}
    r = await raw_exchange(s.port, http_request(path, body, headers=headers))
    check(r, headers, stream=stream, expect_ok=expect_ok, sent=body)
    await s.assert_quiescent()
    return r


def check(
    r: RawResponse,
    sent_headers: dict[str, str],
    *,
    stream: bool | None,
    expect_ok: bool,
    sent: bytes,
) -> None:
    what = f"{r.status} for {sent[:300]!r}: {r.body[:300]!r}"
    assert r.status in INTENDED, what
    if expect_ok:
        assert r.status == 200, what
    ctype = r.headers.get("content-type", "")
    rid = sent_headers.get("x-request-id")
    if "x-request-id" in r.headers:
        if rid is not None and _RID_OK.match(rid):
            assert r.headers["x-request-id"] == rid, what
        else:
            assert re.fullmatch(r"kvg-[0-9a-f]{12}-[0-9a-f]+", r.headers["x-request-id"]), what
    if r.status != 200:
        assert_openai_error(r.status, ctype, r.body)
        return
    is_sse = ctype.startswith("text/event-stream")
    if stream is not None:
        assert is_sse == stream, what
    if is_sse:
        check_sse(r.body, sent)
    else:
        assert ctype.startswith("application/json"), what
        doc = orjson.loads(r.body)
        assert doc["choices"] and isinstance(doc["usage"], dict), what


def check_sse(body: bytes, sent: bytes) -> None:
    assert body.endswith(b"data: [DONE]\n\n"), body[-300:]
    events = body[: -len(b"\n\n")].split(b"\n\n")
    assert all(e.startswith(b"data: ") for e in events), body[:300]
    assert events.count(b"data: [DONE]") == 1
    chunks = [orjson.loads(e[6:]) for e in events[:-1]]
    assert not any("error" in c for c in chunks), body[-500:]
    try:
        asked = orjson.loads(sent).get("stream_options", {}).get("include_usage") is True
    except (orjson.JSONDecodeError, AttributeError):
        return
    usage = [c for c in chunks if c.get("usage") and c.get("choices") == []]
    # The gateway forces include_usage upstream and strips the chunk for clients that did not ask.
    assert len(usage) == int(asked), body[-500:]


# -- strategies -------------------------------------------------------------------------------------
text = st.text(max_size=120)
short = st.text(max_size=16)
finite = st.floats(allow_nan=False, allow_infinity=False)
json_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    finite,
    st.text(max_size=24),
)
json_any = st.recursive(
    json_scalar,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=10,
)

part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": text}),
    st.fixed_dictionaries(
        {
            "type": st.just("image_url"),
            "image_url": st.fixed_dictionaries(
                {
                    "url": st.sampled_from(
                        ["https://example.invalid/a.png", "data:image/png;base64,"]
                    )
                }
            ),
        }
    ),
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "developer"]),
        "content": st.one_of(text, st.lists(part, min_size=1, max_size=3)),
    },
    optional={"name": st.from_regex(r"[a-z]{1,8}", fullmatch=True)},
)
tool = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {
                "name": st.from_regex(r"[a-z_]{1,12}", fullmatch=True),
                "parameters": st.just(
                    {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
                ),
            },
            optional={"description": short},
        ),
    }
)
common_optional = {
    "max_tokens": st.integers(1, 12),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1, exclude_min=True),  # vLLM and OpenAI refuse 0
    "n": st.just(1),
    "stop": st.one_of(st.none(), short, st.lists(short, max_size=3)),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "user": short,
    "ignore_eos": st.booleans(),
    "top_k": st.integers(-1, 50),
}
chat_optional = {
    **common_optional,
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 5),
    "tools": st.lists(tool, max_size=2),
    "tool_choice": st.sampled_from(["auto", "none"]),
    "max_completion_tokens": st.integers(1, 12),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    "parallel_tool_calls": st.booleans(),
}
completion_optional = {
    **common_optional,
    "logprobs": st.integers(0, 5),
    "echo": st.booleans(),
}


@st.composite
def streaming(draw: st.DrawFn) -> dict[str, Any]:
    if not draw(st.booleans()):
        return draw(st.sampled_from([{}, {"stream": False}, {"stream": None}]))
    out: dict[str, Any] = {"stream": True}
    if draw(st.booleans()):
        out["stream_options"] = draw(
            st.fixed_dictionaries({}, optional={"include_usage": st.booleans()})
        )
    return out


def _chat(base: dict[str, Any], s: dict[str, Any]) -> dict[str, Any]:
    if base.get("top_logprobs"):
        base["logprobs"] = True  # top_logprobs > 0 without logprobs is a 400 (OpenAI and vLLM)
    return {**base, **s}


def chat_bodies() -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(
        _chat,
        st.fixed_dictionaries(
            {"model": st.just(MODEL), "messages": st.lists(message, min_size=1, max_size=4)},
            optional=chat_optional,
        ),
        streaming(),
    )


def completion_bodies() -> st.SearchStrategy[dict[str, Any]]:
    prompt = st.one_of(
        st.text(min_size=1, max_size=200),
        st.lists(st.text(min_size=1, max_size=50), min_size=1, max_size=1),
        st.lists(st.integers(0, 5000), min_size=1, max_size=40),
        st.lists(st.lists(st.integers(0, 5000), min_size=1, max_size=20), min_size=1, max_size=1),
    )
    return st.builds(
        lambda base, s: {**base, **s},
        st.fixed_dictionaries(
            {"model": st.just(MODEL), "prompt": prompt}, optional=completion_optional
        ),
        streaming(),
    )


json_types = ["application/json", "application/json; charset=utf-8", None]
content_types = st.sampled_from(
    [
        *json_types,
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/json; charset=latin-1",
        "",
    ]
)
request_ids = st.one_of(
    st.none(),
    st.from_regex(r"[A-Za-z0-9._:-]{1,40}", fullmatch=True),
    st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=200),
)


@st.composite
def headers(
    draw: st.DrawFn, key: st.SearchStrategy[str | None] | None = None, *, any_type: bool = True
) -> dict[str, str]:
    """Authorization (a valid key unless told), content-type (JSON ones only unless
    `any_type`: another type may fairly be a 415) and x-request-id (valid or not)."""
    h: dict[str, str] = {}
    k = draw(key if key is not None else st.sampled_from([KEY_CAPPED, KEY_OPEN]))
    if k is not None:
        h["authorization"] = k if " " in k else f"Bearer {k}"
    ct = draw(content_types if any_type else st.sampled_from(json_types))
    if ct is not None:
        h["content-type"] = ct
    rid = draw(request_ids)
    if rid is not None:
        h["x-request-id"] = rid
    return h


# Keys that decide the status on their own: 401 for these, whatever the body.
any_key = st.sampled_from(
    [KEY_CAPPED, KEY_OPEN, None, "wrong-key", f"Basic {KEY_OPEN}", f"bearer {KEY_CAPPED}"]
)


# -- valid bodies: all must succeed ----------------------------------------------------------------
@settings(FUZZ, max_examples=80)
@given(body=chat_bodies(), h=headers(any_type=False))
async def test_valid_chat_bodies_succeed(stack: Stack, body: dict[str, Any], h: dict) -> None:
    await exchange(
        stack, CHAT, orjson.dumps(body), h, stream=body.get("stream") is True, expect_ok=True
    )


@settings(FUZZ, max_examples=50)
@given(body=completion_bodies(), h=headers(any_type=False))
async def test_valid_completion_bodies_succeed(stack: Stack, body: dict[str, Any], h: dict) -> None:
    await exchange(
        stack, COMPLETIONS, orjson.dumps(body), h, stream=body.get("stream") is True, expect_ok=True
    )


# -- wrong types everywhere ------------------------------------------------------------------------
FIELDS = [
    "model",
    "messages",
    "prompt",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "temperature",
    "top_p",
    "stop",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "seed",
    "user",
    "cache_salt",
    "prompt_cache_key",
    "ignore_eos",
    "response_format",
]
odd_values = st.one_of(
    json_any,
    st.sampled_from(
        [
            0,
            -1,
            -0.0,
            2**31,
            2**53 + 1,
            2**63 - 1,
            2**64 - 1,
            -(2**63),
            1e308,
            5e-324,
            "",
            "sim-llama ",
            "SIM-LLAMA",
            "x" * 2000,
            [],
            {},
            [[]],
            [{}],
            [None],
            {"include_usage": "yes"},
            {"role": 1},
            {"role": "user", "content": {"a": [1, {"b": None}]}},
        ]
    ),
)


@st.composite
def mutated(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    path = draw(st.sampled_from([CHAT, COMPLETIONS]))
    body = draw(chat_bodies() if path == CHAT else completion_bodies())
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(["top", "top", "message", "message_field", "delete"]))
        msgs = body.get("messages")
        if where == "message" and isinstance(msgs, list) and msgs:
            msgs[draw(st.integers(0, len(msgs) - 1))] = copy.deepcopy(draw(odd_values))
        elif where == "message_field" and isinstance(msgs, list) and msgs:
            m = msgs[draw(st.integers(0, len(msgs) - 1))]
            if isinstance(m, dict):
                field = draw(st.sampled_from(["role", "content", "name", "tool_calls"]))
                m[field] = copy.deepcopy(draw(odd_values))
        elif where == "delete" and body:
            body.pop(draw(st.sampled_from(sorted(body))))
        else:
            body[draw(st.sampled_from(FIELDS))] = copy.deepcopy(draw(odd_values))
    return path, body


@settings(FUZZ, max_examples=150)
@given(case=mutated(), h=headers(any_key))
async def test_wrong_types_are_refused_cleanly(stack: Stack, case: tuple, h: dict) -> None:
    path, body = case
    await exchange(stack, path, orjson.dumps(body), h)


# -- hostile bytes ---------------------------------------------------------------------------------
VALID = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
BAD_UTF8 = [
    b"\xff",
    b"\xc3\x28",
    b"\xed\xa0\x80",
    b"\xf4\x90\x80\x80",
    b"\xc0\xaf",
    b"\x80",
    b"\xe2\x82",
]
NUMBERS = [
    b"1e309",
    b"-1e309",
    b"1e-400",
    b"1180591620717411303424",  # 2**70
    b"18446744073709551615",
    b"18446744073709551616",
    b"-9223372036854775809",
    b"-0",
    b"-0.0",
    b"NaN",
    b"Infinity",
    b"-Infinity",
    b"0x10",
    b"1_000",
    b"01",
    b"1.",
    b"+1",
    b".5",
    b"1e5",
    b"2.0",
    b"9" * 400,
]
NON_OBJECTS = [b"", b" ", b"\n", b"null", b"[]", b"[1,2]", b"1", b'"str"', b"true", b"{}", b"\x00"]


def _with(field: bytes, value: bytes, *, stream: bool = False) -> bytes:
    s = b',"stream":true' if stream else b""
    return VALID[:-1] + b',"' + field + b'":' + value + s + b"}"


def _nest(depth: int, kind: bytes) -> bytes:
    if kind == b"[":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


@st.composite
def hostile(draw: st.DrawFn) -> bytes:
    kind = draw(
        st.sampled_from(
            ["bytes", "utf8", "truncated", "deep", "number", "nonobject", "dupes", "bom", "nul"]
        )
    )
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    if kind == "utf8":
        bad = draw(st.sampled_from(BAD_UTF8))
        where = draw(st.sampled_from(["content", "model", "key", "extra"]))
        if where == "content":
            return VALID.replace(b'"hi"', b'"h' + bad + b'i"')
        if where == "model":
            return VALID.replace(MODEL.encode(), MODEL.encode() + bad)
        if where == "key":
            return VALID[:-1] + b',"k' + bad + b'":1}'
        return VALID[:-1] + b',"x":"' + bad + b'"}'
    if kind == "truncated":
        full = _with(b"max_tokens", b"3", stream=draw(st.booleans()))
        return full[: draw(st.integers(0, len(full) - 1))]
    if kind == "deep":
        depth = draw(st.sampled_from([64, 253, 254, 255, 300, 1023, 1024, 1025, 10_000]))
        nested = _nest(depth, draw(st.sampled_from([b"[", b"{"])))
        where = draw(st.sampled_from(["extra", "content", "whole", "messages", "tools"]))
        if where == "whole":
            return nested
        if where == "content":
            return VALID.replace(b'"hi"', nested)
        if where == "messages":
            return VALID.replace(b'[{"role"', b"[" + nested + b',{"role"')
        return _with(b"x" if where == "extra" else b"tools", nested, stream=draw(st.booleans()))
    if kind == "number":
        field = draw(
            st.sampled_from(
                [b"max_tokens", b"temperature", b"seed", b"n", b"top_p", b"max_completion_tokens"]
            )
        )
        return _with(field, draw(st.sampled_from(NUMBERS)), stream=draw(st.booleans()))
    if kind == "nonobject":
        return draw(st.sampled_from(NON_OBJECTS))
    if kind == "dupes":
        pairs = draw(
            st.lists(
                st.sampled_from(
                    [
                        b'"model":"sim-llama"',
                        b'"model":"nope"',
                        b'"model":null',
                        b'"messages":[{"role":"user","content":"hi"}]',
                        b'"messages":[]',
                        b'"stream":true',
                        b'"stream":false',
                        b'"stream_options":{"include_usage":true}',
                        b'"max_tokens":2',
                        b'"max_tokens":0',
                    ]
                ),
                min_size=1,
                max_size=8,
            )
        )
        return b"{" + b",".join(pairs) + b"}"
    if kind == "bom":
        return b"\xef\xbb\xbf" + VALID
    return VALID.replace(b'"hi"', b'"h\x00i"')


@settings(FUZZ, max_examples=150)
@given(
    path=st.sampled_from([CHAT, COMPLETIONS]),
    body=hostile(),
    h=headers(st.sampled_from([KEY_CAPPED, KEY_OPEN])),
)
async def test_hostile_bytes_are_refused_cleanly(
    stack: Stack, path: str, body: bytes, h: dict
) -> None:
    await exchange(stack, path, body, h)


# -- deterministic edges ---------------------------------------------------------------------------
@pytest.mark.parametrize("key", [KEY_CAPPED, KEY_OPEN])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "depth, status", [(250, 200), (253, 200), (254, 400), (600, 400), (1023, 400), (1024, 400)]
)
async def test_deep_nesting_is_forwarded_or_refused_never_a_500(
    stack: Stack, key: str, stream: bool, depth: int, status: int
) -> None:
    # A top-level object holding `depth` nested lists: depth + 1 levels. orjson re-serializes at
    # most 254, and the gateway re-serializes every streamed or capped body, so a body it accepts
    # must stay within that whatever the tenant.
    body = _with(b"x", _nest(depth, b"["), stream=stream)
    r = await exchange(stack, CHAT, body, {"authorization": f"Bearer {key}"}, stream=stream)
    assert r.status == status, r.body[:300]


deep_json = st.recursive(
    json_scalar,
    lambda c: (
        st.lists(c, min_size=1, max_size=2) | st.dictionaries(short, c, min_size=1, max_size=2)
    ),
    max_leaves=400,
)


def _depth(v: Any) -> int:
    if isinstance(v, dict):
        return 1 + max(map(_depth, v.values()), default=0)
    if isinstance(v, list):
        return 1 + max(map(_depth, v), default=0)
    return 0


@settings(FUZZ, max_examples=200)
@given(extra=deep_json, depth=st.integers(1, 400), path=st.sampled_from([CHAT, COMPLETIONS]))
async def test_parse_request_accepts_exactly_what_can_be_serialized_again(
    extra: Any, depth: int, path: str
) -> None:
    # The gateway re-serializes accepted bodies (stream usage, tenant caps, cache salts), so it
    # must refuse what orjson cannot write back, and nothing else.
    body: dict[str, Any] = {"model": MODEL, "x": extra}
    body.update(
        {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "p"}
    )
    raw = orjson.dumps(body)[:-1] + b',"deep":' + _nest(depth, b"[") + b"}"
    levels = max(_depth(body), 1 + depth)
    try:
        req = parse_request(path, raw)
    except APIError as e:
        assert e.status == 400 and levels > MAX_DEPTH, (levels, e.message)
        return
    assert levels <= MAX_DEPTH
    orjson.dumps(req.data)


async def test_ten_thousand_nested_lists_is_a_400(stack: Stack) -> None:
    for body in (_nest(10_000, b"["), _with(b"messages", _nest(10_000, b"["))):
        r = await exchange(stack, CHAT, body, {"authorization": f"Bearer {KEY_OPEN}"})
        assert r.status == 400


def _sized_body(total: int) -> bytes:
    """A valid chat body of exactly `total` bytes (one long message)."""
    frame = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": ""}]})
    return frame.replace(b'""', b'"' + b"ab " * ((total - len(frame)) // 3) + b'"').ljust(
        total, b" "
    )


@pytest.mark.parametrize("size", [BODY_LIMIT - 1, BODY_LIMIT])
async def test_a_body_at_the_limit_is_not_refused_for_its_size(stack: Stack, size: int) -> None:
    body = _sized_body(size)
    assert len(body) == size
    r = await exchange(stack, CHAT, body, {"authorization": f"Bearer {KEY_CAPPED}"})
    # 200, or the worker's context-length 400: either way not the gateway's 413.
    assert r.status in (200, 400) and b"request_too_large" not in r.body, r.body[:300]


@pytest.mark.parametrize("chunked", [False, True])
async def test_a_body_over_the_limit_is_a_413(stack: Stack, chunked: bool) -> None:
    body = _sized_body(BODY_LIMIT + 1)
    h = {"authorization": f"Bearer {KEY_CAPPED}"}
    if chunked:  # no content-length: the limit is enforced while reading
        h["transfer-encoding"] = "chunked"
        wire = b"".join(
            b"%x\r\n%s\r\n" % (len(body[i : i + 4096]), body[i : i + 4096])
            for i in range(0, len(body), 4096)
        )
        req = http_request(CHAT, wire + b"0\r\n\r\n", headers=h, content_length=False)
    else:
        req = http_request(CHAT, body, headers=h)
    r = await raw_exchange(stack.port, req)
    assert r.status == 413
    assert assert_openai_error(r.status, r.headers["content-type"], r.body)["code"] == (
        "request_too_large"
    )
    await stack.assert_quiescent()


async def test_a_content_length_over_the_limit_is_refused_before_the_body(stack: Stack) -> None:
    h = {"authorization": f"Bearer {KEY_OPEN}", "content-length": str(BODY_LIMIT * 100)}
    r = await raw_exchange(stack.port, http_request(CHAT, b"{", headers=h, content_length=False))
    assert r.status == 413
    assert_openai_error(r.status, r.headers["content-type"], r.body)
    await stack.assert_quiescent()


@pytest.mark.parametrize(
    "raw",
    [
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: abc\r\n\r\n{}",
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: -5\r\n\r\n{}",
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n"
        b"content-length: 3\r\n\r\n{}",
        b"\x00\x01garbage\r\n\r\n",
    ],
)
async def test_malformed_http_is_a_400_from_the_server(stack: Stack, raw: bytes) -> None:
    # Refused by the HTTP parser before the gateway sees a request; still an OpenAI envelope
    # (gateway.server), and nothing held.
    r = await raw_exchange(stack.port, raw)
    assert r.status == 400
    assert_openai_error(r.status, r.headers.get("content-type", ""), r.body)
    await stack.assert_quiescent()


# -- the client's x-request-id as the quota reservation id -------------------------------------------


async def test_a_request_id_can_be_reused_once_its_request_finished(stack: Stack) -> None:
    h = {"authorization": f"Bearer {KEY_OPEN}", "x-request-id": f"reused-{next(_serial)}"}
    body = _with(b"max_tokens", b"2")
    first = await raw_exchange(stack.port, http_request(CHAT, body, headers=h))
    assert first.status == 200
    await stack.assert_quiescent()
    again = await raw_exchange(stack.port, http_request(CHAT, body, headers=h))
    await stack.assert_quiescent()
    assert again.status == 200, again.body[:300]


async def test_a_shared_request_id_does_not_bypass_max_concurrent(stack: Stack) -> None:
    h = {"authorization": f"Bearer {KEY_OPEN}", "x-request-id": f"shared-{next(_serial)}"}
    body = _with(b"max_tokens", b"200")
    n = MAX_CONCURRENT + 4
    rs = await asyncio.gather(
        *(raw_exchange(stack.port, http_request(CHAT, body, headers=h)) for _ in range(n))
    )
    await stack.assert_quiescent()
    statuses = sorted(r.status for r in rs)
    # Fresh ids give exactly MAX_CONCURRENT 200s and the rest 429 (concurrency).
    assert statuses.count(429) >= n - MAX_CONCURRENT, statuses


async def test_after_the_fuzz_nothing_is_held_and_nothing_failed(stack: Stack) -> None:
    # Its own traffic first, so the checks below hold whether the module's other tests ran
    # before (the whole fuzz) or not (this test alone, or in another order).
    for i in range(16):
        h = {"authorization": f"Bearer {KEY_OPEN if i % 2 else KEY_CAPPED}"}
        prompt = f"after the fuzz {i}-{next(_serial)}: " + "tell me more " * 40
        msgs = [{"role": "user", "content": prompt}]
        body = orjson.dumps({"model": MODEL, "messages": msgs, "stream": i % 3 == 0})
        await exchange(stack, CHAT, body, h, stream=i % 3 == 0, expect_ok=True)
        await exchange(stack, CHAT, NON_OBJECTS[i % len(NON_OBJECTS)], h)
    await stack.assert_quiescent()
    m = stack.metrics()
    bad = {
        k: v
        for k, v in m.items()
        if v
        and k.endswith("}")
        and (
            (k.startswith("kvgate_rejected_requests_total") and 'reason="5' in k)
            or (k.startswith("kvgate_requests_total") and 'status="5' in k)
        )
    }
    assert not bad, bad
    for tenant in ("capped", "open"):
        assert (await stack.gw.quota.shared.usage(tenant))["in_flight"] == 0
    # Both workers served traffic, so the walk was exercised end to end on each.
    served = {
        k for k, v in m.items() if k.startswith("kvgate_requests_total") and 'status="200"' in k
    }
    assert any('worker="w0"' in k for k in served) and any('worker="w1"' in k for k in served)
