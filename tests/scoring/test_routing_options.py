"""`RoutingOptions` validation: what passes it is what prompt hashing and the index can use.

A config reaches these options through TOML, where `64.0` is a float: an integer knob written
that way passed validation and then made every request hashing a prompt a 500 (`str * float`,
slices by a float). Such a value is taken as the integer it names; any other non-integer is
refused, naming the option.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from scoring.route_key import route_request
from scoring.views import RoutingOptions

INT_OPTIONS = sorted(
    f.name for f in dataclasses.fields(RoutingOptions) if isinstance(f.default, int)
)


def test_the_integer_options_are_the_counts_and_sizes() -> None:
    assert {"block_chars", "max_blocks", "tail_ratio", "tail_blocks", "token_block_size"} <= set(
        INT_OPTIONS
    )


@pytest.mark.parametrize("name", INT_OPTIONS)
def test_a_whole_float_for_an_integer_option_is_taken_as_the_integer(name: str) -> None:
    default = getattr(RoutingOptions(), name)
    value = float(default or 1)
    opts = RoutingOptions(**{name: value})
    got = getattr(opts, name)
    assert type(got) is int and got == value


@pytest.mark.parametrize("name", ["block_chars", "max_blocks"])
def test_prompts_hash_under_integer_options_written_as_floats(name: str) -> None:
    # The prompt lengths straddle the dense head (64 blocks of 64 bytes): both code paths.
    opts = RoutingOptions(**{name: 64.0})
    for n in (3_001, 40_003):
        body = {"model": "m", "messages": [{"role": "user", "content": "x" * n}]}
        r = route_request("chat", body, model="m", options=opts)
        assert r.chain


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("block_chars", 64.5),
        ("max_blocks", 0.25),
        ("sample_size", math.inf),
        ("session_max", True),
        ("tail_ratio", "16"),
    ],
)
def test_a_non_integer_for_an_integer_option_is_refused_by_name(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=repr(name)):
        RoutingOptions(**{name: value})  # type: ignore[arg-type]


def test_float_options_still_take_ints() -> None:
    opts = RoutingOptions(chars_per_token=3, affinity_slack=12)
    assert opts.chars_per_token == 3 and opts.affinity_slack == 12


def test_an_integer_too_large_for_a_float_is_refused_not_an_overflow() -> None:
    # math.isfinite(10**400) raises OverflowError, which escaped config validation.
    with pytest.raises(ValueError, match="'max_blocks'"):
        RoutingOptions(max_blocks=10**400)
    with pytest.raises(ValueError, match="'chars_per_token'"):
        RoutingOptions(chars_per_token=10**400)
