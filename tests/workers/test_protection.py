"""Worker protections : drain, deep health probes, circuit breaker, TTFT outliers; held
ejection and half-open readmission of workers whose requests fail."""

from __future__ import annotations

import asyncio
import json

import httpx

from tests.support.sim_workers import run_sim_workers
from workers.probe import Prober
from workers.registry import Registry
from workers.worker import Health, WorkerSpec

CARD = [{"id": "m", "object": "model"}]


class Clock:
    """A hand-driven registry clock: ejection times without sleeping."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(n: int = 1, clock: Clock | None = None, **kw: float) -> Registry:
    r = Registry(
        [WorkerSpec(f"w{i}", f"http://127.0.0.1:{9000 + i}") for i in range(n)],
        clock=clock or Clock(),
        **kw,  # type: ignore[arg-type]
    )
    for i in range(n):
        r.probe_ok(f"w{i}", CARD, None)
    return r


# -- drain -------------------------------------------------------------------------------------
def test_drain_excludes_from_candidates_and_drained_flips_when_in_flight_reaches_zero() -> None:
    r = make(2)
    w0 = r.workers["w0"]
    w0.in_flight = 2  # the proxy's counters: two requests still running there
    assert r.drain("w0") is True
    assert [w.name for w in r.candidates("m")] == ["w1"]
    assert w0.draining and w0.health is Health.HEALTHY  # not a health state: probes go on
    assert not r.drained("w0")
    w0.in_flight -= 1
    assert not r.drained("w0")
    w0.in_flight -= 1
    assert r.drained("w0") and w0.drained
    # Probes keep the state current while it drains.
    r.probe_failed("w0", "x")
    assert w0.consecutive_failures == 1
    r.probe_ok("w0", CARD, None)
    # Undrain readmits at once.
    assert r.drain("w0", False) is True
    assert sorted(w.name for w in r.candidates("m")) == ["w0", "w1"]
    assert not r.drained("w0")


def test_drain_of_unknown_worker_and_drained_of_undrained_worker() -> None:
    r = make(1)
    assert r.drain("nope") is False
    assert r.drained("nope") is False
    assert r.drained("w0") is False  # idle but not draining


def test_drain_survives_config_sync() -> None:
    r = make(2)
    r.drain("w0")
    r.drain("w1")
    # Unchanged and changed-in-place specs keep the Worker; a new URL keeps only the drain.
    r.sync(
        [
            WorkerSpec("w0", "http://127.0.0.1:9000", weight=3.0),
            WorkerSpec("w1", "http://127.0.0.1:9101"),
        ]
    )
    assert r.workers["w0"].draining and r.workers["w0"].health is Health.HEALTHY
    assert r.workers["w1"].draining and r.workers["w1"].health is Health.STARTING
    r.probe_ok("w1", CARD, None)
    assert r.candidates("m") == []


# -- circuit breaker ---------------------------------------------------------------------------
def test_breaker_opens_on_error_rate_with_interleaved_successes() -> None:
    # fail, fail, ok repeated: never 3 in a row, so the consecutive rule alone never trips.
    r = make(
        1, unhealthy_after=3, breaker_window=20, breaker_error_rate=0.5, breaker_min_requests=10
    )
    w = r.workers["w0"]
    outcomes = []
    for i in range(12):
        if i % 3 == 2:
            r.passive_success("w0")
        else:
            r.passive_failure("w0", "HTTP 500")
        outcomes.append(w.health)
    # After 9 outcomes (6 failed) the window is still below min_requests; the 10th (7/10) trips.
    assert outcomes[:9] == [Health.HEALTHY] * 9
    assert outcomes[9] is Health.UNHEALTHY
    assert w.ejection_reason == "breaker"
    assert w.last_error.startswith("circuit breaker: 7/10")
    assert r.candidates("m") == []


def test_breaker_needs_min_requests_and_more_than_the_rate() -> None:
    r = make(1, unhealthy_after=100, breaker_min_requests=10, breaker_error_rate=0.5)
    for _ in range(9):
        r.passive_failure("w0", "HTTP 500")
    assert r.workers["w0"].health is Health.HEALTHY  # 9/9 failed, but only 9 outcomes
    r2 = make(1, unhealthy_after=100, breaker_min_requests=10, breaker_error_rate=0.5)
    for i in range(40):  # exactly 50 %: not *above* the rate
        if i % 2:
            r2.passive_failure("w0", "HTTP 500")
        else:
            r2.passive_success("w0")
    assert r2.workers["w0"].health is Health.HEALTHY
    assert len(r2.workers["w0"].outcomes) == 20  # the window slides


def test_breaker_disabled_with_zero_window() -> None:
    r = make(1, unhealthy_after=100, breaker_window=0)
    for _ in range(50):
        r.passive_failure("w0", "HTTP 500")
    assert r.workers["w0"].health is Health.HEALTHY


def test_breaker_ejection_holds_until_its_time_then_a_trial_readmits_with_a_clean_window() -> None:
    clock = Clock()
    seen: list[tuple[str, Health, Health]] = []
    r = make(
        1,
        clock,
        unhealthy_after=100,
        breaker_min_requests=4,
        backoff_initial_s=5,
        backoff_max_s=40,
    )
    r.on_change = lambda w, was: seen.append((w.name, was, w.health))
    w = r.workers["w0"]
    for _ in range(4):
        r.passive_failure("w0", "HTTP 503")
    assert w.health is Health.UNHEALTHY and w.ejected_until == clock.t + 5
    assert seen == [("w0", Health.HEALTHY, Health.UNHEALTHY)]
    # A probe inside the ejection time does not readmit; the next probe waits for it to end.
    clock.t += 1
    r.probe_ok("w0", CARD, None)
    assert w.health is Health.UNHEALTHY and w.last_error.startswith("circuit breaker")
    r.passive_failure("w0", "HTTP 503")  # a late failure of a request sent before
    assert w.last_error.startswith("circuit breaker")
    assert r.next_probe_delay("w0", 0.5) == 4
    clock.t += 4
    r.probe_ok("w0", CARD, None)  # hold over: half-open, not healthy
    assert w.health is Health.HALF_OPEN and w.ejection_reason == "breaker"
    r.passive_success("w0")  # the trial request succeeded
    assert w.health is Health.HEALTHY
    assert list(w.outcomes) == [False] and w.outcome_failures == 0 and w.ejection_reason == ""
    # Straight back in trouble: the ejection time doubles.
    for _ in range(4):
        r.passive_failure("w0", "HTTP 503")
    assert w.ejected_until == clock.t + 10 and w.ejections == 2
    clock.t += 10
    r.probe_ok("w0", CARD, None)
    r.passive_success("w0")
    # In for longer than the longest ejection: a fresh incident starts from the base time.
    clock.t += 41
    for _ in range(4):
        r.passive_failure("w0", "HTTP 503")
    assert w.ejected_until == clock.t + 5 and w.ejections == 1


def test_outcomes_of_an_ejected_worker_are_not_recorded() -> None:
    clock = Clock()
    r = make(1, clock, unhealthy_after=1, backoff_initial_s=1)
    r.passive_failure("w0", "connect")
    w = r.workers["w0"]
    assert w.health is Health.UNHEALTHY and w.ejection_reason == "failures"
    r.passive_failure("w0", "connect")  # late failures of requests already in flight
    r.passive_success("w0")  # a late success does not end the hold either
    assert w.health is Health.UNHEALTHY and w.last_error.startswith("1 request failed in a row")
    clock.t += 1
    r.probe_ok("w0", CARD, None)
    assert w.health is Health.HALF_OPEN and list(w.outcomes) == [True]  # from while it was in
    r.passive_success("w0")
    assert w.health is Health.HEALTHY and list(w.outcomes) == [False]


# -- requests failing while /health says 200 ----------------------------------------------------
def test_failing_every_request_while_health_says_200_holds_backs_off_and_needs_a_trial() -> None:
    clock = Clock()
    seen: list[tuple[Health, Health]] = []
    r = make(2, clock, unhealthy_after=3, backoff_initial_s=5, backoff_max_s=40)
    r.on_change = lambda w, was: seen.append((was, w.health)) if w.name == "w0" else None
    w = r.workers["w0"]
    # Probes in between say 200 and reset the probe streak, not the request streak.
    for _ in range(3):
        r.probe_ok("w0", CARD, None)
        r.passive_failure("w0", "HTTP 500")
    assert w.health is Health.UNHEALTHY and w.ejection_reason == "failures"
    assert w.ejected_until == clock.t + 5 and w.ejections == 1
    assert w.last_error == "3 requests failed in a row (last: HTTP 500)"
    # /health keeps answering 200 during the hold: it stays out.
    for dt in (0.0, 1.0, 3.9):
        clock.t += dt
        r.probe_ok("w0", CARD, None)
        assert w.health is Health.UNHEALTHY and r.held("w0")
        assert [c.name for c in r.candidates("m")] == ["w1"]
    assert w.last_error.startswith("3 requests failed")  # still says why
    # Each failed trial ejects it again for twice as long, up to backoff_max_s.
    holds = []
    for _ in range(5):
        clock.t = w.ejected_until
        r.probe_ok("w0", CARD, None)
        assert w.health is Health.HALF_OPEN and not r.held("w0")
        r.probe_ok("w0", CARD, None)  # more probes do not end the trial either
        assert w.health is Health.HALF_OPEN
        assert w in r.candidates("m") and w in r.healthy()
        w.in_flight = 1  # the proxy sent it the trial request: one at a time
        assert r.candidates("m") == [r.workers["w1"]]
        w.in_flight = 0
        r.passive_failure("w0", "HTTP 500")
        assert w.health is Health.UNHEALTHY and w.last_error == "trial request failed: HTTP 500"
        holds.append(w.ejected_until - clock.t)
    assert holds == [10, 20, 40, 40, 40] and w.ejections == 6
    # Fixed: the first trial after the hold succeeds and it is healthy again.
    clock.t = w.ejected_until
    r.probe_ok("w0", CARD, None)
    r.passive_success("w0")
    assert w.health is Health.HEALTHY and w.ejection_reason == "" and w.passive_streak == 0
    assert [c.name for c in r.candidates("m")] == ["w0", "w1"]
    # One transition each, and healthy only once: at the end, from half-open.
    assert seen.count((Health.UNHEALTHY, Health.HALF_OPEN)) == 6
    assert seen.count((Health.HALF_OPEN, Health.UNHEALTHY)) == 5
    assert [t for t in seen if t[1] is Health.HEALTHY] == [(Health.HALF_OPEN, Health.HEALTHY)]
    assert len(seen) == 1 + 6 + 5 + 1


def test_trial_passes_at_first_byte_and_half_open_requests_bounds_the_trial() -> None:
    clock = Clock()
    r = make(1, clock, unhealthy_after=2, backoff_initial_s=1, half_open_requests=2)
    w = r.workers["w0"]
    r.passive_failure("w0", "connect: refused")
    r.passive_failure("w0", "connect: refused")
    clock.t += 1
    r.probe_ok("w0", CARD, None)
    assert w.health is Health.HALF_OPEN
    w.in_flight = 1
    assert r.candidates("m") == [w]  # two at once allowed
    w.in_flight = 2
    assert r.candidates("m") == []
    # A stream's first byte is the trial passing (its end may be minutes away).
    assert r.observe_ttft("w0", 0.05) == []
    assert w.health is Health.HEALTHY and r.candidates("m") == [w]
    assert w.last_success_at == clock.t and w.consecutive_failures == 0
    r.configure(half_open_requests=1)
    assert r.half_open_requests == 1


def test_mixed_streak_with_request_failures_is_a_held_ejection() -> None:
    clock = Clock()
    r = make(1, clock, unhealthy_after=3, backoff_initial_s=2)
    w = r.workers["w0"]
    r.passive_failure("w0", "HTTP 502")
    r.probe_failed("w0", "/health returned 503")
    r.probe_failed("w0", "/health returned 503")
    assert w.health is Health.UNHEALTHY and w.ejection_reason == "failures"
    assert w.last_error == "3 failures in a row, 2 of them probes (last: /health returned 503)"
    assert w.ejected_until == clock.t + 2


def test_probe_only_unhealthy_is_readmitted_by_probes_and_keeps_the_error_window() -> None:
    r = make(1, unhealthy_after=2, breaker_min_requests=4)
    w = r.workers["w0"]
    r.passive_failure("w0", "HTTP 500")
    r.passive_success("w0")
    r.passive_failure("w0", "HTTP 500")
    r.passive_success("w0")  # 2/4 failed: at the rate, not above it
    r.probe_failed("w0", "/health returned 503")
    r.probe_failed("w0", "/health returned 503")
    assert w.health is Health.UNHEALTHY and w.ejection_reason == "" and not r.held("w0")
    r.probe_ok("w0", CARD, None)
    assert w.health is Health.HEALTHY  # today's behaviour: nothing it was sent failed
    # The window survived the flap: one more failure (3/5) trips the breaker.
    assert list(w.outcomes) == [True, False, True, False]
    r.passive_failure("w0", "HTTP 500")
    assert w.health is Health.UNHEALTHY and w.ejection_reason == "breaker"


def test_half_open_worker_failing_probes_goes_unhealthy_and_back_to_half_open() -> None:
    clock = Clock()
    r = make(1, clock, unhealthy_after=2, backoff_initial_s=1)
    w = r.workers["w0"]
    r.passive_failure("w0", "HTTP 500")
    r.passive_failure("w0", "HTTP 500")
    clock.t += 1
    r.probe_ok("w0", CARD, None)
    assert w.health is Health.HALF_OPEN
    r.probe_failed("w0", "ConnectError")
    assert w.health is Health.HALF_OPEN
    r.probe_failed("w0", "ConnectError")
    assert w.health is Health.UNHEALTHY and not r.held("w0") and w.ejection_reason == "failures"
    r.probe_ok("w0", CARD, None)
    assert w.health is Health.HALF_OPEN  # its requests failed: still needs a trial


def test_ejection_hold_does_not_overflow_after_many_failed_trials() -> None:
    clock = Clock()
    r = make(1, clock, unhealthy_after=1, backoff_initial_s=1.0, backoff_max_s=30.0)
    w = r.workers["w0"]
    r.passive_failure("w0", "HTTP 500")
    w.ejections = 5000  # days of a worker failing every trial
    clock.t = w.ejected_until
    r.probe_ok("w0", CARD, None)
    r.passive_failure("w0", "HTTP 500")
    assert w.ejected_until == clock.t + 30 and w.ejections == 5001


def test_change_messages_say_why_once_per_transition() -> None:
    clock = Clock()
    lines: list[str] = []
    r = make(1, clock, unhealthy_after=2, backoff_initial_s=1)
    r.on_change = lambda w, was: lines.append(w.change_message(was))
    for _ in range(5):
        r.passive_failure("w0", "HTTP 500")  # three of them late: no line
    clock.t += 1
    r.probe_ok("w0", CARD, None)
    r.probe_ok("w0", CARD, None)
    r.passive_success("w0")
    r.probe_failed("w0", "ConnectError")
    r.probe_failed("w0", "ConnectError")
    assert lines == [
        "worker w0 ejected (failures, ejection 1 in a row, held 1s): 2 requests failed in a row "
        "(last: HTTP 500)",
        "worker w0 -> half_open after its failures ejection: back once a trial request succeeds",
        "worker w0 -> healthy (a trial request succeeded; models: ['m'])",
        "worker w0 -> unhealthy (ConnectError)",
    ]


async def test_poke_does_nothing_while_the_worker_is_held() -> None:
    clock = Clock()
    r = make(1, clock, unhealthy_after=1, backoff_initial_s=5)
    async with httpx.AsyncClient() as client:
        p = Prober(r, client, interval_s=1, timeout_s=1)
        wake = p._wake["w0"] = asyncio.Event()  # the probe loop's wake-up, without the loop
        r.passive_failure("w0", "HTTP 500")
        p.poke("w0")  # no probe can readmit it for 5 s: nothing to wake for
        assert not wake.is_set()
        clock.t += 5
        p.poke("w0")
        assert wake.is_set()


# -- TTFT outliers -----------------------------------------------------------------------------
def feed(r: Registry, name: str, seconds: float, n: int = 20) -> None:
    for _ in range(n):
        r.observe_ttft(name, seconds)


def test_outlier_ejected_only_beyond_factor_and_floor() -> None:
    clock = Clock()
    r = make(3, clock, outlier_check_s=0)
    feed(r, "w0", 0.1)
    feed(r, "w1", 0.12)
    # 8x its peers but under the 1 s floor: prefix-cache luck, not a sick worker.
    feed(r, "w2", 0.9)
    assert r.outliers() == [] and all(w.health is Health.HEALTHY for w in r.workers.values())
    # Above the floor but only 2.5x the peers' median (w2's own 0.9 s is the median here).
    r2 = make(3, clock, outlier_check_s=0)
    feed(r2, "w0", 1.0)
    feed(r2, "w1", 1.2)
    feed(r2, "w2", 2.9)
    assert r2.outliers() == []
    # Both: ejected, with a readable reason.
    feed(r, "w2", 4.0, n=50)
    w2 = r.workers["w2"]
    assert w2.health is Health.UNHEALTHY and w2.ejection_reason == "outlier"
    assert w2.last_error.startswith("ttft outlier: median ")
    assert "vs peers' 0.120s" in w2.last_error
    assert sorted(w.name for w in r.candidates("m")) == ["w0", "w1"]


def test_outlier_needs_min_samples() -> None:
    r = make(3, outlier_check_s=0, outlier_min_samples=20)
    feed(r, "w0", 0.1)
    feed(r, "w1", 0.1)
    feed(r, "w2", 10.0, n=19)
    assert r.workers["w2"].health is Health.HEALTHY
    r.observe_ttft("w2", 10.0)
    assert r.workers["w2"].health is Health.UNHEALTHY


def test_outlier_ejection_never_exceeds_max_fraction() -> None:
    clock = Clock()
    r = make(6, clock, outlier_check_s=0, outlier_max_fraction=0.34)
    for i in range(4):
        feed(r, f"w{i}", 0.2)
    for i in (4, 5):
        feed(r, f"w{i}", 8.0 + i)  # two clear outliers; 6 x 0.34 = 2 may go
    out = {n for n, w in r.workers.items() if w.health is Health.UNHEALTHY}
    assert out == {"w4", "w5"}
    # The two already out count against the cap: a third slow worker stays in.
    feed(r, "w3", 9.0, n=50)
    assert r.workers["w3"].health is Health.HEALTHY
    assert r.outliers() == []
    # Three workers: at most one out, however slow the others.
    r3 = make(3, clock, outlier_check_s=0)
    feed(r3, "w0", 0.2)
    feed(r3, "w1", 5.0)
    feed(r3, "w2", 6.0)
    assert sum(w.health is Health.UNHEALTHY for w in r3.workers.values()) <= 1
    # Two workers: never (their median is their mean).
    r2 = make(2, clock, outlier_check_s=0, outlier_max_fraction=0.5)
    feed(r2, "w0", 0.2)
    feed(r2, "w1", 50.0)
    assert all(w.health is Health.HEALTHY for w in r2.workers.values())


def test_outliers_are_compared_with_peers_serving_the_same_models() -> None:
    r = make(6, outlier_check_s=0)
    for i in (3, 4, 5):
        r.probe_ok(f"w{i}", [{"id": "big"}], None)
    for i in (0, 1, 2):
        feed(r, f"w{i}", 0.2)
    for i in (3, 4, 5):
        feed(r, f"w{i}", 3.0)  # a bigger model: slower, and not anyone's outlier
    assert r.outliers() == []


def test_outlier_check_is_rate_limited_and_readmission_clears_samples() -> None:
    clock = Clock()
    r = make(3, clock, outlier_check_s=5.0, backoff_initial_s=2)
    feed(r, "w0", 0.2)
    feed(r, "w1", 0.2)
    r.observe_ttft("w2", 0.2)  # runs the check now (nothing to find) and arms the next one
    feed(r, "w2", 6.0, n=30)
    assert r.workers["w2"].health is Health.HEALTHY  # within 5 s of the last check
    clock.t += 5
    assert r.observe_ttft("w2", 6.0) == ["w2"]
    w2 = r.workers["w2"]
    assert w2.health is Health.UNHEALTHY
    clock.t += 2
    r.probe_ok("w2", CARD, None)
    assert w2.health is Health.HEALTHY and len(w2.ttfts) == 0


def test_outliers_disabled_with_zero_factor() -> None:
    r = make(3, outlier_check_s=0, outlier_factor=0)
    feed(r, "w0", 0.2)
    feed(r, "w1", 0.2)
    feed(r, "w2", 60.0)
    assert r.workers["w2"].health is Health.HEALTHY and len(r.workers["w2"].ttfts) == 0


def test_configure_changes_knobs_live_and_rejects_unknown_ones() -> None:
    r = make(1, breaker_window=20, unhealthy_after=100)
    for _ in range(8):
        r.passive_success("w0")
    r.configure(breaker_window=4, breaker_min_requests=4, unhealthy_after=50)
    assert r.unhealthy_after == 50
    for _ in range(3):
        r.passive_failure("w0", "HTTP 500")
    # The window shrank to the last 4 outcomes: 3/4 failed.
    assert r.workers["w0"].health is Health.UNHEALTHY
    try:
        r.configure(bogus=1)
    except TypeError:
        pass
    else:
        raise AssertionError("unknown knob accepted")


# -- deep probes -------------------------------------------------------------------------------
async def test_deep_probe_ejects_a_worker_that_cannot_generate_and_readmits_it() -> None:
    async with run_sim_workers(1) as fleet:
        r = Registry([WorkerSpec("w0", fleet[0])], unhealthy_after=2, breaker_window=0)
        w = r.workers["w0"]
        async with httpx.AsyncClient(timeout=5) as client:
            p = Prober(r, client, interval_s=1, timeout_s=5, deep_every=3, deep_timeout_s=5)
            assert await p.probe_once("w0") and w.health is Health.HEALTHY
            # /health stays 200, every generation fails.
            fleet.workers[0].faults.update({"error_rate": 1.0, "error_status": 500})
            assert await p.probe_once("w0")  # shallow
            assert await p.probe_once("w0")  # shallow
            assert not await p.probe_once("w0")  # the 3rd: deep, fails
            assert w.health is Health.HEALTHY and w.last_error.startswith("deep probe (sim-llama)")
            assert "500" in w.last_error
            assert not await p.probe_once("w0")  # failures pending: deep again at once
            assert w.health is Health.UNHEALTHY
            assert w.models == {"sim-llama"}  # what the shallow part learnt is kept
            assert not await p.probe_once("w0")  # unhealthy: every probe is deep
            assert w.health is Health.UNHEALTHY
            # The fault is cleared through the admin endpoint, as an operator would.
            resp = await client.post(fleet[0] + "/sim/faults", json={"error_rate": 0.0})
            resp.raise_for_status()
            assert await p.probe_once("w0")
            assert w.health is Health.HEALTHY and w.last_error == ""


async def test_deep_probe_off_by_default_and_skipped_after_proxied_success() -> None:
    async with run_sim_workers(1, faults={"error_rate": 1.0}) as fleet:
        r = Registry([WorkerSpec("w0", fleet[0])])
        w = r.workers["w0"]
        async with httpx.AsyncClient(timeout=5) as client:
            shallow = Prober(r, client, interval_s=1, timeout_s=5)
            for _ in range(5):
                assert await shallow.probe_once("w0")
            deep = Prober(r, client, interval_s=1, timeout_s=5, deep_every=2)
            assert await deep.probe_once("w0")  # 1st: shallow
            r.passive_success("w0")  # a proxied request generated since: proof enough
            assert await deep.probe_once("w0")  # due, but skipped
            assert await deep.probe_once("w0")
            assert not await deep.probe_once("w0")  # due, no traffic since: deep, fails
            assert w.consecutive_failures == 1


async def test_deep_probe_request_shape() -> None:
    seen: list[httpx.Request] = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req)
        if req.url.path == "/v1/models":
            data = [{"id": "lora-a", "parent": "base"}, {"id": "base"}]
            return httpx.Response(200, json={"object": "list", "data": data})
        if req.url.path == "/v1/completions":
            return httpx.Response(200, json={"choices": []})  # 200 but nothing generated
        return httpx.Response(200 if req.url.path == "/health" else 404)

    r = Registry([WorkerSpec("w0", "http://w0", api_key="sk-w")])
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        p = Prober(r, client, interval_s=1, timeout_s=1, deep_every=1)
        assert not await p.probe_once("w0")
    (req,) = [q for q in seen if q.url.path == "/v1/completions"]
    assert req.method == "POST" and req.headers["authorization"] == "Bearer sk-w"
    body = json.loads(req.content)
    assert body == {"model": "base", "prompt": "ping", "max_tokens": 1, "temperature": 0}
    assert "no choices" in r.workers["w0"].last_error
    # deep_model wins when the worker serves it.
    p.deep_model = "lora-a"
    assert p._pick_model([{"id": "lora-a", "parent": "base"}, {"id": "base"}]) == "lora-a"
    assert p._pick_model([{"id": "other"}]) == "other"
