"""A stream cut before its usage chunk is charged what the worker generated, not one token per
SSE event.

Review finding: vLLM sends one event for many tokens when it merges a lagging stream's deltas (a
client that reads slowly makes it lag), and none at all for reasoning it hides
(`include_reasoning: false`). A client that hung up before the usage chunk was charged its
prompt estimate plus (events - 2): 2,000 generated tokens in 5 events cost 9 tokens. The
gateway now asks every worker for continuous usage (`stream_options.continuous_usage_stats`),
keeps the last usage an event carried and strips it again for clients that did not ask; a
stream whose output is hidden is charged its reservation when cut.

Worker: an in-process stand-in with vLLM 0.32's wire shape (usage after `choices` in each
content event when continuous usage is asked for).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from tests.gateway.conftest import (
    MODEL,
    keyed_settings,
    last_usage,
    run_gateway,
    serve_app,
    stub_app,
)

KEY = "kvg-cut-stream"
PROMPT = 9
MERGED = 400  # tokens per content event
EVENTS = 5
HIDDEN = 2_000  # reasoning tokens no event shows
MAX_TOKENS = 4_096


def event(delta: dict[str, Any], usage: dict[str, int] | None, finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    body: dict[str, Any] = {
        "id": "chatcmpl-x",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": MODEL,
        "choices": [choice],
    }
    if usage is not None:
        body["usage"] = usage
    return b"data: " + orjson.dumps(body) + b"\n\n"


def usage(completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": PROMPT,
        "total_tokens": PROMPT + completion,
        "completion_tokens": completion,
    }


def worker(seen: list[dict[str, Any]]) -> Any:
    """Role event, then (hidden reasoning: a pause where no event is sent) content events of
    MERGED tokens each, then a long pause before the finish and usage chunks."""

    async def chat(request: Request) -> Response:
        body = orjson.loads(await request.body())
        seen.append(body)
        opts = body.get("stream_options") or {}
        live = opts.get("include_usage") is True and opts.get("continuous_usage_stats") is True
        hidden = body.get("include_reasoning") is False

        async def gen() -> AsyncIterator[bytes]:
            n = 0
            yield event({"role": "assistant", "content": ""}, usage(n) if live else None)
            if hidden:
                await asyncio.sleep(0.2)
                n += HIDDEN
            for _ in range(EVENTS):
                n += MERGED
                yield event({"content": " tok" * MERGED}, usage(n) if live else None)
                await asyncio.sleep(0.05)
            await asyncio.sleep(30)  # the client hangs up in here
            yield event({"content": ""}, usage(n) if live else None, "stop")
            yield b"data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    return stub_app(chat)


async def cut_after_events(g: Any, **extra: Any) -> bytes:
    """Send a stream, read EVENTS content events, hang up; what the client had received."""
    body = orjson.dumps(
        {
            "model": MODEL,
            "stream": True,
            "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": "count"}],
            **extra,
        }
    )
    host, port = g.url.removeprefix("http://").split(":")
    r, w = await asyncio.open_connection(host, int(port))
    w.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"authorization: Bearer {KEY}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await w.drain()
    got = b""
    while got.count(b" tok" * MERGED) < EVENTS:
        data = await asyncio.wait_for(r.read(65536), 10)
        assert data, got
        got += data
    w.transport.abort()
    return got


async def run_cut(tmp_path: Path, **extra: Any) -> tuple[dict[str, Any], bytes, dict[str, Any]]:
    """(the usage record, what the client received, the body the worker got)."""
    seen: list[dict[str, Any]] = []
    usage_file = tmp_path / "usage.jsonl"
    async with serve_app(worker(seen)) as url:
        limits = {"tpm": 1_000_000, "max_output_tokens": MAX_TOKENS}
        async with run_gateway(keyed_settings([url], KEY, usage_file, limits)) as g:
            await g.wait_healthy(1)
            got = await cut_after_events(g, **extra)
            rec = await last_usage(usage_file)
    return rec, got, seen[-1]


async def test_a_cut_stream_of_merged_deltas_is_charged_the_tokens_generated(
    tmp_path: Path,
) -> None:
    rec, got, sent = await run_cut(tmp_path)
    assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert rec["outcome"] == "client_disconnect"
    # Before the fix: the prompt estimate + (6 events - 2) = 9 tokens for 2,000 generated.
    assert rec["charged_tokens"] >= PROMPT + EVENTS * MERGED, rec
    assert b'"usage"' not in got  # the client asked for no usage: none of it reaches it


@pytest.mark.parametrize(
    ("options", "inline"),
    [
        ({"include_usage": True}, False),
        ({"include_usage": True, "continuous_usage_stats": True}, True),
    ],
)
async def test_a_client_gets_the_usage_it_asked_for(
    tmp_path: Path, options: dict[str, bool], inline: bool
) -> None:
    rec, got, sent = await run_cut(tmp_path, stream_options=options)
    assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert (got.count(b'"usage":{') == EVENTS + 1) is inline, got[:400]
    if not inline:
        assert b'"usage"' not in got
    assert rec["charged_tokens"] >= PROMPT + EVENTS * MERGED, rec


async def test_a_cut_stream_with_hidden_reasoning_is_charged_its_reservation(
    tmp_path: Path,
) -> None:
    rec, _got, sent = await run_cut(tmp_path, include_reasoning=False)
    assert sent["include_reasoning"] is False
    # The worker generated HIDDEN + 2,000 tokens, five events' worth of them visible: charged
    # as much as the request could have generated (the output cap is in the reservation).
    assert rec["charged_tokens"] >= MAX_TOKENS, rec
