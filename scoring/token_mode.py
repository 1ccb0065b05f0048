"""Token mode: the served model's own tokens, cut into the worker's own blocks.

Text mode (``scoring.prefix``) approximates vLLM's cache with bytes of a ChatML-like rendering, so
a matched block only *probably* corresponds to cached KV. Token mode removes the approximation:
the request is rendered with the model's chat template, tokenized with its ``tokenizer.json``
exactly as vLLM does, and the ids are cut into ``block_size``-token blocks -- the unit vLLM caches
and reports in its KV events. Entry ``i`` of the chain then names the same tokens as the worker's
block ``i``, which is what lets a KV-event index (a later issue) recompute our key from a
``BlockStored`` event's ``token_ids``: the chain is ``chain_hashes_tokens(ids, block_size, seed)``,
a pure function of the ids, the block size and ``seed_for(model, namespace, cache_salt)``, the
same function and seed text mode already uses for token-id prompts.

This module is pure: the tokenizer (``encode``) and the template (``render``) are injected, already
loaded (``gateway.tokenizers.load_token_keyer`` builds them from a model directory), so it can be
tested with any callables and never touches the disk.

Cost. Rendering is ~10-20 us; tokenizing dominates (several ms for an 8k-token chat, see the
lead's report), so the keyer keeps an LRU of *rendered prefix -> token ids* for the two prefixes
that repeat in practice: the first message (a shared system prompt) and the whole conversation so
far (the next turn of the same chat extends it). Reusing ids for a prefix is only correct where
the tokenizer is known to restart there: right after an added token that it splits out before
normalizing and pre-tokenizing (``safe_boundaries``; the loader picks them and self-checks), so
``encode(a + b) == encode(a) + encode(b)`` when ``a`` ends with such a token.

Isolation. A hit skips the tokenizer (milliseconds for a long prompt), so a cache shared by every
tenant told an isolated tenant, by the latency of its own requests (even refused ones), whether
another tenant had sent a given system prompt or conversation. Every entry therefore belongs to
one *cache scope*, the ``(namespace, cache_salt)`` pair the chain is seeded by (``seed_for``), and
is found only by a lookup in that scope: tenants that share KV on the workers share entries too,
isolated tenants and distinct salts never do.
"""

from __future__ import annotations

import array
import bisect
import dataclasses
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol

import xxhash

from scoring.chat_inputs import (
    ContentFormat,
    TokenKeyError,
    _content,
    body_bytes,
    chat_inputs,
    rendered_bytes,
)
from scoring.prefix import (
    PathKind,
    PromptKey,
    block_keys,
    chain_hashes_tokens,
    render_completion,
    seed_for,
    tail_layout,
)
from scoring.views import RouteRequest

__all__ = [
    "ChatRenderer",
    "ContentFormat",
    "Encoder",
    "TokenKeyError",
    "TokenKeyer",
    "with_key",
]

Encoder = Callable[[str], Sequence[int]]


# Token mode renders a chat body itself only while its rendered size stays within this many times
# the body's own (plus the slack): beyond, the template's output is quadratic in the body.
_MAX_RENDER_RATIO = 8
_RENDER_SLACK = 64 * 1024


class ChatRenderer(Protocol):
    """The chat template, applied as ``transformers.apply_chat_template(tokenize=False)`` does.

    ``messages`` and ``tools`` are already in the shape vLLM hands the template (``chat_inputs``);
    ``template_kwargs`` carries ``add_generation_prompt``, ``continue_final_message``,
    ``documents`` and the request's ``chat_template_kwargs``.
    """

    def __call__(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, /, **kw: Any
    ) -> str: ...


# -- rendered prefix -> ids ------------------------------------------------------------------------
# Who may reuse an entry: (namespace, cache_salt), what `seed_for` seeds a chain with apart from
# the model (one keyer serves one model). ("", "") is the shared tenants' scope.
Scope = tuple[str, str]
_CacheKey = tuple[Scope, int, int]


class _PrefixIds:
    """LRU of token ids for rendered prefixes that end on a safe boundary.

    Keyed by (cache scope, prefix length in characters, xxh3-128 of its UTF-8): one streaming
    pass over the text yields the key of every boundary, so finding the longest cached prefix
    costs O(text), not O(text x boundaries), and the cache does not hold the (possibly 100 KB)
    prefix strings. A 128-bit digest collision is the only way a wrong entry is used. The scope is
    held as is, not hashed: a lookup can only ever find an entry stored under an equal
    ``(namespace, cache_salt)``, with no digest to collide across tenants (timing-oracle review
    finding). The token budget is shared by all scopes (one tenant's volume can evict another's
    entries, which costs the other a tokenizer call, never a wrong or foreign hit).
    """

    def __init__(
        self,
        added_tokens: Collection[str],
        safe: Collection[str],
        max_tokens: int,
        min_chars: int,
    ) -> None:
        # Longest first: Python's alternation is leftmost-first, which then equals the
        # tokenizer's leftmost-longest added-token matching.
        tokens = sorted({t for t in (*added_tokens, *safe) if t}, key=len, reverse=True)
        self._re = re.compile("|".join(map(re.escape, tokens))) if tokens else None
        self._safe = frozenset(safe)
        self.max_tokens = max_tokens
        self.min_chars = min_chars
        self._lru: OrderedDict[_CacheKey, array.array[int]] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def enabled(self) -> bool:
        return self._re is not None and bool(self._safe) and self.max_tokens > 0

    @property
    def held_tokens(self) -> int:
        return self._held

    def boundaries(self, text: str, scope: Scope) -> tuple[list[int], list[_CacheKey]]:
        """Every safe cut point of ``text`` and its cache key in ``scope``, in order."""
        assert self._re is not None
        cuts: list[int] = []
        keys: list[_CacheKey] = []
        h = xxhash.xxh3_128()
        prev = 0
        safe = self._safe
        for m in self._re.finditer(text):
            if m.group() not in safe:
                continue
            b = m.end()
            h.update(text[prev:b].encode("utf-8", "surrogatepass"))
            prev = b
            cuts.append(b)
            keys.append((scope, b, h.intdigest()))
        return cuts, keys

    def get(self, keys: list[_CacheKey]) -> tuple[int, array.array[int] | None]:
        """The longest cached prefix among ``keys``: (its index, ids) or (-1, None)."""
        with self._lock:
            for i in range(len(keys) - 1, -1, -1):
                ids = self._lru.get(keys[i])
                if ids is not None:
                    self._lru.move_to_end(keys[i])
                    self.hits += 1
                    return i, ids
            self.misses += 1
        return -1, None

    def put(self, key: _CacheKey, ids: array.array[int]) -> None:
        n = len(ids)
        if n > self.max_tokens or key[1] < self.min_chars:
            return
        with self._lock:
            old = self._lru.pop(key, None)
            if old is not None:
                self._held -= len(old)
            self._lru[key] = ids
            self._held += n
            while self._held > self.max_tokens:
                _, dropped = self._lru.popitem(last=False)
                self._held -= len(dropped)


def _ids(seq: Sequence[int]) -> array.array[int]:
    try:
        return seq if isinstance(seq, array.array) else array.array("I", seq)
    except (OverflowError, TypeError) as e:
        raise TokenKeyError(f"token ids must be integers in [0, 2^32): {e}") from e


class TokenKeyer:
    """Request body -> the worker's token ids -> ``PromptKey`` (the type ``text_key`` returns).

    ``encode`` must tokenize *without* special tokens (what vLLM does to a rendered chat, whose
    template writes BOS itself); ``encode_special`` *with* them (what vLLM does to a completions
    string prompt: a Llama tokenizer adds BOS), defaulting to ``encode``. A request's own
    ``add_special_tokens`` picks between them, as it does on the worker.

    ``added_tokens`` are every string the tokenizer splits out before anything else and
    ``safe_boundaries`` those of them after which its output provably restarts; with none, or with
    ``cache_tokens=0``, no prefix ids are cached. Safe to share between threads: tokenizing an
    8k-token prompt takes milliseconds, so callers may run ``key`` off the event loop.
    """

    def __init__(
        self,
        encode: Encoder,
        render: ChatRenderer,
        *,
        encode_special: Encoder | None = None,
        content_format: ContentFormat = "string",
        developer_role: bool = True,
        added_tokens: Collection[str] = (),
        safe_boundaries: Collection[str] = (),
        cache_tokens: int = 1 << 20,
        cache_min_chars: int = 1024,
    ) -> None:
        self._encode = encode
        self._encode_special = encode_special or encode
        self._render = render
        self.content_format: ContentFormat = content_format
        self.developer_role = developer_role
        self._cache = _PrefixIds(added_tokens, safe_boundaries, cache_tokens, cache_min_chars)

    # -- introspection, for metrics and tests --
    @property
    def cache_enabled(self) -> bool:
        return self._cache.enabled

    def cache_stats(self) -> dict[str, int]:
        c = self._cache
        return {"hits": c.hits, "misses": c.misses, "held_tokens": c.held_tokens}

    # -- ids --
    def render(self, body: Mapping[str, Any]) -> str:
        """The chat prompt text the worker's template produces for ``body``."""
        rendered, size = rendered_bytes(body), body_bytes(body)
        if rendered > _MAX_RENDER_RATIO * size + _RENDER_SLACK:
            # Deep JSON a template prints indented (Llama 3.x's `tojson(indent=4)`) renders
            # quadratically: a 1 MB body was 400 MB of template output, rendered here before
            # any quota is taken (review finding). The worker renders it if it must; the
            # gateway keys it as text.
            raise TokenKeyError(f"renders to ~{rendered // max(size, 1)}x its body: keyed as text")
        try:
            # Inside the try: what normalisation cannot take falls back to text mode too.
            msgs, tools, kw = chat_inputs(
                body, content_format=self.content_format, developer_role=self.developer_role
            )
            return self._render(msgs, tools, **kw)
        except TokenKeyError:
            raise
        except Exception as e:  # template errors (raise_exception), type errors in content
            raise TokenKeyError(f"chat template failed: {e}") from e

    def token_ids(
        self,
        path_kind: PathKind,
        body: Mapping[str, Any],
        *,
        namespace: str = "",
        cache_salt: str | None = None,
    ) -> array.array[int]:
        """The prompt token ids the worker computes KV for (token-id prompts: the ids as given).

        ``namespace`` and ``cache_salt`` (None: the body's own) are the request's cache scope,
        as `key` takes them: cached prefix ids are reused only within one scope."""
        if path_kind == "chat":
            text = self.render(body)
            if body.get("add_special_tokens", False) is True:
                return self._encode_with(self._encode_special, text)
            first = self._first_text(body)
            return self._encode_plain(text, first, (namespace, _salt_of(body, cache_salt)))
        prompt = render_completion(body.get("prompt"))
        if isinstance(prompt, list):
            return _ids(prompt)
        plain = body.get("add_special_tokens", True) is False
        return self._encode_with(self._encode if plain else self._encode_special, prompt)

    def key(
        self,
        path_kind: PathKind,
        body: Mapping[str, Any],
        *,
        model: str,
        namespace: str = "",
        cache_salt: str | None = None,
        block_size: int = 16,
        max_blocks: int = 256,
        tail_ratio: int = 0,
        tail_blocks: int = 0,
        block_chain_blocks: int = 0,
    ) -> PromptKey:
        """The request's PromptKey in the worker's blocks: chain over full ``block_size`` blocks.

        With ``block_chain_blocks``, also one key per worker block (up to that many, no tail):
        what the precise index keys the worker's KV events by.

        Same seed and hash as text mode's token-id path (``seed_for``, ``chain_hashes_tokens``),
        so the same ids key the same chain whichever mode saw them; ``prompt_tokens`` is exact.
        Raises ``TokenKeyError`` when the request cannot be tokenized (fall back to text mode).
        """
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        salt = _salt_of(body, cache_salt)
        ids = self.token_ids(path_kind, body, namespace=namespace, cache_salt=salt)
        chain = chain_hashes_tokens(
            ids,
            block_size=block_size,
            seed=seed_for(model, namespace, salt),
            max_blocks=max_blocks,
            tail_ratio=tail_ratio,
            tail_blocks=tail_blocks,
        )
        ends = tail_layout(max_blocks, tail_ratio, tail_blocks) if tail_ratio > 0 else ()
        blocks = (
            block_keys(ids, block_size, model, salt, block_chain_blocks)
            if block_chain_blocks > 0
            else []
        )
        total = len(ids) if path_kind == "chat" else self._batch_tokens(body, len(ids))
        return PromptKey(chain, float(len(ids)), float(block_size), max_blocks, ends, blocks, total)

    def _batch_tokens(self, body: Mapping[str, Any], first: int) -> int:
        """Every prompt token of a completions request, ``first`` being its first prompt's.

        The chain stands for a batch by its first prompt (`render_completion`); the input cap
        must not: the rest of a batch and the suffix (counted in every prompt, as the estimate
        counts it) held any number of finely tokenizing tokens past `max_input_tokens` (review:
        a 130-token cap let 497 through)."""
        prompt = body.get("prompt")
        batch = prompt if type(prompt) is list and prompt and type(prompt[0]) is not int else ()
        total = first
        if batch:
            enc = self._encode if body.get("add_special_tokens", True) is False else None
            for p in batch[1:]:
                if isinstance(p, list):
                    total += len(p)
                else:
                    total += len(self._encode_with(enc or self._encode_special, str(p)))
        suffix = body.get("suffix")
        if isinstance(suffix, str) and suffix:
            total += (len(batch) or 1) * len(self._encode_with(self._encode, suffix))
        return total

    # -- internals --
    def _encode_with(self, enc: Encoder, text: str) -> array.array[int]:
        try:
            return _ids(enc(text))
        except TokenKeyError:
            raise
        except Exception as e:
            raise TokenKeyError(f"tokenizer failed: {e}") from e

    def _first_text(self, body: Mapping[str, Any]) -> str:
        """The first message's text, to find where the shared system prompt ends when rendered."""
        msgs = body.get("messages")
        if not isinstance(msgs, Sequence) or not msgs or not isinstance(msgs[0], Mapping):
            return ""
        c = _content(msgs[0].get("content"), "string")
        return c if isinstance(c, str) else ""

    def _encode_plain(self, text: str, first: str, scope: Scope) -> array.array[int]:
        """``encode(text)``, reusing the ids of its longest safe prefix cached in ``scope``.

        Cut points are stored for the end of the first message (a system prompt shared across
        users) and the end of the text (the next turn of this conversation starts with it). A
        miss encodes the text in pieces at those cut points, which costs the same as one call, so
        a miss never pays twice to fill the cache.
        """
        cache = self._cache
        if not cache.enabled or len(text) < cache.min_chars:
            return self._encode_with(self._encode, text)
        cuts, keys = cache.boundaries(text, scope)
        if not cuts:
            return self._encode_with(self._encode, text)
        hit, cached = cache.get(keys)
        start = cuts[hit] if hit >= 0 else 0
        store: list[int] = []  # indices into cuts/keys to fill
        first = first.strip()  # many templates trim the content they print
        pos = text.find(first) if first else -1
        if pos >= 0:
            i = bisect.bisect_left(cuts, pos + len(first))
            if hit < i < len(cuts):
                store.append(i)
        last = len(cuts) - 1
        if last > hit and last not in store:
            store.append(last)
        store.sort()
        out = array.array("I", cached) if cached is not None else array.array("I")
        pos = start
        for i in store:
            b = cuts[i]
            out.extend(self._encode_with(self._encode, text[pos:b]))
            pos = b
            cache.put(keys[i], array.array("I", out))
        if pos < len(text):
            out.extend(self._encode_with(self._encode, text[pos:]))
        return out


def _salt_of(body: Mapping[str, Any], cache_salt: str | None) -> str:
    """The salt a request's chain is seeded by: the caller's, else the body's own."""
    return cache_salt if cache_salt is not None else str(body.get("cache_salt") or "")


def with_key(route: RouteRequest, key: PromptKey) -> RouteRequest:
    """``route`` (from ``route_request(..., hash_prefix=False)``) carrying ``key``'s chain.

    Lets the gateway keep ``route_request`` for everything else it decides (session scoping,
    priority) and swap in a token-mode key, without a second code path building RouteRequests.
    """
    return dataclasses.replace(
        route,
        chain=tuple(key.chain),
        block_tokens=key.block_tokens,
        prompt_tokens=round(key.prompt_tokens),
        dense_blocks=key.dense_blocks,
        tail_ends=key.tail_ends,
        block_chain=tuple(key.blocks),
        exact_tokens=key.input_tokens or round(key.prompt_tokens),
    )
