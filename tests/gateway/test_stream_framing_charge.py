"""Streams framed or ended in ways the byte scan once missed are relayed as whole events and
charged for what the worker did.

Review findings:
* A worker framing its events with CRLF or CR (valid SSE; sse-starlette writes CRLF) had no
  event found in its whole stream: it reached the client raw with the usage it never asked for
  and a second [DONE], and was charged nothing (its request count too).
* A stream cut in the middle of an event sent the half event to the client: the OpenAI SDK
  parsed it, raised a JSONDecodeError and never read the error event after it.
* A usage object without its counts (`{}`, `{"total_tokens": 25}`) was read as 0 and 0: the
  request was free.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.call import Usage
from tests.gateway.conftest import MODEL, keyed_settings, last_usage, run_gateway
from tests.support.raw_worker import Script, raw_worker

KEY = "kvg-framing"
PROMPT, TOKENS, MAX_TOKENS = 5, 20, 50
HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)


def event(delta: dict[str, Any], usage: dict[str, Any] | None = None, live: bool = True) -> bytes:
    body: dict[str, Any] = {
        "id": "chatcmpl-x",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]
        if delta
        else [],
    }
    if usage is not None:
        body["usage"] = usage
    return b"data: " + orjson.dumps(body) + b"\n\n"


def counts(n: int) -> dict[str, int]:
    return {"prompt_tokens": PROMPT, "completion_tokens": n, "total_tokens": PROMPT + n}


def stream_events(final_usage: dict[str, Any] | None) -> list[bytes]:
    """vLLM's shape with live usage: role, TOKENS content events, the usage chunk, [DONE]."""
    out = [event({"role": "assistant", "content": ""}, counts(0))]
    out += [event({"content": " tok"}, counts(i + 1)) for i in range(TOKENS)]
    out += [event({}, final_usage), b"data: [DONE]\n\n"]
    return out


def script(writes: list[bytes]) -> Script:
    async def run(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(HEAD)
        for x in writes:
            w.write(b"%x\r\n%b\r\n" % (len(x), x))
            await w.drain()
            await asyncio.sleep(0.001)  # one read each
        w.write(b"0\r\n\r\n")
        await w.drain()

    return run


def dechunk(raw: bytes) -> bytes:
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower(), head
    out = b""
    while True:
        line, _, rest = rest.partition(b"\r\n")
        n = int(line, 16)
        if n == 0:
            return out
        out += rest[:n]
        rest = rest[n + 2 :]


async def run(
    tmp_path: Path,
    writes: list[bytes],
    stream: bool = True,
    metrics: dict[str, float] | None = None,
) -> tuple[dict, bytes]:
    """(the usage record, the body the client received); ``metrics`` gets the gateway's."""
    usage_file = tmp_path / "usage.jsonl"
    async with raw_worker(script(writes)) as (url, _posts):
        limits = {"tpm": 100_000, "max_output_tokens": MAX_TOKENS}
        timeouts = {"first_byte_s": 5, "idle_s": 5, "total_s": 15}
        s = keyed_settings([url], KEY, usage_file, limits, timeouts=timeouts)
        async with run_gateway(s) as g:
            await g.wait_healthy(1)
            body = orjson.dumps(
                {
                    "model": MODEL,
                    "stream": stream,
                    "max_tokens": MAX_TOKENS,
                    "messages": [{"role": "user", "content": "hi there"}],
                }
            )
            host, port = g.url.removeprefix("http://").split(":")
            r, w = await asyncio.open_connection(host, int(port))
            w.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
                + f"authorization: Bearer {KEY}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
                + body
            )
            got = await asyncio.wait_for(r.read(), 20)
            w.close()
            rec = await last_usage(usage_file)
            assert all(wk.in_flight == 0 for wk in g.gw.registry.workers.values())
            if metrics is not None:
                metrics.update(await g.metrics())
    return rec, got


def reframe(events: list[bytes], eol: bytes) -> list[bytes]:
    """The same events with ``eol`` line ends, each CRLF split over two reads where it can be."""
    out: list[bytes] = []
    for e in events:
        e = e.replace(b"\n", eol)
        if eol == b"\r\n":
            cut = e.index(b"\r\n") + 1  # between the CR and the LF of the data line's end
            out += [e[:cut], e[cut:]]
        else:
            out.append(e)
    return out


@pytest.mark.parametrize("eol", [b"\r\n", b"\r"], ids=["crlf", "cr"])
async def test_events_framed_with_cr_are_relayed_as_events_and_charged(
    tmp_path: Path, eol: bytes
) -> None:
    rec, got = await run(tmp_path, reframe(stream_events(counts(TOKENS)), eol))
    body = dechunk(got)
    assert rec["outcome"] == "ok" and rec["charged_tokens"] == PROMPT + TOKENS, rec
    assert body.count(b"data: [DONE]") == 1 and body.endswith(b"data: [DONE]\n\n"), body[-200:]
    assert b"\r" not in body and b'"usage"' not in body  # the client asked for no usage
    events = [e for e in body.split(b"\n\n") if e]
    assert len(events) == TOKENS + 2  # role + content + [DONE]: the usage chunk is dropped
    assert body.count(b" tok") == TOKENS


async def test_a_stream_cut_mid_event_drops_the_half_event_before_the_error(
    tmp_path: Path,
) -> None:
    full = stream_events(counts(TOKENS))
    half = full[3][: len(full[3]) // 2]
    rec, got = await run(tmp_path, [*full[:3], half])
    body = dechunk(got)
    events = [e for e in body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and b'"error"' in events[-2], events[-2:]
    for e in events[:-1]:  # every event but [DONE] is whole JSON
        orjson.loads(e.removeprefix(b"data: "))
    assert len(events) == 5  # role, two content events, the error, [DONE]
    assert rec["outcome"] == "upstream_broken" and rec["charged_tokens"] >= PROMPT + 2, rec


async def test_a_json_answer_to_a_stream_is_charged_the_prompt(tmp_path: Path) -> None:
    """Not SSE at all: no event to relay; the worker had the prompt, so it is not free."""
    answer = {"id": "c", "object": "chat.completion", "choices": [], "usage": counts(TOKENS)}
    rec, got = await run(tmp_path, [orjson.dumps(answer)])
    body = dechunk(got)
    assert b'"prompt_tokens"' not in body and b'"error"' in body, body
    assert rec["outcome"] == "upstream_broken" and rec["charged_tokens"] >= PROMPT, rec


@pytest.mark.parametrize("final", [{}, {"total_tokens": 25}], ids=["empty", "total-only"])
async def test_a_final_usage_without_counts_leaves_the_live_usage_to_charge(
    tmp_path: Path, final: dict[str, Any]
) -> None:
    rec, _got = await run(tmp_path, stream_events(final))
    assert rec["charged_tokens"] >= PROMPT + TOKENS, rec


@pytest.mark.parametrize(
    "u",
    [
        {},
        {"total_tokens": 25},
        {"prompt_tokens": 5},
        {"completion_tokens": 3},
        {"prompt_tokens": None, "completion_tokens": 2},
    ],
)
def test_a_usage_without_both_counts_is_no_usage(u: dict[str, Any]) -> None:
    assert Usage.from_json(u) is None
    assert Usage.from_json({"prompt_tokens": 5, "completion_tokens": 3}) == Usage(5, 3, 0)


@pytest.mark.parametrize("together", [False, True], ids=["two-reads", "one-read"])
async def test_an_in_band_error_event_is_relayed_and_recorded_as_one(
    tmp_path: Path, together: bool
) -> None:
    """vLLM's error after the first byte (`data: {"error": ...}`, then [DONE]) was recorded
    `ok`, counted in no metric and taken as the worker's success."""
    full = stream_events(counts(TOKENS))
    err = b'data: {"error": {"message": "engine failed", "type": "InternalServerError"}}\n\n'
    metrics: dict[str, float] = {}
    done = b"data: [DONE]\n\n"
    writes = [*full[:3], *([err + done] if together else [err, done])]
    rec, got = await run(tmp_path, writes, metrics=metrics)
    body = dechunk(got)
    assert err in body and body.endswith(b"data: [DONE]\n\n")
    assert rec["outcome"] == "upstream_error_event" and rec["charged_tokens"] >= PROMPT + 2, rec
    assert metrics['kvgate_stream_errors_total{reason="upstream_error_event"}'] == 1
