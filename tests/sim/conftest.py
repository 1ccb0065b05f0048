"""Shared fixtures for the simulator's HTTP tests.

The servers run in the test's own event loop on free 127.0.0.1 ports (see
`tests.support.sim_workers.run_sim_workers`, which other suites can call directly with their own
settings), so a failing handler shows its traceback in the test output.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from tests.support.sim_workers import SimFleet, run_sim_workers


@pytest.fixture
async def sim_fleet() -> AsyncIterator[SimFleet]:
    """One worker with the `fast` profile and a small KV cache (blocks of 16 tokens)."""
    async with run_sim_workers(1, profile="fast", num_blocks=512, block_size=16) as fleet:
        yield fleet


@pytest.fixture
async def sim_url(sim_fleet: SimFleet) -> str:
    return sim_fleet[0]


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0)) as c:
        yield c
