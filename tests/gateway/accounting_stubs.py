"""Stand-in vLLM workers and a limited tenant for the token-accounting tests (usage shapes a
real vLLM does not send: missing, null, negative).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from typing import Any

import orjson

from gateway.config import Settings
from gateway.usage import UsageSink
from tests.gateway.conftest import MODEL, settings_for, stub_app

KEY = "kvg-review-tokens"


class RecordedSink:
    """The gateway's usage sink (a JSONL file or the Redis stream), each record kept here too:
    written after the quota settlement, so one here means the store has it."""

    def __init__(self, sink: UsageSink) -> None:
        self.sink = sink
        self.records: list[dict[str, Any]] = []

    async def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        await self.sink.write(record)

    async def close(self) -> None:
        await self.sink.close()


def tenant_settings(urls: list[str], quota: dict[str, Any], **tenant: Any) -> Settings:
    base = settings_for(urls, quota=quota, probes={"interval_s": 0.2, "timeout_s": 1.0})
    data = base.model_dump()
    data["tenants"] = {
        "t": {
            "keys_sha256": [hashlib.sha256(KEY.encode()).hexdigest()],
            "rpm": 600,
            "tpm": 100_000,
            "max_concurrent": 1,
            **tenant,
        }
    }
    return Settings(**data)


HEADERS = {"authorization": f"Bearer {KEY}"}


def chat_body(stream: bool, **extra: Any) -> bytes:
    return orjson.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 8,
            "stream": stream,
            **extra,
        }
    )


def ev(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


ROLE = ev(
    {
        "id": "chatcmpl-r",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
    }
)


def content(text: str, finish: str | None = None) -> bytes:
    return ev(
        {
            "id": "chatcmpl-r",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": MODEL,
            "choices": [
                {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
            ],
        }
    )


def usage_chunk(prompt: int, completion: int, cached: int = 0) -> bytes:
    return ev(
        {
            "id": "chatcmpl-r",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": MODEL,
            "choices": [],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached},
            },
        }
    )


DONE = b"data: [DONE]\n\n"


def streaming_worker(
    events_before: list[bytes], events_after: list[bytes], gate: asyncio.Event | None = None
) -> Any:
    """A vLLM stand-in streaming `events_before`, then (once `gate` is set) `events_after`."""
    from starlette.requests import Request
    from starlette.responses import StreamingResponse

    async def chat(request: Request) -> Any:
        await request.body()

        async def gen():  # type: ignore[no-untyped-def]
            for e in events_before:
                yield e
            if gate is not None:
                await gate.wait()
            for e in events_after:
                yield e

        return StreamingResponse(gen(), media_type="text/event-stream; charset=utf-8")

    return stub_app(chat)


def whole_worker(make: Callable[[dict[str, Any]], tuple[int, dict[str, Any]]]) -> Any:
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    async def chat(request: Request) -> Any:
        status, doc = make(orjson.loads(await request.body()))
        return JSONResponse(doc, status_code=status)

    return stub_app(chat)


def completion_doc(usage: Any = None) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "id": "chatcmpl-w",
        "object": "chat.completion",
        "created": 1,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "a reasonably long answer " * 4},
                "finish_reason": "length",
            }
        ],
    }
    if usage is not None:
        doc["usage"] = usage
    return doc


async def wait_for(pred: Callable[[], Any], timeout: float) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        if await pred():
            return True
        await asyncio.sleep(0.05)
    return bool(await pred())
