"""A peer's learned batch is checked for what the replay relies on, not just its types: a tail
layout that does not fit its chain (the index read past its end, or weighed entries at 0 and
never evicted them), a dispatch time no publisher's clock gives, an absurd prompt size. Rows
the local path writes, short prompts and partial tails included, still decode."""

from __future__ import annotations

import pytest

from scoring.learned import Learned
from scoring.route_key import route_request
from scoring.views import RoutingOptions
from workers.learned_share import decode_batch, encode_batch

KEY = (8.0, 4.0, 2.0, 8.0)
CHAIN = tuple(range(100, 110))  # 4 dense blocks, then 6 tail spans


def note(chain: tuple[int, ...] = CHAIN, dense: int = 4, tails: tuple[int, ...] = (), **kw: object):
    e = Learned("w0", chain, dense, tails, "s", 10, 50.0)
    return e._replace(**kw)  # type: ignore[arg-type]


def decodes(e: Learned, sent: float = 50.5) -> bool:
    return decode_batch(encode_batch(KEY, [e], sent), now=7.0) is not None


@pytest.mark.parametrize(
    "tails",
    [
        (6, 9, 13),  # shorter than the chain's 6 tail entries: the index read tails[5]
        (0, 0, 0, 0, 0, 0),  # every tail entry weighing 0 blocks: capacity never bound
        (6, 9, 9, 13, 19, 28),  # one weighing 0
        (6, 9, 8, 13, 19, 28),  # one weighing -1
        (4, 9, 13, 19, 28, 42),  # the first ending where the dense head does
    ],
)
def test_a_tail_layout_that_does_not_fit_the_chain_drops_the_batch(tails: tuple[int, ...]) -> None:
    assert not decodes(note(tails=tails))


@pytest.mark.parametrize("at", [-1e300, 50.5 - 2 * 86_400.0, 1e300])
def test_a_dispatch_time_far_from_the_publish_time_drops_the_batch(at: float) -> None:
    assert not decodes(note(at=at))


def test_an_absurd_prompt_size_is_clamped() -> None:
    got = decode_batch(encode_batch(KEY, [note(prompt_tokens=2**62)], 50.5), now=7.0)
    assert got is not None
    tokens = got[1][0].prompt_tokens
    assert tokens <= 2**32, "a prompt's tokens were not clamped"
    assert tokens >= 2**24


@pytest.mark.parametrize("chars", [10, 40, 100, 10_000])
def test_the_rows_the_local_path_writes_decode(chars: int) -> None:
    """The local path sends the whole layout (``tail_layout``) whatever the chain's length: a
    chain shorter than the dense head, or with fewer tail entries than the layout has."""
    o = RoutingOptions(block_chars=8, max_blocks=4, tail_ratio=2, tail_blocks=8)
    r = route_request("completions", {"prompt": "x" * chars, "model": "m"}, options=o)
    e = Learned("w0", r.chain, r.dense_blocks, r.tail_ends, None, r.prompt_tokens, 50.0)
    got = decode_batch(encode_batch(KEY, [e, e._replace(chain=())], 50.5), now=7.0)
    assert got is not None
    assert [x._replace(at=0.0) for x in got[1]] == [
        e._replace(at=0.0),
        e._replace(chain=(), at=0.0),
    ]
