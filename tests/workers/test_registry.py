from workers.registry import Registry
from workers.vllm_metrics import WorkerMetrics
from workers.worker import Health, WorkerSpec

CARD = [{"id": "m", "object": "model"}]


def make(n: int = 2, **kw: int) -> Registry:
    return Registry([WorkerSpec(f"w{i}", f"http://127.0.0.1:{9000 + i}") for i in range(n)], **kw)


def test_starting_workers_are_not_routable_until_a_probe_succeeds() -> None:
    r = make()
    assert r.candidates("m") == []
    r.probe_ok("w0", CARD, WorkerMetrics(running=2))
    assert [w.name for w in r.candidates("m")] == ["w0"]
    assert r.candidates("other") == []
    assert r.workers["w0"].view().running == 2


def test_ejection_after_n_consecutive_failures_counting_passive_ones() -> None:
    r = make(unhealthy_after=3)
    r.probe_ok("w0", CARD, None)
    r.probe_failed("w0", "boom")
    r.passive_failure("w0", "connect")
    assert r.workers["w0"].health is Health.HEALTHY
    r.passive_failure("w0", "connect")
    assert r.workers["w0"].health is Health.UNHEALTHY
    assert r.candidates("m") == []
    # Still a known model: "none healthy" (503), not "unknown" (404).
    assert r.knows_model("m") and not r.knows_model("x")


def test_success_resets_the_failure_streak() -> None:
    r = make(unhealthy_after=2)
    r.probe_ok("w0", CARD, None)
    r.passive_failure("w0", "x")
    r.passive_success("w0")
    r.passive_failure("w0", "x")
    assert r.workers["w0"].health is Health.HEALTHY


def test_backoff_grows_while_unhealthy_and_resets_on_recovery() -> None:
    r = make(unhealthy_after=1, backoff_initial_s=1, backoff_max_s=5)
    r.probe_ok("w0", CARD, None)
    delays = []
    for _ in range(5):
        r.probe_failed("w0", "down")
        delays.append(r.next_probe_delay("w0", 0.5))
    assert delays == [1, 2, 4, 5, 5]
    r.probe_ok("w0", CARD, None)
    assert r.workers["w0"].health is Health.HEALTHY
    assert r.next_probe_delay("w0", 0.5) == 0.5


def test_readmission_needs_healthy_after_successes() -> None:
    r = make(unhealthy_after=1, healthy_after=2)
    r.probe_ok("w0", CARD, None)
    r.probe_ok("w0", CARD, None)
    r.probe_failed("w0", "x")
    r.probe_ok("w0", CARD, None)
    assert r.workers["w0"].health is Health.UNHEALTHY
    r.probe_ok("w0", CARD, None)
    assert r.workers["w0"].health is Health.HEALTHY


def test_sync_adds_removes_and_keeps_state_of_unchanged_workers() -> None:
    r = make(2)
    r.probe_ok("w0", CARD, None)
    added, removed = r.sync(
        [
            WorkerSpec("w0", "http://127.0.0.1:9000", weight=2.0),
            WorkerSpec("w5", "http://127.0.0.1:9005"),
        ]
    )
    assert added == ["w5"] and removed == ["w1"]
    assert r.workers["w0"].health is Health.HEALTHY  # kept
    assert r.workers["w0"].spec.weight == 2.0  # updated in place
    # A new URL under the same name is a different server: it starts over.
    r.sync([WorkerSpec("w0", "http://127.0.0.1:9100")])
    assert r.workers["w0"].health is Health.STARTING


def test_served_models_is_the_union_over_healthy_workers() -> None:
    r = make(3)
    r.probe_ok("w0", [{"id": "a"}], None)
    r.probe_ok("w1", [{"id": "b"}, {"id": "lora-x", "parent": "b"}], None)
    r.probe_ok("w2", [{"id": "c"}], None)
    for _ in range(3):
        r.probe_failed("w2", "down")
    assert sorted(r.served_models()) == ["a", "b", "lora-x"]
    assert r.served_models()["lora-x"]["parent"] == "b"


def test_view_is_reused_until_the_worker_changes() -> None:
    r = make(1)
    w = r.workers["w0"]
    v1 = w.view()
    assert w.view() is v1
    w.in_flight += 1
    v2 = w.view()
    assert v2 is not v1 and v2.in_flight == 1
    r.probe_ok("w0", CARD, WorkerMetrics(running=3))
    v3 = w.view()
    assert v3 is not v2 and v3.running == 3 and v3.in_flight_at_scrape == 1


def test_lora_adapters_are_models_of_their_own() -> None:
    r = make(2)
    r.probe_ok("w0", [{"id": "base"}], None)
    r.probe_ok("w1", [{"id": "base"}, {"id": "sql-lora", "parent": "base"}], None)
    assert [w.name for w in r.candidates("sql-lora")] == ["w1"]
    assert sorted(w.name for w in r.candidates("base")) == ["w0", "w1"]
