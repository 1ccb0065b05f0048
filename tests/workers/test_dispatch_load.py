"""The load counting rules the gateway's workers and the simulator's replicas share."""

from __future__ import annotations

from workers.dispatch_load import Load
from workers.worker import Worker, WorkerSpec


def test_a_request_counts_from_dispatch_to_release_and_its_prefill_to_the_first_byte() -> None:
    for load in (Load(), Worker(WorkerSpec("w", "http://127.0.0.1:9"))):
        load.dispatched(300)
        load.dispatched(200)
        assert (load.in_flight, load.prefill_tokens, load.sent_tokens_since_scrape) == (2, 500, 500)
        load.prefill_done(300)
        assert (load.in_flight, load.prefill_tokens) == (2, 200)
        load.released()
        assert load.in_flight == 1
        # More done than counted (a guard: the figure is an estimate) stops at zero.
        load.prefill_tokens = 50
        load.prefill_done(200)
        load.released()
        assert (load.in_flight, load.prefill_tokens) == (0, 0)
        assert load.sent_tokens_since_scrape == 500  # a scrape, not a release, clears it
