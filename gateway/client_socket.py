"""What the kernel knows about a client's reading: the basis of the stalled-reader cut-off.

A client that stops reading is invisible to the relay until every buffer between the two fills:
the transport's, the gateway's socket send buffer (autotuned up to megabytes) and the client's
receive buffer. At token rates that is many seconds of output, generated and billed for nobody,
while the stream holds a worker slot and a lease. The kernel knows better: TCP_INFO's
`tcpi_bytes_acked` grows while the client's TCP stack accepts data, and SIOCOUTQ says whether
anything is still waiting for it. No progress of the first while the second is non-zero, for the
stall window, is a reader that stopped, whatever the buffer sizes.

Linux only (the gateway's platform); elsewhere `AckProbe.of` returns None and the relay falls
back to timing its own blocked sends.
"""

from __future__ import annotations

import contextlib
import fcntl
import socket
import struct
import sys
import termios
from typing import Any

# struct tcp_info (linux/tcp.h): tcpi_bytes_acked is the u64 at byte 120 (since Linux 4.1).
_BYTES_ACKED = struct.Struct("=Q")
_BYTES_ACKED_AT = 120
_TCP_INFO_LEN = _BYTES_ACKED_AT + _BYTES_ACKED.size
_OUTQ = termios.TIOCOUTQ  # == SIOCOUTQ for sockets: bytes not yet acked by the peer
_INT = struct.Struct("i")
_ZERO = _INT.pack(0)


class AckProbe:
    """Reads one client connection's acked and queued bytes: two syscalls, no allocation kept."""

    __slots__ = ("_sock", "_transport")

    def __init__(self, sock: socket.socket, transport: Any) -> None:
        self._sock = sock
        self._transport = transport

    @classmethod
    def of(cls, send: Any) -> AckProbe | None:
        """The probe for the connection behind an ASGI `send`, when the server exposes it.

        uvicorn's `send` is a bound method of the request cycle that holds the transport; any
        other server (or a wrapped `send`) gets None and the timed-send fallback.
        """
        if sys.platform != "linux":
            return None
        transport = getattr(getattr(send, "__self__", None), "transport", None)
        if transport is None:
            return None
        try:
            sock = transport.get_extra_info("socket")
            if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
                return None
            if sock.fileno() < 0:  # closed already: the disconnect handling takes it
                return None
        except (OSError, ValueError):
            return None
        # No read here: the stall check's first read finds a socket closed since (one less pair
        # of syscalls per stream).
        return cls(sock, transport)

    def read(self) -> tuple[int, int]:
        """(bytes the peer has acked so far, bytes still waiting for it: ours + the kernel's).

        Raises OSError once the connection is closed (uvloop's socket wrapper raises ValueError
        for a closed descriptor: one exception type for the caller)."""
        try:
            info = self._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
            queued = _INT.unpack(fcntl.ioctl(self._sock.fileno(), _OUTQ, _ZERO))[0]
        except ValueError as e:
            raise OSError(str(e)) from None
        acked = _BYTES_ACKED.unpack_from(info, _BYTES_ACKED_AT)[0]
        with contextlib.suppress(Exception):
            queued += self._transport.get_write_buffer_size()
        return acked, queued
