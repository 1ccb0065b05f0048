"""Usage records: one per finished request, for billing and cost separation.

Sinks: a Redis stream (`XADD ... MAXLEN ~ N`, shared by every replica; consume with XREAD or a
consumer group) or a JSONL file for single-replica setups. Fields are flat strings so the stream
reads the same in any Redis client:

    request_id, client_request_id, tenant, model, worker, status, outcome, prompt_tokens,
    cached_tokens, completion_tokens, charged_tokens, ttft_ms, duration_ms, ts (unix seconds)

`request_id` is the gateway's own id, unique per request (gateway.ids); `client_request_id` is
whatever the client sent as `x-request-id` (empty when none), a label that clients may reuse.

Billing export must never fail a user request, and must not lose records to a Redis restart:
while the stream is unreachable, records wait in a bounded in-process buffer (oldest dropped past
`usage_buffer_max`, counted) and are written in order when Redis answers again. Delivery is at
least once: a write whose reply was lost is written again, so consumers dedupe on `request_id`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from itertools import islice
from pathlib import Path
from typing import Any, Protocol

import orjson
from prometheus_client import Counter, Gauge

log = logging.getLogger("kvgate.usage")


class UsageSink(Protocol):
    async def write(self, record: dict[str, Any]) -> None: ...

    async def close(self) -> None: ...


class NullSink:
    async def write(self, record: dict[str, Any]) -> None:
        return None

    async def close(self) -> None:
        return None


class JsonlSink:
    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("ab", buffering=0)

    async def write(self, record: dict[str, Any]) -> None:
        try:
            # One small unbuffered append: atomic for lines under PIPE_BUF on local filesystems.
            self._f.write(orjson.dumps(record) + b"\n")
        except OSError as e:
            log.warning("usage record dropped: %s", str(e))

    async def close(self) -> None:
        self._f.close()


class RedisStreamSink:
    FLUSH_BATCH = 500

    def __init__(
        self,
        client: Any,
        stream: str,
        maxlen: int,
        *,
        buffer_max: int = 100_000,
        retry_s: float = 1.0,
        buffered_gauge: Gauge | None = None,
        dropped_counter: Counter | None = None,
    ) -> None:
        self.client = client
        self.stream = stream
        self.maxlen = maxlen
        self.buffer_max = buffer_max
        self.retry_s = retry_s
        self._buf: deque[dict[str, str]] = deque()
        self._flusher: asyncio.Task[None] | None = None
        self._gauge = buffered_gauge
        self._dropped = dropped_counter
        self.dropped = 0

    @property
    def buffered(self) -> int:
        return len(self._buf)

    async def write(self, record: dict[str, Any]) -> None:
        fields = {k: "" if v is None else str(v) for k, v in record.items()}
        if self._buf:  # behind the backlog, in order
            self._hold(fields)
            return
        try:
            await self.client.xadd(self.stream, fields, maxlen=self.maxlen, approximate=True)
        except Exception as e:  # any Redis failure: buffer, never fail the request
            log.warning("usage stream unreachable, buffering records until it answers: %s", str(e))
            self._hold(fields)

    def _hold(self, fields: dict[str, str]) -> None:
        self._buf.append(fields)
        if len(self._buf) > self.buffer_max:
            self._buf.popleft()
            if not self.dropped:
                log.error("usage buffer full (%d records): dropping the oldest", self.buffer_max)
            self.dropped += 1
            if self._dropped is not None:
                self._dropped.inc()
        self._export()
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_loop())

    def _export(self) -> None:
        if self._gauge is not None:
            self._gauge.set(len(self._buf))

    async def _flush_loop(self) -> None:
        while self._buf:
            await asyncio.sleep(self.retry_s)
            with contextlib.suppress(Exception):  # still down: try again later
                await self._flush()
        log.info("usage stream reachable again: buffered records written")

    async def _flush(self) -> None:
        while self._buf:
            batch = list(islice(self._buf, self.FLUSH_BATCH))
            pipe = self.client.pipeline(transaction=False)
            for fields in batch:
                pipe.xadd(self.stream, fields, maxlen=self.maxlen, approximate=True)
            await pipe.execute()
            for fields in batch:  # by identity: a full buffer may have dropped some meanwhile
                if self._buf and self._buf[0] is fields:
                    self._buf.popleft()
            self._export()

    async def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
        if self._buf:
            with contextlib.suppress(Exception):
                await self._flush()
        if self._buf:
            log.error("%d usage records never reached the stream", len(self._buf))
