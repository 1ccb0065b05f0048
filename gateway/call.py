"""One client request on its way through the walk (`Call`), who pays for it (`Account`), and
what its worker reported it used (`Usage`): the record every step reads and settlement
(gateway/settlement.py) charges from."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from scoring.views import Decision, RouteRequest
from workers.worker import Worker

if TYPE_CHECKING:
    from gateway.desired_workers import InFlight
    from gateway.quota_gate import Ticket
    from gateway.tenancy import Tenant
    from scoring.policy import Policy

# The substring that marks the usage chunk among SSE events (and in a whole response): found with
# a byte search, parsed only then.
USAGE_MARK = b'"usage"'


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @classmethod
    def from_json(cls, u: Any) -> Usage | None:
        """The worker's usage, or None when it is not one a charge can be computed from
        (missing, either count absent or null, or counts that are not non-negative integers:
        a negative count had made the charge negative and the settlement raise after its
        ticket was done, holding the lease). Cached tokens are at most the prompt's."""
        if not isinstance(u, dict):
            return None
        prompt, completion = u.get("prompt_tokens"), u.get("completion_tokens")
        if prompt is None or completion is None:
            # No counts (`{}`, `{"total_tokens": 25}`): not a usage, charged by what else is
            # known. Taken as 0 and 0, such a usage made the request free (review).
            return None
        details = u.get("prompt_tokens_details") or {}
        prompt = _count(prompt)
        completion = _count(completion)
        cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else 0
        if prompt is None or completion is None or cached is None:
            return None
        return cls(prompt, completion, min(cached, prompt))


# More tokens than any request generates or reads: a count above it is a broken (or hostile)
# worker's, not a usage. `1e308` was taken whole: its charge overflowed the float of a metric
# after the ticket was closed, and the tenant's concurrency lease leaked until its TTL.
MAX_COUNT = 1 << 40


def _count(v: Any) -> int | None:
    """A token count: a non-negative int up to MAX_COUNT (null or absent: 0), else None."""
    if v is None:
        return 0
    if type(v) is int and 0 <= v <= MAX_COUNT:
        return v
    if type(v) is float and 0 <= v <= MAX_COUNT and v.is_integer():
        return int(v)
    return None


@dataclass(slots=True)
class Call:
    """One client request on its way through the proxy."""

    request_id: str  # the gateway's own (gateway.ids): unique, names the request everywhere
    model: str
    path: str
    body: bytes
    stream: bool
    client_wants_usage: bool
    route: RouteRequest
    route_debug: Decision | None = None
    policy: Policy | None = None  # the policy that placed it (told when its prefill is done)
    t_start: float = field(default_factory=time.perf_counter)
    worker: str = ""
    attempts: int = 0
    admit_s: float = math.inf  # how long it may wait for room (its deadline header, or default)
    status: int = 0
    ttft: float | None = None
    events: int = 0
    usage: Usage | None = None
    # The last usage a content event carried (``continuous_usage_stats``, forced upstream), as
    # its JSON object's bytes: what a stream cut before its usage chunk is charged by, parsed
    # only then. One event is not one token (vLLM merges the deltas of a lagging stream, and a
    # client that reads slowly makes it lag), so counting events undercharged such cuts. A
    # stream of several choices holds each choice's last instead, as a JSON list of
    # [index, usage] (`relay._choices_usage`): each counts its own choice alone.
    live_usage: bytes = b""
    client_wants_live_usage: bool = False  # asked for `continuous_usage_stats`: not stripped
    live_usage_upstream: bool = False  # the worker was asked for usage on every event
    outcome: str = ""  # ok | upstream_4xx | client_disconnect | upstream_broken | idle_timeout
    # Workers this request may use (a canary split), or None for any; ignored when none qualify.
    pool_ok: Callable[[Worker], bool] | None = None
    pool: str = ""  # the chosen worker's `pool` label, for per-pool metrics
    prefill_tokens: int = 0  # the routing decision's estimate, held on the worker until 1st byte
    prefill_reported: bool = False  # this attempt's on_prefill_done was called
    learned: Any = None  # this attempt's policy.on_dispatch receipt (for on_refused)
    account: Account | None = None  # who pays (None: the proxy's own tests, no tenancy)
    client_request_id: str | None = None  # the client's x-request-id: a label, echoed, forwarded
    # The request went to a worker that may be generating it (non-streaming: nothing tells how
    # far it got until the whole answer arrives); cleared when the attempt was refused.
    upstream_sent: bool = False
    # perf_counter when the (last) attempt went to its worker: the request log's `sent_ms`, the
    # walk's own share of TTFT (body, checks, keying, quota, admission queue, a connection).
    t_sent: float = 0.0
    finished: bool = False  # recorded (settled, counted, logged): `Lifecycle.finish` ran


@dataclass(slots=True)
class Account:
    """Who pays for a request and what was reserved for it: the walk's part of a `Call`."""

    tenant: Tenant
    ticket: Ticket | None
    prompt_estimate: int
    tokens: int = 0  # prompt estimate + output cap: the autoscaler's tokens in flight
    choices: int = 1  # sequences generated (choices x prompts): a live usage counts one
    # Tokens generated that no event shows (chat `include_reasoning: false` hides the reasoning):
    # a stream cut before its usage chunk is charged its reservation, as a cut whole answer is.
    hidden_output: bool = False
    in_flight: InFlight | None = None
    settled: bool = False  # settled: the ticket is closed whatever happens next
