"""Request bodies: size-capped read, one JSON parse, and the checks that must hold before any
worker sees the request. Unknown fields are kept and forwarded: vLLM grows extensions
(`ignore_eos`, `cache_salt`, ...) faster than a gateway should track them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request

from gateway.errors import APIError, bad_request

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


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The body, capped at ``limit`` bytes and ``timeout_s`` seconds: a client that dribbles or
    stalls its upload would otherwise hold a connection and a task forever (uvicorn has no body
    timeout of its own), a cheap way to exhaust a gateway."""
    if timeout_s is None:
        return await _read_body(request, limit)
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_body(request, limit)
    except TimeoutError:
        raise APIError(
            408,
            f"The request body did not arrive within {timeout_s:g} seconds",
            "invalid_request_error",
            code="request_timeout",
        ) from None


async def _read_body(request: Request, limit: int) -> bytes:
    cl = request.headers.get("content-length")
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


def _too_deep(raw: bytes, data: Any) -> bool:
    """Whether `data` nests deeper than orjson can serialize it again (MAX_DEPTH levels)."""
    # A body cannot nest deeper than it has brackets: that count (C speed) clears nearly all.
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return False
    try:
        orjson.dumps(data)  # what parsed can only fail to serialize by depth
    except orjson.JSONEncodeError:
        return True
    return False


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    if not isinstance(prompt, list) or not prompt:
        return False
    first = prompt[0]
    if isinstance(first, str):
        return all(isinstance(p, str) for p in prompt)
    if _is_int(first):
        return all(_is_int(p) and p >= 0 for p in prompt)
    if isinstance(first, list):
        return all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt)
    return False


def parse_request(path: str, raw: bytes) -> ParsedRequest:
    if not raw:
        raise bad_request("Request body is empty; expected a JSON object")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        # orjson also rejects invalid UTF-8 here, which is what we want.
        raise bad_request(f"Request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad_request("Request body must be a JSON object")
    if _too_deep(raw, data):
        raise bad_request(f"Request body is nested more than {MAX_DEPTH} levels deep")
    model = data.get("model")
    if model is None:
        raise bad_request("you must provide a model parameter", "model")
    if not isinstance(model, str) or not model:
        raise bad_request("`model` must be a non-empty string", "model")
    if path == CHAT:
        msgs = data.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise bad_request("`messages` must be a non-empty array", "messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise bad_request(f"`messages[{i}]` must be an object with a `role`", "messages")
    elif not _check_prompt(data.get("prompt")):
        raise bad_request(
            "`prompt` must be a string, an array of strings, or an array of token ids", "prompt"
        )
    stream = data.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("`stream` must be a boolean", "stream")
    for key in ("max_tokens", "max_completion_tokens", "n"):
        v = data.get(key)
        if v is not None and (not _is_int(v) or v < 1):
            raise bad_request(f"`{key}` must be a positive integer", key)
    opts = data.get("stream_options")
    wants_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad_request("`stream_options` must be an object", "stream_options")
        if not stream:
            raise bad_request(
                "Stream options can only be defined when `stream=True`.", "stream_options"
            )
        wants_usage = opts.get("include_usage") is True
    modified = False
    if stream and not wants_usage:
        # Every stream must end with usage so the gateway can account for it; the relay strips
        # that chunk again for clients that did not ask.
        data["stream_options"] = {**(opts or {}), "include_usage": True}
        modified = True
    return ParsedRequest(model, stream, wants_usage, data, modified)
