import orjson
import pytest

from gateway.errors import APIError
from gateway.validate import CHAT, COMPLETIONS, parse_request, request_headers

MSG = [{"role": "user", "content": "hi"}]


def body(**kw: object) -> bytes:
    return orjson.dumps(kw)


def test_non_stream_body_is_forwarded_byte_for_byte_with_unknown_fields() -> None:
    raw = b'{"model": "m", "messages": [{"role":"user","content":"hi"}], "ignore_eos": true}'
    r = parse_request(CHAT, raw)
    assert not r.modified and r.model == "m" and not r.stream
    assert r.data["ignore_eos"] is True


def test_stream_forces_usage_upstream_and_remembers_the_client_did_not_ask() -> None:
    r = parse_request(CHAT, body(model="m", messages=MSG, stream=True, top_k=5))
    assert r.modified
    sent = r.data
    assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert sent["top_k"] == 5
    assert r.stream and not r.client_wants_usage and not r.client_wants_live_usage


def test_stream_with_usage_requested_still_gets_it_on_every_event_upstream() -> None:
    raw = body(model="m", prompt="x", stream=True, stream_options={"include_usage": True})
    r = parse_request(COMPLETIONS, raw)
    assert r.client_wants_usage and not r.client_wants_live_usage and r.modified
    assert r.data["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


def test_without_tenants_only_the_final_usage_is_asked_for() -> None:
    r = parse_request(CHAT, body(model="m", messages=MSG, stream=True), live_usage=False)
    assert r.modified and r.data["stream_options"] == {"include_usage": True}
    raw = body(model="m", prompt="x", stream=True, stream_options={"include_usage": True})
    assert not parse_request(COMPLETIONS, raw, live_usage=False).modified


def test_stream_with_both_usages_requested_is_left_alone() -> None:
    opts = {"include_usage": True, "continuous_usage_stats": True}
    r = parse_request(COMPLETIONS, body(model="m", prompt="x", stream=True, stream_options=opts))
    assert r.client_wants_usage and r.client_wants_live_usage and not r.modified


@pytest.mark.parametrize(
    "path, raw, param",
    [
        (CHAT, b"", None),
        (CHAT, b"{not json", None),
        (CHAT, b"\xff\xfe{}", None),
        (CHAT, b"[1,2]", None),
        (CHAT, body(messages=MSG), "model"),
        (CHAT, body(model=3, messages=MSG), "model"),
        (CHAT, body(model="m"), "messages"),
        (CHAT, body(model="m", messages="hi"), "messages"),
        (CHAT, body(model="m", messages=[{"content": "x"}]), "messages[0].role"),
        (CHAT, body(model="m", messages=MSG, stream="yes"), "stream"),
        (CHAT, body(model="m", messages=MSG, max_tokens=0), "max_tokens"),
        (CHAT, body(model="m", messages=MSG, max_tokens=True), "max_tokens"),
        (CHAT, body(model="m", messages=MSG, max_tokens=1.5), "max_tokens"),
        (
            CHAT,
            body(model="m", messages=MSG, stream_options={"include_usage": True}),
            "stream_options",
        ),
        (CHAT, body(model="m", messages=MSG, stream=True, stream_options=[1]), "stream_options"),
        (COMPLETIONS, body(model="m"), "prompt"),
        (COMPLETIONS, body(model="m", prompt=[]), "prompt"),
        (COMPLETIONS, body(model="m", prompt=[1, "a"]), "prompt"),
        (COMPLETIONS, body(model="m", prompt=[-1]), "prompt"),
        (COMPLETIONS, body(model="m", prompt={"a": 1}), "prompt"),
    ],
)
def test_bad_bodies_are_400_with_the_param(path: str, raw: bytes, param: str | None) -> None:
    with pytest.raises(APIError) as ei:
        parse_request(path, raw)
    assert ei.value.status == 400
    assert ei.value.param == param
    err = orjson.loads(ei.value.body())["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]


@pytest.mark.parametrize("prompt", ["text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_all_prompt_forms_vllm_accepts_are_accepted(prompt: object) -> None:
    assert parse_request(COMPLETIONS, body(model="m", prompt=prompt)).model == "m"


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def chat_body(**kw: object) -> bytes:
    return body(model="m", messages=MSG, **kw)


def msgs(*m: object) -> bytes:
    return body(model="m", messages=list(m))


# What OpenAI (and vLLM, for most) answer with a 400 must not reach a worker,
# and the error names the offending field as OpenAI does.
@pytest.mark.parametrize(
    "path, raw, param",
    [
        (CHAT, msgs({"role": "user", "content": 123}), "messages[0].content"),
        (CHAT, msgs({"role": "user", "content": {"text": "x"}}), "messages[0].content"),
        (CHAT, msgs({"role": "user", "content": True}), "messages[0].content"),
        (CHAT, msgs({"role": "user", "content": None}), "messages[0].content"),
        (CHAT, msgs({"role": "user"}), "messages[0].content"),
        (CHAT, msgs({"role": "system", "content": None}), "messages[0].content"),
        (
            CHAT,
            msgs({"role": "tool", "content": None, "tool_call_id": "c1"}),
            "messages[0].content",
        ),
        (CHAT, msgs({"role": "assistant", "content": None}), "messages[0].content"),
        (CHAT, msgs({"role": "user", "content": [1]}), "messages[0].content[0]"),
        (CHAT, msgs({"role": "user", "content": [{"text": "x"}]}), "messages[0].content[0]"),
        (CHAT, msgs({"role": "user", "content": [{"type": 1}]}), "messages[0].content[0]"),
        (
            CHAT,
            msgs({"role": "user", "content": [{"type": "text", "text": 5}]}),
            "messages[0].content[0].text",
        ),
        (CHAT, msgs({"role": "wizard", "content": "x"}), "messages[0].role"),
        (CHAT, msgs({"role": "USER", "content": "x"}), "messages[0].role"),
        (CHAT, msgs({"role": 1, "content": "x"}), "messages[0].role"),
        (CHAT, msgs({"role": ["user"], "content": "x"}), "messages[0].role"),
        (CHAT, msgs({"role": {"a": 1}, "content": "x"}), "messages[0].role"),
        (CHAT, msgs(*MSG, "hi"), "messages[1]"),
        (CHAT, msgs(*MSG, None), "messages[1]"),
        (
            CHAT,
            msgs(*MSG, {"role": "assistant", "content": None, "tool_calls": "zzz"}),
            "messages[1].tool_calls",
        ),
        (
            CHAT,
            msgs({"role": "assistant", "content": "x", "tool_calls": [1]}),
            "messages[0].tool_calls",
        ),
        (CHAT, msgs({"role": "user", "content": "x", "name": 7}), "messages[0].name"),
        (CHAT, chat_body(temperature=-1), "temperature"),
        (CHAT, chat_body(temperature=2.01), "temperature"),
        (CHAT, chat_body(temperature="hot"), "temperature"),
        (CHAT, chat_body(temperature=True), "temperature"),
        (CHAT, chat_body(top_p=5), "top_p"),
        (CHAT, chat_body(top_p=0), "top_p"),
        (CHAT, chat_body(top_p=-0.5), "top_p"),
        (CHAT, chat_body(top_p=[1]), "top_p"),
        (CHAT, chat_body(presence_penalty=2.5), "presence_penalty"),
        (CHAT, chat_body(presence_penalty=-3), "presence_penalty"),
        (CHAT, chat_body(frequency_penalty=-2.1), "frequency_penalty"),
        (CHAT, chat_body(frequency_penalty="0"), "frequency_penalty"),
        (CHAT, chat_body(n=0), "n"),
        (CHAT, chat_body(n=-1), "n"),
        (CHAT, chat_body(n="3"), "n"),
        (CHAT, chat_body(n=2.0), "n"),
        (CHAT, chat_body(best_of=0), "best_of"),
        (CHAT, chat_body(n=3, best_of=2), "best_of"),
        (CHAT, chat_body(max_completion_tokens=0), "max_completion_tokens"),
        (CHAT, chat_body(max_completion_tokens="5"), "max_completion_tokens"),
        (CHAT, chat_body(tools=[1]), "tools[0]"),
        (CHAT, chat_body(tools="f"), "tools"),
        (CHAT, chat_body(tools={"type": "function"}), "tools"),
        (CHAT, chat_body(tools=[{"type": "function"}]), "tools[0].function"),
        (CHAT, chat_body(tools=[{"type": "function", "function": "f"}]), "tools[0].function"),
        (CHAT, chat_body(tools=[{"function": {"name": ""}}]), "tools[0].function"),
        (CHAT, chat_body(tools=[{"type": 3, "function": {"name": "f"}}]), "tools[0].type"),
        (
            CHAT,
            chat_body(tools=[TOOL, {"type": "function", "function": {"name": 1}}]),
            "tools[1].function",
        ),
        (CHAT, chat_body(stop=1), "stop"),
        (CHAT, chat_body(stop=["a", 1]), "stop"),
        (CHAT, chat_body(stop={"a": "b"}), "stop"),
        (CHAT, chat_body(seed="1"), "seed"),
        (CHAT, chat_body(seed=1.5), "seed"),
        (CHAT, chat_body(seed=2**63), "seed"),
        (CHAT, chat_body(seed=2**64 - 1), "seed"),
        # Beyond 64 bits orjson parses a float.
        (CHAT, chat_body()[:-1] + b',"seed":-9223372036854775809}', "seed"),
        (CHAT, chat_body()[:-1] + b',"temperature":18446744073709551616}', "temperature"),
        (CHAT, chat_body(logprobs=1), "logprobs"),
        (CHAT, chat_body(logprobs="yes"), "logprobs"),
        (CHAT, chat_body(top_logprobs=-1), "top_logprobs"),
        (CHAT, chat_body(top_logprobs=2.5), "top_logprobs"),
        (CHAT, chat_body(top_logprobs=3), "top_logprobs"),
        (CHAT, chat_body(top_logprobs=3, logprobs=False), "top_logprobs"),
        (CHAT, chat_body(use_beam_search="yes"), "use_beam_search"),
        # vLLM reads these spellings as False; the gateway read only `false` so (a stream cut
        # while reasoning was charged the prompt, not the reservation).
        (CHAT, chat_body(include_reasoning=0), "include_reasoning"),
        (CHAT, chat_body(include_reasoning="false"), "include_reasoning"),
        (CHAT, chat_body(add_generation_prompt="no"), "add_generation_prompt"),
        (CHAT, chat_body(continue_final_message=1), "continue_final_message"),
        (CHAT, chat_body(add_special_tokens="off"), "add_special_tokens"),
        (COMPLETIONS, body(model="m", prompt="x", echo="true"), "echo"),
        (
            CHAT,
            chat_body(stream=True, stream_options={"include_usage": "true"}),
            "stream_options",
        ),
        (
            CHAT,
            chat_body(stream=True, stream_options={"continuous_usage_stats": 0}),
            "stream_options",
        ),
        (COMPLETIONS, body(model="m", prompt=""), "prompt"),
        (COMPLETIONS, body(model="m", prompt=["a", ""]), "prompt"),
        (COMPLETIONS, body(model="m", prompt=[""]), "prompt"),
        (COMPLETIONS, body(model="m", prompt=[[]]), "prompt"),
        (COMPLETIONS, body(model="m", prompt=None), "prompt"),
        (COMPLETIONS, body(model="m", prompt="x", logprobs=True), "logprobs"),
        (COMPLETIONS, body(model="m", prompt="x", logprobs=-1), "logprobs"),
        (COMPLETIONS, body(model="m", prompt="x", logprobs=1.5), "logprobs"),
        (COMPLETIONS, body(model="m", prompt="x", temperature=-1), "temperature"),
        (COMPLETIONS, body(model="m", prompt="x", top_p=5), "top_p"),
        (COMPLETIONS, body(model="m", prompt="x", best_of=2, n=3), "best_of"),
        (COMPLETIONS, body(model="m", prompt="x", stop=[None]), "stop"),
        (COMPLETIONS, body(model="m", prompt="x", max_tokens=-5), "max_tokens"),
    ],
)
def test_malformed_fields_are_400_naming_the_field(path: str, raw: bytes, param: str) -> None:
    with pytest.raises(APIError) as ei:
        parse_request(path, raw)
    e = ei.value
    assert e.status == 400 and e.param == param, (e.param, e.message)
    err = orjson.loads(e.body())["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


@pytest.mark.parametrize(
    "path, raw",
    [
        # Boundaries OpenAI accepts.
        (CHAT, chat_body(temperature=0, top_p=1, presence_penalty=-2, frequency_penalty=2)),
        (CHAT, chat_body(temperature=2.0, top_p=1e-9, presence_penalty=2, frequency_penalty=-2)),
        (CHAT, chat_body(seed=2**63 - 1)),
        (CHAT, chat_body(seed=-(2**63))),
        (CHAT, chat_body(n=2, best_of=2, use_beam_search=True)),
        (CHAT, chat_body(include_reasoning=False, add_generation_prompt=True, echo=False)),
        (CHAT, chat_body(continue_final_message=None, add_special_tokens=None)),
        (CHAT, chat_body(stop="x")),
        (CHAT, chat_body(stop=[])),
        (CHAT, chat_body(logprobs=True, top_logprobs=5)),
        (CHAT, chat_body(logprobs=False, top_logprobs=0)),
        # Null means "not set" for every optional field.
        (
            CHAT,
            chat_body(
                temperature=None,
                top_p=None,
                n=None,
                best_of=None,
                seed=None,
                stop=None,
                logprobs=None,
                top_logprobs=None,
                tools=None,
                max_tokens=None,
                max_completion_tokens=None,
                presence_penalty=None,
                frequency_penalty=None,
            ),
        ),
        # Every role, and the content shapes each may have.
        (
            CHAT,
            msgs(
                {"role": "developer", "content": "d"},
                {"role": "system", "content": [{"type": "text", "text": "s"}]},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "u"},
                        {"type": "image_url", "image_url": {"url": "https://x.invalid/a.png"}},
                        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
                    ],
                    "name": "bob",
                },
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "assistant", "tool_calls": [CALL]},
                {"role": "assistant", "content": None, "function_call": {"name": "f"}},
                {"role": "tool", "content": "42", "tool_call_id": "c1"},
                {"role": "function", "name": "f", "content": None},
                {"role": "assistant", "content": ""},
                {"role": "user", "content": []},
            ),
        ),
        (CHAT, chat_body(tools=[TOOL, {"function": {"name": "g"}}], tool_choice="auto")),
        (CHAT, chat_body(tools=[{"type": "custom", "custom": {"name": "c"}}])),
        (CHAT, chat_body(tools=[])),
        (COMPLETIONS, body(model="m", prompt="x", logprobs=0, echo=True, n=2, best_of=3)),
        (COMPLETIONS, body(model="m", prompt=["a", "b", "c"], stop=["\n"], seed=0)),
        # top_logprobs is a chat field: on completions it is an unknown field, passed through.
        (COMPLETIONS, body(model="m", prompt="x", top_logprobs="anything")),
    ],
)
def test_valid_values_at_the_edges_are_accepted(path: str, raw: bytes) -> None:
    r = parse_request(path, raw)
    assert r.data == orjson.loads(raw) and not r.modified


def test_unknown_fields_pass_through_untouched_whatever_they_hold() -> None:
    extra = {
        "ignore_eos": True,
        "top_k": -1,
        "min_p": 0.1,
        "repetition_penalty": 1.2,
        "cache_salt": "s",
        "skip_special_tokens": False,
        "chat_template_kwargs": {"enable_thinking": False},
        "guided_json": {"type": "object"},
        "wizard": [1, {"role": "wizard"}],
        "prompt": 12,  # a chat request's unknown field, even with a completions name
    }
    raw = body(model="m", messages=MSG, **extra)
    r = parse_request(CHAT, raw)
    assert r.data == orjson.loads(raw) and not r.modified
    raw = body(model="m", prompt="p", messages="not checked here", tools=[1], **{"role": 5})
    r = parse_request(COMPLETIONS, raw)
    assert r.data == orjson.loads(raw) and not r.modified


def test_request_headers_are_read_once_by_lower_case_name_the_first_of_repeats() -> None:
    scope = {
        "headers": [
            (b"authorization", b"Bearer a"),
            (b"x-request-id", b"first"),
            (b"x-request-id", b"second"),
            (b"x-caf\xe9", b"\xff"),
        ]
    }
    h = request_headers(scope)
    assert h["authorization"] == "Bearer a" and h["x-request-id"] == "first"  # as Starlette's
    assert h["x-caf\xe9"] == "\xff"  # latin-1 both ways, never a decode error


PD_PARAMS = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1, 2]}


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        (CHAT, chat_body(kv_transfer_params=PD_PARAMS), "kv_transfer_params"),
        (COMPLETIONS, body(model="m", prompt="x", kv_transfer_params={}), "kv_transfer_params"),
        (
            CHAT,
            chat_body(chat_template="{% for i in range(10**6) %}x{% endfor %}"),
            "chat_template",
        ),
    ],
)
def test_engine_control_fields_are_refused_from_clients(path: str, raw: bytes, param: str) -> None:
    # Another tenant's KV blocks on a P/D fleet; a template that renders an uncapped prompt.
    with pytest.raises(APIError) as ei:
        parse_request(path, raw)
    assert ei.value.status == 400 and ei.value.param == param
    assert "not accepted from clients" in ei.value.message


def test_engine_control_fields_unset_or_foreign_to_the_endpoint_pass() -> None:
    raw = chat_body(kv_transfer_params=None, chat_template=None)
    assert parse_request(CHAT, raw).data["kv_transfer_params"] is None
    raw = body(model="m", prompt="x", chat_template="t")  # completions has no template
    assert parse_request(COMPLETIONS, raw).data["chat_template"] == "t"


_LIMIT = 4 * 1024 * 1024
_CHAT_HEAD = '{"model":"m","messages":[{"role":"user","content":"hi"}]'


def _fill(prefix: str, item: str, suffix: str) -> bytes:
    n = (_LIMIT - 64 - len(prefix) - len(suffix)) // (len(item) + 1)
    return (prefix + ",".join([item] * n) + suffix).encode()


@pytest.mark.parametrize(
    ("path", "raw", "why"),
    [
        (COMPLETIONS, _fill('{"model":"m","prompt":[', "[1]", "]}"), "arrays and objects"),
        (COMPLETIONS, _fill('{"model":"m","prompt":[', "1", "]}"), "values"),
        (
            CHAT,
            _fill(_CHAT_HEAD + ',"tools":[{"type":"function","function":{"e":[', "0", "]}}]}"),
            "values",
        ),
        (CHAT, _fill(_CHAT_HEAD + ',"tools":[', '{"function":{"name":"a"}}', "]}"), "strings"),
        (CHAT, _fill(_CHAT_HEAD + ',"x":[', '""', "]}"), "strings"),
        (CHAT, _fill(_CHAT_HEAD + ',"x":{', '"a":1', "}}"), "strings"),
        (CHAT, _fill(_CHAT_HEAD + ',"x":[', "{}", "]}"), "arrays and objects"),
    ],
    ids=["id-lists", "ids", "enum", "tools", "strings", "keys", "objects"],
)
def test_a_body_of_more_values_than_a_request_holds_is_refused_before_parsing(
    path: str, raw: bytes, why: str
) -> None:
    """Review: bodies under the size limit made of tiny values held the event loop 0.5-1.3 s
    (parsed, then walked in Python) and ~25x their size in memory, refused or not."""
    assert len(raw) <= _LIMIT
    with pytest.raises(APIError) as e:
        parse_request(path, raw)
    assert e.value.status == 400 and why in e.value.message, e.value.message


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        # Text full of brackets, commas, colons and escaped quotes: none of them JSON's.
        (
            CHAT,
            orjson.dumps(
                {
                    "model": "m",
                    "messages": [{"role": "user", "content": '[{"a":1},"b"],' * 250_000}],
                }
            ),
        ),
        (COMPLETIONS, orjson.dumps({"model": "m", "prompt": list(range(500_000))})),
        (
            CHAT,
            orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}] * 20_000}),
        ),
    ],
    ids=["text", "token-ids", "messages"],
)
def test_big_bodies_of_ordinary_shape_are_parsed(path: str, raw: bytes) -> None:
    assert len(raw) > 200_000
    assert parse_request(path, raw).model == "m"
