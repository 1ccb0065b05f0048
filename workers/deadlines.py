"""Bounded waits on the hot path with one timer for all of them.

``asyncio.timeout`` arms a loop timer (a libuv timer under uvloop) and builds a ``Timeout`` per
wait; a streaming request made two (the worker's response head, then its first event), ~3% of
the gateway's core under the bench overhead ladder. Here a wait puts its deadline in a dict, and
one timer, ticking every ``tick_s`` while any wait is live, cancels the tasks whose deadline has
passed. A wait can end up to one tick late; the bounds it serves are seconds (`first_byte_s`,
`total_s`, `connect_s`), the tick 20 ms.

The gateway's own stalls do not count against a wait (up to the wait's own length again): a
tick that runs late says the loop was busy with other work, and the event a wait is for may be
sitting unread meanwhile, since the loop runs timers before it polls for I/O. Without that, a
gateway saturated by a spike (a loop iteration of ~1 s at 1,024 streams on a third of a core)
timed out its own connects to healthy workers (`connect_s` 2 s: a connect takes a few loop
iterations), counted them as the workers' failures, ejected every worker and answered the rest
of the spike with 503s (`bench overhead --router-cpu 0.3 --workers 6` at 1,024 in flight).
"""

from __future__ import annotations

import asyncio
from types import TracebackType

__all__ = ["Deadlines", "Wait"]


class Deadlines:
    """``with deadlines.within(s):`` is ``async with asyncio.timeout(s):`` for one task's await:
    TimeoutError when the block is still waiting ``s`` seconds later (a tick later at most)."""

    def __init__(self, tick_s: float = 0.02) -> None:
        self.tick_s = tick_s
        self._live: dict[Wait, float] = {}
        self._timer: asyncio.TimerHandle | None = None
        # No live wait's deadline is earlier (a wait that ended may have set it): a tick before
        # it has nothing to expire and skips the scan, which at 1,024 waits in flight cost a
        # scan of all of them every tick (~90 us, 17 us per request in cProfile).
        self._next = float("inf")
        self._due = 0.0  # loop time the ticking timer was set for

    def within(self, seconds: float) -> Wait:
        return Wait(self, seconds)

    def __len__(self) -> int:
        """Waits in progress."""
        return len(self._live)

    def expire_all(self) -> int:
        """End every wait in progress now, as if its deadline had passed (a drain's grace is
        over: `gateway.proxy.Proxy.cut_waiting`); returns how many there were."""
        waits = list(self._live)
        self._live.clear()
        self._next = float("inf")
        for wait in waits:
            wait.expire()
        return len(waits)

    def _add(self, wait: Wait, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        at = self._live[wait] = loop.time() + seconds
        if at < self._next:
            self._next = at
        if self._timer is None:
            self._arm(loop)

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        self._due = loop.time() + self.tick_s
        self._timer = loop.call_later(self.tick_s, self._sweep, loop)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        live = self._live
        now = loop.time()
        stalled = now - self._due
        if stalled > self.tick_s and live:
            self._forgive(stalled)
        if now >= self._next:
            for wait in [w for w, at in live.items() if at <= now]:
                del live[wait]
                wait.expire()
            self._next = min(live.values(), default=float("inf"))
        if live:
            self._arm(loop)
        else:
            self._next = float("inf")

    def _forgive(self, stalled: float) -> None:
        """The loop ran `stalled` seconds late: every live wait gets that long again, within
        its slack (its own length, so a wait ends after twice its bound of wall time at most: a
        dead worker is still found out under load). O(waits), and only when the loop stalls."""
        live = self._live
        for wait, at in live.items():
            extra = min(stalled, wait.slack)
            if extra > 0.0:
                wait.slack -= extra
                live[wait] = at + extra
        self._next = min(live.values())


class Wait:
    __slots__ = ("_cancelling", "_owner", "_seconds", "_task", "expired", "slack")

    def __init__(self, owner: Deadlines, seconds: float) -> None:
        self._owner = owner
        self._seconds = max(0.0, seconds)
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0
        self.expired = False
        self.slack = self._seconds  # time the loop's own stalls may still add to this wait

    def __enter__(self) -> Wait:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("Deadlines.within() must be used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._owner._add(self, self._seconds)
        return self

    def expire(self) -> None:
        self.expired = True
        assert self._task is not None
        self._task.cancel()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._owner._live.pop(self, None)
        # As asyncio.timeout: our cancel is taken back; it becomes TimeoutError unless another
        # cancel (the client left, shutdown) is also pending, which stays a CancelledError.
        if self.expired:
            assert self._task is not None
            if self._task.uncancel() <= self._cancelling and et is asyncio.CancelledError:
                raise TimeoutError from e
