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
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import orjson
import xxhash

__all__ = [
    "EMBEDS_PARTS",
    "RENDERED_FIELDS",
    "RENDERER_FIELDS",
    "REQUEST_TEMPLATE_VARS",
    "ContentFormat",
    "TokenKeyError",
    "body_bytes",
    "chat_inputs",
    "part_type",
    "rendered_bytes",
    "utf8_len",
]

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
    "prompt_embeds": "embeds",
}
# vLLM's MM_PARSER_MAP keys a part without a `type` (or with a `uuid`) is recognised by, in its
# order: `{"image_url": ...}` is an image whatever else it holds.
_KEYED_PARTS = (
    "image_url",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "audio_url",
    "input_audio",
    "video_url",
)
# Content parts that carry tensors rather than text or media (vLLM's `--enable-prompt-embeds` /
# `--enable-mm-embeds`): their token count is the tensor's length, which no estimate of the body
# sees, so the gateway refuses them unless told otherwise (`tenancy.accept_embeds`).
EMBEDS_PARTS = frozenset({"image_embeds", "audio_embeds", "video_embeds", "prompt_embeds"})
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

# Body fields vLLM hands the template as variables of their own name, over any chat_template_kwargs
# entry of that name (vLLM's merge_kwargs: the request's value wins unless None or "auto"), each
# with the value it takes when the body leaves it out.
REQUEST_TEMPLATE_VARS: Mapping[str, Any] = {
    "add_generation_prompt": True,
    "continue_final_message": False,
    "documents": None,
    "reasoning_effort": None,
}
# Every body field whose content the template receives, hence may render into the prompt. The one
# list: ``chat_inputs`` builds the template's inputs from these fields and no other, and the
# gateway's prompt estimate (``rendered_bytes``, for `max_input_tokens` and the reservation) counts
# these fields and ``RENDERER_FIELDS``, so a field the template sees can never be free against the
# caps (a RAG template renders `documents`, Llama 3.1 `chat_template_kwargs.custom_tools`). Not
# here: sampling fields, `cache_salt`.
RENDERED_FIELDS: tuple[str, ...] = (
    "messages",
    "tools",
    "chat_template_kwargs",
    *REQUEST_TEMPLATE_VARS,
)
# Fields vLLM's template path (the one ``chat_inputs`` models) does not hand the template, but one
# of its own renderers puts into the prompt: Kimi-K3's (vllm/renderers/kimi_k3.py) renders the
# `response_format` schema and `tool_choice`. The estimate counts them too: on such a fleet a
# 50 kB schema is ~12k prompt tokens, and elsewhere counting it over-reserves what the settlement
# gives back (a cap errs on the safe side).
RENDERER_FIELDS: tuple[str, ...] = ("response_format", "tool_choice")


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


def part_type(part: Mapping[str, Any]) -> str | None:
    """The part type vLLM parses a content part as (`_parse_chat_message_content_mm_part`): its
    `type`, unless that is missing or the part has a `uuid`, when the first media key present
    decides; None where vLLM finds neither (it refuses the part)."""
    kind = part.get("type")
    if kind is not None and part.get("uuid") is None:
        return kind if type(kind) is str else None
    for key in _KEYED_PARTS:
        if key in part:
            return key
    return None


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
        kind = part_type(part) or "text"
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
    """Content as the template receives it: parts (``openai``) or their text joined by newlines.

    Joining, vLLM keeps only truthy parts, so an empty text part adds no newline; as parts
    (`{"type": "text", "text": ""}`, truthy) it is kept. Joined here with their newlines, 600
    empty parts and "hello" were 609 tokens where vLLM counted 9 (review finding): a wrong 400
    against `max_input_tokens`, and a route key that matched no worker block.
    """
    parts = _parts(content)
    if fmt == "openai":
        return [
            {"type": "text", "text": p} if isinstance(p, str) else {"type": p["type"]}
            for p in parts
        ]
    return "\n".join(p if isinstance(p, str) else p["_ph"] for p in parts if p != "")


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
                except (ValueError, RecursionError):  # a string nested past the parser's stack
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
    extra: dict[str, Any] = {k: body.get(k, dflt) for k, dflt in REQUEST_TEMPLATE_VARS.items()}
    if effort is not None and "enable_thinking" not in kw:
        extra["enable_thinking"] = effort != "none"
    # vLLM's merge_kwargs: the request's own fields win unless unset (None or "auto").
    kw.update({k: v for k, v in extra.items() if v is not None and v != "auto"})
    return msgs, tools, kw


# -- how much of a request the template renders, cheaply -------------------------------------------
def utf8_len(s: str) -> int:
    """UTF-8 length, as the route key (``scoring.prefix.text_key``) sizes text: no copy for ASCII
    (``isascii`` is O(1) in CPython); otherwise one encode, ~1.4 ns a character, the only exact
    way CPython has. ``surrogatepass`` as there: JSON may carry lone surrogates."""
    return len(s) if s.isascii() else len(s.encode("utf-8", "surrogatepass"))


_ENCODE_STR = json.JSONEncoder(ensure_ascii=False).encode


def json_str_bytes(s: str) -> int:
    """UTF-8 size of ``s`` as ``tojson`` (``json.dumps``, ``ensure_ascii=False``) writes it, quotes
    included: a control character takes 6 bytes (``\\u0001``) or 2 (``\\n``), a quote or a
    backslash 2. Sized as plain text, a tool description of 7,800 control characters rendered 5.9x
    the bytes charged against `max_input_tokens` (review finding). Plain text, the usual case, is
    three C scans; anything else is encoded once."""
    if s.isprintable() and '"' not in s and "\\" not in s:
        return (len(s) if s.isascii() else utf8_len(s)) + 2
    return utf8_len(_ENCODE_STR(s))


def _scalar_bytes(obj: Any) -> int:
    t = type(obj)
    if t is int or t is float:
        return len(repr(obj))
    if t is str:  # a dict key
        return json_str_bytes(obj) - 2
    return 4 if t is bool or obj is None else len(str(obj))  # true, false, null


_SCALARS = frozenset({int, float, bool, type(None)})

# Nesting levels a template's JSON is sized flat (see `_json_bytes`) in fields no common
# template prints indented (messages' JSON, `response_format`, `tool_choice`).
_FLAT_DEPTH = 16
# A depth no nesting reaches from: `_json_bytes` from here charges no indentation anywhere.
_NEVER_DEEP = -(1 << 40)


def _json_bytes(obj: Any, depth: int = 1, flat: int = _FLAT_DEPTH, sp: int = 1) -> int:
    """About the UTF-8 size of ``obj`` as a template writes it (``tojson``, or ``key: value``):
    strings (escapes included, ``json_str_bytes``), keys and numbers exactly, separators as
    ``tojson`` (``json.dumps``) writes them: ``", "`` and ``": "``, so 6 bytes a key and 2 an
    item (``sp=0``: compact JSON's ``,`` and ``:``, the body as sent, ``body_bytes``). Charged
    compact, a list of 600 zeros in a tool call rendered 1.5x its bytes (review finding).
    Templates serialise tool schemas and documents whole, so their keys are prompt tokens too.
    Parsed JSON holds only these exact types, so ``type() is`` stands in for the ABC checks.

    Past ``flat`` levels every element is charged what ``tojson(indent=4)`` writes before it, a
    newline and 4 x depth spaces (``depth``: the container's level, 1 for the outermost), as is
    each container's closing line; there an item's separator is ``,`` alone. Fields a common
    template prints that way (`_indented_bytes`) are sized so from the top; any other past
    ``_FLAT_DEPTH``, where a list nested d deep is 2d bytes of body and ~4d^2 indented (6 kB of
    deep tool schemas rendered 2.5 MB, ~300x, past a 2,000-token `max_input_tokens`: review
    finding).
    """
    t = type(obj)
    if t is str:
        return json_str_bytes(obj)
    if depth > flat:
        ind = 4 * depth + 1
        item = 1 + ind  # `,` and the next line
    else:
        ind = 0
        item = 1 + sp
    if t is dict:
        n = 2 + ind
        key = 3 + item + (1 if ind else sp)  # its quotes, `: ` (`:` compact) and separator
        for k, v in obj.items():
            n += _scalar_bytes(k) + key
            tv = type(v)
            if tv is str:
                n += json_str_bytes(v)
            elif tv is dict or tv is list:
                n += _json_bytes(v, depth + 1, flat, sp)
            else:
                n += _scalar_bytes(v)
        return n
    if t is list:
        if obj and _SCALARS.issuperset(map(type, obj)):
            # Numbers, booleans and nulls only (a long enum, an embedding): orjson writes them
            # as the template does, in C. Walked one by one, 2M zeros in a 4 MiB tool schema
            # held the event loop ~0.7 s (review). Each element: its text and its separator.
            return len(orjson.dumps(obj)) + (item - 1) * len(obj) + 1 + ind
        n = 2 + ind
        for v in obj:
            tv = type(v)
            if tv is str:
                n += json_str_bytes(v) + item
            elif tv is dict or tv is list:
                n += _json_bytes(v, depth + 1, flat, sp) + item
            else:
                n += _scalar_bytes(v) + item
        return n
    return _scalar_bytes(obj)


def _indented_bytes(obj: Any) -> int:
    """JSON a template may print with ``tojson(indent=4)``, sized with its indentation at every
    depth: Llama 3.x prints each tool so (``custom_tools`` too), and `documents` and template
    kwargs, which templates print whole, are sized alike. Sized flat up to 16 levels, a wide
    list of small items (an enum of 5,000 numbers five lists deep) rendered 23x the bytes
    charged against `max_input_tokens` (review finding): there an element's indentation, not
    its text, is most of the prompt. Real schemas pay for it too, about doubled in bytes (3
    small tools: 1,023 B compact, 2,103 B indented), which is what such a template prints; a
    template printing them compact is over-charged by that much (the reservation's excess is
    settled back; the input cap errs on the safe side). Messages are not sized this way: their
    text is printed as is, and the JSON in them (tool calls' arguments) on one line.

    A list is sized from depth 0 (each element one line: its own newline) so that its elements
    are at depth 1: these templates print each tool or document on its own, not the list."""
    return _json_bytes(obj, 0, -1)


def body_bytes(body: Mapping[str, Any]) -> int:
    """About the body's own size as compact JSON, to compare what it renders to
    (``rendered_bytes``) without serialising it."""
    return _json_bytes(body, _NEVER_DEEP, sp=0)


def _content_bytes(content: Any, media: Mapping[str, int]) -> int:
    """A message's ``content`` as ``_content`` renders it: text parts' text, each media part what
    `media` charges its kind (an image's base64 is not its token count: vLLM expands a part into
    model-specific tokens apart from the text, so the operator states what one part may cost),
    and any other part type its JSON. Only content *parts* are media: a ``file`` key elsewhere
    (tool-call arguments, documents) is text the template renders.

    Plus the newline vLLM joins the parts with (string content format, most text models), one
    before each part but the first, empty text parts left out as vLLM leaves them out (and media
    of a kind left free, as the operator set it): counting the text alone, 1,000 one-byte parts
    rendered ~2 kB charged as 1 kB, ~8x the tokens estimated (review finding)."""
    if type(content) is str:
        return utf8_len(content)
    if content is None:
        return 0
    if type(content) is dict:
        content = [content]
    elif type(content) is not list:
        return _json_bytes(content)
    n = 0
    joined = 0  # parts the rendered text is joined from
    for part in content:
        if type(part) is str:
            if not part:
                continue
            n += utf8_len(part)
        elif type(part) is dict:
            kind = part_type(part) or "text"
            key = _TEXT_PART_KEYS.get(kind)
            if key is not None:
                text = part.get(key)
                if text is None or text == "":
                    continue
                n += utf8_len(text) if type(text) is str else _json_bytes(text)
            elif (mk := _MEDIA_KINDS.get(kind)) is not None:
                charge = media.get(mk, 0)
                if not charge:  # its kind is free, its newline too (text-only fleets)
                    continue
                n += charge
            else:
                n += _json_bytes(part)
        else:
            n += _json_bytes(part)
        joined += 1
    return n + joined - 1 if joined else 0


# Tool-call `arguments` strings re-serialised to size them exactly, at most this many characters
# a request (`_messages_bytes`): past it they are sized by a bound from byte counts alone
# (`_arguments_bytes`). Parsing and printing a list of numbers costs up to ~100 ns a character
# (`1e15`s, zeros; random floats ~60, strings ~4-9), a 4 MiB body of them ~0.4 s of a held
# event loop; 32 KiB is ~3 ms at most.
_ARGS_PARSE_BUDGET = 32 * 1024
# Folds what the bound in `_arguments_bytes` counts into fewer patterns: any digit to 0, `E` to
# `e`, `:` to `,` (either separator gains the same space).
_BOUND_FOLD = bytes.maketrans(b"123456789E:", b"000000000e,")
_SEVENTEEN_DIGITS_POINT = b"0" * 17 + b"."


def _arguments_bytes(args: str, budget: int) -> tuple[int, int]:
    """A tool call's ``arguments`` string as a template prints it, and the parse budget left.

    vLLM ``json.loads`` the string and templates print the object back with ``tojson``
    (``json.dumps``: ``", "``, ``": "``, floats by ``repr``), so what renders is not what was
    sent: ``[0,0,...]`` is 1.5x its bytes, ``[[],...]`` 1.3x, ``1e15`` 18 bytes for 4 (~5x,
    review findings). Charged the larger of that re-serialisation and the string's size as the
    walk has always taken it (``json_str_bytes``, all an unparseable one gets: vLLM prints
    ``{}`` for it).

    The re-serialisation can outgrow the string only by a space after each ``,`` and ``:`` that
    lacks one, 14 bytes per number in exponent form (``1e15``) and 3 per float of 17 or more
    digits before its point (``12345678901234567.0`` -> ``1.2345678901234568e+16``); escapes and
    whitespace only shrink. That bound, from C-level byte counts (~10 ns a character, as
    ``json_str_bytes``), settles the usual call, prose or code in strings, without parsing; the
    rest (lists of numbers) is parsed while the request's budget lasts, else charged the bound.
    """
    raw = json_str_bytes(args)
    b = args.encode("utf-8", "surrogatepass").translate(_BOUND_FOLD)
    bound = (
        len(b)
        + b.count(b",")
        - b.count(b", ")
        + 14 * b.count(b"0e")
        + 3 * b.count(_SEVENTEEN_DIGITS_POINT)
    )
    if bound <= raw:
        return raw, budget
    if len(args) > budget:
        return bound, budget
    try:
        printed = utf8_len(json.dumps(json.loads(args), ensure_ascii=False))
    except (ValueError, RecursionError):  # vLLM coerces it to `{}`: the string's size stands
        printed = 0
    return max(raw, printed), budget - len(args)


def _tool_calls_bytes(calls: Any, budget: int) -> tuple[int, int]:
    """A message's ``tool_calls`` as ``_json_bytes`` sizes them, but each
    ``function.arguments`` string as ``_arguments_bytes`` does; and the parse budget left."""
    if type(calls) is not list:
        return _json_bytes(calls), budget
    n = 2
    for call in calls:
        fn = call.get("function") if type(call) is dict else None
        args = fn.get("arguments") if type(fn) is dict else None
        if type(args) is str:
            size, budget = _arguments_bytes(args, budget)
            n += size - 2  # in place of the empty string sized below
            call = {**call, "function": {**fn, "arguments": ""}}
        n += _json_bytes(call, 2) + 2
    return n, budget


def _messages_bytes(msgs: Any, media: Mapping[str, int], budget: int = _ARGS_PARSE_BUDGET) -> int:
    """``budget``: characters of tool-call arguments this request may parse (a default, so the
    plain chat pays nothing for it)."""
    if type(msgs) is not list:
        return _json_bytes(msgs)
    n = 8 * len(msgs)  # role markers of the chat template
    for m in msgs:
        if type(m) is not dict:
            n += _json_bytes(m)
            continue
        c = m.get("content")
        if type(c) is str and len(m) <= 2:  # a role and text: the common message, one length
            n += len(c) if c.isascii() else utf8_len(c)
            continue
        for k, x in m.items():
            if k == "content":
                n += _content_bytes(x, media)
            elif k == "tool_calls":
                size, budget = _tool_calls_bytes(x, budget)
                n += size
            else:
                n += _json_bytes(x)
    return n


def _template_kwargs_bytes(kw: Any) -> int:
    if type(kw) is not dict:
        return 0  # chat_inputs hands the template nothing from it
    # All of it, apply_chat_template's own parameters too: vLLM 0.32 drops those (as
    # chat_inputs does), but vLLM before its kwargs rework (still 0.11, which kvgate serves)
    # let the request's `tools` / `documents` here replace the ones the template prints, so
    # 100 kB of tools in them passed as 3 tokens (review finding). Over-counting is settled back.
    # Each value as the template prints it alone (Llama 3.1's `custom_tools`, indented).
    n = 2
    for k, x in kw.items():
        n += (len(k) if type(k) is str and k.isascii() else _scalar_bytes(k)) + 4
        n += _indented_bytes(x)
    return n


# How each rendered field is sized: every one of RENDERED_FIELDS and RENDERER_FIELDS, and only
# those; the JSON it holds unless it has its own rule.
_FIELD_BYTES: dict[str, Callable[[Any], int]] = {
    **dict.fromkeys((*RENDERED_FIELDS, *RENDERER_FIELDS), _json_bytes),
    # Printed with `tojson(indent=4)` by common templates (`_indented_bytes`).
    "tools": _indented_bytes,
    "documents": _indented_bytes,
    "chat_template_kwargs": _template_kwargs_bytes,
}
_NO_MEDIA: Mapping[str, int] = {}


def rendered_bytes(body: Mapping[str, Any], media: Mapping[str, int] = _NO_MEDIA) -> int:
    """About the UTF-8 bytes of everything a chat request's template receives (``RENDERED_FIELDS``),
    and what vLLM's other renderers add (``RENDERER_FIELDS``): message text and fields, tools,
    documents, template kwargs, a `response_format` schema, and `media[kind]` bytes for each
    image, audio or video part; the template's own text (but 8 bytes of role markers a message)
    left out. One walk of the parsed body, no
    serialisation: the gateway runs it on every chat request for its input cap and reservation,
    so it goes over the body's own keys (a handful) rather than looking up each rendered field.

    A plain message (a role and string content) costs one length; anything else counts every
    string the template may render: text, refusal and thinking parts, tool calls' arguments (a
    string or an object), names. Counting only `content` let ~10k tokens of `refusal` parts,
    tool-call arguments or `documents` past `max_input_tokens` as a handful.
    """
    n = 0
    sizes = _FIELD_BYTES
    for k, v in body.items():
        size = sizes.get(k)
        # None: unset (vLLM's default); a bool is a switch (add_generation_prompt): no text.
        if size is not None and v is not None and v is not True and v is not False:
            n += _messages_bytes(v, media) if k == "messages" else size(v)
    return n
