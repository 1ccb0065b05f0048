"""Config sections and the pure cores' settings are declared apart; the mappers between them
(gateway.config.to_core) must fail loudly on drift, and the shipped pairs must not drift."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import BaseModel

from gateway.admission import AdmissionSettings as AdmissionCore
from gateway.config import (
    AdmissionSettings,
    AutoscaleSettings,
    ConfigError,
    ProbeSettings,
    Settings,
    WeightsSettings,
    to_core,
)
from gateway.core_settings import ADMISSION_GATEWAY_ONLY as _ADMISSION_GATEWAY_ONLY
from gateway.core_settings import admission_settings as _admission
from gateway.core_settings import registry_knobs as _registry_knobs
from gateway.core_settings import routing_weights as _weights
from gateway.desired_workers import AutoscaleSettings as AutoscaleCore
from scoring.views import Weights


def test_every_section_maps_onto_its_core_with_the_same_defaults() -> None:
    assert _admission(AdmissionSettings()) == AdmissionCore()
    assert _weights(WeightsSettings()) == Weights()
    assert to_core(AutoscaleSettings(), AutoscaleCore) == AutoscaleCore()
    from workers.registry import Registry

    knobs = _registry_knobs(ProbeSettings())
    assert set(knobs) == Registry.KNOBS
    assert set(_ADMISSION_GATEWAY_ONLY) <= set(AdmissionSettings.model_fields)


def test_a_field_missing_on_either_side_fails_loudly() -> None:
    @dataclasses.dataclass
    class Core:
        a: int = 1
        b: int = 2

    class Short(BaseModel):
        a: int = 1

    class Long(BaseModel):
        a: int = 1
        b: int = 2
        c: int = 3

    with pytest.raises(TypeError, match=r"missing from the section \['b'\]"):
        to_core(Short(), Core)
    with pytest.raises(TypeError, match=r"does not take \['c'\]"):
        to_core(Long(), Core)
    assert to_core(Long(), Core, gateway_only=("c",)) == Core(1, 2)


def test_autoscale_section_is_checked_by_the_formulas_own_rules(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from gateway.config import load_settings

    bad = tmp_path / "bad.toml"
    bad.write_text("[autoscale]\nmin_workers = 9\nmax_workers = 4\n")
    with pytest.raises(ConfigError, match="min_workers"):
        load_settings(bad)
    ok = tmp_path / "ok.toml"
    ok.write_text("[autoscale]\nmax_workers = 16\ntarget_ttft_p95_s = 1.5\n")
    s = load_settings(ok)
    assert to_core(s.autoscale, AutoscaleCore).max_workers == 16
    assert Settings().autoscale.max_workers == 64


def test_autoscale_and_outlier_settings_apply_on_reload() -> None:
    from gateway.asgi import create_app

    s = Settings(workers=[{"name": "w0", "url": "http://127.0.0.1:9"}])
    gw = create_app(s, None).state.gateway
    new = s.model_copy(
        update={
            "autoscale": s.autoscale.model_copy(update={"max_workers": 7}),
            "probes": s.probes.model_copy(update={"outlier_window": 80, "outlier_check_s": 0.5}),
        }
    )
    gw.apply(new)
    assert gw.autoscale.settings.max_workers == 7
    assert (gw.registry.outlier_window, gw.registry.outlier_check_s) == (80, 0.5)
