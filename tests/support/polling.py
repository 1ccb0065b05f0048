"""Waiting for a condition in async tests, with a generous bound: what a test checks is that
something happens, never how fast (the machines are shared and noisy)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(cond: Callable[[], bool], seconds: float = 15.0) -> bool:
    """Whether ``cond()`` came true within ``seconds``, asked every 50 ms."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        if cond():
            return True
        await asyncio.sleep(0.05)
    return cond()
