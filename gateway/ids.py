"""Request ids: the gateway's own, unique across replicas and restarts, cheap to make.

A client's `x-request-id` cannot name a request: clients reuse ids (retries, bugs, copy-paste) and
an attacker can pick a victim's, so billing that dedupes on it would drop records and a worker
that keys requests by it would collide. Every request gets an id of ours (a random per-process
prefix and a counter: unique without a syscall per request); the client's id travels beside it.
"""

from __future__ import annotations

import itertools
import os

_PREFIX = "kvg-" + os.urandom(6).hex() + "-"
_counter = itertools.count(1)


def next_request_id() -> str:
    return f"{_PREFIX}{next(_counter):x}"


def echo_headers(request_id: str, client_request_id: str | None) -> dict[str, str]:
    """What every response carries: the client's id echoed back under the header it sent (ours
    when it sent none), and ours always under `x-kvgate-request-id` (quote it in support tickets:
    it is the usage record's `request_id`)."""
    return {"x-request-id": client_request_id or request_id, "x-kvgate-request-id": request_id}
