import orjson
import pytest

from gateway.errors import APIError
from gateway.validate import CHAT, COMPLETIONS, parse_request

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
    assert sent["stream_options"] == {"include_usage": True}
    assert sent["top_k"] == 5
    assert r.stream and not r.client_wants_usage


def test_stream_with_usage_requested_is_left_alone() -> None:
    raw = body(model="m", prompt="x", stream=True, stream_options={"include_usage": True})
    r = parse_request(COMPLETIONS, raw)
    assert r.client_wants_usage and not r.modified


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
        (CHAT, body(model="m", messages=[{"content": "x"}]), "messages"),
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
