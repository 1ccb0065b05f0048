"""A request's precise block chain is cut at one block size (the first candidate's in token
mode), while each worker's KV events are keyed at its own (`workers.kv_intake.PreciseSink`). A
worker keyed at another size can never match the chain: it must not count as trusted for that
request, or `RoutingState.matches` throws away what the approximate index learned of it too.

Real classes: events go through `PreciseSink` into a `PreciseIndex`, read by `RoutingState`."""

from __future__ import annotations

from scoring.precise import PreciseIndex
from scoring.prefix import block_keys, chain_hashes_tokens, seed_for
from scoring.state import RoutingState
from scoring.views import RouteRequest
from workers.kv_intake import PreciseSink
from workers.kv_wire import BlockStored

TOKENS = list(range(256))  # a 256-token prefix: 16 blocks of 16, 8 of 32


def st(hashes: range, bs: int) -> BlockStored:
    return BlockStored(
        tuple(hashes), None, tuple(TOKENS), bs, None, "GPU", None, 0, "full_attention"
    )


def fleet(sizes: dict[str, int]) -> tuple[RoutingState, PreciseSink]:
    idx = PreciseIndex()
    state = RoutingState(precise=idx)
    sink = PreciseSink(idx, lambda _w: "m", lambda w: sizes[w])
    for i, (w, bs) in enumerate(sizes.items()):
        sink.set_live(w, True)
        sink.apply(w, [st(range(1000 * i, 1000 * i + 256 // bs), bs)])  # all hold the prefix
    return state, sink


def request(bs: int) -> RouteRequest:
    """Keyed as gateway.keying keys a token-mode request whose first candidate has ``bs``."""
    chain = tuple(chain_hashes_tokens(TOKENS, block_size=bs, seed=seed_for("m", "", "")))
    return RouteRequest(
        model="m",
        chain=chain,
        block_tokens=float(bs),
        block_chain=tuple(block_keys(TOKENS, bs, "m", "", 8192)),
        dense_blocks=len(chain),
        prompt_tokens=len(TOKENS),
    )


def test_a_worker_keyed_at_another_block_size_keeps_its_approximate_figure() -> None:
    state, _sink = fleet({"w16": 16, "w32": 32})
    req = request(16)
    # The approximate index did learn that w32 was sent this prefix before.
    state.index.record("w32", list(req.chain), dense=len(req.chain))
    m, trusted = state.matches(req, 1.0)
    assert m == {"w16": 16, "w32": 16}
    assert trusted == {"w16"}  # w32's events cannot speak for a chain of 16-token blocks


def test_pending_keys_of_another_block_size_are_not_its_figure() -> None:
    state, _sink = fleet({"w16": 16, "w32": 32})
    req = request(16)
    # A dispatch noted as pending under the 16-token chain: not what w32's events say.
    state.precise.note_dispatch("w32", req.block_chain[:4], 0.5)  # type: ignore[union-attr]
    m, trusted = state.matches(req, 1.0)
    assert "w32" not in m and trusted == {"w16"}


def test_the_chain_at_the_other_size_trusts_the_other_worker() -> None:
    state, _sink = fleet({"w16": 16, "w32": 32})
    m, trusted = state.matches(request(32), 1.0)
    assert m == {"w32": 8} and trusted == {"w32"}


def test_one_worker_keyed_apart_from_the_chain_is_left_out_too() -> None:
    # A single-size fleet whose events are keyed at another size than the one the chain is cut
    # at (a hybrid model's attention block size, say): nothing to match, approximate figures.
    state, _sink = fleet({"w32": 32})
    req = request(16)
    state.index.record("w32", list(req.chain), dense=len(req.chain))
    m, trusted = state.matches(req, 1.0)
    assert m == {"w32": 16} and not trusted


def test_a_single_size_fleet_is_trusted_as_before() -> None:
    state, _sink = fleet({"a": 16, "b": 16})
    m, trusted = state.matches(request(16), 1.0)
    assert m == {"a": 16, "b": 16} and trusted == {"a", "b"}


def test_sizes_follow_the_workers() -> None:

    state, sink = fleet({"w16": 16, "w32": 32})
    sizes = sink.index.keyed_sizes
    assert sizes.uniform == -1
    sink.reset("w32", "restart")  # a new engine may key at another size: learned anew
    assert sizes.of == {"w16": 16} and sizes.uniform == 16
    sink.remove("w16")
    assert sizes.uniform == 0
    sink.apply("w32", [st(range(5000, 5016), 16)])
    assert sizes.uniform == 16
    _m, trusted = state.matches(request(16), 1.0)
    assert trusted == {"w16", "w32"}  # w16 is still live in the index; sizes just don't know it
