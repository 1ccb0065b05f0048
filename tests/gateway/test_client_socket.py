"""AckProbe on both event loops the gateway runs on (asyncio in tests, uvloop in production):
what the client's TCP stack accepted, and a closed connection as one exception type."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from gateway.client_socket import AckProbe


class _Cycle:
    """Stands in for uvicorn's request cycle: `send` is bound to an object holding `transport`."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    async def send(self, message: dict[str, Any]) -> None:
        return None


async def _probe_scenario() -> None:
    accepted: asyncio.Future[asyncio.Transport] = asyncio.get_running_loop().create_future()

    class Server(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            accepted.set_result(transport)  # type: ignore[arg-type]

    srv = await asyncio.get_running_loop().create_server(Server, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    transport = await accepted
    probe = AckProbe.of(_Cycle(transport).send)
    assert probe is not None
    acked0, queued0 = probe.read()
    assert queued0 == 0
    transport.write(b"x" * 50_000)
    await reader.readexactly(50_000)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10  # generous: polled, so only a probe that never sees them fails
    while True:  # the ACKs follow the read
        acked, queued = probe.read()
        if (acked - acked0, queued) == (50_000, 0) or loop.time() > deadline:
            break
        await asyncio.sleep(0.01)
    assert (acked - acked0, queued) == (50_000, 0)
    transport.close()
    # The socket closes on a later turn of the loop: poll until the probe reports it, which it
    # must do with OSError, not ValueError (uvloop): the relay catches one type.
    deadline = loop.time() + 10
    while True:
        try:
            probe.read()
        except OSError:
            break
        assert loop.time() < deadline, "the probe never reported the closed connection"
        await asyncio.sleep(0.01)
    assert AckProbe.of(_Cycle(transport).send) is None
    writer.close()
    srv.close()


@pytest.mark.parametrize(
    "runner",
    [asyncio.run, uvloop.run],
    ids=["asyncio", "uvloop"],
)
def test_acks_and_a_closed_connection(runner: Callable[[Coroutine[Any, Any, None]], None]) -> None:
    runner(_probe_scenario())


def test_a_send_without_a_transport_gets_no_probe() -> None:
    async def send(message: dict[str, Any]) -> None:
        return None

    assert AckProbe.of(send) is None
