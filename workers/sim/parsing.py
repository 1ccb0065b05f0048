"""Request-body parsing shared by the generation and tokenizer endpoints.

vLLM accepts several shapes for one field (a prompt as text, as token ids, or as a one-element
batch of either) and reports each wrong shape in its own way; these helpers copy that, so client
error handling sees the same messages from the simulator as from vLLM. `GenRequest`, the validated
result, is what the worker runs from, whichever endpoint the request came in on.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from workers.sim.errors import invalid, schema_error

__all__ = [
    "GenRequest",
    "is_int",
    "opt_bool",
    "parse_completion_prompt",
    "request_base_id",
]


@dataclass(slots=True)
class GenRequest:
    """A validated generation request, whichever endpoint it came from."""

    chat: bool
    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    ignore_eos: bool
    cache_salt: str | None
    base_id: str
    # `stream_options.continuous_usage_stats` (with include_usage): usage on every event too.
    continuous_usage: bool = False


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def opt_bool(body: dict[str, Any], key: str, default: bool = False, loc: str = "body") -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise schema_error(f"{loc}.{key}", "Input should be a valid boolean", "bool_type", v)
    return v


def parse_completion_prompt(prompt: Any) -> tuple[list[int] | None, str | None]:
    """vLLM accepts str | list[str] | list[int] | list[list[int]]; the sim serves one prompt."""
    if isinstance(prompt, str):
        if not prompt:
            raise schema_error(
                "body",
                "Value error, Either prompt or prompt_embeds must be provided and non-empty.",
                given={"prompt": prompt},
            )
        return None, prompt
    if isinstance(prompt, list) and prompt:
        if all(is_int(t) for t in prompt):
            if any(t < 0 for t in prompt):
                raise invalid("Token ids must be non-negative.", "prompt")
            return list(prompt), None
        if len(prompt) == 1:
            return parse_completion_prompt(prompt[0])
        if all(isinstance(p, str | list) for p in prompt):
            raise invalid("The simulator serves one prompt per request.", "prompt")
    if prompt is None:
        raise schema_error(
            "body",
            "Value error, Either prompt or prompt_embeds must be provided and non-empty.",
            given={},
        )
    raise schema_error("body.prompt", "Input should be a valid string", "string_type", prompt)


def request_base_id(headers: dict[bytes, bytes], body: dict[str, Any]) -> str:
    """vLLM reuses X-Request-Id, then the body's request_id, else a fresh random id."""
    hdr = headers.get(b"x-request-id")
    if hdr:
        return hdr.decode("latin-1")
    rid = body.get("request_id")
    if isinstance(rid, str) and rid:
        return rid
    return secrets.token_hex(8)
