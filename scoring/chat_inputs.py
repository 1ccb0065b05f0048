"""Chat request -> the template's inputs: messages, tools and kwargs as vLLM hands them over.

Token mode (``scoring.token_mode``) must render a chat exactly as the worker does, and what the
template sees is not the request body: vLLM first normalises it (text parts joined, media replaced,
tool-call arguments parsed, tools filled with defaults, ``developer`` folded into ``system`` where
the template lacks it, ``chat_template_kwargs`` merged). This module reproduces that step alone,
pure and template-free, so it can be checked against vLLM's behaviour without a tokenizer.
Both modules raise ``TokenKeyError``, so it is defined here, below the keyer; ``scoring.token_mode``
re-exports it and ``ContentFormat`` as part of ``TokenKeyer``'s interface.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import xxhash

__all__ = ["ContentFormat", "TokenKeyError", "chat_inputs"]

ContentFormat = Literal["string", "openai"]

# vLLM's TEXT_PART_TYPES and where each keeps its text.
_TEXT_PART_KEYS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
_MEDIA_KINDS = {
    "image_url": "image",
    "input_image": "image",
    "image_embeds": "image",
    "image_pil": "image",
    "audio_url": "audio",
    "input_audio": "audio",
    "audio_embeds": "audio",
    "video_url": "video",
    "video_embeds": "video",
}
# apply_chat_template's own parameters: a request's chat_template_kwargs naming them never reaches
# the template as a variable.
_NOT_TEMPLATE_VARS = frozenset(
    {
        "conversation",
        "chat_template",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "tools",
        "messages",
    }
)


class TokenKeyError(ValueError):
    """The request cannot be tokenized the worker's way (the template rejected it, bad ids).

    vLLM would answer such a request with a 400 itself; routing should fall back to text mode
    rather than fail it here, so the worker's own error reaches the client.
    """


# -- request -> template inputs, as vLLM builds them -----------------------------------------------
def _media_placeholder(kind: str, part: Mapping[str, Any]) -> str:
    # vLLM replaces media with model-specific placeholder tokens we cannot reproduce; a stable
    # text keeps different media apart without carrying a megabyte payload into the tokenizer.
    payload = json.dumps(part.get(kind, part), sort_keys=True, default=str)
    return f"<|{kind}:{xxhash.xxh3_64_hexdigest(payload.encode('utf-8', 'surrogatepass'))}|>"


def _parts(content: Any) -> list[str | dict[str, Any]]:
    """Content as vLLM's list of parts: text parts as strings, media parts as small dicts."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if isinstance(content, Mapping):
        content = [content]
    if not isinstance(content, Sequence):
        return [str(content)]
    out: list[str | dict[str, Any]] = []
    for part in content:
        if isinstance(part, str):
            out.append(part)
            continue
        if not isinstance(part, Mapping):
            out.append(str(part))
            continue
        kind = str(part.get("type", "text"))
        key = _TEXT_PART_KEYS.get(kind)
        if key is not None:
            text = part.get(key)
            if text is not None:  # vLLM skips text parts with no text
                out.append(str(text))
        else:
            ph = _media_placeholder(kind, part)
            out.append({"type": _MEDIA_KINDS.get(kind, kind), "_ph": ph})
    return out


def _content(content: Any, fmt: ContentFormat) -> str | list[dict[str, Any]]:
    parts = _parts(content)
    if fmt == "openai":
        return [
            {"type": "text", "text": p} if isinstance(p, str) else {"type": p["type"]}
            for p in parts
        ]
    return "\n".join(p if isinstance(p, str) else p["_ph"] for p in parts)


def _tool_calls(calls: Any) -> list[Any] | None:
    """Assistant tool calls with JSON-string arguments parsed to objects, as vLLM hands them on.

    Tool-use templates iterate ``arguments`` as a mapping; invalid or non-object JSON becomes
    ``{}`` (vLLM coerces rather than failing every later turn of the conversation).
    """
    if not isinstance(calls, list) or not calls:
        return None
    out: list[Any] = []
    for item in calls:
        if not isinstance(item, Mapping):
            raise TokenKeyError("assistant tool_calls entries must be objects")
        item = dict(item)
        fn = item.get("function")
        if isinstance(fn, Mapping):
            fn = dict(fn)
            args = fn.get("arguments")
            parsed: Any = {}
            if isinstance(args, Mapping):
                parsed = dict(args)
            elif isinstance(args, str) and args:
                try:
                    parsed = json.loads(args)
                except ValueError:
                    parsed = {}
            fn["arguments"] = parsed if isinstance(parsed, dict) else {}
            item["function"] = fn
        out.append(item)
    return out


def _tool(tool: Any) -> Any:
    """A request tool as vLLM's ``model_dump()`` of it: defaults filled, unset optionals left out.

    Templates that ``tojson`` the tools see these exact keys, so a client that omits
    ``description`` renders ``"description": null`` on the worker.
    """
    if not isinstance(tool, Mapping) or not isinstance(tool.get("function"), Mapping):
        return tool
    fn = tool["function"]
    top_defer = tool.get("defer_loading")
    fn_defer = fn.get("defer_loading")
    if fn_defer is None:
        fn_defer = top_defer  # vLLM propagates the tool's flag to its function
    out_fn: dict[str, Any] = {
        "name": fn.get("name"),
        "description": fn.get("description"),
        "parameters": fn.get("parameters"),
    }
    if fn.get("strict") is not None:
        out_fn["strict"] = fn["strict"]
    if fn_defer is not None:
        out_fn["defer_loading"] = fn_defer
    out: dict[str, Any] = {"type": tool.get("type", "function"), "function": out_fn}
    if top_defer is not None:
        out["defer_loading"] = top_defer
    return out


def _consolidate_system(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's merge of all system messages into one leading message (after developer->system)."""
    texts: list[str] = []
    rest: list[dict[str, Any]] = []
    needed = False
    for i, m in enumerate(msgs):
        if m["role"] != "system":
            rest.append(m)
            continue
        needed = needed or i > 0 or bool(texts)
        c = m.get("content", "")
        if isinstance(c, list):
            c = "\n".join(
                p["text"] if isinstance(p, dict) and "text" in p else p
                for p in c
                if isinstance(p, str) or (isinstance(p, dict) and "text" in p)
            )
        if c:
            texts.append(c)
    if not needed:
        return msgs
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest]


def chat_inputs(
    body: Mapping[str, Any],
    *,
    content_format: ContentFormat = "string",
    developer_role: bool = True,
) -> tuple[list[dict[str, Any]], list[Any] | None, dict[str, Any]]:
    """A chat body -> (messages, tools, template kwargs) as vLLM passes them to the template.

    Follows vLLM 0.32's ``parse_chat_messages`` and ``build_chat_params`` for what changes the
    rendered text: text parts joined by newlines (or kept as parts for templates that iterate
    content, ``content_format="openai"``), tool-call arguments parsed, tool results flattened,
    ``developer`` turned into ``system`` for templates that do not know it, and the request's
    ``chat_template_kwargs`` under the request's own ``add_generation_prompt`` etc. The body is
    never mutated.
    """
    raw = body.get("messages") or ()
    if not isinstance(raw, Sequence) or isinstance(raw, str | bytes):
        raise TokenKeyError("messages must be a list")
    msgs: list[dict[str, Any]] = []
    for m in raw:
        if not isinstance(m, Mapping):
            raise TokenKeyError("each message must be an object")
        role = str(m.get("role", "user"))
        out: dict[str, Any] = {"role": role, "content": _content(m.get("content"), content_format)}
        if role == "assistant":
            calls = _tool_calls(m.get("tool_calls"))
            if calls is not None:
                out["tool_calls"] = calls
            if m.get("reasoning") is not None:
                out["reasoning"] = out["reasoning_content"] = str(m["reasoning"])
        elif role == "tool":
            if "tool_call_id" in m:
                out["tool_call_id"] = m["tool_call_id"]
            c = out["content"]
            if isinstance(c, list) and all(p.get("type") == "text" for p in c):
                out["content"] = "\n".join(p["text"] for p in c)
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
        if isinstance(m.get("task"), str):
            out["task"] = m["task"]
        if role == "developer":
            out["tools"] = m.get("tools")
        msgs.append(out)
    if not developer_role and any(m["role"] == "developer" for m in msgs):
        for m in msgs:
            if m["role"] == "developer":
                m["role"] = "system"
                m.pop("tools", None)
        msgs = _consolidate_system(msgs)

    tools_raw = body.get("tools")
    tools = [_tool(t) for t in tools_raw] if isinstance(tools_raw, list) and tools_raw else None

    user_kw = body.get("chat_template_kwargs")
    kw: dict[str, Any] = {
        k: v
        for k, v in (user_kw.items() if isinstance(user_kw, Mapping) else ())
        if isinstance(k, str) and k not in _NOT_TEMPLATE_VARS
    }
    effort = body.get("reasoning_effort")
    extra: dict[str, Any] = {
        "add_generation_prompt": body.get("add_generation_prompt", True),
        "continue_final_message": body.get("continue_final_message", False),
        "documents": body.get("documents"),
        "reasoning_effort": effort,
    }
    if effort is not None and "enable_thinking" not in kw:
        extra["enable_thinking"] = effort != "none"
    # vLLM's merge_kwargs: the request's own fields win unless unset (None or "auto").
    kw.update({k: v for k, v in extra.items() if v is not None and v != "auto"})
    return msgs, tools, kw
