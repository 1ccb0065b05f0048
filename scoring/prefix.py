"""Request -> the text a worker will see -> chained 64-bit block hashes.

vLLM caches KV in fixed blocks and finds a cached block by a hash of the block *and everything
before it*. Routing wants the same notion without a tokenizer on the request path: render the
request the way a chat template would (roles, tools, order all change the tokens, so they must
change the text), cut the UTF-8 encoding into fixed blocks (about one vLLM block's worth, 64 bytes
~ 16 tokens), and chain each block's xxh3-64 to its parent through the seed:
``h_i = xxh3_64(block_i, seed=h_{i-1})``, ``h_-1 = seed_for(model, namespace, cache_salt)``. A
block hash therefore names its whole prefix, which lets the index answer "who holds the first k
blocks" with plain dict lookups and no tree.

Blocks are cut in UTF-8 bytes rather than code points: it is cheaper (one ``encode``, one
``struct.unpack_from``) and bytes track tokens more evenly across scripts than characters do (a CJK
character is ~1 token and 3 bytes, an English token ~4 bytes). ``block_chars`` keeps its name: for
ASCII text it *is* characters.

The chain is a dense head of single blocks (``max_blocks``, 64 by default: ~1k tokens at full
resolution) followed by a *tail* of spans that grow with depth (``tail_layout``: each 1/16 of what
precedes it), so a match is resolved to within ~6% of any prompt up to ~2M tokens in ~150 entries:
a 32k-token prompt is 122 entries instead of 2,000 dense blocks.

Cost (measured, CPython 3.11, quiet machine): ~53 ns per dense block plus ~0.1-0.2 us per tail
span; ~10 us for an 8k-token prompt (99 entries), rendering a 32k-character chat ~3 us. Per-entry
Python overhead dominates, so blocks are cut by one C-level ``struct`` unpack and the chain runs
through xxh3's seed (one C call per entry, no concatenation, no digest object).

A full dense head is the part requests share most (a system prompt, an agent's preamble, the
earlier turns of a conversation), so its hashes are memoised from its second sighting on
(``_HEADS``): one xxh3-128 call over the head's 4 KiB and a byte compare replace 64 chained calls
(2.0 instead of 7.8 us on the 2-core development VM), while a head not seen before costs ~1.2 us
more (the digest and the doorkeeper). The memo is exact (the head's bytes are compared, not just
its digest), so a chain never depends on what was hashed before.
"""

from __future__ import annotations

import array
import bisect
import contextlib
import functools
import itertools
import json
import struct
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import xxhash

__all__ = [
    "PathKind",
    "PromptKey",
    "chain_hashes_text",
    "chain_hashes_tokens",
    "render_chat",
    "render_completion",
    "request_chain",
    "seed_for",
    "tail_layout",
    "text_key",
]

PathKind = Literal["chat", "completion"]

_h64 = xxhash.xxh3_64_intdigest
_h128 = xxhash.xxh3_128_intdigest
_MASK64 = (1 << 64) - 1

# The dense-head memo (module docstring). _HEADS: xxh3-128 of the head, seeded by the chain's seed
# -> (seed, block bytes, head, its chain), for heads seen at least twice; a hit is checked against
# all three, so a digest collision costs a recomputation, never a wrong chain. Bounded by bytes
# (the head plus ~48 B per hash): 8 MiB is ~1,100 default 4 KiB heads, more distinct shared heads
# than a fleet serves at once. First in, first out, one entry per insert (emptying it at once would
# free ~70k objects inside one routing decision, ~2 ms), and ``popitem`` is one atomic step, so
# token mode's worker threads share it without a lock.
# _SEEN, the doorkeeper: the digests of heads seen once lately, one per slot (digest mod size, a
# newer head overwrites). A head is memoised at its second sighting, so a stream of one-off prompts
# neither pays for storing and evicting chains (~1 us each) nor flushes the shared heads out.
_HEADS: OrderedDict[int, tuple[int, int, bytes, tuple[int, ...]]] = OrderedDict()
HEAD_MEMO_BYTES = 8 << 20
# Longer heads are not memoised: the precise index's per-block keys (up to 8,192 blocks, 512 KiB)
# are one long head whose copy and digest would cost ~10% of hashing it, for rare exact repeats.
_HEAD_MEMO_MAX = 64 << 10
_SEEN_SLOTS = 8192  # a power of two
_SEEN: list[int] = [0] * _SEEN_SLOTS

# ChatML-style markers: the shape most current templates (Qwen, many fine-tunes) produce. The exact
# template does not matter for routing as long as it is deterministic and keeps roles, order and
# message boundaries in the text, and a shared conversation prefix renders to a shared text prefix.
_START = "<|im_start|>"
_END = "<|im_end|>\n"
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})


@functools.lru_cache(maxsize=4096)  # a handful of (model, tenant, salt) serve most requests
def seed_for(model: str, namespace: str = "", cache_salt: str = "") -> int:
    """The chain's root: the same text under another model, tenant namespace or salt never matches.

    vLLM keys its own cache by ``cache_salt``, so two tenants isolated by salt really do not share
    blocks on a worker; seeding by it keeps the index from claiming they do.
    """
    key = f"{model}\x00{namespace}\x00{cache_salt}".encode()
    return _h64(key)


def _dump(obj: Any) -> str:
    # Client key order is kept (the worker's template serialises what it received, in that order).
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), default=str)


def _content_text(content: Any) -> str:
    """A message's content as text; non-text parts become short stable placeholders.

    An image or audio part changes the KV the worker computes, so it must change the hash, but its
    base64 payload can be megabytes: a placeholder carrying the payload's hash is enough.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Mapping):
        content = [content]
    if not isinstance(content, Iterable):
        return str(content)
    out: list[str] = []
    for part in content:
        if isinstance(part, str):
            out.append(part)
            continue
        if not isinstance(part, Mapping):
            out.append(str(part))
            continue
        kind = part.get("type", "text")
        if kind is None or (isinstance(kind, str) and kind in _TEXT_PARTS):
            out.append(str(part.get("text", "")))
        else:
            payload = part.get(kind, part) if isinstance(kind, str) else part
            out.append(f"<|{kind}:{_h64(_dump(payload).encode()):016x}|>")
    return "".join(out)


def _tool_calls_text(calls: Any) -> str:
    if not calls or not isinstance(calls, Sequence):
        return ""
    out: list[str] = []
    for call in calls:
        if not isinstance(call, Mapping):
            out.append(f"<tool_call>{_dump(call)}</tool_call>")
            continue
        fn = call.get("function")
        if isinstance(fn, Mapping):
            args = fn.get("arguments", "")
            if not isinstance(args, str):
                args = _dump(args)
            out.append(
                f'<tool_call>{{"name":{_dump(fn.get("name"))},"arguments":{args}}}</tool_call>'
            )
        else:
            out.append(f"<tool_call>{_dump(call)}</tool_call>")
    return "\n".join(out)


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Any] | None = None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """Chat messages (+ tools) as one ChatML-like string, in the order the worker's template uses.

    Tools go inside the leading system block, after the system text, as most templates put them:
    two requests with the same system prompt share it whether or not they carry tools. The
    generation prompt (``<|im_start|>assistant\\n``) is rendered too, so turn N+1 of a conversation,
    which contains turn N's reply, extends turn N's text exactly as it extends its tokens.

    Parsed JSON is plain dicts and strs, so those are tested by exact type first: an
    ``isinstance(m, Mapping)`` ABC check costs ~0.2 us, per message, on every routed request.
    """
    parts: list[str] = []
    msgs = list(messages)
    first = 0
    system_text: str | None = None
    system_role: Any = "system"
    m0 = msgs[0] if msgs else None
    if (type(m0) is dict or isinstance(m0, Mapping)) and m0.get("role") in ("system", "developer"):
        system_role = m0.get("role")
        content = m0.get("content")
        system_text = content if type(content) is str else _content_text(content)
        first = 1
    if system_text is not None or tools:
        block = system_text or ""
        if tools:
            block += "\n\n# Tools\n" + "\n".join(_dump(t) for t in tools)
        parts += (_START, str(system_role), "\n", block, _END)
    last = len(msgs) - 1
    for i in range(first, len(msgs)):
        m = msgs[i]
        if type(m) is not dict and not isinstance(m, Mapping):
            parts += (_START, "user\n", str(m), _END)
            continue
        role = m.get("role", "user")
        if type(role) is not str:
            role = str(role)
        parts += (_START, role)
        name = m.get("name")
        if name:
            parts += (" name=", str(name))
        if role == "tool" and m.get("tool_call_id"):
            parts += (" id=", str(m["tool_call_id"]))
        parts.append("\n")
        content = m.get("content")
        parts.append(content if type(content) is str else _content_text(content))
        reasoning = m.get("reasoning_content")
        if reasoning:
            parts += ("<think>", str(reasoning), "</think>")
        calls = m.get("tool_calls")
        if calls:
            calls = _tool_calls_text(calls)
            if calls:
                parts += ("\n", calls)
        if not (continue_final_message and i == last):
            parts.append(_END)
    if add_generation_prompt and not continue_final_message:
        parts += (_START, "assistant\n")
    return "".join(parts)


_INTS = frozenset({int})


def render_completion(prompt: Any) -> str | list[int]:
    """A completions ``prompt`` as the worker sees it: text as is, token ids as ids.

    A batch (list of prompts) is routed as one request; its first prompt stands for the batch, which
    is what decides whether the worker can reuse a cached prefix for the bulk of it.
    """
    if prompt is None:
        return ""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence) and not isinstance(prompt, bytes | bytearray):
        if not prompt:
            return ""
        head = prompt[0]
        if isinstance(head, int) and not isinstance(head, bool):
            if type(prompt) is list and _INTS.issuperset(map(type, prompt)):
                return prompt  # the usual case, checked in C: no copy of 100k ids
            return list(map(int, prompt))
        return render_completion(head)
    return str(prompt)


@functools.lru_cache(maxsize=64)
def tail_layout(dense: int, ratio: int, entries: int) -> tuple[int, ...]:
    """Where the tail's entries end, in blocks from the start of the prompt (cumulative).

    Each tail entry spans ``covered // ratio`` blocks (at least one), so a match is resolved to
    within ~1/ratio of the prompt at any depth: fine where prompts are short, coarse where only
    the share matters. With ratio 16 after a 64-block head, 160 entries reach ~12 MiB of text.
    """
    ends: list[int] = []
    covered = dense
    for _ in range(entries):
        covered += max(1, covered // ratio)
        ends.append(covered)
    return tuple(ends)


def chain_hashes_text(
    text: str | bytes,
    *,
    block_chars: int = 64,
    seed: int,
    max_blocks: int = 256,
    tail_ratio: int = 0,
    tail_blocks: int = 0,
) -> list[int]:
    """Chained hashes of the full ``block_chars``-byte blocks of ``text`` (at most ``max_blocks``),
    then, if ``tail_ratio`` and ``tail_blocks`` are set, of up to ``tail_blocks`` growing spans of
    blocks laid out by ``tail_layout``: the *tail*.

    Only full blocks (spans) are hashed, as vLLM only caches full blocks: a trailing partial block
    can never be a hit on a worker. The tail exists because long prompts (agents re-sending a 70k
    token context behind a 16k-token shared preamble) look alike within any affordable dense
    window, while 2,000 dense blocks cost ~0.1 ms to hash and 2,000 index entries per request.
    Every tail hash is still chained through the whole prefix.
    """
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if block_chars <= 0:
        raise ValueError("block_chars must be positive")
    n = min(len(data) // block_chars, max_blocks)
    if n <= 0:
        return []
    f = _h64
    h = seed & _MASK64
    size = n * block_chars
    if n == max_blocks and size <= _HEAD_MEMO_MAX and type(data) is bytes:  # module docstring
        head = data[:size]
        digest = _h128(head, h)
        hit = _HEADS.get(digest)
        if hit is not None and hit[0] == h and hit[1] == block_chars and hit[2] == head:
            out = list(hit[3])
        else:
            seed_h = h
            blocks = (
                _blocks(block_chars, n).unpack_from(data)
                if n <= _BLOCKS_CACHED
                else _many_blocks(data, block_chars, n)
            )
            out = [h := f(block, h) for block in blocks]
            slot = digest & (_SEEN_SLOTS - 1)
            if _SEEN[slot] != digest:  # first sighting: remember it, keep nothing
                _SEEN[slot] = digest
            else:
                if len(_HEADS) >= HEAD_MEMO_BYTES // (size + 48 * n):
                    with contextlib.suppress(KeyError):  # another thread emptied it meanwhile
                        _HEADS.popitem(last=False)
                _HEADS[digest] = (seed_h, block_chars, head, tuple(out))
    else:
        # One C-level unpack into n block-sized bytes objects, then one C call per block: half the
        # per-block cost of slicing in a Python loop (53 vs 110 ns/block measured).
        blocks = (
            _blocks(block_chars, n).unpack_from(data)
            if n <= _BLOCKS_CACHED
            else _many_blocks(data, block_chars, n)
        )
        out = [h := f(block, h) for block in blocks]
    if n == max_blocks and tail_ratio > 0 and tail_blocks > 0:
        ends = tail_layout(max_blocks, tail_ratio, tail_blocks)
        m = bisect.bisect_right(ends, len(data) // block_chars)
        if m > 0:
            h = out[-1]
            spans = _spans(block_chars, max_blocks, tail_ratio, tail_blocks, m)
            out += [h := f(block, h) for block in spans.unpack_from(data, n * block_chars)]
    return out


# A Struct of n blocks costs ~34 bytes per block for as long as it is cached, and n comes from
# prompt lengths (up to the precise index's 8,192 blocks) and from workers' events (any length):
# 4,096 cached long Structs held hundreds of MiB. Only short runs are cached (the text chain's dense
# head is at most 64 blocks); a longer one is unpacked a cached run at a time. Cached, at most
# 4,096 x 256 blocks: ~18 MiB even if every entry is a different block size.
_BLOCKS_CACHED = 256


@functools.lru_cache(maxsize=4096)
def _blocks(block_chars: int, n: int) -> struct.Struct:
    if n > _BLOCKS_CACHED:
        raise ValueError(f"{n} blocks: unpack more than {_BLOCKS_CACHED} with _many_blocks")
    return struct.Struct(f"{block_chars}s" * n)


def _many_blocks(data: bytes, block_chars: int, n: int) -> Iterable[bytes]:
    """The first ``n`` blocks of ``data``, as one Struct of ``n`` blocks would unpack them,
    through cached Structs of at most ``_BLOCKS_CACHED`` blocks (iterated in C)."""
    full, rest = divmod(n, _BLOCKS_CACHED)
    run = _blocks(block_chars, _BLOCKS_CACHED).unpack_from
    step = block_chars * _BLOCKS_CACHED
    runs = [run(data, off) for off in range(0, full * step, step)]
    if rest:
        runs.append(_blocks(block_chars, rest).unpack_from(data, full * step))
    return itertools.chain.from_iterable(runs)


@functools.lru_cache(maxsize=4096)
def _spans(block_chars: int, dense: int, ratio: int, entries: int, m: int) -> struct.Struct:
    ends = tail_layout(dense, ratio, entries)[:m]
    starts = (dense, *ends[:-1])
    return struct.Struct(
        "".join(f"{(e - s) * block_chars}s" for s, e in zip(starts, ends, strict=True))
    )


def chain_hashes_tokens(
    token_ids: Sequence[int],
    *,
    block_size: int,
    seed: int,
    max_blocks: int = 256,
    tail_ratio: int = 0,
    tail_blocks: int = 0,
) -> list[int]:
    """Chained hashes of full ``block_size``-token blocks, the unit vLLM itself caches (and the
    same tail as ``chain_hashes_text``).

    Ids are packed as uint32 (vocabularies are far below 2^32) so a block hashes its ids, not their
    decimal spelling.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    n = min(len(token_ids) // block_size, max_blocks)
    if n == 0:
        return []
    used = n * block_size
    if n == max_blocks and tail_ratio > 0 and tail_blocks > 0:
        ends = tail_layout(max_blocks, tail_ratio, tail_blocks)
        m = bisect.bisect_right(ends, len(token_ids) // block_size)
        if m:
            used = ends[m - 1] * block_size
    arr = array.array("I", token_ids[:used])
    # The real max_blocks, not n: the same chain either way, but only a full head is a head worth
    # memoising (a shorter prompt is all head, and rarely sent twice).
    return chain_hashes_text(
        arr.tobytes(),
        block_chars=block_size * arr.itemsize,
        seed=seed,
        max_blocks=max_blocks,
        tail_ratio=tail_ratio,
        tail_blocks=tail_blocks,
    )


def block_keys(
    token_ids: Sequence[int], block_size: int, model: str, cache_salt: str, max_blocks: int
) -> list[int]:
    """One key per full worker block, as the precise (KV-event) index keys a worker's blocks.

    Seeded by what the worker itself sees (model or LoRA name, ``cache_salt``), never by the
    gateway's namespace: the events are keyed without knowing which tenant sent the blocks, and
    vLLM isolates tenants by the salt alone (an isolated tenant always carries its own).
    """
    return chain_hashes_tokens(
        token_ids,
        block_size=block_size,
        seed=seed_for(model, "", cache_salt),
        max_blocks=max_blocks,
    )


class PromptKey(NamedTuple):
    """A prompt's routing key: its chain and what the chain's entries stand for."""

    chain: list[int]
    prompt_tokens: float  # the whole prompt, estimated for text (may exceed what the chain covers)
    block_tokens: float  # tokens per block
    dense_blocks: int  # entries [0, dense_blocks) are single blocks; later ones are tail spans
    tail_ends: tuple[int, ...]  # tail entry i ends after tail_ends[i] blocks (tail_layout)
    # Token mode with KV events: one key per worker block, no tail (``RouteRequest.block_chain``).
    blocks: Sequence[int] = ()
    # Token mode: every prompt token the request holds, counted by the tokenizer (a batch's
    # every prompt, a completions suffix in each), which `prompt_tokens` (the first) is not.
    input_tokens: int = 0


def text_key(
    path_kind: PathKind,
    body: Mapping[str, Any],
    *,
    model: str,
    namespace: str = "",
    cache_salt: str | None = None,
    block_chars: int = 64,
    max_blocks: int = 256,
    token_block_size: int = 16,
    chars_per_token: float = 4.0,
    tail_ratio: int = 0,
    tail_blocks: int = 0,
    block_chain_blocks: int = 0,
) -> PromptKey:
    """A request body's PromptKey: rendered, hashed and sized (token counts estimated for text).

    ``prompt_tokens`` covers the whole prompt, not just the hashed part, so a scorer can tell how
    much of a long prompt a match covers. Exact for token-id prompts; UTF-8 bytes / chars_per_token
    for text.
    """
    salt = cache_salt if cache_salt is not None else str(body.get("cache_salt") or "")
    seed = seed_for(model, namespace, salt)
    if path_kind == "chat":
        text: str | list[int] = render_chat(
            body.get("messages") or (),
            body.get("tools"),
            add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            continue_final_message=bool(body.get("continue_final_message", False)),
        )
    else:
        text = render_completion(body.get("prompt"))
    ends = tail_layout(max_blocks, tail_ratio, tail_blocks) if tail_ratio > 0 else ()
    if isinstance(text, list):
        chain = chain_hashes_tokens(
            text,
            block_size=token_block_size,
            seed=seed,
            max_blocks=max_blocks,
            tail_ratio=tail_ratio,
            tail_blocks=tail_blocks,
        )
        blocks = (
            block_keys(text, token_block_size, model, salt, block_chain_blocks)
            if block_chain_blocks > 0
            else []
        )
        return PromptKey(chain, float(len(text)), float(token_block_size), max_blocks, ends, blocks)
    # surrogatepass: JSON may carry lone surrogates (stdlib json accepts "\\ud800"); never raise
    data = text.encode("utf-8", "surrogatepass")
    chain = chain_hashes_text(
        data,
        block_chars=block_chars,
        seed=seed,
        max_blocks=max_blocks,
        tail_ratio=tail_ratio,
        tail_blocks=tail_blocks,
    )
    return PromptKey(
        chain, len(data) / chars_per_token, block_chars / chars_per_token, max_blocks, ends
    )


def request_chain(
    path_kind: PathKind,
    body: Mapping[str, Any],
    *,
    model: str,
    namespace: str = "",
    block_chars: int = 64,
    max_blocks: int = 256,
    cache_salt: str | None = None,
    token_block_size: int = 16,
    tail_ratio: int = 0,
    tail_blocks: int = 0,
) -> list[int]:
    """The chained block hashes of a chat or completions request body."""
    return text_key(
        path_kind,
        body,
        model=model,
        namespace=namespace,
        cache_salt=cache_salt,
        block_chars=block_chars,
        max_blocks=max_blocks,
        token_block_size=token_block_size,
        tail_ratio=tail_ratio,
        tail_blocks=tail_blocks,
    ).chain
