"""workers.deadlines: asyncio.timeout's semantics with one ticking timer for every wait."""

from __future__ import annotations

import asyncio

import pytest

from workers.deadlines import Deadlines


async def test_a_wait_past_its_deadline_is_a_timeout_and_the_timer_stops() -> None:
    d = Deadlines(tick_s=0.01)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(TimeoutError), d.within(0.05):
        await asyncio.sleep(10)
    waited = loop.time() - t0
    assert 0.05 <= waited < 5  # generous: the bound is a tick late at most, on a quiet machine
    assert len(d) == 0
    await asyncio.sleep(0.05)
    assert d._timer is None  # nothing live: no tick keeps running


async def test_a_wait_that_ends_in_time_returns_and_is_never_cancelled_later() -> None:
    d = Deadlines(tick_s=0.01)
    with d.within(0.05):
        await asyncio.sleep(0)
    assert len(d) == 0
    await asyncio.sleep(0.1)  # well past the deadline: no stray cancel reaches the task
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_zero_or_negative_seconds_time_out_at_the_next_tick() -> None:
    d = Deadlines(tick_s=0.01)
    for s in (0.0, -1.0):
        with pytest.raises(TimeoutError), d.within(s):
            await asyncio.sleep(10)


async def test_many_waits_share_the_timer_and_each_gets_its_own_outcome() -> None:
    d = Deadlines(tick_s=0.01)

    async def wait(limit: float, work: float) -> str:
        try:
            with d.within(limit):
                await asyncio.sleep(work)
        except TimeoutError:
            return "timeout"
        return "ok"

    got = await asyncio.gather(*(wait(0.05, 10) for _ in range(20)), wait(5, 0.01))
    assert got == ["timeout"] * 20 + ["ok"]
    assert len(d) == 0


async def test_a_cancel_from_outside_stays_a_cancel() -> None:
    d = Deadlines(tick_s=0.01)

    async def waiter() -> None:
        with d.within(10):
            await asyncio.sleep(10)

    task = asyncio.create_task(waiter())
    await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(d) == 0


async def test_an_outside_cancel_that_races_the_deadline_is_not_swallowed() -> None:
    d = Deadlines(tick_s=10)  # the test sweeps by hand
    started = asyncio.Event()

    async def waiter() -> None:
        with d.within(0.0):
            started.set()
            await asyncio.sleep(10)

    task = asyncio.create_task(waiter())
    await started.wait()
    d._sweep(asyncio.get_running_loop())  # the deadline passes: its cancel is pending ...
    task.cancel()  # ... and so is the client's, before the task runs again
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(d) == 0


async def test_outside_a_task_it_says_so() -> None:
    d = Deadlines()

    def sync_use() -> None:
        with d.within(1):
            pass

    with pytest.raises(RuntimeError):
        await asyncio.get_running_loop().run_in_executor(None, sync_use)


async def test_a_short_wait_after_a_long_one_still_expires_at_its_own_deadline() -> None:
    # The sweep skips its scan until the earliest deadline is due: a short wait that starts
    # while a long one is live (or after one that ended) must move that point forward.
    d = Deadlines(tick_s=0.01)
    loop = asyncio.get_running_loop()

    async def wait(limit: float, work: float) -> tuple[str, float]:
        t0 = loop.time()
        try:
            with d.within(limit):
                await asyncio.sleep(work)
        except TimeoutError:
            return "timeout", loop.time() - t0
        return "ok", loop.time() - t0

    long = asyncio.ensure_future(wait(30, 30))
    with d.within(0.02):  # ends in time: its deadline stays behind as the earliest
        await asyncio.sleep(0)
    await asyncio.sleep(0.05)  # the stale earliest deadline passes: one scan, nothing expires
    outcome, waited = await wait(0.05, 10)
    assert outcome == "timeout" and waited < 5  # not at the long wait's 30 s
    assert not long.done()
    long.cancel()
    with pytest.raises(asyncio.CancelledError):
        await long
    assert len(d) == 0


def _stall(seconds: float, then: asyncio.Future[str]) -> None:
    """Hold the loop (a gateway busy with other requests), then let the awaited event in: it
    arrives right after, as a connect completion sits unread until the loop polls again."""
    import time

    time.sleep(seconds)
    asyncio.get_running_loop().call_soon(then.set_result, "connected")


async def test_the_loops_own_stall_does_not_time_out_a_wait_whose_event_is_due() -> None:
    """A spike that keeps the loop busy past a wait's bound is the gateway's doing, not the
    awaited party's: the wait gets the stall back (its event, here right after the stall, is
    taken), where asyncio.timeout would have cancelled it at the first late tick (a saturated
    gateway timed out its own connects to healthy workers and ejected all of them)."""
    d = Deadlines(tick_s=0.01)
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[str] = loop.create_future()
    loop.call_soon(_stall, 0.3, fut)
    with d.within(0.2):
        assert await fut == "connected"


async def test_a_stall_forgives_at_most_the_waits_own_length() -> None:
    """Twice its bound of wall time at most: a wait for something that never comes still ends,
    however busy the loop is (a dead worker is found out under load too)."""
    d = Deadlines(tick_s=0.01)
    loop = asyncio.get_running_loop()
    never: asyncio.Future[str] = loop.create_future()
    loop.call_soon(_stall, 0.5, loop.create_future())  # 0.5 s stall > 2 x 0.1 s
    t0 = loop.time()
    with pytest.raises(TimeoutError), d.within(0.1):
        await never
    assert loop.time() - t0 < 5
    assert len(d) == 0
