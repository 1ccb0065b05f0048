"""Request ids: the gateway's own, unique across replicas and restarts, cheap to make.

A client's `x-request-id` cannot name a request: clients reuse ids (retries, bugs, copy-paste) and
an attacker can pick a victim's, so billing that dedupes on it would drop records and a worker
that keys requests by it would collide. Every request gets an id of ours (a random per-process
prefix and a counter: unique without a syscall per request); the client's id travels beside it.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Iterable

_PREFIX = "kvg-" + os.urandom(6).hex() + "-"
_counter = itertools.count(1)


def next_request_id() -> str:
    return f"{_PREFIX}{next(_counter):x}"


# A client id we echo, log and forward: short, printable, no separators (matched whole: `$` also
# matches before a trailing newline).
client_rid_ok = re.compile(r"[A-Za-z0-9._:-]{1,128}").fullmatch


def client_request_id(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The client's `x-request-id` from ASGI headers, when it is one we may echo."""
    for k, v in headers:
        if k == b"x-request-id":
            rid = v.decode("latin-1")
            return rid if client_rid_ok(rid) else None
    return None


def echo_raw(
    headers: Iterable[tuple[bytes, bytes]],
) -> tuple[str, str | None, list[tuple[bytes, bytes]]]:
    """A new id of ours, the client's, and `echo_headers` as ASGI header pairs: for responses
    built outside the walk (the edge's refusals, Starlette's routes)."""
    rid = next_request_id()
    client = client_request_id(headers)
    return (
        rid,
        client,
        [(k.encode(), v.encode("latin-1")) for k, v in echo_headers(rid, client).items()],
    )


def echo_headers(request_id: str, client_request_id: str | None) -> dict[str, str]:
    """What every response carries: the client's id echoed back under the header it sent (ours
    when it sent none), and ours always under `x-kvgate-request-id` (quote it in support tickets:
    it is the usage record's `request_id`)."""
    return {"x-request-id": client_request_id or request_id, "x-kvgate-request-id": request_id}
