"""The official `openai` client talks to the simulator unchanged, as it does to vLLM.

This is the end-user view of "byte-compatible": the SDK's strict pydantic types must parse every
chunk, map our error envelopes to its exception classes, and find usage where vLLM puts it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest

from tests.support.sim_workers import SimFleet

MODEL = "sim-llama"


@pytest.fixture
async def oai(sim_fleet: SimFleet) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(base_url=f"{sim_fleet[0]}/v1", api_key="sk-sim", max_retries=0)
    try:
        yield client
    finally:
        await client.close()


async def test_openai_streams_chat_with_usage(oai: openai.AsyncOpenAI) -> None:
    stream = await oai.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colors."},
        ],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    content_chunks = [c for c in chunks if c.choices]
    assert content_chunks[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert len(text.split()) == 6
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    assert usage.completion_tokens == 6
    assert usage.total_tokens == usage.prompt_tokens + 6
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")


async def test_openai_streams_chat_without_usage_by_default(oai: openai.AsyncOpenAI) -> None:
    stream = await oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
    )
    chunks = [c async for c in stream]
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_openai_streams_completions(oai: openai.AsyncOpenAI) -> None:
    stream = await oai.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    text_chunks = [c for c in chunks if c.choices]
    assert len("".join(c.choices[0].text for c in text_chunks).split()) == 5
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5


async def test_openai_non_streaming_and_cached_tokens(oai: openai.AsyncOpenAI) -> None:
    prompt = "Summarize the following. " + "Routing only matters where caches are reused. " * 30
    first = await oai.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    again = await oai.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage is not None and again.usage is not None
    assert first.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0

    chat = await oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4
    )
    assert chat.choices[0].message.role == "assistant"
    assert len((chat.choices[0].message.content or "").split()) == 4
    assert chat.choices[0].finish_reason == "length"


async def test_openai_maps_error_envelopes(oai: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        await oai.chat.completions.create(
            model="missing", messages=[{"role": "user", "content": "x"}], max_tokens=1
        )
    assert nf.value.status_code == 404
    with pytest.raises(openai.BadRequestError):
        await oai.completions.create(model=MODEL, prompt=[1] * 40000, max_tokens=1, stream=True)
    models = await oai.models.list()
    assert [m.id for m in models.data] == [MODEL]
