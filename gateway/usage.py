"""Usage records: one per finished request, for billing and cost separation.

Sinks: a Redis stream (`XADD ... MAXLEN ~ N`, shared by every replica; consume with XREAD or a
consumer group) or a JSONL file for single-replica setups. Fields are flat strings so the stream
reads the same in any Redis client:

    request_id, tenant, model, worker, status, outcome, prompt_tokens, cached_tokens,
    completion_tokens, charged_tokens, ttft_ms, duration_ms, ts (unix seconds)

A failing sink logs and drops the record: billing export must never fail a user request.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

import orjson

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
            log.warning("usage record dropped: %s", e)

    async def close(self) -> None:
        self._f.close()


class RedisStreamSink:
    def __init__(self, client: Any, stream: str, maxlen: int) -> None:
        self.client = client
        self.stream = stream
        self.maxlen = maxlen

    async def write(self, record: dict[str, Any]) -> None:
        fields = {k: "" if v is None else str(v) for k, v in record.items()}
        try:
            await self.client.xadd(self.stream, fields, maxlen=self.maxlen, approximate=True)
        except Exception as e:  # any Redis failure: drop, never fail the request
            log.warning("usage record dropped: %s", e)

    async def close(self) -> None:
        return None
