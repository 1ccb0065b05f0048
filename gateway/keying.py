"""The route key: what routing knows of a request before choosing a worker (prompt-prefix block
hashes in the tenant's namespace, the session id, priority, the precise index's block chain).

Text mode hashes the rendered prompt (scoring.route_key.route_request). Token mode
(`[routing.token_mode]`) keys on the worker's own tokens and blocks, so the approximate index
agrees with vLLM's prefix cache block for block; its tokenizer runs in a thread for big bodies
(it would stall every other stream), and a request it cannot tokenize falls back to text mode
(the worker will refuse it too).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Iterable, Mapping
from typing import Any

from gateway.config import TokenModeSettings
from scoring.policy import Policy
from scoring.route_key import route_request, session_id_from
from scoring.token_mode import TokenKeyer, TokenKeyError, with_key
from scoring.views import RouteRequest, RoutingOptions, WorkerView


def load_keyers(
    t: TokenModeSettings,
    running: Mapping[str, TokenKeyer] | None = None,
    was: TokenModeSettings | None = None,
) -> dict[str, TokenKeyer]:
    """Token keyers per model, from `[routing.token_mode]` (tokenizer files, or the sim's).

    On a reload (``running`` loaded from ``was``) a model whose tokenizer directory and cache
    size did not change keeps its keyer and its warm prefix-ids cache: loading runs on the event
    loop, and reloading every model's tokenizer for an edit of ``offload_bytes`` held every
    stream and probe for seconds (review: 2.5 s for three 128k-vocabulary tokenizers)."""
    from gateway.tokenizers import SIM_TOKENIZER, load_token_keyer, sim_token_keyer

    same = running is not None and was is not None and was.cache_tokens == t.cache_tokens
    out = {}
    for m, p in t.models.items():
        k = running.get(m) if same and running is not None else None
        if k is not None and was is not None and was.models.get(m) == p:
            out[m] = k
            continue
        out[m] = (
            sim_token_keyer(t.cache_tokens)
            if p == SIM_TOKENIZER
            else load_token_keyer(p, cache_tokens=t.cache_tokens)
        )
    return out


def route_key_now(
    *,
    needs_chain: bool,
    keyer: TokenKeyer | None,
    block_size: int,
    options: RoutingOptions,
    is_chat: bool,
    data: Mapping[str, Any],
    model: str,
    namespace: str,
    session_id: str | None,
    tenant_priority: float,
    request_id: str,
    precise: bool,
    session_scope: str | None = None,
) -> RouteRequest:
    """The route key, computed in this thread: the one keying path, which the gateway (through
    `route_key`) and the offline simulator (bench/simulate.py) both take. ``keyer`` None: text
    mode; ``block_size`` the workers' (token mode); ``precise`` whether a KV-event index wants
    the block chain; ``session_scope`` the tenant's name (None: the session is scoped by
    ``namespace``, `scoring.route_key.route_request`)."""
    salt = data.get("cache_salt")
    cache_salt = salt if isinstance(salt, str) else None
    kind = "chat" if is_chat else "completion"
    chain_blocks = options.precise_max_blocks if precise else 0
    key = None
    if keyer is not None and needs_chain:
        with contextlib.suppress(TokenKeyError):  # the worker rejects it too: text mode
            key = keyer.key(
                kind,
                data,
                model=model,
                namespace=namespace,
                cache_salt=cache_salt,
                block_size=block_size,
                max_blocks=options.max_blocks,
                tail_ratio=options.tail_ratio,
                tail_blocks=options.tail_blocks,
                block_chain_blocks=chain_blocks,
            )
    route = route_request(
        kind,
        data,
        model=model,
        namespace=namespace,
        cache_salt=cache_salt,
        tenant_priority=tenant_priority,
        session_id=session_id,
        session_scope=session_scope,
        request_id=request_id,
        options=options,
        hash_prefix=needs_chain and key is None,
        block_chain_blocks=chain_blocks,
    )
    return route if key is None else with_key(route, key)


async def route_key(
    *,
    policy: Policy,
    keyers: Mapping[str, TokenKeyer],
    views: Iterable[WorkerView],
    options: RoutingOptions,
    token_mode: TokenModeSettings,
    is_chat: bool,
    data: dict[str, Any],
    raw_len: int,
    model: str,
    namespace: str,
    headers: Mapping[str, str],
    session_header: str,
    tenant_priority: float,
    request_id: str,
    precise: bool,
    session_scope: str | None = None,
    cache_model: str | None = None,
) -> RouteRequest:
    """The request's route key; ``views`` are the model's candidates (token mode reads their
    block size). A big body's tokenization runs in a thread (`route_key_now` there).
    ``cache_model``: the name its blocks are keyed under (`Registry.cache_name`), when it is
    not ``model`` (the served name, which picks the tokenizer).
    ``session_scope``: the tenant's name (`Tenant.session_scope`), which keeps its session ids
    apart from every other tenant's, shared ones included; None scopes them by ``namespace``:
    each isolated tenant apart, the shared tenants together."""
    needs_chain = getattr(policy, "needs_chain", False)
    keyer = keyers.get(model) if needs_chain else None
    bs = next((v.block_size for v in views if v.block_size), 16) if keyer is not None else 16
    now = functools.partial(
        route_key_now,
        needs_chain=needs_chain,
        keyer=keyer,
        block_size=bs,
        options=options,
        is_chat=is_chat,
        data=data,
        model=cache_model or model,
        namespace=namespace,
        session_id=session_id_from(headers, data, session_header),
        tenant_priority=tenant_priority,
        request_id=request_id,
        precise=precise,
        session_scope=session_scope,
    )
    if keyer is not None and raw_len > token_mode.offload_bytes:
        return await asyncio.to_thread(now)
    return now()
