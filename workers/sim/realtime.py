"""The real-time clock: drives one `Engine` on the asyncio loop for the HTTP server.

The loop is the engine's only caller, so the engine needs no locks: `submit` and `abort` run on the
same event loop between steps. A step's outputs are computed when the step starts but delivered
only after its modelled duration, exactly as a GPU forward pass would make them visible. Deadlines
advance by the modelled durations rather than by what `sleep` actually took, so oversleeping in one
step is absorbed by the next instead of stretching the whole stream.

Cost per token matters (one process runs 8-32 of these loops), so delivery is a deque plus a
single reusable future per waiting consumer, not an `asyncio.Queue` per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable

from workers.sim.engine import Engine
from workers.sim.engine_types import EngineStats, KVEvent, RequestOutput, SimRequest

_log = logging.getLogger(__name__)

# If the loop falls further behind its modelled schedule than this (a stalled event loop, a
# debugger), restart the schedule from now instead of bursting the backlog of steps back to back.
_MAX_LAG_S = 0.25


class RequestHandle:
    """One submitted request's output stream; iterate it, or `abort()` it (idempotent)."""

    __slots__ = ("_buf", "_closed", "_loop", "_waiter", "request_id")

    def __init__(self, request_id: str, loop: EngineLoop) -> None:
        self.request_id = request_id
        self._loop = loop
        self._buf: deque[RequestOutput] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False  # no more outputs will be pushed (finished, aborted or stopped)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        while not self._buf:
            if self._closed:
                raise StopAsyncIteration
            waiter = asyncio.get_running_loop().create_future()
            self._waiter = waiter
            try:
                await waiter
            finally:
                self._waiter = None
        return self._buf.popleft()

    @property
    def finished(self) -> bool:
        """True once the stream can produce nothing more (outputs may still be buffered)."""
        return self._closed

    def abort(self) -> None:
        """Stop the request and free its KV blocks; the iterator ends after buffered outputs.

        Buffered outputs are dropped too: a consumer that aborts does not want more tokens.
        """
        if self._closed:
            return
        self._loop._abort(self.request_id)
        self._buf.clear()
        self._close()

    def _push(self, out: RequestOutput) -> None:
        self._buf.append(out)
        if out.finished:
            self._closed = True
        self._wake()

    def _close(self) -> None:
        self._closed = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class EngineLoop:
    """Runs `engine.step` back to back while there is work, sleeping each step's duration."""

    def __init__(
        self, engine: Engine, on_kv_events: Callable[[list[KVEvent]], None] | None = None
    ) -> None:
        self.engine = engine
        # Called right after each step that recorded KV events, so they leave in step order and
        # before anything else (a prefix-cache reset between steps) can touch the engine.
        self.on_kv_events = on_kv_events
        self._handles: dict[str, RequestHandle] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # Set if the loop died on an engine bug; the server reports it (e.g. /health -> 503).
        self.error: BaseException | None = None

    async def start(self) -> None:
        if self._task is None or self._task.done():
            self.error = None
            self._task = asyncio.create_task(self._run(), name="sim-engine-loop")

    @property
    def alive(self) -> bool:
        """True while the stepping task runs (False before start, after stop or a crash)."""
        return self._task is not None and not self._task.done()

    async def stop(self) -> None:
        """Stop stepping, abort everything in flight and end every open stream."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for handle in list(self._handles.values()):
            self.engine.abort(handle.request_id)
            handle._close()
        self._handles.clear()

    def submit(self, req: SimRequest) -> RequestHandle:
        """Queue a request now; raises ValueError (from the engine) for an invalid one.

        Raises RuntimeError when the loop is not running, rather than accepting a request that
        would never be stepped.
        """
        if not self.alive:
            raise RuntimeError("engine loop is not running") from self.error
        if req.request_id in self._handles:
            raise ValueError(f"request id {req.request_id!r} is already in flight")
        self.engine.add_request(req, asyncio.get_running_loop().time())
        handle = RequestHandle(req.request_id, self)
        self._handles[req.request_id] = handle
        self._wake.set()
        return handle

    def stats(self) -> EngineStats:
        return self.engine.stats()

    @property
    def num_in_flight(self) -> int:
        return len(self._handles)

    def _abort(self, request_id: str) -> None:
        if self._handles.pop(request_id, None) is not None:
            self.engine.abort(request_id)

    async def _run(self) -> None:
        try:
            await self._step_forever()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an engine bug: end every stream instead of hanging them
            self.error = exc
            _log.exception("simulated engine loop crashed; open streams were ended")
            for handle in list(self._handles.values()):
                handle._close()
            self._handles.clear()

    async def _step_forever(self) -> None:
        loop = asyncio.get_running_loop()
        engine = self.engine
        handles = self._handles
        on_kv_events = self.on_kv_events
        deadline = loop.time()
        while True:
            if not engine.has_work():
                self._wake.clear()
                await self._wake.wait()
                deadline = loop.time()
            now = loop.time()
            if now - deadline > _MAX_LAG_S:
                deadline = now
            step = engine.step(deadline)
            if on_kv_events is not None:
                events = engine.take_kv_events()
                if events:  # vLLM publishes one batch per step that produced events
                    on_kv_events(events)
            deadline += step.duration
            delay = deadline - loop.time()
            await asyncio.sleep(delay if delay > 0 else 0)
            for out in step.outputs:
                # Outputs of requests aborted during the sleep are dropped here.
                handle = handles.get(out.request_id)
                if handle is None:
                    continue
                if out.finished:
                    del handles[out.request_id]
                handle._push(out)
