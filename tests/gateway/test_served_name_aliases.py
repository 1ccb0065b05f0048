"""One vLLM server, several `--served-model-name`s: one set of KV blocks, one set of keys.

KV-events review finding: vLLM caches one set of blocks for every name it serves (the name is not
in its block hash) and publishes events without a name. The gateway keyed a request's blocks by
the name it asked for and a worker's events by its alphabetically first name, so requests under
any other alias never matched the worker's events, and the approximate index split one cache
into one per alias. Both are now keyed by the model's weights (its cards' `root`) wherever the
fleet agrees on them (`Registry.cache_name`).
"""

from __future__ import annotations

from gateway.app import Gateway
from gateway.keying import route_key_now
from scoring.prefix import block_keys
from scoring.views import RoutingOptions
from tests.gateway.conftest import settings_for
from workers.kv_wire import FULL_ATTENTION, BlockStored

TOKENS = tuple(range(1, 65))
ROOT = "/models/llama"


def card(name: str, root: str = ROOT, parent: str | None = None) -> dict[str, object]:
    return {"id": name, "object": "model", "root": root, "parent": parent}


def fleet(*cards_per_worker: list[dict[str, object]]) -> Gateway:
    gw = Gateway(settings_for([f"http://127.0.0.1:{9 + i}" for i in range(len(cards_per_worker))]))
    for i, cards in enumerate(cards_per_worker):
        gw.registry.probe_ok(f"w{i}", cards, None)
    return gw


def test_aliases_of_one_model_key_their_blocks_alike() -> None:
    gw = fleet([card("llama"), card("prod-chat"), card("ad", "/adapters/a", parent="llama")])
    r = gw.registry
    assert r.cache_name("llama") == r.cache_name("prod-chat") == ROOT
    assert r.cache_name("ad") == "ad"  # a LoRA adapter's blocks are its own
    assert r.cache_name("unknown") == "unknown"


def test_a_name_whose_weights_differ_between_workers_keys_by_the_name() -> None:
    # A canary serving other weights under the same name: no one root to key by.
    gw = fleet([card("llama")], [card("llama", "/models/llama-v2")])
    assert gw.registry.cache_name("llama") == "llama"
    gw.registry.remove("w1")  # the canary leaves: the name's weights are one again
    assert gw.registry.cache_name("llama") == ROOT


def test_requests_under_every_alias_match_the_workers_events() -> None:
    gw = fleet([card("llama"), card("prod-chat")])
    sink = gw.kv_fleet.sink
    sink.set_live("w0", True)
    sink.apply(
        "w0",
        [
            BlockStored(
                tuple(range(100, 104)), None, TOKENS, 16, None, "GPU", None, 0, FULL_ATTENTION
            )
        ],
    )
    now = sink.clock()
    got = {
        m: gw.precise.match(block_keys(TOKENS, 16, gw.registry.cache_name(m), "", 4), now).get(
            "w0", 0
        )
        for m in ("llama", "prod-chat")
    }
    assert got == {"llama": 4, "prod-chat": 4}


def test_the_approximate_index_shares_one_chain_across_aliases() -> None:
    gw = fleet([card("llama"), card("prod-chat")])
    body = {"messages": [{"role": "user", "content": "a shared system prompt " * 40}]}

    def chain(model: str) -> tuple[int, ...]:
        return route_key_now(
            needs_chain=True,
            keyer=None,
            block_size=16,
            options=RoutingOptions(),
            is_chat=True,
            data={**body, "model": model},
            model=gw.registry.cache_name(model),
            namespace="",
            session_id=None,
            tenant_priority=0.5,
            request_id="r",
            precise=False,
        ).chain

    assert chain("llama") == chain("prod-chat") != ()
