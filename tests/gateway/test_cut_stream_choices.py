"""A cut stream of several choices (a /v1/completions batch of prompts, n > 1) is charged what
every choice generated, each prompt once.

Review finding: vLLM's live usage (`continuous_usage_stats`, which the gateway forces upstream)
counts the event's choice alone, `completion_tokens` that choice's and `prompt_tokens` its
prompt's, and a batch's prompts and a prompt's n choices run as engine requests of their own,
merged as they come. The relay kept the last usage of the stream and settlement charged it times
the choices: a batch whose first prompt had generated 2,000 tokens and whose second, started
late, had 3 was charged 14 tokens when its client hung up, and a batch's prompt tokens were one
prompt's. A cut completion's event count also took one event too many for a role event, which
completions do not send.

Workers: in-process stand-ins with vLLM's wire shape (one choice per event, `index` first, usage
after `choices`), several events in one write as vLLM sends a lagging reader's; the relay's scan
is also driven directly, its settlement read from what `Lifecycle.finish` is given.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.call import Account, Call
from gateway.config import TenantSettings, TimeoutSettings
from gateway.quota import TenantLimits
from gateway.relay import RelayResponse
from gateway.settlement import charge
from gateway.tenancy import Tenant
from gateway.validate import CHAT, COMPLETIONS
from scoring.views import RouteRequest
from tests.gateway.conftest import MODEL, keyed_settings, last_usage, run_gateway, serve_app

KEY = "kvg-cut-choices"
MAX_TOKENS = 2_000
ESTIMATE = 4  # the gateway's prompt estimate in the unit cases: below every prompt's real count
LAST_WORDS = " end of what was sent"


def completion_event(index: int, text: str, prompt: int, done: int) -> bytes:
    choice = {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": None,
        "stop_reason": None,
    }
    usage = {"prompt_tokens": prompt, "total_tokens": prompt + done, "completion_tokens": done}
    body = {
        "id": "cmpl-x",
        "object": "text_completion",
        "created": 1,
        "model": MODEL,
        "choices": [choice],
        "usage": usage,
    }
    return b"data: " + orjson.dumps(body) + b"\n\n"


def chat_event(index: int, delta: dict[str, str], prompt: int, done: int) -> bytes:
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
    usage = {"prompt_tokens": prompt, "total_tokens": prompt + done, "completion_tokens": done}
    body = {
        "id": "chatcmpl-x",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": MODEL,
        "choices": [choice],
        "usage": usage,
    }
    return b"data: " + orjson.dumps(body) + b"\n\n"


# -- the relay's scan and the settlement, directly --------------------------------------------------
def tenant() -> Tenant:
    return Tenant("t", TenantSettings(), TenantLimits(), "salt", "")


def relay_for(path: str, body: dict[str, Any], choices: int) -> tuple[RelayResponse, list[int]]:
    """A relay whose worker was asked for live usage, and the charges its settlement makes
    (what `Lifecycle.finish` is given, charged as the settlement would)."""
    call = Call("r1", MODEL, path, orjson.dumps(body), True, False, RouteRequest(MODEL))
    call.live_usage_upstream = True
    call.account = Account(tenant(), None, ESTIMATE, choices=choices)
    charged: list[int] = []

    async def finish(c: Call) -> None:
        assert c.account is not None
        charged.append(charge(c.account, c) or 0)

    life = SimpleNamespace(released=lambda w, c: None, succeeded=lambda w: None, finish=finish)
    r = RelayResponse(life, call, None, None, (None, b""), {}, TimeoutSettings(), 0.0)  # type: ignore[arg-type]
    return r, charged


def cut(r: RelayResponse, reads: list[bytes]) -> bytes:
    """Feed ``reads`` to the scan, then end the stream there, as a client that hangs up does;
    what the client was sent."""
    for chunk in reads:
        r._feed(chunk)
    r._call.outcome = "client_disconnect"
    asyncio.run(r._complete())
    return b"".join(r._out)


def test_a_cut_batch_is_charged_every_prompts_tokens_not_the_last_events_times_the_choices() -> (
    None
):
    body = {"model": MODEL, "stream": True, "prompt": ["a", "b", "c"], "max_tokens": MAX_TOKENS}
    r, charged = relay_for(COMPLETIONS, body, choices=3)
    got = cut(
        r,
        [
            completion_event(0, " x" * 700, 50, 700) + completion_event(2, " z", 30, 1),
            completion_event(0, " x" * 600, 50, 1300) + completion_event(1, " y" * 5, 70, 5),
            # The read's last event is the choice that started last: the old charge's basis.
            completion_event(2, " z", 30, 2),
        ],
    )
    # Prompts 50 + 70 + 30, each once; 1,300 + 5 + 2 generated. Before the fix: 36, the last
    # event's prompt (30) and its 2 tokens x 3 choices.
    assert charged == [150 + 1307]
    assert b'"usage"' not in got  # the client asked for no usage: none reaches it


def test_the_n_choices_of_one_prompt_share_its_prompt_tokens() -> None:
    # vLLM numbers a batch's choices prompt x n + the choice's own: 0-1 are prompt 0's.
    body = {"model": MODEL, "stream": True, "prompt": ["a", "b"], "n": 2, "max_tokens": 99}
    r, charged = relay_for(COMPLETIONS, body, choices=4)
    cut(
        r,
        [
            completion_event(0, " x" * 40, 50, 40)
            + completion_event(1, " x" * 90, 50, 90)
            + completion_event(3, " y" * 8, 70, 8)
            + completion_event(0, " x" * 10, 50, 50)
            + completion_event(2, " y", 70, 1),
        ],
    )
    assert charged == [50 + 70 + 50 + 90 + 1 + 8]  # before the fix: 74 (70 + 1 x 4)


def test_a_cut_chat_of_n_choices_is_charged_each_choices_tokens_and_the_prompt_once() -> None:
    body = {"model": MODEL, "stream": True, "n": 3, "messages": [{"role": "user", "content": "x"}]}
    r, charged = relay_for(CHAT, body, choices=3)
    roles = b"".join(chat_event(i, {"role": "assistant", "content": ""}, 40, 0) for i in range(3))
    cut(
        r,
        [
            roles,
            chat_event(1, {"content": " t" * 900}, 40, 900),
            chat_event(2, {"content": " u" * 300}, 40, 300)
            + chat_event(0, {"content": " v"}, 40, 1),
        ],
    )
    assert charged == [40 + 900 + 300 + 1]  # before the fix: 44 (40 + 6 events - 2)


def test_usage_whose_choice_is_unreadable_is_charged_as_any_choices() -> None:
    # Not vLLM's layout (`index` after `text`): the choice is unknown, so the largest count may
    # be any choice's: times the choices, an upper bound; never the last event's alone.
    def event(index: int, prompt: int, done: int) -> bytes:
        return (
            b'data: {"id":"c","choices":[{"text":"w","index":%d}],"usage":{"prompt_tokens":%d,'
            b'"completion_tokens":%d}}\n\n' % (index, prompt, done)
        )

    body = {"model": MODEL, "stream": True, "prompt": ["a", "b"]}
    r, charged = relay_for(COMPLETIONS, body, choices=2)
    cut(r, [event(0, 20, 600) + event(1, 20, 4), event(0, 20, 601) + event(1, 20, 5)])
    assert charged == [20 * 2 + 601 * 2]  # before the fix: 20 + 5 x 2


def test_a_single_choice_stream_keeps_its_last_usage_as_it_came() -> None:
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "x"}]}
    r, charged = relay_for(CHAT, body, choices=1)
    last = chat_event(0, {"content": " b"}, 40, 12)
    cut(r, [chat_event(0, {"content": " a"}, 40, 11) + last])
    assert r._call.live_usage == orjson.dumps(orjson.loads(last[6:])["usage"])
    assert charged == [40 + 12]


def test_events_counted_without_live_usage_skip_only_events_that_are_not_tokens() -> None:
    def call(path: str, events: int) -> Call:
        c = Call("r1", MODEL, path, b"{}", True, False, RouteRequest(MODEL))
        c.events, c.outcome = events, "upstream_broken"
        return c

    # 12 events of a completion: 11 tokens (no role event; the one event not counted stands for
    # the [DONE] or usage chunk, as for a chat). Before the fix: 10.
    assert charge(Account(tenant(), None, 100), call(COMPLETIONS, 12)) == 100 + 11
    # A chat: one role event per choice. Before the fix, n = 3: 2 role events counted as tokens.
    assert charge(Account(tenant(), None, 100), call(CHAT, 12)) == 100 + 10
    assert charge(Account(tenant(), None, 100, choices=3), call(CHAT, 12)) == 100 + 8


# -- through the gateway: a batch whose client hangs up --------------------------------------------
def batch_worker(seen: list[dict[str, Any]]) -> Any:
    """/v1/completions for a batch of two prompts: prompt 0 generates 2,000 tokens, prompt 1
    (started late) 3; each read several events, the lagging choice's last. Then a long pause."""

    async def health(request: Request) -> Response:
        return Response(b"")

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def completions(request: Request) -> Response:
        seen.append(orjson.loads(await request.body()))

        async def gen() -> AsyncIterator[bytes]:
            yield completion_event(0, " tok" * 1000, 45, 1000) + completion_event(1, " a", 61, 1)
            await asyncio.sleep(0.05)
            yield (
                completion_event(0, " tok" * 1000, 45, 2000)
                + completion_event(1, " b", 61, 2)
                + completion_event(1, LAST_WORDS, 61, 3)
            )
            await asyncio.sleep(60)  # the client hangs up in here
            yield b"data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/v1/models", models),
            Route("/v1/completions", completions, methods=["POST"]),
        ]
    )


async def test_a_batch_whose_client_hangs_up_is_charged_what_every_prompt_generated(
    tmp_path: Path,
) -> None:
    seen: list[dict[str, Any]] = []
    usage_file = tmp_path / "usage.jsonl"
    async with serve_app(batch_worker(seen), force_exit=True) as url:
        limits = {"tpm": 1_000_000, "max_output_tokens": MAX_TOKENS}
        async with run_gateway(keyed_settings([url], KEY, usage_file, limits)) as g:
            await g.wait_healthy(1)
            body = orjson.dumps(
                {"model": MODEL, "stream": True, "max_tokens": MAX_TOKENS, "prompt": ["a", "b"]}
            )
            host, port = g.url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                + f"authorization: Bearer {KEY}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await writer.drain()
            got = b""
            while LAST_WORDS.encode() not in got:
                data = await asyncio.wait_for(reader.read(65536), 10)
                assert data, got[-300:]
                got += data
            writer.transport.abort()
            rec = await last_usage(usage_file)
    assert seen[-1]["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert rec["outcome"] == "client_disconnect"
    # Both prompts' tokens (45 + 61) and both choices' (2,000 + 3): exactly, nothing counted
    # twice. Before the fix: 67, the last event's prompt (61) and its 3 tokens x 2 choices.
    assert rec["charged_tokens"] == 45 + 61 + 2003, rec
    assert b'"usage"' not in got


def test_a_chat_whose_choices_are_unreadable_counts_its_prompt_once() -> None:
    def event(index: int, done: int) -> bytes:
        return (
            b'data: {"choices":[{"delta":{"content":"w"},"index":%d}],"usage":{"prompt_tokens":40,'
            b'"completion_tokens":%d}}\n\n' % (index, done)
        )

    body = {"model": MODEL, "stream": True, "n": 2, "messages": [{"role": "user", "content": "x"}]}
    r, charged = relay_for(CHAT, body, choices=2)
    cut(r, [event(0, 300) + event(1, 7)])
    assert charged == [40 + 300 * 2]  # before the fix: 40 + 7 x 2
