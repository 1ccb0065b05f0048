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

__all__ = ["route_request", "scoped_session_id", "session_id_from"]

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


def scoped_session_id(scope: str, session_id: str) -> str:
    """``session_id`` within ``scope`` (a tenant), unambiguously: no (scope, id) pair, whatever
    characters either holds, spells another pair's key.

    A scoped key is ``f"{len(scope)}:{scope}\\x00{id}"``: the length prefix ends the scope
    exactly, so one scope's ids cannot reach into another's. Only an id in the empty scope (no
    tenant, or a shared tenant when no name is passed) with no NUL stays as it is (what the
    simulator and an open gateway key by); one with a NUL is prefixed ``"0:\\x00"`` like any
    scoped key. Raw keys have no NUL and scoped ones have one, so neither can equal the other.
    Scoping only isolated tenants as ``f"{namespace}\\x00{id}"`` let a shared tenant send
    ``user = "tenant:a\\u0000alice"`` and land on isolated tenant a's session "alice", following
    or re-pinning a's pin and learning its worker from ``x-kvgate-worker``.
    """
    if not scope and "\x00" not in session_id:
        return session_id
    return f"{len(scope)}:{scope}\x00{session_id}"


def route_request(
    path_kind: PathKind,
    body: Mapping[str, Any],
    *,
    model: str | None = None,
    namespace: str = "",
    cache_salt: str | None = None,
    tenant_priority: float = 0.5,
    session_id: str | None = None,
    session_scope: str | None = None,
    request_id: str = "",
    options: RoutingOptions | None = None,
    hash_prefix: bool = True,
    block_chain_blocks: int = 0,
) -> RouteRequest:
    """A request body -> its RouteRequest: rendered, hashed (if ``hash_prefix``) and sized once.

    ``namespace`` is the tenant's cache namespace (empty for shared caches). The session id is
    always scoped (``scoped_session_id``) by ``session_scope``, the tenant's name, so two
    tenants' ``user="alice"`` are different sessions, shared tenants' too; without one, by
    ``namespace``: isolated tenants apart from each other and from the shared ones.
    """
    o = options or _DEFAULT_OPTIONS
    model = model if model is not None else str(body.get("model") or "")
    if session_id is not None:
        scope = namespace if session_scope is None else session_scope
        session_id = scoped_session_id(scope, session_id)
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
