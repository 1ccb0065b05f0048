"""A whole answer is read into memory only up to a bound.

Review finding (high): a non-streaming 200, and any non-200 answer (also to `stream: true`), was
read whole with no size limit (`Proxy._whole` -> `resp.read()`, bounded only by `total_s`): a
worker sending a body without end grew the gateway by 200+ MiB in half a second. Now past
`WHOLE_BODY_MAX` (a 200) or `WHOLE_ERROR_MAX` (anything else) the upstream connection is
aborted and the client gets an OpenAI-shaped 502 `upstream_response_too_large`. The 200 was
generated whole, so it is settled as a whole answer cut off (its reservation); a refusal's body
is refunded. No slot or lease is left behind.

Side finding: a stream's 4xx whose body stalled to the total deadline was answered "The worker
sent nothing before the first-byte timeout" although its head (and body bytes) came.

The caps are shrunk here (1 MiB, 64 KiB) so that the worker's body (16 MiB at most, cut off at
the end so that the old code finished too) stays small.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway import proxy
from gateway.config import Settings
from tests.gateway.conftest import MODEL, run_gateway, settings_for, until
from tests.support.raw_worker import raw_worker

KEY = "kvg-whole-bounds"
HEADERS = {"authorization": f"Bearer {KEY}"}
CAP = 1 << 20
ERROR_CAP = 64 << 10
SENT_MAX = 16 << 20  # what the worker sends at most, then it ends the body
PIECE = 256 << 10


@pytest.fixture(autouse=True)
def small_caps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proxy, "WHOLE_BODY_MAX", CAP, raising=False)
    monkeypatch.setattr(proxy, "WHOLE_ERROR_MAX", ERROR_CAP, raising=False)


def settings(url: str, client: str, usage_file: Path, **timeouts: float) -> Settings:
    data = settings_for(
        [url],
        upstream={"client": client},
        probes={"interval_s": 60},  # only requests judge the worker
        timeouts={"first_byte_s": 10, "idle_s": 5, "total_s": 30, **timeouts},
        quota={"backend": "memory", "usage_file": str(usage_file)},
    ).model_dump()
    data["tenants"] = {
        "t": {
            "keys_sha256": [hashlib.sha256(KEY.encode()).hexdigest()],
            "tpm": 100_000,
            "max_concurrent": 1,
        }
    }
    return Settings(**data)


def chat(stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 16,
        "stream": stream,
    }


class BigAnswer:
    """A worker answering ``status`` with a chunked body of up to SENT_MAX bytes; ``gone`` is set
    once the gateway closed the connection on it."""

    def __init__(self, status: bytes) -> None:
        self.status = status
        self.sent = 0
        self.gone = asyncio.Event()

    async def __call__(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(
            b"HTTP/1.1 " + self.status + b"\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        piece = b"%x\r\n%b\r\n" % (PIECE, b"x" * PIECE)
        try:
            while self.sent < SENT_MAX:
                w.write(piece)
                await w.drain()
                self.sent += PIECE
            w.write(b"0\r\n\r\n")
            await w.drain()
            with contextlib.suppress(TimeoutError):
                if await asyncio.wait_for(r.read(), 15) == b"":
                    self.gone.set()
        except ConnectionError:
            self.gone.set()
            raise


async def ask(g: Any, stream: bool) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as c:
        return await c.post(g.url + "/v1/chat/completions", json=chat(stream), headers=HEADERS)


def records(usage_file: Path) -> list[dict[str, Any]]:
    if not usage_file.exists():
        return []
    return [orjson.loads(line) for line in usage_file.read_bytes().splitlines()]


async def no_leftovers(g: Any) -> None:
    """The worker's slot and the tenant's lease are free again."""
    w = g.gw.registry.workers["w0"]
    await until(lambda: w.in_flight == 0, 10, "the worker's slot freed")
    limits = g.gw.tenants.by_name["t"].limits
    assert (await g.gw.quota.shared.usage("t", limits))["in_flight"] == 0, "lease held"


@pytest.mark.parametrize("client", ["h1", "aiohttp", "httpx"])
@pytest.mark.parametrize(
    ("status", "stream"),
    [(b"200 OK", False), (b"400 Bad Request", True), (b"400 Bad Request", False)],
    ids=["200", "400-stream", "400-whole"],
)
async def test_a_whole_answer_over_its_bound_is_cut_off_with_a_502(
    tmp_path: Path, client: str, status: bytes, stream: bool
) -> None:
    worker = BigAnswer(status)
    usage_file = tmp_path / "usage.jsonl"
    async with (
        raw_worker(worker) as (url, posts),
        run_gateway(settings(url, client, usage_file)) as g,
    ):
        await g.wait_healthy(1)
        r = await ask(g, stream)
        assert r.status_code == 502, (
            f"HTTP {r.status_code} with {len(r.content)} body bytes after the worker sent "
            f"{worker.sent} (cap {CAP if status.startswith(b'200') else ERROR_CAP})"
        )
        err = r.json()["error"]
        assert err["type"] == "upstream_error"
        assert err["code"] == "upstream_response_too_large"
        assert len(posts) == 1, "an answer too big is not asked of another worker"
        # The gateway stopped reading and closed the connection: the worker sees it go.
        await asyncio.wait_for(worker.gone.wait(), 15)
        assert worker.sent < SENT_MAX
        await no_leftovers(g)
        health = g.gw.registry.workers["w0"].health.value
    assert health == "healthy", "a tenant's request can make an answer this big"
    recs = records(usage_file)
    if status.startswith(b"200"):
        # Generated whole before its first byte came: settled as a whole answer cut off.
        assert len(recs) == 1 and recs[0]["charged_tokens"] > 0, recs
        assert recs[0]["status"] == 502 and recs[0]["outcome"] == "upstream_too_large"
    else:
        assert recs == [], "a refusal's body too big generated nothing: refunded"


@pytest.mark.parametrize("client", ["h1", "aiohttp"])
async def test_a_whole_answer_within_its_bound_is_relayed(tmp_path: Path, client: str) -> None:
    body = orjson.dumps(
        {
            "id": "x",
            "object": "chat.completion",
            "model": MODEL,
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "a" * (CAP // 2)}}
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        }
    )

    async def answer(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
            % len(body)
        )
        for i in range(0, len(body), PIECE // 4):  # many reads: the cap counts them all
            w.write(body[i : i + PIECE // 4])
            await w.drain()

    usage_file = tmp_path / "usage.jsonl"
    async with (
        raw_worker(answer) as (url, _posts),
        run_gateway(settings(url, client, usage_file)) as g,
    ):
        await g.wait_healthy(1)
        r = await ask(g, False)
        assert r.status_code == 200 and r.content == body
        await no_leftovers(g)
    assert records(usage_file)[-1]["charged_tokens"] == 4


async def test_a_streams_refusal_that_outlasts_the_deadline_says_so(tmp_path: Path) -> None:
    """Its head and body bytes came: "sent nothing before the first-byte timeout" was wrong, and
    no time was left for another worker (whose attempt would have failed at once, blamed)."""

    async def stalled(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(
            b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
            b"content-length: 1000\r\n\r\n" + b'{"error":'
        )
        await w.drain()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(r.read(), 30)  # until the gateway gives up on it

    usage_file = tmp_path / "usage.jsonl"
    async with raw_worker(stalled) as (url, posts):
        s = settings(url, "h1", usage_file, first_byte_s=1, total_s=1.5)
        async with run_gateway(s) as g:
            await g.wait_healthy(1)
            r = await ask(g, True)
            assert r.status_code == 504, r.text
            err = r.json()["error"]
            assert err["type"] == "upstream_error" and err["code"] == "upstream_timeout"
            assert "sent nothing" not in err["message"], err["message"]
            assert len(posts) == 1
            await no_leftovers(g)
    assert records(usage_file) == [], "a refusal generated nothing: refunded"
