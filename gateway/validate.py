"""Request bodies: size-capped read, one JSON parse, and the checks that must hold before any
worker sees the request. Unknown fields are kept and forwarded: vLLM grows extensions
(`ignore_eos`, `cache_salt`, ...) faster than a gateway should track them.

The known fields OpenAI answers with a 400 when malformed (message roles and content, tools,
sampling bounds, output limits, `n`/`best_of`, `stop`, `seed`, logprobs) are checked here, on the
parsed dict, with `param` naming the field as OpenAI does: a bad request refused by the worker
has already taken a queue slot, a quota reservation and a worker round trip, and some (`n` that
is not an int, a non-numeric limit) would otherwise break the gateway's own accounting. Only type
and range checks that cost a few lookups: no schema model of the whole body. Two engine-control
fields are refused outright (`_NOT_FROM_CLIENTS`): what they do cannot be capped or isolated.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.types import Scope

from gateway.errors import APIError, bad_request
from scoring.chat_inputs import EMBEDS_PARTS, part_type

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

# orjson parses JSON nested up to 1024 levels but serializes at most 254, and the gateway
# re-serializes many bodies (forced stream usage, tenant caps, cache salts): a body it accepts must
# stay forwardable. No OpenAI request field comes near this depth.
MAX_DEPTH = 254


@dataclass(slots=True)
class ParsedRequest:
    model: str
    stream: bool
    client_wants_usage: bool
    data: dict[str, Any]
    # `data` differs from the client's bytes and must be re-serialized before it goes upstream.
    modified: bool = False
    # The client asked for usage on every event too (`continuous_usage_stats`): not stripped.
    client_wants_live_usage: bool = False


def request_headers(scope: Scope) -> dict[str, str]:
    """The request's headers by lower-case name (the first of repeated ones, as Starlette's
    `Headers.get` answers), built once: the walk reads five of them, and each Starlette lookup
    scans and re-encodes the whole list (6.4 us for the five, 0.9 us this way)."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in reversed(scope["headers"])}


async def read_body(
    request: Request, content_length: str | None, limit: int, timeout_s: float | None
) -> bytes:
    """The body, capped at ``limit`` bytes and ``timeout_s`` seconds: a client that dribbles or
    stalls its upload would otherwise hold a connection and a task forever (uvicorn has no body
    timeout of its own), a cheap way to exhaust a gateway. ``content_length``: the header's
    value (`request_headers`), None when the client sent none."""
    if timeout_s is None or _arrived(request):
        return await _read_body(request, limit, content_length)
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_body(request, limit, content_length)
    except TimeoutError:
        raise APIError(
            408,
            f"The request body did not arrive within {timeout_s:g} seconds",
            "invalid_request_error",
            code="request_timeout",
        ) from None


def _arrived(request: Request) -> bool:
    """The whole body is already buffered (uvicorn read it with the head, the usual case): reading
    it cannot wait, so no timer is armed (a timeout context per request was ~1% of the gateway's
    core under the bench overhead ladder). Any other server: False, the timeout applies."""
    cycle = getattr(request.receive, "__self__", None)  # uvicorn's RequestResponseCycle
    return getattr(cycle, "more_body", True) is False


async def _read_body(request: Request, limit: int, cl: str | None) -> bytes:
    if cl is not None:
        try:
            declared = int(cl)
        except ValueError:
            raise bad_request("Invalid Content-Length header") from None
        if declared > limit:
            raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        # The client gave up mid-upload: nobody reads the answer, but it is not a gateway error.
        raise APIError(
            499,
            "Client closed the connection before the request body was complete",
            "invalid_request_error",
            code="client_closed_request",
        ) from None
    return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"Request body too large: the limit is {limit} bytes",
        "invalid_request_error",
        code="request_too_large",
    )


# What one body may hold, counted outside its strings before it is parsed: parsing and walking
# cost per value, not per byte. A 4 MiB body of 1M one-id lists (`[[1],[1],...]`) held the event
# loop 1.3 s and 2M numbers in a tool schema 0.6 s, refused or not, and 4 MiB of `{}` held ~110
# MiB while its request ran (review). A chat holds a few containers per message and part, and a
# prompt of token ids one value per token (1M: past any context window), and a string's
# count is what taking the strings out costs (~0.5 us each).
MAX_CONTAINERS = 1 << 16
MAX_VALUES = 1 << 20
MAX_STRINGS = 1 << 17
# A body this small cannot hold more than any (a value is at least a byte and a comma).
_COUNT_FROM = 1 << 17
# A JSON string, escapes included (unrolled: one pass, no backtracking per character).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def _too_many_values(raw: bytes) -> str | None:
    """Why ``raw`` holds more JSON values than a request may, or None. Brackets and commas
    are counted in C first; only a body over a bound there is counted again with its strings
    taken out (text may hold any number of both)."""
    if len(raw) < _COUNT_FROM:
        return None
    containers = raw.count(b"[") + raw.count(b"{")
    values = raw.count(b",") + raw.count(b":")
    if containers <= MAX_CONTAINERS and values <= MAX_VALUES:
        return None
    # At least this many strings: every quote but the escaped ones (`\\"` may be a backslash
    # escaped, then a quote, so this never counts more than there are).
    if (raw.count(b'"') - raw.count(b'\\"')) // 2 > MAX_STRINGS:
        return f"more than {MAX_STRINGS} strings"
    bare = _STRING.sub(b'""', raw)
    if bare.count(b"[") + bare.count(b"{") > MAX_CONTAINERS:
        return f"more than {MAX_CONTAINERS} arrays and objects"
    if bare.count(b",") + bare.count(b":") > MAX_VALUES:
        return f"more than {MAX_VALUES} values"
    return None


def _too_deep(data: Any) -> bool:
    """Whether `data` nests deeper than orjson can serialize it again (MAX_DEPTH levels).

    Serializing is the check: what orjson parsed can only fail to serialize by depth, and its
    SIMD writer takes ~0.6 us for a 4 kB chat body, where counting the body's brackets first
    (two ``bytes.count`` passes, byte by byte) took 3.3 us."""
    try:
        orjson.dumps(data)
    except orjson.JSONEncodeError:
        return True
    return False


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_prompt(prompt: Any) -> bool:
    # vLLM refuses an empty prompt ("The decoder prompt cannot be empty"), also inside a list.
    if isinstance(prompt, str):
        return bool(prompt)
    if not isinstance(prompt, list) or not prompt:
        return False
    first = prompt[0]
    if isinstance(first, str):
        return all(isinstance(p, str) and p for p in prompt)
    if _is_int(first):
        return _token_ids(prompt)
    if isinstance(first, list):
        # Lists, none empty, of ids: all three in C, the ids checked as one list.
        return (
            _LISTS.issuperset(map(type, prompt))
            and all(prompt)
            and _token_ids(list(itertools.chain.from_iterable(prompt)))
        )
    return False


_INTS = frozenset({int})
_LISTS = frozenset({list})


def _token_ids(ids: list[Any]) -> bool:
    """Ints (not bools) in the token-id range, checked in C: a generator per id, and a call per
    prompt, held the event loop ~0.35 s for 60k prompts of 16 ids (review)."""
    return _INTS.issuperset(map(type, ids)) and min(ids) >= 0 and max(ids) <= _MAX_TOKEN_ID


# Token ids are packed as unsigned 32-bit to be keyed (``scoring.prefix.chain_hashes_tokens``);
# no vocabulary comes near it, and an id past it crashed the keying with a 500 (review finding).
_MAX_TOKEN_ID = 2**32 - 1


# What OpenAI accepts as a message role (vLLM renders any string, but a role the chat template
# does not know is silently dropped or garbled by most templates: a 400 is the honest answer).
ROLES = frozenset({"system", "user", "assistant", "tool", "developer", "function"})
# Roles whose `content` may be null or absent: an assistant turn that only calls tools, and the
# legacy function result (OpenAI types it `string | null`).
_NULL_CONTENT_OK = frozenset({"assistant", "function"})
# Sampling bounds OpenAI enforces with a 400 (vLLM refuses the same or a subset): field ->
# (low, high, low inclusive).
_BOUNDS: dict[str, tuple[float, float, bool]] = {
    "temperature": (0.0, 2.0, True),
    "top_p": (0.0, 1.0, False),
    "presence_penalty": (-2.0, 2.0, True),
    "frequency_penalty": (-2.0, 2.0, True),
}
_INT64 = (-(2**63), 2**63 - 1)  # vLLM's seed range (a torch long)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a decimal"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object"


def _invalid_type(param: str, expected: str, got: Any) -> APIError:
    return bad_request(
        f"Invalid type for '{param}': expected {expected}, but got {_type_name(got)} instead.",
        param,
    )


def _check_messages(msgs: Any, accept_embeds: bool) -> None:
    """Each message: a known role, content of a shape a chat template can render, tool calls a
    list of objects. Runs on every chat request, so the usual message (a role and string content,
    nothing else) costs three lookups; anything else gets the full check."""
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("`messages` must be a non-empty array", "messages")
    for i, m in enumerate(msgs):
        if (
            type(m) is dict
            and len(m) == 2
            and type(m.get("content")) is str
            and type(role := m.get("role")) is str
            and role in ROLES
        ):
            continue
        _check_message(i, m, accept_embeds)


def _check_message(i: int, m: Any, accept_embeds: bool) -> None:
    if not isinstance(m, dict):
        raise _invalid_type(f"messages[{i}]", "an object", m)
    role = m.get("role")
    if role is None:
        raise bad_request(
            f"Missing required parameter: 'messages[{i}].role'.", f"messages[{i}].role"
        )
    if not isinstance(role, str) or role not in ROLES:
        shown = repr(role) if isinstance(role, str) else _type_name(role)
        raise bad_request(
            f"Invalid value for 'messages[{i}].role': {shown[:64]}. Supported values are: "
            "'system', 'assistant', 'user', 'function', 'tool', and 'developer'.",
            f"messages[{i}].role",
        )
    content = m.get("content")
    if content is None:
        if role not in _NULL_CONTENT_OK or (
            role == "assistant" and not m.get("tool_calls") and not m.get("function_call")
        ):
            raise bad_request(
                f"Missing required parameter: 'messages[{i}].content' (only an assistant "
                "message with `tool_calls` may omit it).",
                f"messages[{i}].content",
            )
    elif isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise bad_request(
                    f"Invalid 'messages[{i}].content[{j}]': a content part must be an "
                    "object with a string `type`.",
                    f"messages[{i}].content[{j}]",
                )
            if part["type"] == "text" and not isinstance(part.get("text"), str):
                raise _invalid_type(
                    f"messages[{i}].content[{j}].text", "a string", part.get("text")
                )
            if not accept_embeds and (kind := part_type(part)) in EMBEDS_PARTS:
                raise _embeds_refused(f"messages[{i}].content[{j}]", f"`{kind}` parts")
    elif not isinstance(content, str):
        raise _invalid_type(
            f"messages[{i}].content", "one of a string or array of objects", content
        )
    calls = m.get("tool_calls")
    if calls is not None and (
        not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls)
    ):
        raise _invalid_type(f"messages[{i}].tool_calls", "an array of objects", calls)
    name = m.get("name")
    if name is not None and not isinstance(name, str):
        raise _invalid_type(f"messages[{i}].name", "a string", name)


def _embeds_refused(param: str, what: str) -> APIError:
    # The tensor's length is its token count, which no estimate of the body sees: accepted, it
    # would pass any `max_input_tokens` and reservation (and vLLM deserialises it with torch).
    return bad_request(
        f"{what} are not accepted: embeddings cannot be counted against this key's token limits.",
        param,
    )


def _check_tools(tools: Any) -> None:
    """vLLM builds a guided-decoding schema from these: a malformed entry would fail there, after
    the request took a queue slot and a reservation."""
    if tools is None:
        return
    if not isinstance(tools, list):
        raise _invalid_type("tools", "an array of objects", tools)
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise _invalid_type(f"tools[{i}]", "an object", t)
        kind = t.get("type", "function")
        if not isinstance(kind, str):
            raise _invalid_type(f"tools[{i}].type", "a string", kind)
        if kind != "function":
            continue  # newer tool kinds (OpenAI "custom"): the worker decides
        fn = t.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(
                f"Invalid 'tools[{i}].function': expected an object with a non-empty string "
                "`name`.",
                f"tools[{i}].function",
            )


def _check_n_best_of(data: dict[str, Any]) -> None:
    n, best_of = data.get("n"), data.get("best_of")
    if type(best_of) is int and type(n) is int and best_of < n:
        raise bad_request(
            f"`best_of` ({best_of}) must be greater than or equal to `n` ({n}).", "best_of"
        )


def _out_of_bounds(key: str, v: Any) -> APIError:
    if not _is_number(v):
        return _invalid_type(key, "a number", v)
    lo, hi, lo_ok = _BOUNDS[key]
    low = f">= {lo:g}" if lo_ok else f"> {lo:g}"
    return bad_request(
        f"Invalid '{key}': expected a value {low} and <= {hi:g}, but got {v} instead.", key
    )


def _seed(key: str, v: Any, data: dict[str, Any], chat: bool) -> None:
    if not _is_int(v) or not _INT64[0] <= v <= _INT64[1]:
        raise bad_request("`seed` must be an integer in the signed 64-bit range", "seed")


def _stop(key: str, v: Any, data: dict[str, Any], chat: bool) -> None:
    if not (isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))):
        raise _invalid_type("stop", "a string or an array of strings", v)


def _bool(key: str, v: Any, data: dict[str, Any], chat: bool) -> None:
    if not isinstance(v, bool):
        raise _invalid_type(key, "a boolean", v)


def _logprobs(key: str, v: Any, data: dict[str, Any], chat: bool) -> None:
    if chat:
        _bool(key, v, data, chat)
    elif not _is_int(v) or v < 0:
        # On /v1/completions `logprobs` is the number of top tokens, not a switch.
        raise bad_request("`logprobs` must be a non-negative integer", "logprobs")


def _top_logprobs(key: str, v: Any, data: dict[str, Any], chat: bool) -> None:
    if not chat:
        return  # not a completions field: passed through like any unknown one
    if not _is_int(v) or v < 0:
        raise bad_request("`top_logprobs` must be a non-negative integer", "top_logprobs")
    if v > 0 and data.get("logprobs") is not True:
        raise bad_request(
            "`logprobs` must be set to true when `top_logprobs` is used.", "top_logprobs"
        )


def _cache_salt(key: str, v: Any, data: dict[str, Any], chat: bool) -> None:
    # vLLM's own rule (validate_cache_salt), checked here because with tenants the gateway maps
    # every salt to one of its own (gateway.tenancy.Tenant.client_salt), which would turn a salt
    # vLLM refuses into one it accepts.
    if not isinstance(v, str) or not v:
        raise bad_request("`cache_salt` must be a non-empty string if provided", "cache_salt")
    if len(v) > 128 or any(c in v for c in "@/\\\x00"):
        raise bad_request(
            "`cache_salt` must be at most 128 characters and must not contain '@', '/', a "
            "backslash or NUL",
            "cache_salt",
        )


def _not_from_clients(key: str, v: Any, data: dict[str, Any], chat: bool) -> None:
    if key == "chat_template" and not chat:
        return  # not a completions field: passed through like any unknown one
    raise bad_request(f"`{key}` is not accepted from clients: {_NOT_FROM_CLIENTS[key]}", key)


# Engine-control fields a tenant must not set, and why. `kv_transfer_params` addresses another
# engine's KV blocks on a disaggregated (P/D) fleet (`do_remote_prefill`, `remote_block_ids`):
# forwarded, a tenant could read blocks computed for someone else. A request `chat_template` is
# refused by vLLM unless started with `--trust-request-chat-template`, and where that flag is on a
# few bytes of template can render any size of prompt, which no estimate of the body can cap.
_NOT_FROM_CLIENTS: dict[str, str] = {
    "kv_transfer_params": "KV transfer between engines is set up by the serving stack.",
    # The encoder cache's counterpart on an encode/prefill/decode fleet (transfer ids, mm
    # hashes, a consumer's ZMQ address).
    "ec_transfer_params": "encoder-cache transfer between engines is set up by the serving stack.",
    # vLLM copies it into the request's extra_args, where `kv_transfer_params` and
    # `ec_transfer_params` are read from too: the fields above by another name. A malformed one
    # there was a 500 from the worker, which ejected healthy workers for every tenant.
    "vllm_xargs": "engine extension arguments are set by the serving stack.",
    # Tokens per SSE event: a stream cut by its client is charged by the events it received,
    # so 999 tokens an event were charged as one.
    "stream_interval": "each event carries the tokens the serving stack sends it.",
    "chat_template": "the model's own chat template is used.",
}

_MEDIA_KWARGS = ("media_io_kwargs", "mm_processor_kwargs")
_POSITIVE_INTS = frozenset({"max_tokens", "max_completion_tokens", "n", "best_of"})
# The rarer scalar fields OpenAI refuses with a 400 when malformed: field -> check(key, value,
# body, chat). The frequent ones (output limits, sampling bounds) are checked inline.
_CHECKS: dict[str, Callable[[str, Any, dict[str, Any], bool], None]] = {
    "seed": _seed,
    "stop": _stop,
    "use_beam_search": _bool,
    # Switches the gateway reads itself, by identity (`is False`): vLLM's request model takes
    # 0, "false", "no" or "off" for False, so a spelling the gateway did not treat as False
    # hid the reasoning from a stream cut while reasoning (no events, no live usage) and had
    # it charged the prompt estimate instead of the reservation: max_tokens of compute for
    # the price of the prompt. The others decide what is rendered and counted against the
    # token caps (a BOS, the generation prompt, the echoed prompt).
    **dict.fromkeys(
        (
            "include_reasoning",
            "add_special_tokens",
            "add_generation_prompt",
            "continue_final_message",
            "echo",
        ),
        _bool,
    ),
    "logprobs": _logprobs,
    "top_logprobs": _top_logprobs,
    "cache_salt": _cache_salt,
    **dict.fromkeys(_NOT_FROM_CLIENTS, _not_from_clients),
}


def _check_sampling(data: dict[str, Any], chat: bool) -> None:
    """Walks the body's own keys (a handful) rather than every checked field, so a request pays
    only for the fields it sets; `type(v) is int` also refuses booleans. Null means "not set"."""
    for key, v in data.items():
        if v is None:
            continue
        if key in _POSITIVE_INTS:
            if type(v) is not int or v < 1:
                raise bad_request(f"`{key}` must be a positive integer", key)
            if key == "best_of" or (key == "n" and "best_of" in data):
                _check_n_best_of(data)
        elif (bounds := _BOUNDS.get(key)) is not None:
            t = type(v)
            lo, hi, lo_ok = bounds
            if (t is not float and t is not int) or v > hi or v < lo or (v == lo and not lo_ok):
                raise _out_of_bounds(key, v)
        elif (check := _CHECKS.get(key)) is not None:
            check(key, v, data, chat)


def parse_request(
    path: str,
    raw: bytes,
    *,
    accept_embeds: bool = False,
    accept_media_kwargs: bool = False,
    live_usage: bool = True,
) -> ParsedRequest:
    """Parse once and check the body for `path`; raises the OpenAI 400 envelope (as APIError).
    Tensor inputs (`prompt_embeds`, chat `*_embeds` parts) only where `accept_embeds`; request
    media processing (`media_io_kwargs`, `mm_processor_kwargs`) only where
    `accept_media_kwargs`. `live_usage`: a stream asks the worker for the usage on every event
    too (tenants are charged from it when the stream is cut); without tenants nothing is charged,
    and the relay's stripping it again (~1 us an event) is not paid."""
    if not raw:
        raise bad_request("Request body is empty; expected a JSON object")
    if (why := _too_many_values(raw)) is not None:
        raise bad_request(f"Request body holds {why}")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        # orjson also rejects invalid UTF-8 here, which is what we want.
        raise bad_request(f"Request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad_request("Request body must be a JSON object")
    if _too_deep(data):
        raise bad_request(f"Request body is nested more than {MAX_DEPTH} levels deep")
    model = data.get("model")
    if model is None:
        raise bad_request("you must provide a model parameter", "model")
    if not isinstance(model, str) or not model:
        raise bad_request("`model` must be a non-empty string", "model")
    chat = path == CHAT
    if chat:
        _check_messages(data.get("messages"), accept_embeds)
        _check_tools(data.get("tools"))
    elif not _check_prompt(data.get("prompt")):
        raise bad_request(
            "`prompt` must be a non-empty string, an array of non-empty strings, or an array of "
            "token ids",
            "prompt",
        )
    if not accept_embeds and data.get("prompt_embeds") is not None:
        raise _embeds_refused("prompt_embeds", "`prompt_embeds`")
    if not accept_media_kwargs:
        for key in _MEDIA_KWARGS:
            if data.get(key) is not None:
                # vLLM uses them over the engine's own (video frames, image pixels): a media
                # part then costs any number of tokens, which no per-part charge bounds.
                raise bad_request(
                    f"`{key}` is not accepted: media processing is set by the serving stack.",
                    key,
                )
    stream = data.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("`stream` must be a boolean", "stream")
    _check_sampling(data, chat)
    opts = data.get("stream_options")
    wants_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad_request("`stream_options` must be an object", "stream_options")
        if not stream:
            raise bad_request(
                "Stream options can only be defined when `stream=True`.", "stream_options"
            )
        for k in ("include_usage", "continuous_usage_stats"):
            if (v := opts.get(k)) is not None and not isinstance(v, bool):
                raise bad_request(f"`stream_options.{k}` must be a boolean", "stream_options")
        wants_usage = opts.get("include_usage") is True
    wants_live = wants_usage and opts is not None and opts.get("continuous_usage_stats") is True
    modified = False
    # Every stream must end with usage so the gateway can account for it and, with `live_usage`,
    # every event must carry the usage so far, so a stream cut before its end is charged what it
    # generated (`gateway.settlement.charge`); the relay strips both again for clients that did
    # not ask.
    if stream and not wants_usage and not live_usage:
        data["stream_options"] = {**(opts or {}), "include_usage": True}
        modified = True
    elif stream and live_usage and not wants_live:
        data["stream_options"] = {
            **(opts or {}),
            "include_usage": True,
            "continuous_usage_stats": True,
        }
        modified = True
    return ParsedRequest(model, stream, wants_usage, data, modified, wants_live)
