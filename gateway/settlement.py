"""Settlement: charge a tenant for what a request really used, exactly once, and write its usage
record. The one place that decides what a finished, broken, cut-off or refused request costs.

What is charged, in order of what is known:
* the worker's reported usage (prompt + completion, cached prompt tokens discounted per tenant);
* a stream that broke before its usage chunk, or whose client left after the worker had it
  (before its first token too): the prompt estimate plus the events streamed (role, usage and
  [DONE] events are not tokens), as the quota conventions settle a disconnect;
* a whole (non-streaming) response cut off while the worker generated it: how far the worker got
  is unknowable, so the reservation (prompt + output cap) is what it may have spent; exact billing
  of cut-off work needs `stream: true`;
* nothing generated: the reservation goes back; an upstream 4xx still counts as an attempt.
"""

from __future__ import annotations

import time
from typing import Any

from gateway.call import Account, Call, Usage
from gateway.quota_gate import QuotaGate, Ticket
from gateway.usage import UsageSink

# Outcomes of a non-streaming request cut off while a worker was generating it.
CUT_OFF = frozenset({"upstream_timeout", "client_disconnect"})


def charge(account: Account, call: Call) -> int | None:
    """Tokens to charge for ``call``; None when nothing was generated (release instead)."""
    u = call.usage
    if u is not None:
        discount = account.tenant.cfg.cached_token_discount
        return max(0, u.prompt_tokens + u.completion_tokens - int(discount * u.cached_tokens))
    if call.stream and (call.events > 0 or call.outcome == "client_disconnect"):
        # Streamed so far, or nothing yet from a worker that had the prompt: a client that
        # hangs up before the first token still cost a prefill (free, it was a way to fire
        # unlimited prefills at a rate-limited key).
        return account.prompt_estimate + max(0, call.events - 2)
    if not call.stream and (call.outcome in CUT_OFF or call.status == 200):
        # Cut off while generating, or a whole answer that came without usage (a server that
        # omits it, a proxy that strips it): generated, amount unknown. The reservation
        # bounds it (the output cap is in it); charged nothing, such a key was unlimited.
        t = account.ticket
        return t.reserved if t is not None else account.tokens
    return None


def usage_record(account: Account, call: Call, charged: int) -> dict[str, Any]:
    """The usage record's schema (one per request, to the usage sink: Redis stream or JSONL)."""
    u: Usage | None = call.usage
    return {
        "request_id": call.request_id,
        "client_request_id": call.client_request_id,
        "tenant": account.tenant.name,
        "model": call.model,
        "worker": call.worker,
        "status": call.status,
        "outcome": call.outcome,
        "prompt_tokens": u.prompt_tokens if u else None,
        "cached_tokens": u.cached_tokens if u else None,
        "completion_tokens": u.completion_tokens if u else None,
        "charged_tokens": charged,
        "ttft_ms": round(call.ttft * 1000, 3) if call.ttft is not None else None,
        "duration_ms": round((time.perf_counter() - call.t_start) * 1000, 3),
        "ts": round(time.time(), 3),
    }


class Settlement:
    """Settles calls against the quota store and writes their usage records."""

    def __init__(self, quota: QuotaGate, usage: UsageSink) -> None:
        self.quota = quota
        self.usage = usage

    async def settle(self, call: Call) -> None:
        """Charge the tenant for what really happened, once (later calls do nothing)."""
        account = call.account
        if account is None or account.settled:
            return
        account.settled = True
        if account.in_flight is not None:
            account.in_flight.end()
        t = account.ticket
        charged = charge(account, call)
        if charged is None:
            if t is not None:
                # Nothing generated: an upstream 4xx is the client's request's fault (the
                # attempt counts), anything else is not.
                await self.quota.release(t, refund_all=not (400 <= call.status < 500))
            charged = 0
        elif t is not None:
            await self.quota.settle(t, charged)
        await self.usage.write(usage_record(account, call, charged))

    async def refund(self, call: Call | None, ticket: Ticket | None) -> None:
        """Give a reservation back whole (nothing reached a worker, or the walk was cancelled),
        unless the call was settled already."""
        account = call.account if call is not None else None
        if ticket is not None and not (account is not None and account.settled):
            await self.quota.release(ticket, refund_all=True)
