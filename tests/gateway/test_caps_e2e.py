"""Output caps, reservations and malformed fields per endpoint: the token-cap bypass, reserve-what-the-worker-reads, malformed limits.

A tenant's `max_output_tokens` must bound what a worker generates whichever field the worker
reads its limit from (vLLM: `max_tokens` on /v1/completions; `max_completion_tokens`, then
`max_tokens`, on chat), and the reservation must cover every choice of every prompt. The pure
tests pin `apply_caps` down field by field; the end-to-end ones send the same matrix through a
gateway to a simulated worker (which reads the limit exactly as vLLM does) and look at the
tokens generated (`usage`) and reserved (the quota gate's `admit`, and the rate-limit headers).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import orjson
import pytest

from gateway.config import Settings, TenantSettings
from gateway.errors import APIError
from gateway.quota import TenantLimits
from gateway.quota_gate import Ticket
from gateway.tenancy import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    Tenant,
    apply_caps,
    estimate_prompt_tokens,
    output_tokens,
)
from gateway.validate import parse_request
from tests.gateway.conftest import MODEL, RunningGateway, run_gateway, settings_for

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
CAP, DEFAULT = 100, 16
KEY_CAP, KEY_REJECT, KEY_SMALL = "kvg-caps-cap", "kvg-caps-reject", "kvg-caps-small"

# Each output-limit field absent, under the cap, or over it. The two "under" values differ so
# that the tokens generated tell which field the worker read.
MT = {"absent": None, "under": 40, "over": 8000}
MCT = {"absent": None, "under": 30, "over": 9000}
MATRIX = [(path, mt, mct) for path in (COMPLETIONS, CHAT) for mt in MT for mct in MCT]  # 2 x 3 x 3


def expected_out(path: str, mt: str, mct: str) -> int:
    """What the worker may generate per choice once the gateway capped or injected the limit:
    the field it reads (as vLLM), capped at CAP; the tenant default when it reads none."""
    if path == CHAT and MCT[mct] is not None:
        return min(MCT[mct], CAP)
    if MT[mt] is not None:
        return min(MT[mt], CAP)
    return DEFAULT


def request_body(path: str, mt: str, mct: str, **kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = (
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        if path == CHAT
        else {"model": MODEL, "prompt": "x"}
    )
    if MT[mt] is not None:
        base["max_tokens"] = MT[mt]
    if MCT[mct] is not None:
        base["max_completion_tokens"] = MCT[mct]
    return {**base, **kw}


def tenant(**cfg: Any) -> Tenant:
    return Tenant("t", TenantSettings(**cfg), TenantLimits(), "salt", "")


# -- apply_caps, pure ---------------------------------------------------------------------------
@pytest.mark.parametrize("path, mt, mct", MATRIX)
def test_cap_mode_caps_every_output_field_and_reserves_what_the_worker_reads(
    path: str, mt: str, mct: str
) -> None:
    data = request_body(path, mt, mct)
    out, changed = apply_caps(
        tenant(max_output_tokens=CAP, default_max_tokens=DEFAULT),
        MODEL,
        data,
        1,
        is_chat=path == CHAT,
    )
    assert out == expected_out(path, mt, mct)
    # No field a worker might read is left above the cap...
    assert all(
        data.get(k) is None or data[k] <= CAP for k in ("max_tokens", "max_completion_tokens")
    )
    # ...and the one this endpoint's worker reads says exactly what was reserved.
    read = data.get("max_completion_tokens") if path == CHAT else None
    assert (read or data["max_tokens"]) == out
    assert changed == (mt == "over" or mct == "over" or out == DEFAULT)


@pytest.mark.parametrize("path, mt, mct", MATRIX)
def test_reject_mode_refuses_any_output_field_over_the_cap(path: str, mt: str, mct: str) -> None:
    data = request_body(path, mt, mct)
    t = tenant(max_output_tokens=CAP, default_max_tokens=DEFAULT, over_max_output="reject")
    if mt == "over" or mct == "over":
        with pytest.raises(APIError) as ei:
            apply_caps(t, MODEL, data, 1, is_chat=path == CHAT)
        want = "max_completion_tokens" if mct == "over" else "max_tokens"
        assert ei.value.status == 400 and ei.value.param == want
        assert str(CAP) in ei.value.message
    else:
        out, _ = apply_caps(t, MODEL, data, 1, is_chat=path == CHAT)
        assert out == expected_out(path, mt, mct)


@pytest.mark.parametrize("path, mt, mct", MATRIX)
def test_without_an_output_cap_the_reservation_is_still_what_the_worker_reads(
    path: str, mt: str, mct: str
) -> None:
    data = request_body(path, mt, mct)
    out, _ = apply_caps(tenant(default_max_tokens=DEFAULT), MODEL, data, 1, is_chat=path == CHAT)
    if path == CHAT and MCT[mct] is not None:
        assert out == MCT[mct]
    elif MT[mt] is not None:
        assert out == MT[mt]  # on completions max_completion_tokens is not what it reads
    else:
        assert out == DEFAULT and data["max_tokens"] == DEFAULT


def test_the_incident_body_is_capped_on_the_field_completions_read() -> None:
    data = {"model": MODEL, "prompt": "x", "max_tokens": 8000, "max_completion_tokens": 1}
    out, changed = apply_caps(tenant(max_output_tokens=CAP), MODEL, data, 1, is_chat=False)
    assert (out, changed, data["max_tokens"], data["max_completion_tokens"]) == (CAP, True, CAP, 1)


@pytest.mark.parametrize(
    "path, extra, factor",
    [
        (CHAT, {"n": 3}, 3),
        (COMPLETIONS, {"n": 3}, 3),
        (COMPLETIONS, {"prompt": ["a", "b", "c"]}, 3),
        (COMPLETIONS, {"prompt": [[1, 2], [3], [4, 5, 6]]}, 3),
        (COMPLETIONS, {"prompt": [1, 2, 3]}, 1),  # one prompt of token ids
        (COMPLETIONS, {"prompt": ["a", "b", "c"], "n": 2}, 6),
        (COMPLETIONS, {"best_of": 4, "n": 2}, 4),
        (CHAT, {"best_of": 3}, 3),
        (CHAT, {"n": 4, "use_beam_search": True}, 4),
    ],
)
def test_reservation_covers_every_choice_of_every_prompt(
    path: str, extra: dict[str, Any], factor: int
) -> None:
    for cfg in ({"max_output_tokens": CAP}, {}):
        data = {**request_body(path, "over" if cfg else "under", "absent"), **extra}
        out, _ = apply_caps(tenant(**cfg), MODEL, data, 1, is_chat=path == CHAT)
        per_choice = CAP if cfg else MT["under"]
        assert out == factor * per_choice, (cfg, extra)
        assert data["max_tokens"] == per_choice  # the per-choice limit itself is not multiplied


@pytest.mark.parametrize(
    "extra, param",
    [({"n": 5}, "n"), ({"best_of": 5}, "best_of"), ({"n": 2, "best_of": 9}, "best_of")],
)
def test_more_choices_than_max_n_is_a_400_naming_the_field(extra: dict, param: str) -> None:
    data = {**request_body(COMPLETIONS, "under", "absent"), **extra}
    with pytest.raises(APIError) as ei:
        apply_caps(tenant(max_n=4), MODEL, data, 1, is_chat=False)
    assert ei.value.status == 400 and ei.value.param == param and "4" in ei.value.message
    out, _ = apply_caps(tenant(max_n=4), MODEL, {**data, "n": 4, "best_of": 4}, 1, is_chat=False)
    assert out == 4 * MT["under"]


def test_max_n_has_a_default() -> None:
    assert TenantSettings().max_n == 16


def test_the_prompt_estimate_counts_every_prompt_of_a_list() -> None:
    one = estimate_prompt_tokens(False, {"prompt": "abcd" * 100}, 4.0)
    assert estimate_prompt_tokens(False, {"prompt": ["abcd" * 100] * 3}, 4.0) == 3 * one
    assert estimate_prompt_tokens(False, {"prompt": [[1, 2, 3], [4, 5]]}, 4.0) == 5


_BIG = "lorem ipsum " * 3400  # ~40k characters: ~10k tokens at 4 characters per token
_RENDERED_ELSEWHERE = {
    # vLLM renders these into the prompt as text too, not only `content` and `text` parts.
    "refusal_part": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": _BIG}]},
    ],
    "thinking_part": [{"role": "user", "content": [{"type": "thinking", "thinking": _BIG}]}],
    "tool_call_arguments": [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": _BIG}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ],
}


@pytest.mark.parametrize("case", sorted(_RENDERED_ELSEWHERE))
def test_max_input_tokens_counts_every_text_the_template_renders(case: str) -> None:
    # Counting only `content` strings and `text` parts estimated each of these ~10k-token
    # prompts at 3-8 tokens: past `max_input_tokens`, and almost free against the TPM.
    body = {"model": MODEL, "messages": _RENDERED_ELSEWHERE[case], "max_tokens": 8}
    data = parse_request(CHAT, orjson.dumps(body)).data  # a body the gateway accepts
    est = estimate_prompt_tokens(True, data, 4.0)
    assert est >= len(_BIG) // 4
    with pytest.raises(APIError) as e:
        apply_caps(tenant(max_input_tokens=2000), MODEL, data, est, is_chat=True)
    assert e.value.status == 400


def test_an_images_bytes_are_not_counted_as_prompt_text() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 40_000}}
    msg = {"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}
    assert estimate_prompt_tokens(True, {"messages": [msg]}, 4.0) < 20


@pytest.mark.parametrize(
    "path, data, want",
    [
        # An open gateway caps nothing: this is what the autoscaler counts in flight.
        (COMPLETIONS, {"prompt": "x", "max_tokens": 8000, "max_completion_tokens": 1}, 8000),
        (COMPLETIONS, {"prompt": "x", "max_completion_tokens": 50}, COMPLETIONS_DEFAULT_MAX_TOKENS),
        (COMPLETIONS, {"prompt": "x"}, COMPLETIONS_DEFAULT_MAX_TOKENS),
        (COMPLETIONS, {"prompt": "x", "max_tokens": None}, 0),  # rest of the context: unknown
        (COMPLETIONS, {"prompt": ["a", "b"], "n": 3, "max_tokens": 10}, 60),
        (CHAT, {"max_tokens": 8000, "max_completion_tokens": 1}, 1),
        (CHAT, {"max_tokens": 7}, 7),
        (CHAT, {"n": 2, "max_completion_tokens": 5}, 10),
        (CHAT, {}, 0),
    ],
)
def test_output_tokens_of_an_open_gateway(path: str, data: dict, want: int) -> None:
    before = dict(data)
    assert output_tokens(path == CHAT, data) == want
    assert data == before  # nothing injected without tenants


# -- end to end ---------------------------------------------------------------------------------
def h(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def caps_settings(urls: list[str], **small: Any) -> Settings:
    data = settings_for(urls).model_dump()
    common = {
        "rpm": 100_000,
        "tpm": 10_000_000,
        "max_concurrent": 16,
        "max_output_tokens": CAP,
        "default_max_tokens": DEFAULT,
    }
    data["tenants"] = {
        "cap": {"keys_sha256": [h(KEY_CAP)], **common},
        "reject": {"keys_sha256": [h(KEY_REJECT)], **common, "over_max_output": "reject"},
        # The incident's tenant: a small TPM that the bypass blew through.
        "small": {"keys_sha256": [h(KEY_SMALL)], **common, "tpm": 6000, **small},
    }
    return Settings(**data)


class AdmitSpy:
    """Records the tokens each admitted-or-refused request asked the quota gate to reserve."""

    def __init__(self, g: RunningGateway) -> None:
        self.tokens: list[int] = []
        quota = g.gw.quota
        real: Callable[..., Awaitable[Ticket]] = quota.admit

        async def admit(tenant: Tenant, request_id: str, model: str, tokens: int) -> Ticket:
            self.tokens.append(tokens)
            return await real(tenant, request_id, model, tokens)

        quota.admit = admit  # type: ignore[method-assign]

    def take(self) -> list[int]:
        out, self.tokens = self.tokens, []
        return out


async def send(
    c: httpx.AsyncClient, url: str, path: str, body: dict, key: str
) -> tuple[httpx.Response, int | None]:
    """POST; returns the response and the completion tokens its usage reports (streams too)."""
    r = await c.post(url + path, json=body, headers={"authorization": f"Bearer {key}"})
    if r.status_code != 200:
        return r, None
    if not body.get("stream"):
        return r, r.json()["usage"]["completion_tokens"]
    usage = [
        orjson.loads(line[6:])["usage"]
        for line in r.text.split("\n\n")
        if line.startswith("data: {") and '"usage":{' in line
    ]
    return r, usage[-1]["completion_tokens"] if usage else None


async def leases(g: RunningGateway) -> float:
    m = await g.metrics()
    return sum(v for k, v in m.items() if k.startswith("kvgate_tenant_in_flight"))


def prompt_est(g: RunningGateway, path: str, body: dict) -> int:
    return estimate_prompt_tokens(path == CHAT, body, g.gw.routing_options.chars_per_token)


async def test_incident_concurrent_completions_cannot_bypass_the_cap_or_the_tpm(sims) -> None:  # type: ignore[no-untyped-def]
    fleet = sims(1, profile="instant")
    async with run_gateway(caps_settings(fleet.urls)) as g:
        await g.wait_healthy(1)
        spy = AdmitSpy(g)
        body = {
            "model": MODEL,
            "prompt": "x",
            "max_tokens": 8000,
            "max_completion_tokens": 1,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with httpx.AsyncClient(timeout=30) as c:
            got = await asyncio.gather(
                *(send(c, g.url, COMPLETIONS, body, KEY_SMALL) for _ in range(4))
            )
        assert [r.status_code for r, _ in got] == [200] * 4
        assert [n for _, n in got] == [CAP] * 4  # was 8000 each
        est = prompt_est(g, COMPLETIONS, body)
        assert sorted(spy.take()) == [est + CAP] * 4
        # Each admission took prompt + CAP from the 6000 budget (the bypass left 5996): the
        # last one admitted saw at least three others' reservations (one request's worth of
        # slack for refill and settlement while they ran), every one at least its own.
        remaining = sorted(int(r.headers["x-ratelimit-remaining-tokens"]) for r, _ in got)
        assert remaining[0] <= 6000 - 3 * CAP, remaining
        assert remaining[-1] <= 6000 - CAP, remaining
        assert await leases(g) == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_both_endpoints_every_combination_of_output_fields(sims, stream: bool) -> None:  # type: ignore[no-untyped-def]
    fleet = sims(1, profile="instant")
    async with run_gateway(caps_settings(fleet.urls)) as g, httpx.AsyncClient(timeout=30) as c:
        await g.wait_healthy(1)
        spy = AdmitSpy(g)
        wrong: list[str] = []
        for path, mt, mct in MATRIX:
            case = f"{path} max_tokens {mt} max_completion_tokens {mct}"
            extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
            body = request_body(path, mt, mct, **extra)
            want = expected_out(path, mt, mct)
            # Cap mode: generated and reserved exactly the capped limit the worker reads.
            r, generated = await send(c, g.url, path, body, KEY_CAP)
            reserved = spy.take()
            if r.status_code != 200 or generated != want:
                wrong.append(f"cap: {case}: {r.status_code} generated {generated}, want {want}")
            if reserved != [prompt_est(g, path, body) + want]:
                wrong.append(f"cap: {case}: reserved {reserved}, want prompt + {want}")
            # Reject mode: any output field over the cap is a 400 before any reservation.
            r, generated = await send(c, g.url, path, body, KEY_REJECT)
            reserved = spy.take()
            if mt == "over" or mct == "over":
                param = "max_completion_tokens" if mct == "over" else "max_tokens"
                err = r.json().get("error", {}) if r.status_code != 200 else {}
                if r.status_code != 400 or err.get("param") != param or reserved:
                    wrong.append(f"reject: {case}: {r.status_code} {err} reserved {reserved}")
            elif r.status_code != 200 or generated != want or len(reserved) != 1:
                wrong.append(f"reject: {case}: {r.status_code} generated {generated}")
        assert not wrong, "\n".join(wrong)
        assert await leases(g) == 0


@pytest.mark.parametrize(
    "path, extra",
    [
        (CHAT, {"n": 3}),
        (COMPLETIONS, {"n": 3}),
        (COMPLETIONS, {"prompt": ["a", "b", "c"]}),
        (COMPLETIONS, {"best_of": 3}),
    ],
)
async def test_n_and_prompt_lists_reserve_every_choice(sims, path: str, extra: dict) -> None:  # type: ignore[no-untyped-def]
    fleet = sims(1, profile="instant")
    # 1,000 tokens of budget: one choice of CAP fits many times over, three choices of 400 never.
    s = caps_settings(fleet.urls, tpm=1000, max_output_tokens=400)
    async with run_gateway(s) as g, httpx.AsyncClient(timeout=30) as c:
        await g.wait_healthy(1)
        spy = AdmitSpy(g)
        body = {**request_body(path, "under", "absent"), "max_tokens": 400, **extra}
        r, _ = await send(c, g.url, path, body, KEY_SMALL)
        # Three choices x 400 tokens is more than the whole budget: refused, never forwarded
        # (it used to be reserved as one choice and sent on).
        assert spy.take() == [prompt_est(g, path, body) + 3 * 400]
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "insufficient_quota"
        assert r.headers["x-should-retry"] == "false"
        # The same request with one choice fits.
        one = {**request_body(path, "under", "absent"), "max_tokens": 400}
        r, generated = await send(c, g.url, path, one, KEY_SMALL)
        assert r.status_code == 200 and generated == 400
        assert spy.take() == [prompt_est(g, path, one) + 400]
        assert await leases(g) == 0


async def test_n_within_budget_reserves_n_times_and_gives_it_back(sims) -> None:  # type: ignore[no-untyped-def]
    fleet = sims(1, profile="instant")
    async with run_gateway(caps_settings(fleet.urls)) as g, httpx.AsyncClient(timeout=30) as c:
        await g.wait_healthy(1)
        spy = AdmitSpy(g)
        body = request_body(COMPLETIONS, "over", "absent", n=3)
        r, _ = await send(c, g.url, COMPLETIONS, body, KEY_CAP)
        # The simulator serves n=1 only (its 400 is passed on); what matters is the reservation.
        assert spy.take() == [prompt_est(g, COMPLETIONS, body) + 3 * CAP]
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        assert await leases(g) == 0
        # Above the tenant's max_n (default 16): the gateway's own 400, nothing reserved.
        r, _ = await send(c, g.url, COMPLETIONS, {**body, "n": 17}, KEY_CAP)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        assert "16" in r.json()["error"]["message"]
        assert spy.take() == []


MALFORMED = [
    (CHAT, {"messages": [{"role": "user", "content": 123}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    (CHAT, {"temperature": -1}, "temperature"),
    (CHAT, {"top_p": 5}, "top_p"),
    (CHAT, {"tools": [1]}, "tools[0]"),
    (
        CHAT,
        {
            "messages": [
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": None, "tool_calls": "zzz"},
            ]
        },
        "messages[1].tool_calls",
    ),
    (COMPLETIONS, {"prompt": ""}, "prompt"),
    (COMPLETIONS, {"top_p": 5}, "top_p"),
]


async def test_malformed_fields_are_refused_at_the_gateway_with_nothing_reserved(sims) -> None:  # type: ignore[no-untyped-def]
    fleet = sims(1, profile="instant")
    async with run_gateway(caps_settings(fleet.urls)) as g, httpx.AsyncClient(timeout=30) as c:
        await g.wait_healthy(1)
        spy = AdmitSpy(g)
        for (path, fields, param), key in itertools.product(MALFORMED, (KEY_CAP, KEY_REJECT)):
            body = {**request_body(path, "under", "absent"), **fields}
            r, _ = await send(c, g.url, path, body, key)
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == param, (body, err)
            assert err["type"] == "invalid_request_error" and err["message"]
            assert "x-kvgate-worker" not in r.headers  # never reached a worker
        assert spy.take() == []
        assert await leases(g) == 0
        # Unknown fields still pass through to the worker.
        body = request_body(CHAT, "under", "absent", ignore_eos=True, some_extension={"a": [1]})
        r, generated = await send(c, g.url, CHAT, body, KEY_CAP)
        assert r.status_code == 200 and generated == MT["under"]
