"""A worker on a raw socket, for the answers a real server would never give on cue.

Health checks and the model list are answered like a worker answers them, so the gateway routes
to it; every POST hands the connection to a script that writes whatever bytes the test needs
(a 5xx body in two halves, a burst then silence, a malformed usage chunk). The connection closes
when the script returns. Only 127.0.0.1.

    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None: ...

    async with raw_worker(script) as (url, posts):
        ...  # posts: the POST bodies received so far
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson

__all__ = ["Script", "answer_probe", "models_body", "raw_worker", "server"]

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(r: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """The request line and the body (content-length framed, as the gateway sends them)."""
    head = await r.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    n = 0
    for h in lines[1:]:
        if h.lower().startswith(b"content-length:"):
            n = int(h.split(b":", 1)[1])
    return lines[0], await r.readexactly(n) if n else b""


def _ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b" % (
        len(body),
        body,
    )


def models_body(model: str) -> bytes:
    """What `GET /v1/models` answers: the one model served."""
    return orjson.dumps({"object": "list", "data": [{"id": model, "object": "model"}]})


def answer_probe(line: bytes, w: asyncio.StreamWriter, models: bytes) -> bool:
    """Answer anything but a POST as a worker does (health, the model list, else 404), so the
    gateway admits and routes to it; False for a POST, which is the test's to answer."""
    if line.startswith(b"POST "):
        return False
    if line.startswith(b"GET /health"):
        w.write(_ok(b""))
    elif line.startswith(b"GET /v1/models"):
        w.write(_ok(models))
    else:
        w.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
    return True


@contextlib.asynccontextmanager
async def server(handler: Script) -> AsyncIterator[tuple[str, list[int]]]:
    """A scripted server on a free port: ``handler`` owns each connection (closed when it
    returns). Yields its URL and a list that counts accepted connections."""
    accepted: list[int] = []

    async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            await handler(r, w)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()

    srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", accepted
    finally:
        srv.close()


@contextlib.asynccontextmanager
async def raw_worker(
    script: Script, *, model: str = "sim-llama"
) -> AsyncIterator[tuple[str, list[bytes]]]:
    """Serve on a free port until the block exits; yields the base URL and the POST bodies."""
    posts: list[bytes] = []
    models = models_body(model)

    async def worker(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            line, body = await read_request(r)
            if not answer_probe(line, w, models):
                posts.append(body)
                await script(r, w)
                return
            await w.drain()

    async with server(worker) as (url, _accepted):
        yield url, posts
