"""The gateway in front of two real vLLM servers, through the official `openai` client.

"Relayed intact" is checked against the truth: the same deterministic request (greedy decoding,
`ignore_eos`, a prompt shorter than one KV block so no prefix-cache hit can differ) is sent to the
worker the gateway chose, directly, and the two parsed responses must be equal apart from the
fields vLLM makes unique per request (`id`, `created`, `system_fingerprint`). For streams, vLLM
itself decides how tokens are cut into events (a busy server merges several tokens into one
delta), so streams are compared as the sequence of their content, first and last events.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.gateway.conftest import RunningGateway
from tests.integration.conftest import MAX_MODEL_LEN, MODEL, VllmFleet, openai_client

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "user", "content": "Explain how a hash map works."}]
PROMPT = "Once upon a time"
# Greedy and fixed-length: identical output on every worker, every run.
SAMPLING: dict[str, Any] = {"temperature": 0.0, "max_tokens": 8}
EXTRA: dict[str, Any] = {"ignore_eos": True}
UNIQUE = {"id", "created", "system_fingerprint"}
# ~1,700 tokens of words the tiny tokenizer knows: over the 1,024-token context.
TOO_LONG = " ".join(f"word{i} token{i} value{i}" for i in range(180))


def _dump(obj: Any) -> Any:
    return obj.model_dump(exclude=UNIQUE)


async def _call(
    client: openai.AsyncOpenAI, kind: str, stream: bool, **kw: Any
) -> tuple[dict[str, str], list[Any]]:
    """One chat or completions call; returns (response headers, parsed chunks or [response]).

    `kw` overrides the defaults (including `messages`/`prompt`).
    """
    api = client.chat.completions if kind == "chat" else client.completions
    args: dict[str, Any] = {"model": MODEL, **SAMPLING, "extra_body": EXTRA}
    args |= {"messages": MESSAGES} if kind == "chat" else {"prompt": PROMPT}
    args |= kw
    if stream:
        args["stream"] = True
    async with api.with_streaming_response.create(**args) as resp:
        headers = dict(resp.headers)
        parsed = await resp.parse()
        items = [c async for c in parsed] if stream else [parsed]
    return headers, items


async def _call_direct(
    fleet: VllmFleet, worker: str, kind: str, stream: bool, **kw: Any
) -> list[Any]:
    """The same call straight to one worker: the reference the relayed response must equal."""
    async with openai_client(fleet.worker(worker).url) as direct:
        return (await _call(direct, kind, stream, **kw))[1]


def _summary(kind: str, chunks: list[Any]) -> dict[str, Any]:
    """What a stream means, independent of how the server cut it into events."""
    pieces = [
        (c.choices[0].delta.content if kind == "chat" else c.choices[0].text) or ""
        for c in chunks
        if c.choices
    ]
    return {
        "text": "".join(pieces),
        "finish": [
            c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
        ],
        "first": _dump(chunks[0]) | {"choices": None}
        if kind == "completions"
        else _dump(chunks[0]),
        "usage": [_dump(c) for c in chunks if c.usage is not None],
        "objects": {c.object for c in chunks},
    }


async def test_models_are_the_union_of_the_real_workers(client: openai.AsyncOpenAI) -> None:
    page = await client.models.list()
    assert [m.id for m in page.data] == [MODEL]  # two workers, one model, listed once
    card = page.data[0].model_dump()
    assert card["owned_by"] == "vllm" and card["max_model_len"] == MAX_MODEL_LEN


@pytest.mark.parametrize("kind", ["chat", "completions"])
@pytest.mark.parametrize("usage", [True, False], ids=["usage", "no-usage"])
async def test_stream_is_relayed_intact(
    client: openai.AsyncOpenAI, fleet: VllmFleet, kind: str, usage: bool
) -> None:
    rid = f"it-{uuid.uuid4().hex[:12]}"
    opts = {"stream_options": {"include_usage": True}} if usage else {}
    headers, chunks = await _call(client, kind, True, extra_headers={"x-request-id": rid}, **opts)
    worker = headers["x-kvgate-worker"]
    assert headers["x-request-id"] == rid  # the client's id, echoed
    assert worker in {w.name for w in fleet.workers}
    # The real worker knew the request by the gateway's own id (clients reuse theirs): vLLM
    # builds response ids from it.
    ours = headers["x-kvgate-request-id"]
    assert ours != rid and all(ours in c.id for c in chunks), [c.id for c in chunks]

    direct = await _call_direct(fleet, worker, kind, True, **opts)
    got, want = _summary(kind, chunks), _summary(kind, direct)
    assert got == want
    text, finish = got["text"], got["finish"]
    assert text and finish == ["length"]
    if kind == "chat":
        assert chunks[0].choices[0].delta.role == "assistant"
    if usage:
        last = chunks[-1]
        assert last.choices == [] and last.usage is not None
        assert last.usage.completion_tokens == SAMPLING["max_tokens"]
        assert last.usage.prompt_tokens > 0
        assert last.usage.prompt_tokens_details.cached_tokens == 0  # shorter than one block
    else:
        # The gateway forced include_usage upstream for accounting and stripped it again.
        assert all(c.usage is None and c.choices for c in chunks)


@pytest.mark.parametrize("kind", ["chat", "completions"])
async def test_non_streaming_is_relayed_intact(
    client: openai.AsyncOpenAI, fleet: VllmFleet, kind: str
) -> None:
    headers, (resp,) = await _call(client, kind, False)
    (direct,) = await _call_direct(fleet, headers["x-kvgate-worker"], kind, False)
    assert _dump(resp) == _dump(direct)
    assert resp.usage.completion_tokens == SAMPLING["max_tokens"]
    assert resp.usage.prompt_tokens_details.cached_tokens == 0
    assert resp.choices[0].finish_reason == "length"


async def test_sse_framing_from_real_vllm_survives_the_relay(gateway: RunningGateway) -> None:
    """Below the client library: every event is `data: <json>\\n\\n`, the last `data: [DONE]`."""
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, **SAMPLING, **EXTRA}
    async with (
        httpx.AsyncClient(timeout=60) as c,
        c.stream("POST", gateway.url + "/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
        raw = b"".join([part async for part in r.aiter_raw()])
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    for ev in events[:-2]:
        assert ev.startswith(b"data: {") and b"\n" not in ev
        assert orjson.loads(ev[6:])["object"] == "chat.completion.chunk"


async def test_unknown_model_is_a_404_from_the_gateway(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    resp = info.value.response
    assert resp.status_code == 404
    assert "x-kvgate-worker" not in resp.headers  # refused before any worker was asked
    assert resp.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
@pytest.mark.parametrize("kind", ["chat", "completions"])
async def test_too_long_prompt_400_is_vllms_own(
    client: openai.AsyncOpenAI, fleet: VllmFleet, kind: str, stream: bool
) -> None:
    """vLLM rejects over-context prompts before streaming; the gateway passes status and body."""
    content: dict[str, Any] = (
        {"messages": [{"role": "user", "content": TOO_LONG}]}
        if kind == "chat"
        else {"prompt": TOO_LONG}
    )
    with pytest.raises(openai.BadRequestError) as info:
        await _call(client, kind, stream, **content)
    resp = info.value.response
    worker = resp.headers["x-kvgate-worker"]  # it came from a worker, not from the gateway
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    body = {"model": MODEL, **content, **SAMPLING, "stream": stream}
    async with httpx.AsyncClient(timeout=60) as c:
        direct = await c.post(fleet.worker(worker).url + path, json=body)
    assert resp.status_code == direct.status_code == 400
    assert resp.json() == direct.json()
    err = resp.json()["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400
    assert str(MAX_MODEL_LEN) in err["message"]
