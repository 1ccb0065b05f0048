"""Bodies the gateway's keying could not take answered 500 (token-mode review findings): token
ids past uint32 (packed as unsigned 32-bit to be keyed) passed validation in either prompt form,
and a tool call's `arguments` string nested past the JSON parser's stack escaped token mode's
text-mode fallback (the body itself is shallow: the nesting is inside a string). Now the first
is vLLM's 400 on `prompt` and the second routes like any request."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gateway.tokenizers import sim_token_keyer
from scoring.token_mode import TokenKeyError
from tests.gateway.conftest import MODEL, run_gateway, settings_for
from tests.support.sim_workers import run_sim_workers

BAD_IDS = ([2**32] * 16, [[-1] * 16], [[2**40] * 16], [[1] * 16, [2**32] * 16])
DEEP_ARGS = {
    "model": MODEL,
    "max_tokens": 1,
    "messages": [
        {"role": "user", "content": "call it"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 5000}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ],
}


def test_the_token_keyer_keys_deep_arguments_or_fails_with_its_own_error() -> None:
    # Its own error is the one the gateway falls back to text mode on; a RecursionError was not.
    try:
        key = sim_token_keyer().key("chat", DEEP_ARGS, model=MODEL)
    except TokenKeyError:
        return
    assert key.prompt_tokens > 0


@pytest.mark.parametrize("token_mode", [False, True], ids=["text_mode", "token_mode"])
async def test_out_of_range_ids_are_a_400_and_deep_arguments_route(token_mode: bool) -> None:
    routing: dict[str, Any] = {"policy": "kv_aware"}
    if token_mode:
        routing["token_mode"] = {"models": {MODEL: "sim"}}
    async with run_sim_workers(1) as fleet:
        settings = settings_for(list(fleet), routing=routing)
        async with run_gateway(settings) as g, httpx.AsyncClient(timeout=10) as c:
            await g.wait_healthy(1)
            for prompt in BAD_IDS:
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
                r = await c.post(g.url + "/v1/completions", json=body)
                assert r.status_code == 400, (prompt[:1], r.status_code, r.text)
                assert r.json()["error"]["param"] == "prompt"
            ok = await c.post(g.url + "/v1/completions", json={**body, "prompt": [2**32 - 1] * 16})
            assert ok.status_code != 500, ok.text  # the largest id keys fine (the sim may refuse)
            r = await c.post(g.url + "/v1/chat/completions", json=DEEP_ARGS)
            assert r.status_code == 200, (r.status_code, r.text)
