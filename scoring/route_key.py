"""Building a request's routing key: what routing knows of a request before choosing a worker.

``route_request`` renders and hashes the prompt once (``scoring.prefix.text_key``) into a
``RouteRequest`` that every attempt of the request reuses; ``session_id_from`` finds its session
id. Kept apart from the policies (``scoring.policy``), which only read the key: the gateway
(``gateway.keying``), the simulator and the benches build it, passing the policy's ``options`` (so
chains match its index's block size) and ``needs_chain`` (so no hashing when it reads no chain).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import xxhash

from scoring.prefix import PathKind, text_key
from scoring.views import RouteRequest, RoutingOptions

__all__ = ["route_request", "session_id_from"]

_DEFAULT_OPTIONS = RoutingOptions()
_MAX_SESSION_ID = 128


def session_id_from(
    headers: Mapping[str, str], body: Mapping[str, Any], header: str = "x-session-id"
) -> str | None:
    """The session id: the configured header, else the body's ``user`` or ``prompt_cache_key``.

    Ids longer than 128 characters are replaced by their hash so a client cannot grow the session
    table's memory with huge ids.
    """
    sid: Any = headers.get(header)
    if sid is None and header.lower() != header:
        sid = headers.get(header.lower())
    if not sid:
        sid = body.get("user") or body.get("prompt_cache_key")
    if not sid or not isinstance(sid, str):
        return None
    if len(sid) > _MAX_SESSION_ID:
        sid = "h:" + xxhash.xxh3_128_hexdigest(sid.encode())
    return sid


def route_request(
    path_kind: PathKind,
    body: Mapping[str, Any],
    *,
    model: str | None = None,
    namespace: str = "",
    cache_salt: str | None = None,
    tenant_priority: float = 0.5,
    session_id: str | None = None,
    request_id: str = "",
    options: RoutingOptions | None = None,
    hash_prefix: bool = True,
    block_chain_blocks: int = 0,
) -> RouteRequest:
    """A request body -> its RouteRequest: rendered, hashed (if ``hash_prefix``) and sized once.

    ``namespace`` is the tenant's cache namespace (empty for shared caches) and also scopes the
    session id, so two tenants' ``user="alice"`` are different sessions.
    """
    o = options or _DEFAULT_OPTIONS
    model = model if model is not None else str(body.get("model") or "")
    if session_id is not None and namespace:
        session_id = f"{namespace}\x00{session_id}"
    if not hash_prefix:
        return RouteRequest(
            model=model,
            request_id=request_id,
            tenant_priority=tenant_priority,
            session_id=session_id,
        )
    k = text_key(
        path_kind,
        body,
        model=model,
        namespace=namespace,
        cache_salt=cache_salt,
        block_chars=o.block_chars,
        max_blocks=o.max_blocks,
        token_block_size=o.token_block_size,
        chars_per_token=o.chars_per_token,
        tail_ratio=o.tail_ratio,
        tail_blocks=o.tail_blocks,
        block_chain_blocks=block_chain_blocks,
    )
    # Positional, in field order: keywords make CPython build a dict to call a dataclass __init__.
    return RouteRequest(
        model,
        request_id,
        tenant_priority,
        tuple(k.chain),
        k.block_tokens,
        round(k.prompt_tokens),
        session_id,
        k.dense_blocks,
        k.tail_ends,
        tuple(k.blocks),
    )
