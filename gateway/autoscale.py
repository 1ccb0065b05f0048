"""Autoscaling signals, exported: the ``kvgate_autoscale_*`` series and the fleet snapshot.

The thin shell over ``DesiredWorkers`` (gateway/desired_workers.py, the pure formula and why it
exists):

``AutoscaleCollector`` (prometheus_client ``Collector``)
    Calls ``evaluate`` at scrape time with a snapshot callable (``fleet_loads`` builds one from
    the registry and the admission controller) and exports the ``kvgate_autoscale_*`` series.

Wiring (for gateway/app.py)
    * Register ``AutoscaleCollector(estimator, functools.partial(fleet_loads, registry,
      admission))`` on the metrics registry, ``estimator`` being the gateway's one
      ``DesiredWorkers``.
    * ``estimator.note_unserved(model)`` where a request for a model the registry knows is refused
      for want of a serving worker (gateway/desired_workers.py, "Wiring").
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.desired_workers import SIGNALS, DesiredWorkers, ModelLoad, WorkerLoad

if TYPE_CHECKING:
    from gateway.admission import AdmissionController
    from workers.registry import Registry
    from workers.worker import Worker

__all__ = ["AutoscaleCollector", "fleet_loads"]

log = logging.getLogger("kvgate.autoscale")


def fleet_loads(registry: Registry, admission: AdmissionController) -> dict[str, ModelLoad]:
    """The snapshot ``AutoscaleCollector`` needs, from the gateway's live objects.

    Models come from every worker (healthy or not, so a model whose workers are all down still
    reports N = 0 and asks for capacity) and from every admission pool; a model in neither (a
    reload removed its last worker) is left out, and ``DesiredWorkers.evaluate`` exports nothing
    for it. ``fleet`` counts the workers that serve the model in any health state, draining ones
    left out (the operator is taking them away): before its first scale-in the desired count
    does not go below it, so a gateway that restarts while workers are down or still loading
    does not ask the autoscaler to remove them; and with none of them healthy the model is down,
    not idle (no step in).

    A worker that has not yet answered a probe with its models (still loading, down since the
    gateway started, a new URL) lists none. Until it answers, it counts toward ``fleet`` of the
    models its peers serve (``_assumed_models``): the answering workers configured with the same
    labels, else every answering worker (draining ones aside, in both). In a fleet of one model,
    that model (review: a gateway restarted while 2 of 3 workers were still loading said
    desired = 1). In a fleet of several models, the model of the workers labelled alike
    (review: 3 llama and 2 qwen workers, one of each answered, said 1 and 1); with no labels to
    tell its workers apart, none. There is no grace period: a vLLM load can take many minutes,
    and the floor it holds ends anyway at the model's first scale-in step, after a calm cooldown.
    """
    models: set[str] = set(admission.pools())
    answered: list[Worker] = []
    unprobed: list[Worker] = []
    for w in registry.workers.values():
        models.update(w.models)
        if not w.draining:
            (answered if w.models else unprobed).append(w)
    assumed = _assumed_models(answered, unprobed)
    out: dict[str, ModelLoad] = {}
    for model in models:
        workers = tuple(
            WorkerLoad(
                kv_usage=w.metrics.kv_usage,
                num_blocks=w.metrics.num_blocks,
                block_size=w.metrics.block_size,
                waiting=w.metrics.waiting,
            )
            for w in registry.candidates(model)
        )
        fleet = sum(1 for w in answered if model in w.models) + assumed.get(model, 0)
        out[model] = ModelLoad(workers, sum(admission.depth_by_tier(model).values()), fleet)
    return out


def _assumed_models(answered: list[Worker], unprobed: list[Worker]) -> Counter[str]:
    """Model -> workers that have not answered yet and are assumed to serve it (``fleet_loads``).

    Workers with the same labels in the config are taken as replicas of one deployment, the
    only thing the config says of what a worker serves: an unanswered one is assumed to serve
    what every answering worker with its labels lists (a base model and its LoRA adapters: what
    they all list). With none of those, what every answering worker lists, as before labels
    counted: the fleet's model if it serves one, nothing if several. The assumption is never
    wider than what the answering peers agree on, and never narrower than the fleet-wide one."""
    out: Counter[str] = Counter()
    if not unprobed or not answered:
        return out
    everyone = frozenset.intersection(*(w.models for w in answered))
    by_labels: dict[tuple[tuple[str, str], ...], frozenset[str]] = {}
    for w in answered:
        key = _labels(w)
        by_labels[key] = by_labels[key] & w.models if key in by_labels else w.models
    for w in unprobed:
        out.update(by_labels.get(_labels(w), everyone))
    return out


def _labels(w: Worker) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(w.spec.labels.items()))


# -- prometheus ------------------------------------------------------------------------------------
_GAUGES = {
    "queue_depth": (
        "kvgate_autoscale_queue_depth",
        "Requests waiting for a worker: the admission queue plus requests queued inside workers",
    ),
    "queue_wait": (
        "kvgate_autoscale_queue_wait_p95_seconds",
        "p95 admission wait over the window, all admitted requests (absent without samples)",
    ),
    "ttft": (
        "kvgate_autoscale_ttft_p95_seconds",
        "p95 gateway-observed time to first token over the window (absent without samples)",
    ),
    "kv_headroom": (
        "kvgate_autoscale_kv_headroom",
        "Free share (0..1) of the KV cache of the model's healthy workers",
    ),
    "kv_free": (
        "kvgate_autoscale_kv_free_tokens",
        "Free KV cache tokens over the model's healthy workers (absent when a size is unknown)",
    ),
    "tokens": (
        "kvgate_autoscale_tokens_in_flight",
        "Prompt estimate + output cap of the requests dispatched and not finished",
    ),
    "healthy": (
        "kvgate_autoscale_healthy_workers",
        "Healthy workers serving the model",
    ),
    "desired": (
        "kvgate_autoscale_desired_workers",
        "Workers the signals call for (README: Autoscaling); set replicas to this",
    ),
}


class AutoscaleCollector(Collector):
    """The ``kvgate_autoscale_*`` series, evaluated at scrape time.

    Evaluation advances the scale-in cooldown, so it runs where the autoscaler reads: each scrape
    is one evaluation. A failure is logged and yields no autoscale series rather than failing the
    whole scrape.
    """

    def __init__(
        self,
        estimator: DesiredWorkers,
        snapshot: Callable[[], Mapping[str, ModelLoad]],
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.estimator = estimator
        self.snapshot = snapshot
        self.clock = clock or estimator.clock

    def describe(self) -> Iterable[Metric]:
        # Registration must not evaluate (it would start cooldowns before any scrape).
        return list(self._families())

    def _families(self) -> Iterator[Metric]:
        for name, doc in _GAUGES.values():
            yield GaugeMetricFamily(name, doc, labels=["model"])
        yield GaugeMetricFamily(
            "kvgate_autoscale_pressure",
            "Pressure ratios of the desired-workers formula (1 = at target), by signal",
            labels=["model", "signal"],
        )
        yield CounterMetricFamily(
            "kvgate_autoscale_scale_events",
            "Changes of the desired worker count, by direction (out, in)",
            labels=["model", "direction"],
        )

    def collect(self) -> Iterator[Metric]:
        try:
            signals = self.estimator.evaluate(self.snapshot(), self.clock())
        except Exception:
            log.exception("autoscale evaluation failed")
            return
        *gauges, pressure, events = self._families()
        g = dict(zip(_GAUGES, gauges, strict=True))
        for sig in signals:
            m = [sig.model]
            g["queue_depth"].add_metric(m, float(sig.queue_depth))
            if sig.queue_wait_p95_s is not None:
                g["queue_wait"].add_metric(m, sig.queue_wait_p95_s)
            if sig.ttft_p95_s is not None:
                g["ttft"].add_metric(m, sig.ttft_p95_s)
            g["kv_headroom"].add_metric(m, sig.kv_headroom)
            if sig.kv_free_tokens is not None:
                g["kv_free"].add_metric(m, float(sig.kv_free_tokens))
            g["tokens"].add_metric(m, float(sig.tokens_in_flight))
            g["healthy"].add_metric(m, float(sig.healthy_workers))
            g["desired"].add_metric(m, float(sig.desired_workers))
            for name in SIGNALS:
                pressure.add_metric([sig.model, name], sig.ratios[name])
            outs, ins = self.estimator.scale_events(sig.model)
            events.add_metric([sig.model, "out"], float(outs))
            events.add_metric([sig.model, "in"], float(ins))
        yield from (*gauges, pressure, events)
