"""Token mode's prefix-ids cache is scoped by the request's cache scope (namespace, cache_salt).

A hit skips the tokenizer (milliseconds for a long prompt), so a cache shared across isolated
tenants was a timing oracle: an isolated tenant learned, by the latency of its own requests (even
429s), whether another tenant had sent a given system prompt or conversation (review finding 4).
Entries are now found only by a lookup in the scope that stored them; tenants that share KV
(same namespace and salt) still share them, and one tenant's repeats still hit.

The tokenizer here is a counting character-level one (``encode(a + b) == encode(a) + encode(b)``
everywhere), so what was tokenized afresh is exact and no model files are needed.
"""

from __future__ import annotations

from typing import Any

import pytest

from scoring.token_mode import TokenKeyer

START, END = "<|im_start|>", "<|im_end|>"
SYSTEM = "You are the billing team's private assistant; account 4471 is frozen. " * 40
MODEL = "m"


class Counting:
    """A character-level tokenizer that records how many characters it was asked to encode."""

    def __init__(self) -> None:
        self.chars = 0

    def __call__(self, text: str) -> list[int]:
        self.chars += len(text)
        return [ord(c) for c in text]


def render(messages: list[dict[str, Any]], tools: Any, /, **kw: Any) -> str:
    out = "".join(f"{START}{m['role']}\n{m['content']}{END}\n" for m in messages)
    return out + (f"{START}assistant\n" if kw.get("add_generation_prompt") else "")


def keyer() -> tuple[TokenKeyer, Counting]:
    enc = Counting()
    k = TokenKeyer(
        enc,
        render,
        added_tokens=(START, END),
        safe_boundaries=(START, END),
        cache_min_chars=64,
    )
    assert k.cache_enabled
    return k, enc


def chat(*user: str, system: str = SYSTEM, **extra: Any) -> dict[str, Any]:
    msgs = [{"role": "system", "content": system}]
    msgs += [{"role": "user", "content": u} for u in user]
    return {"model": MODEL, "messages": msgs, **extra}


# An isolated tenant: its own namespace and its own salt (gateway.tenancy sets both).
VICTIM = {"namespace": "tenant:victim", "cache_salt": "salt-victim"}
OTHERS = [
    pytest.param({"namespace": "tenant:attacker", "cache_salt": "salt-attacker"}, id="isolated"),
    pytest.param({"namespace": "", "cache_salt": ""}, id="shared"),
    pytest.param({"namespace": "tenant:victim", "cache_salt": "other"}, id="same-ns-other-salt"),
    pytest.param(
        {"namespace": "tenant:other", "cache_salt": "salt-victim"}, id="other-ns-same-salt"
    ),
]


def key(k: TokenKeyer, body: dict[str, Any], scope: dict[str, str]) -> list[int]:
    return k.key("chat", body, model=MODEL, block_size=4, max_blocks=10_000, **scope).chain


@pytest.mark.parametrize("other", OTHERS)
def test_another_scope_never_hits_an_isolated_tenants_entries(other: dict[str, str]) -> None:
    k, enc = keyer()
    key(k, chat("hello"), VICTIM)
    stored = set(k._cache._lru)
    assert stored, "the victim's system prompt and conversation were cached"
    hits = k.cache_stats()["hits"]

    probe = chat("a different question")  # the victim's system prompt, guessed right
    text = k.render(probe)
    enc.chars = 0
    key(k, probe, other)
    # Behaviour: no hit, and the tokenizer ran over the whole text (the latency of a miss).
    assert k.cache_stats()["hits"] == hits
    assert enc.chars == len(text)
    # Structure: every key the other scope looks up is one the victim's entries cannot have.
    _, probe_keys = k._cache.boundaries(text, (other["namespace"], other["cache_salt"]))
    assert stored.isdisjoint(probe_keys)
    assert {s for s, _, _ in stored} == {("tenant:victim", "salt-victim")}


def test_one_tenant_keeps_its_hits_for_a_shared_system_prompt_and_next_turns() -> None:
    k, enc = keyer()
    first = chat("hello")
    key(k, first, VICTIM)
    hits = k.cache_stats()["hits"]

    other_user = chat("a different question")  # same tenant, same system prompt
    enc.chars = 0
    key(k, other_user, VICTIM)
    assert k.cache_stats()["hits"] == hits + 1
    assert enc.chars < len(k.render(other_user)) - len(SYSTEM)  # the system prompt was reused

    next_turn = chat("hello", "and then?")  # the same conversation, one turn on
    enc.chars = 0
    key(k, next_turn, VICTIM)
    assert k.cache_stats()["hits"] == hits + 2
    assert enc.chars < 64


def test_shared_tenants_keep_sharing_entries() -> None:
    # Non-isolated tenants share a namespace ("") and KV on the workers: they may share ids too.
    k, enc = keyer()
    shared = {"namespace": "", "cache_salt": None}
    key(k, chat("from tenant a"), shared)
    hits = k.cache_stats()["hits"]
    enc.chars = 0
    key(k, chat("from tenant b"), shared)
    assert k.cache_stats()["hits"] == hits + 1
    assert enc.chars < len(SYSTEM)


def test_the_body_cache_salt_scopes_entries_when_none_is_passed() -> None:
    # `key`/`token_ids` without an explicit salt take the body's own, as the chain seed does.
    k, _ = keyer()
    k.token_ids("chat", chat("hello", cache_salt="a"))
    hits = k.cache_stats()["hits"]
    k.token_ids("chat", chat("hello", cache_salt="b"))
    assert k.cache_stats()["hits"] == hits
    k.token_ids("chat", chat("hello", cache_salt="a"))
    assert k.cache_stats()["hits"] == hits + 1


@pytest.mark.parametrize("other", OTHERS)
def test_scoped_ids_are_the_plain_ids(other: dict[str, str]) -> None:
    # Scoping changes what is reused, never the ids: every scope's ids are encode(text).
    k, _ = keyer()
    for scope in (VICTIM, other, VICTIM, other):
        for body in (chat("hello"), chat("hello", "more"), chat("x", system=SYSTEM[:100])):
            ids = k.token_ids("chat", body, **scope)
            assert list(ids) == [ord(c) for c in k.render(body)]
