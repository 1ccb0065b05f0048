"""The prompt estimate (`max_input_tokens`, the reservation, an abandoned stream's settlement)
counts everything the chat template receives, in UTF-8 bytes as the route key does.

Security review findings 1 and 4: `documents` and `chat_template_kwargs` (rendered by RAG and
Llama 3.1 templates) were not counted, so ~54k tokens passed a 2,000-token cap reserved as 3; and
characters were counted where the route key counts bytes, so 8,000 CJK characters (24 kB) passed
it as 2,000 tokens. The estimate now walks `scoring.chat_inputs.RENDERED_FIELDS`, the same list
`chat_inputs` builds the template's inputs from: the drift test below checks, field by field, that
what reaches the template is what the estimate counts.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from gateway.config import TenantSettings
from gateway.errors import APIError
from gateway.quota import TenantLimits
from gateway.tenancy import Tenant, apply_caps, estimate_prompt_tokens, media_bytes
from gateway.tokenizers import ChatTemplate
from gateway.validate import parse_request
from scoring.chat_inputs import RENDERER_FIELDS, chat_inputs
from scoring.prefix import text_key
from scoring.token_mode import TokenKeyer, TokenKeyError

CHAT = "/v1/chat/completions"
MODEL = "m"
BIG = "lorem ipsum dolor sit amet " * 8000  # 216k characters: ~54k tokens at 4 bytes a token
BIG_TOKENS = len(BIG) // 4
HI = [{"role": "user", "content": "hi"}]


def tenant(**cfg: Any) -> Tenant:
    return Tenant("t", TenantSettings(**cfg), TenantLimits(), "salt", "")


def chat_body(**extra: Any) -> dict[str, Any]:
    """A body the gateway accepts (parsed and checked as the walk does), `extra` beside `hi`."""
    raw = orjson.dumps({"model": MODEL, "messages": HI, "max_tokens": 8, **extra})
    return parse_request(CHAT, raw).data


# Top-level fields carrying BIG, in the shape a client sends them. Whether the template receives
# BIG is decided by chat_inputs (the repo's model of vLLM's normalisation), not by this table.
FIELDS: dict[str, dict[str, Any]] = {
    "documents": {"documents": [{"title": "t", "text": BIG}]},
    "documents_file_key": {"documents": [{"file": BIG}]},  # text, not a media part
    "kwargs_custom_tools": {"chat_template_kwargs": {"custom_tools": [{"description": BIG}]}},
    "kwargs_documents": {"chat_template_kwargs": {"documents": [{"text": BIG}]}},
    "kwargs_date_string": {"chat_template_kwargs": {"date_string": BIG}},
    "tools": {
        "tools": [
            {"type": "function", "function": {"name": "f", "description": BIG, "parameters": {}}}
        ]
    },
    "reasoning_effort": {"reasoning_effort": BIG},
    # apply_chat_template's own parameters: vLLM 0.32 drops them, older vLLM let them replace
    # the tools and documents the template prints (counted, `OLDER_VLLM` below).
    "kwargs_tools_param": {"chat_template_kwargs": {"tools": [{"description": BIG}]}},
    "kwargs_messages_param": {"chat_template_kwargs": {"messages": [{"content": BIG}]}},
    # Received by nothing: decoding fields, extensions.
    "response_format": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"description": BIG}},
        }
    },
    "metadata": {"metadata": {"note": BIG}},
    "tool_choice_big": {"tool_choice": {"type": "function", "function": {"name": BIG}}},
    "extension": {"custom_extension": {"note": BIG}},
}


# Rendered by vLLM before its chat_template_kwargs rework (0.11 fleets), not by 0.32.
OLDER_VLLM = {"kwargs_tools_param", "kwargs_messages_param"}


@pytest.mark.parametrize("case", sorted(FIELDS))
def test_the_estimate_counts_exactly_what_the_template_receives(case: str) -> None:
    body = chat_body(**FIELDS[case])
    msgs, tools, kw = chat_inputs(body)
    received = BIG in repr((msgs, tools, kw))
    # Not the template's, but another vLLM renderer's (Kimi-K3 renders the schema, tool_choice).
    rendered_elsewhere = BIG in repr([body.get(f) for f in RENDERER_FIELDS]) or case in OLDER_VLLM
    est = estimate_prompt_tokens(True, body, 4.0)
    if received or rendered_elsewhere:
        assert est >= BIG_TOKENS, f"{case}: the template gets ~{BIG_TOKENS} tokens, counted {est}"
    else:
        assert est < 50, f"{case}: never rendered, yet counted as {est} tokens"


@pytest.mark.parametrize(
    "case",
    [
        "documents",
        "documents_file_key",
        "kwargs_custom_tools",
        "kwargs_documents",
        "tools",
        "response_format",
        "tool_choice_big",
    ],
)
def test_max_input_tokens_refuses_a_prompt_hidden_in_a_rendered_field(case: str) -> None:
    body = chat_body(**FIELDS[case])
    est = estimate_prompt_tokens(True, body, 4.0)
    with pytest.raises(APIError) as e:
        apply_caps(tenant(max_input_tokens=2000), MODEL, body, est, is_chat=True)
    assert e.value.status == 400


def test_tool_call_arguments_given_as_an_object_count_whatever_their_keys() -> None:
    # A `file` or `image` key outside a content part is text the template renders.
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"file": BIG}}}
    msgs = [*HI, {"role": "assistant", "content": None, "tool_calls": [call]}]
    assert estimate_prompt_tokens(True, {"messages": msgs}, 4.0) >= BIG_TOKENS


MEDIA = {"image": 1000, "audio": 1500, "video": 8000}
MEDIA_BYTES = media_bytes(MEDIA, 4.0)


@pytest.mark.parametrize(
    ("part", "kind"),
    [
        (
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 200_000}},
            "image",
        ),
        ({"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}}, "image"),
        ({"type": "input_image", "image_url": "https://example.invalid/a.png"}, "image"),
        ({"type": "input_audio", "input_audio": {"data": "A" * 200_000, "format": "wav"}}, "audio"),
        ({"type": "audio_url", "audio_url": {"url": "https://example.invalid/a.wav"}}, "audio"),
        (
            {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + "A" * 200_000}},
            "video",
        ),
        # vLLM parses a part with a `uuid` by its media key, whatever its `type` says.
        ({"type": "text", "uuid": "u1", "image_url": {"url": "x"}}, "image"),
    ],
)
def test_a_media_part_costs_what_its_kind_is_set_to(part: dict[str, Any], kind: str) -> None:
    msg = {"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}
    est = estimate_prompt_tokens(True, {"messages": [msg]}, 4.0, MEDIA_BYTES)
    assert MEDIA[kind] <= est < MEDIA[kind] + 20


def test_images_no_longer_pass_an_input_cap_as_nothing() -> None:
    # Token review finding: media counted 0 tokens, so 50 images (~50k tokens on a vision model)
    # passed a 2,000-token max_input_tokens as the few tokens of their question.
    image = {"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}}
    msg = {"role": "user", "content": [{"type": "text", "text": "compare these"}, *[image] * 50]}
    body = chat_body(messages=[msg])
    est = estimate_prompt_tokens(True, body, 4.0, MEDIA_BYTES)
    assert est >= 50 * MEDIA["image"]
    with pytest.raises(APIError) as e:
        apply_caps(tenant(max_input_tokens=2000), MODEL, body, est, is_chat=True)
    assert e.value.status == 400
    assert estimate_prompt_tokens(True, {"messages": [msg]}, 4.0) < 20  # none set: uncharged


def test_a_part_type_vllm_does_not_parse_is_counted_as_its_json() -> None:
    part = {"type": "file", "file": {"file_data": "A" * 200_000, "filename": "x.pdf"}}
    msg = {"role": "user", "content": [part]}
    assert estimate_prompt_tokens(True, {"messages": [msg]}, 4.0, MEDIA_BYTES) >= 50_000


# -- UTF-8 bytes, as the route key -----------------------------------------------------------------
def test_a_cjk_chat_is_estimated_in_bytes_like_the_route_key() -> None:
    text = "漢字仮名交じり文" * 1000  # 8,000 characters, 24,000 UTF-8 bytes
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
    est = estimate_prompt_tokens(True, body, 4.0)
    route = text_key("chat", body, model=MODEL, chars_per_token=4.0).prompt_tokens
    assert est >= 0.95 * route, f"input cap sees {est} tokens, the route key {route:.0f}"
    with pytest.raises(APIError):
        apply_caps(tenant(max_input_tokens=2000), MODEL, body, est, is_chat=True)
    parts = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}],
    }
    assert estimate_prompt_tokens(True, parts, 4.0) >= 0.95 * route


@pytest.mark.parametrize("prompt", ["😀" * 8000, ["😀" * 4000, "漢" * 4000]])
def test_a_non_ascii_completion_is_estimated_in_bytes_like_the_route_key(prompt: Any) -> None:
    est = estimate_prompt_tokens(False, {"model": MODEL, "prompt": prompt}, 4.0)
    prompts = [prompt] if isinstance(prompt, str) else prompt
    route = sum(
        text_key("completion", {"prompt": p}, model=MODEL, chars_per_token=4.0).prompt_tokens
        for p in prompts
    )
    assert est >= 0.95 * route, f"input cap sees {est} tokens, the route key {route:.0f}"


def test_an_ascii_prompt_is_estimated_as_before() -> None:
    # ASCII: bytes are characters, so nothing changes for the common case.
    assert (
        estimate_prompt_tokens(True, {"messages": [{"role": "user", "content": "a" * 400}]}, 4)
        == 103
    )
    assert estimate_prompt_tokens(False, {"prompt": "a" * 400}, 4.0) == 101


# -- templates that print JSON indented (Llama 3.x: `tojson(indent=4)`) ---------------------------
LLAMA31_TOOLS = (
    "{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}"
    "{%- for m in messages %}{{ m.content }}{%- endfor %}"
)


def _deep_tools(n_tools: int, depth: int = 245) -> dict[str, Any]:
    nest: list[Any] = []
    for _ in range(depth):
        nest = [nest]
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"f{i}",
                "parameters": {"type": "object", "properties": {"a": {"default": nest}}},
            },
        }
        for i in range(n_tools)
    ]
    return chat_body(tools=tools)


def test_deep_json_is_estimated_at_what_an_indenting_template_renders() -> None:
    # Review finding: 10 tools nested 245 deep (6 kB of body, under validate's 254 levels) were
    # estimated at 2,129 tokens and rendered 2.5 MB in 5,060 lines by Llama 3.1's tools loop.
    body = _deep_tools(10)
    msgs, tools, kw = chat_inputs(body)
    text = ChatTemplate({"default": LLAMA31_TOOLS}, {})(msgs, tools, **kw)
    est = estimate_prompt_tokens(True, body, 4.0)
    assert est * 4 >= 0.9 * len(text.encode()), (est, len(text))
    with pytest.raises(APIError):
        apply_caps(tenant(max_input_tokens=100_000), MODEL, body, est, is_chat=True)


def test_token_mode_keys_a_quadratic_render_as_text_instead_of_rendering_it() -> None:
    # In token mode the gateway renders the template itself, before any quota: a 1 MB body of
    # such tools was 400 MB of output and 8 s of a held GIL. Now the keyer declines it (the
    # gateway's text-mode fallback), and ordinary tools still render.
    keyer = TokenKeyer(lambda s: [0] * len(s), ChatTemplate({"default": LLAMA31_TOOLS}, {}))
    with pytest.raises(TokenKeyError, match="keyed as text"):
        keyer.render(_deep_tools(100))
    assert '"name": "f"' in keyer.render(chat_body(**FIELDS["tools"]))


def test_shallow_schemas_are_estimated_at_what_an_indenting_template_prints() -> None:
    # Updated with the indentation fix (review finding below): this test said shallow schemas
    # paid no indentation at all, which is what let a wide list at a shallow depth through. An
    # indenting template (Llama 3.x) prints their indentation too, so it is charged, and no more
    # than that render: a compact-printing template is over-charged by the indentation alone.
    nest: Any = {"type": "string"}
    for _ in range(5):
        nest = {"type": "object", "properties": {"x": nest}}
    tool = {"type": "function", "function": {"name": "f", "parameters": nest}}
    est = estimate_prompt_tokens(True, {"tools": [tool]}, 4.0)
    indented = len(json.dumps(tool, indent=4))
    assert 0.9 * indented <= est * 4 <= 1.1 * indented, (est * 4, indented)
    # JSON in a message (a tool call's arguments) is printed compact: still sized flat.
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": nest}}
    msg = {"role": "assistant", "content": None, "tool_calls": [call]}
    flat = len(orjson.dumps(msg))
    assert estimate_prompt_tokens(True, {"messages": [msg]}, 4.0) * 4 <= 1.3 * flat


# Templates printing each tool (Llama 3.x, `custom_tools` too) and each document (Granite) with
# `tojson(indent=4)`, as transformers' `tojson` writes it.
INDENTING = (
    "{%- set ts = custom_tools if custom_tools is defined else tools %}"
    "{%- for t in ts or [] %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}"
    "{%- for d in documents or [] %}{{- d | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}"
    "{%- for m in messages %}{{ m.content }}{%- endfor %}"
)


def _wide(leaf_items: int = 5000, lists: int = 5) -> dict[str, Any]:
    """A schema with an enum of `leaf_items` small numbers, `lists` lists deep: 10 kB of body."""
    enum: Any = [0] * leaf_items
    for _ in range(lists):
        enum = [enum]
    return {"type": "object", "properties": {"x": {"type": "integer", "enum": enum}}}


WIDE_FIELDS: dict[str, dict[str, Any]] = {
    "tools": {"tools": [{"type": "function", "function": {"name": "f", "parameters": _wide()}}]},
    "custom_tools": {
        "chat_template_kwargs": {"custom_tools": [{"name": "f", "parameters": _wide()}]}
    },
    "documents": {"documents": [{"title": "t", "table": _wide()}]},
}


@pytest.mark.parametrize("case", sorted(WIDE_FIELDS))
def test_a_wide_list_at_a_shallow_depth_is_estimated_at_what_an_indenting_template_prints(
    case: str,
) -> None:
    # Review finding: JSON nested under 16 levels was charged no indentation, so an enum of
    # 5,000 numbers five lists deep in a tool (10 kB of body) rendered 23x the bytes charged
    # against `max_input_tokens`: each item is 2 bytes of body and a ~50-byte indented line.
    body = chat_body(**WIDE_FIELDS[case])
    msgs, tools, kw = chat_inputs(body)
    printed = len(ChatTemplate({"default": INDENTING}, {})(msgs, tools, **kw).encode())
    est = estimate_prompt_tokens(True, body, 4.0)
    assert 0.9 * printed <= est * 4 <= 1.25 * printed, (est * 4, printed)
    with pytest.raises(APIError):
        apply_caps(tenant(max_input_tokens=printed // 8), MODEL, body, est, is_chat=True)


# -- escapes: `tojson` writes a control character as \u00XX, a quote or backslash as two bytes ------
COMPACT_TOOLS = (
    "{%- for t in tools %}{{- t | tojson }}{{- '\\n' }}{%- endfor %}"
    "{%- for m in messages %}{{ m.content }}{%- endfor %}"
)


@pytest.mark.parametrize(
    "text", ["\x01" * 7800, '"' * 7800, "\\" * 7800, "\n\t" * 3900, "é\x02" * 3900]
)
@pytest.mark.parametrize("template", [COMPACT_TOOLS, LLAMA31_TOOLS])
def test_escaped_characters_in_rendered_json_are_estimated_as_printed(
    text: str, template: str
) -> None:
    # Review finding: a tool description of 7,800 control characters was estimated as 1,990
    # tokens (its characters + 2 per string), passed a 2,000-token `max_input_tokens`, and
    # rendered 46,887 bytes (5.9x) through a template's `tojson`; quotes and backslashes 2x.
    body = chat_body(
        tools=[{"type": "function", "function": {"name": "f", "description": text}}],
    )
    msgs, tools, kw = chat_inputs(body)
    rendered = len(ChatTemplate({"default": template}, {})(msgs, tools, **kw).encode())
    est = estimate_prompt_tokens(True, body, 4.0)
    assert est * 4 >= 0.95 * rendered, (est * 4, rendered)
    with pytest.raises(APIError):
        apply_caps(tenant(max_input_tokens=2_000), MODEL, body, est, is_chat=True)


def test_plain_text_in_rendered_json_costs_what_it_did() -> None:
    tool = {"type": "function", "function": {"name": "f", "description": "plain words " * 50}}
    est = estimate_prompt_tokens(True, chat_body(tools=[tool]), 4.0)
    assert est * 4 <= 1.1 * len(json.dumps(tool, indent=4)) + 40
