import dataclasses
import math
from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.config import (
    ConfigError,
    KVEventSettings,
    MediaTokenSettings,
    Settings,
    TenantSettings,
    TokenModeSettings,
    WeightsSettings,
    WorkerSettings,
    load_settings,
)
from gateway.config_watcher import ConfigWatcher
from scoring.views import RoutingOptions

ROOT = Path(__file__).resolve().parents[2]


def test_example_config_is_valid_and_complete() -> None:
    s = load_settings(ROOT / "config.example.toml")
    assert s.server.host == "127.0.0.1"
    assert [w.name for w in s.workers] == ["sim-1", "sim-2", "sim-3", "sim-4"]
    # Every option of every section appears in the example file, so ops can find it.
    text = (ROOT / "config.example.toml").read_text()
    sections: dict[str, type] = {
        name: f.annotation  # type: ignore[misc]
        for name, f in Settings.model_fields.items()
        if name not in ("workers", "tenants")
    }
    sections["routing.weights"] = WeightsSettings
    sections["routing.token_mode"] = TokenModeSettings
    sections["routing.kv_events"] = KVEventSettings
    sections["tenants.team-a"] = TenantSettings
    sections["tenancy.media_tokens"] = MediaTokenSettings
    sections["[workers"] = WorkerSettings
    for section, model in sections.items():
        assert f"[{section}]" in text, section
        body = text.split(f"[{section}]", 1)[1]
        for key in model.model_fields:
            if key in (
                "splits",
                "options",
                "weights",
                "model_limits",
                "token_mode",
                "kv_events",
                "media_tokens",
            ):
                continue  # sub-tables, checked on their own
            if key in ("api_key", "kv_events_replay", "kv_events_topic", "max_concurrency"):
                assert f"# {key}" in text, (
                    f"{section}.{key} is not documented in config.example.toml"
                )
                continue  # per-worker options, shown in the comments of [[workers]]
            assert f"\n{key} = " in body, f"{section}.{key} missing from config.example.toml"
    opts = text.split("[routing.options]", 1)[1]
    for f in dataclasses.fields(RoutingOptions):
        assert f"\n{f.name} = " in opts, f"routing.options.{f.name} missing"
    assert load_settings(ROOT / "config.example.toml").routing.options  # all listed, all valid


def test_env_overrides_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "c.toml"
    f.write_text("[server]\nport = 8001\n")
    monkeypatch.setenv("KVGATE_SERVER__PORT", "9123")
    assert load_settings(f).server.port == 9123


@pytest.mark.parametrize(
    "text, needle",
    [
        ("[server\nport=1", "invalid TOML"),
        ("[server]\nprot = 1\n", "server.prot"),
        ("[probes]\ninterval_s = -1\n", "probes.interval_s"),
        ("[probes]\ninterval_s = nan\n", "finite"),
        (
            '[[workers]]\nname="a"\nurl="http://x"\n[[workers]]\nname="a"\nurl="http://y"\n',
            "duplicate",
        ),
        ('[[workers]]\nname="a"\nurl="ftp://x"\n', "workers.0.url"),
        (  # one server's KV events credited to two workers
            '[[workers]]\nname="a"\nurl="http://x"\nkv_events="tcp://h:5557"\n'
            '[[workers]]\nname="b"\nurl="http://y"\nkv_events="tcp://h:5557"\n',
            "share kv_events",
        ),
        ('[routing]\npolicy = "bogus"\n', "routing.policy"),
        ("[routing.weights]\nprefix = -1\n", "routing.weights.prefix"),
        ("[routing.weights]\nprefix = nan\n", "finite"),
        ("[routing.options]\nblock_charz = 3\n", "block_charz"),
        ('[tenants.a]\nkeys_sha256 = ["abc"]\n', "64 hex"),
        ('[tenancy]\nanonymous_tenant = "ghost"\n', "ghost"),
    ],
)
def test_invalid_files_are_rejected_with_the_reason(tmp_path: Path, text: str, needle: str) -> None:
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[")):
        load_settings(f)


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_settings_built_without_the_file_refuse_non_finite_numbers(value: float) -> None:
    # The file loader refuses inf/nan itself; settings from the environment or built in code
    # went through `gt=0` alone, and a tenant's queue_weight = inf made its queued requests 500s.
    with pytest.raises(ValidationError, match="finite"):
        Settings(tenants={"a": {"queue_weight": value}})
    with pytest.raises(ValidationError, match="finite"):
        Settings(timeouts={"total_s": value})


def test_watcher_applies_valid_and_keeps_running_config_on_invalid(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[routing]\npolicy = "round_robin"\n')
    applied: list[Settings] = []
    errors: list[str] = []
    w = ConfigWatcher(f, load_settings(f), applied.append, errors.append)
    f.write_text('[routing]\npolicy = "least_loaded"\n')
    assert w.reload()
    assert applied[-1].routing.policy == "least_loaded"
    f.write_text('[routing]\npolicy = "least_loaded"\nweight = 1\n')
    assert not w.reload()
    assert errors and w.current.routing.policy == "least_loaded"
    assert len(applied) == 1
    # An unchanged file applies nothing.
    f.write_text('[routing]\npolicy = "least_loaded"\n')
    assert w.reload() and len(applied) == 1


def test_example_routing_options_drive_a_real_routing_decision() -> None:
    from scoring.policy import make_policy
    from scoring.route_key import route_request
    from scoring.views import WorkerView

    s = load_settings(ROOT / "config.example.toml")
    opts = RoutingOptions(**s.routing.options)
    assert isinstance(opts.block_chars, int)
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 50_000}]}
    route = route_request("chat", body, model="m", options=opts)
    assert route.chain
    policy = make_policy(s.routing.policy, options=opts)
    d = policy.choose([WorkerView(name="a"), WorkerView(name="b")], route)
    assert d.worker.name in {"a", "b"}
