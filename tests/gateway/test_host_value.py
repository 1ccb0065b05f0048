"""The Host field's value (gateway/server.py, `GuardedHttpProtocol.on_header`).

RFC 9112 section 3.2: Host = uri-host [ ":" port ] (RFC 3986 section 3.2.2): a reg-name
(unreserved, pct-encoded, sub-delims), an IPv4 address (a reg-name's characters), or an
IP-literal in brackets; the port is digits. llhttp refuses control bytes in any field value but
let through spaces, tabs, delimiters (`/ @ ? #`), non-ASCII bytes and any port: such a Host was
served, and a client could put a path or userinfo in what the app and its logs take for the
authority. It is a 400 now, an OpenAI error envelope like the server's other refusals. An empty
Host is valid (a target URI without an authority) and served, as is an empty port.

Raw sockets on 127.0.0.1; waits are bounded, never timed.
"""

from __future__ import annotations

import pytest

from gateway import server
from gateway.server import valid_host
from tests.gateway.test_head_first_read import _protocol
from tests.gateway.test_server_conformance import _exchange, _gateway, _refusal, _status

BAD = [
    b"a b",
    b"a\tb",
    b"example.com/x",
    b"user@example.com",
    b"example.com?q",
    b"example.com#f",
    b"example.com:8o",
    b"example.com:80:80",
    b"example.com:-1",
    b"exa\x80mple.com",
    b"::1",
    b"[::1",
    b"[::1]x",
    b"[::1]:x",
    b"[g::1]",
    b"[]",
    b"ex%4",
    b"ex%zzample.com",
    b"a]b",
    b'a"b',
    b"a\\b",
]
GOOD = [
    b"",
    b"x",
    b"localhost:8000",
    b"127.0.0.1",
    b"127.0.0.1:80",
    b"[::1]",
    b"[::1]:8000",
    b"[2001:db8::ffff:192.0.2.1]",
    b"[v1.fe:x]",
    b"ex%41mple.com",
    b"a-b.c_d~e!f$g&h'i(j)k*l+m,n;o=p",
    b"example.com:",
    b"example.com  ",  # trailing whitespace (OWS, which llhttp leaves in the value)
]


def test_the_host_grammar() -> None:
    for host in BAD:
        assert not valid_host(host), host
    for host in GOOD:
        assert valid_host(host), host


def _get(host: bytes, version: bytes = b"HTTP/1.1") -> bytes:
    return b"GET /health " + version + b"\r\nhost: " + host + b"\r\nconnection: close\r\n\r\n"


async def test_a_host_that_is_no_uri_host_and_port_gets_a_400() -> None:
    async with _gateway() as (g, port):
        for host in BAD:
            err = _refusal(
                await _exchange(port, _get(host)), b"400 Bad Request", "bad_http_request"
            )
            assert "Host" in err["message"], (host, err)
        # HTTP/1.0 needs no Host, but one it sends is checked the same.
        _refusal(
            await _exchange(port, _get(b"a/b", b"HTTP/1.0")), b"400 Bad Request", "bad_http_request"
        )
        assert g.server.guard.bad_requests == len(BAD) + 1  # type: ignore[union-attr]
        for host in GOOD + GOOD:  # the second time from the values known valid
            assert _status(await _exchange(port, _get(host))) == [b"HTTP/1.1 200 OK"], host
        assert g.server.guard.bad_requests == len(BAD) + 1  # type: ignore[union-attr]


async def test_the_hosts_known_valid_are_bounded_and_hold_no_bad_one() -> None:
    """Valid values are kept so most requests skip the regex: at most `_HOSTS_OK_MAX` of them,
    none longer than `_HOST_KEPT_BYTES`; past that every value is still checked."""
    n = server._HOSTS_OK_MAX + 5
    long = b"h" * (server._HOST_KEPT_BYTES + 1)
    for host in [b"h%d.example:80" % i for i in range(n)] + [long]:
        async with _protocol() as (proto, transport):
            proto.data_received(_get(host))
            assert not transport.out and not proto._waiting, host  # taken: its app runs
    assert len(server._HOSTS_OK) <= server._HOSTS_OK_MAX
    assert long not in server._HOSTS_OK
    for host in BAD:
        async with _protocol() as (proto, transport):
            proto.data_received(_get(host))
            assert bytes(transport.out).startswith(b"HTTP/1.1 400 Bad Request\r\n"), host
    assert not server._HOSTS_OK.intersection(BAD)


@pytest.mark.parametrize("host", [b"a\x01b", b"a\x7fb"], ids=["ctl", "del"])
async def test_control_bytes_in_host_are_a_400_envelope_too(host: bytes) -> None:
    """llhttp refuses these itself (any field value); still the server's envelope."""
    async with _gateway() as (_g, port):
        _refusal(await _exchange(port, _get(host)), b"400 Bad Request", "bad_http_request")
