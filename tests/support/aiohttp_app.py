"""An aiohttp app on a free 127.0.0.1 port, for tests that need a server speaking exact bytes
(SSE bodies cut or malformed on purpose) where starlette's would reframe them."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web


@contextlib.asynccontextmanager
async def serve_aiohttp(app: web.Application) -> AsyncIterator[str]:
    """Serve ``app`` until the block ends; yields its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
