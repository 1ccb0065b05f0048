"""The load a gateway has put on a worker and not yet seen end, and the rules that count it.

Routing reads two figures the worker's own metrics cannot show yet: requests in flight, and the
prompt tokens sent for prefill that have not produced a first token (the decision's estimate of
the uncached part, held from dispatch to the first byte). ``DispatchLoad`` is those rules, once:
mixed into ``workers.worker.Worker``, the gateway's count (``gateway/lifecycle.py`` applies them
to each attempt), and into ``Load``, the offline simulator's count per replica and worker
(``bench/replicas.py``), so a benchmark counts load exactly as the gateway does.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DispatchLoad", "Load"]


class DispatchLoad:
    """Dispatched -> prefill done (once, at the first byte or at the end) -> released."""

    __slots__ = ()
    in_flight: int
    prefill_tokens: int
    sent_tokens_since_scrape: int

    def dispatched(self, prefill_tokens: int) -> None:
        """A request went out with ``prefill_tokens`` uncached prompt tokens to compute: it
        counts in flight, its prefill is queued, and its KV is on the way (until the next
        scrape shows it)."""
        self.in_flight += 1
        self.prefill_tokens += prefill_tokens
        self.sent_tokens_since_scrape += prefill_tokens

    def prefill_done(self, prefill_tokens: int) -> None:
        """A request's prefill is over (its first byte, or its end without one)."""
        left = self.prefill_tokens - prefill_tokens
        self.prefill_tokens = left if left > 0 else 0

    def released(self) -> None:
        """A request ended: one fewer in flight."""
        self.in_flight -= 1


@dataclass(slots=True)
class Load(DispatchLoad):
    """A count on its own (the simulator's, per replica and worker)."""

    in_flight: int = 0
    prefill_tokens: int = 0
    sent_tokens_since_scrape: int = 0
