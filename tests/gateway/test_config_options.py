"""Loading the config: values TOML allows but the gateway cannot run on, and environment overrides.

Every way a file or the environment can be wrong must end as a `ConfigError` naming what is
wrong: at start the CLI prints it, on a reload the watcher rejects and reports it (`on_error`,
`kvgate_config_reload_errors_total`). Anything else escaped a reload unreported, and a value
that validated but could not be used turned every routed request into a 500.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import ConfigError, Settings, load_settings
from gateway.config_watcher import ConfigWatcher
from scoring.route_key import route_request
from scoring.views import RoutingOptions

BASE = '[logging]\nlevel = "warning"\n[[workers]]\nname = "w"\nurl = "http://127.0.0.1:9001"\n'


def _write(tmp_path: Path, text: str) -> Path:
    cfg = tmp_path / "kvgate.toml"
    cfg.write_text(text, encoding="utf-8")
    return cfg


# -- [routing.options]: integer knobs written as floats -------------------------------------------
@pytest.mark.parametrize("option", ["block_chars", "max_blocks", "tail_ratio", "token_block_size"])
def test_an_integer_option_written_as_a_whole_float_loads_as_an_int(
    tmp_path: Path, option: str
) -> None:
    s = load_settings(_write(tmp_path, f"[routing.options]\n{option} = 64.0\n"))
    assert type(s.routing.options[option]) is int and s.routing.options[option] == 64
    opts = RoutingOptions(**s.routing.options)  # what the gateway routes with
    body = {"model": "m", "messages": [{"role": "user", "content": "hello " * 8_000}]}
    assert route_request("chat", body, model="m", options=opts).chain


def test_an_integer_option_with_a_fraction_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"routing\.options.*'block_chars' must be an integer"):
        load_settings(_write(tmp_path, "[routing.options]\nblock_chars = 64.5\n"))


def test_a_reload_with_block_chars_as_a_float_applies_usable_options(tmp_path: Path) -> None:
    cfg = _write(tmp_path, BASE)
    applied: list[Settings] = []
    w = ConfigWatcher(cfg, load_settings(cfg), applied.append, pytest.fail)
    cfg.write_text(BASE + "[routing.options]\nblock_chars = 32.0\n", encoding="utf-8")
    assert w.reload()
    opts = RoutingOptions(**applied[0].routing.options)
    assert type(opts.block_chars) is int
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 5_000}]}
    assert route_request("chat", body, model="m", options=opts).chain


# -- values no validator bounds: never anything but ConfigError ----------------------------------
def test_an_integer_too_large_for_a_float_in_routing_options_is_a_config_error(
    tmp_path: Path,
) -> None:
    big = "1" + "0" * 400
    with pytest.raises(ConfigError, match="max_blocks"):
        load_settings(_write(tmp_path, f"[routing.options]\nmax_blocks = {big}\n"))


def test_toml_nested_too_deeply_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_settings(_write(tmp_path, "x = " + "[" * 3000 + "]" * 3000 + "\n"))


def test_a_directory_in_place_of_the_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(tmp_path)


@pytest.mark.parametrize(
    "extra",
    [
        "[routing.options]\nmax_blocks = 1" + "0" * 400 + "\n",
        "[routing]\nx = " + "[" * 3000 + "]" * 3000 + "\n",
    ],
    ids=["overflow", "recursion"],
)
def test_a_reload_of_such_a_file_is_rejected_and_reported(tmp_path: Path, extra: str) -> None:
    # reload() raised instead: SIGHUP and POST /admin/reload failed, no on_error, no count, and
    # the file watch task died and restarted 5 s later.
    cfg = _write(tmp_path, BASE)
    errors: list[str] = []
    w = ConfigWatcher(cfg, load_settings(cfg), pytest.fail, errors.append)
    cfg.write_text(BASE + extra, encoding="utf-8")
    assert w.reload() is False
    assert len(errors) == 1 and str(cfg) in errors[0]
    assert w.current.workers[0].url.endswith(":9001")


# -- KVGATE_* environment overrides --------------------------------------------------------------
@pytest.mark.parametrize(
    "name",
    ["KVGATE_ROUTNG__POLICY", "KVGATE_TENANTS_X__RPM", "KVGATE_SERVERS__PORT", "kvgate_routng__x"],
)
def test_a_misspelt_top_level_environment_section_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    # A typo inside a section was refused (extra="forbid"); one in the section's name was read
    # by nothing, so `KVGATE_ROUTNG__POLICY=prefix` loaded with policy kv_aware.
    monkeypatch.setenv(name, "prefix")
    with pytest.raises(ConfigError, match=name):
        load_settings(_write(tmp_path, BASE))


def test_environment_overrides_and_other_tools_variables_still_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGATE_ROUTING__POLICY", "prefix")
    monkeypatch.setenv("KVGATE_SERVER__PORT", "9123")  # as `kvgate serve --port` sets it
    monkeypatch.setenv("KVGATE_SERVER__HOST", "0.0.0.0")  # as the Dockerfile sets it
    monkeypatch.setenv("KVGATE_ROUTING__WEIGHTS", '{"prefix": 3}')
    monkeypatch.setenv("KVGATE_QUOTA__REPLICAS", "4")  # as the supervisor sets it
    # Not settings: read by docker compose and by bench/redis_server.py.
    monkeypatch.setenv("KVGATE_PORT", "8001")
    monkeypatch.setenv("KVGATE_REDIS_SERVER", "/usr/bin/redis-server")
    # What Kubernetes injects into every pod of a namespace with a service named kvgate.
    monkeypatch.setenv("KVGATE_SERVICE_HOST", "10.0.0.7")
    monkeypatch.setenv("KVGATE_PORT_8000_TCP_ADDR", "10.0.0.7")
    s = load_settings(_write(tmp_path, BASE))
    assert s.routing.policy == "prefix" and s.server.port == 9123
    assert s.routing.weights.prefix == 3 and s.quota.replicas == 4  # type: ignore[attr-defined]
