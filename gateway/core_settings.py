"""The mappers from config sections to what the cores and the fleet take.

`gateway.config` declares the ops-facing sections; the cores (admission, the registry, the
precise index, the policy's weights) declare their own settings apart and stay importable
without pydantic. These functions are the one place a section becomes a core's settings, used
by `Gateway` at start and on every reload (gateway/app.py) and by the admin API's "add a
worker" (gateway/endpoints.py); tests/gateway/test_settings_mapping.py holds them to no drift.
"""

from __future__ import annotations

from typing import Any

from gateway.admission import AdmissionSettings
from gateway.config import AdmissionSettings as AdmissionConfig
from gateway.config import (
    KVEventSettings,
    ProbeSettings,
    WeightsSettings,
    WorkerSettings,
    to_core,
)
from scoring.precise import PreciseIndex
from scoring.views import Weights
from workers.registry import Registry
from workers.worker import WorkerSpec


def worker_spec(w: WorkerSettings) -> WorkerSpec:
    return WorkerSpec(
        name=w.name,
        url=w.url,
        weight=w.weight,
        labels=dict(w.labels),
        api_key=w.api_key,
        kv_events=w.kv_events,
        kv_events_replay=w.kv_events_replay,
        kv_events_topic=w.kv_events_topic,
        max_concurrency=w.max_concurrency,
    )


# [admission] fields the gateway reads itself (slots and the priority reserve, `worker_room`),
# not the queue core.
ADMISSION_GATEWAY_ONLY = ("worker_concurrency", "priority_reserve", "reserve_min_priority")
# [probes] fields the prober reads (schedule, deep probes), not the registry's health machine.
PROBES_PROBER_ONLY = ("interval_s", "timeout_s", "deep_every", "deep_timeout_s", "deep_model")


def admission_settings(a: AdmissionConfig) -> AdmissionSettings:
    return to_core(a, AdmissionSettings, gateway_only=ADMISSION_GATEWAY_ONLY)


def routing_weights(w: WeightsSettings) -> Weights:
    return to_core(w, Weights)


def registry_knobs(p: ProbeSettings) -> dict[str, Any]:
    """The [probes] settings the registry takes (health, breaker, outliers): every one of its
    knobs must be a [probes] field, and every [probes] field a knob or the prober's."""
    missing = Registry.KNOBS - set(ProbeSettings.model_fields)
    unknown = set(ProbeSettings.model_fields) - Registry.KNOBS - set(PROBES_PROBER_ONLY)
    if missing or unknown:
        raise TypeError(
            f"[probes] vs Registry.KNOBS: missing {sorted(missing)}, unused {sorted(unknown)}"
        )
    return {k: getattr(p, k) for k in Registry.KNOBS}


def precise_index(k: KVEventSettings) -> PreciseIndex:
    return PreciseIndex(
        offload_weight=k.offload_weight,
        pending_ttl_s=k.pending_ttl_s,
        settle_s=k.settle_s,
        stale_after_s=k.stale_after_s,
        stale_after_dispatches=k.stale_after_dispatches,
    )
