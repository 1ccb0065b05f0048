"""docker-compose.gpu.yml and deploy/: valid, and consistent with what the suite proves on CPU.

No Docker engine is needed (or used): the file is validated against the Compose specification's
JSON schema (check-jsonschema ships it), then parsed with PyYAML for the checks a schema cannot
make: the GPU workers run vLLM with the same kvgate-relevant flags as `tests.support.vllm.launch`
(which the real-vLLM tests run on CPU), the gateway config lists exactly those workers, and
Prometheus and the Grafana dashboard point at things that exist.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import load_settings
from gateway.metrics import GatewayMetrics
from tests.integration.conftest import worker_config
from tests.integration.vllm_flags import (
    kv_event_ports,
    kvgate_flags,
    option_value,
    split_dry_run,
)
from tests.support.vllm.venv import REPO_ROOT

COMPOSE = REPO_ROOT / "docker-compose.gpu.yml"
DEPLOY = REPO_ROOT / "deploy"
GATEWAY_CONFIG_IN_CONTAINER = "/etc/kvgate/config.toml"
VLLM_PORT = 8000
KV_EVENT_PORTS = (5557, 5558)
_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def _interpolate(value: str) -> str:
    """Compose `${VAR:-default}` with an empty environment (the defaults a plain `up` uses)."""
    return _VAR.sub(lambda m: m.group(2) or "", value)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return doc


def _vllm_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: svc
        for name, svc in compose["services"].items()
        if "vllm/vllm-openai" in _interpolate(str(svc.get("image", "")))
    }


def _env(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment", {})
    if isinstance(env, list):
        env = dict(e.split("=", 1) for e in env)
    return {k: _interpolate(str(v)) for k, v in env.items()}


def _dry_run_gpu() -> tuple[list[str], dict[str, str]]:
    """The GPU command line the launch helper generates (what the compose file was made from)."""
    out = subprocess.run(
        [
            sys.executable,
            *("-m", "tests.support.vllm.launch", "--model", "MODEL", "--port", "8000"),
            *("--gpu", "--kv-events-port", str(KV_EVENT_PORTS[0]), "--dry-run"),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return split_dry_run(out.stdout.strip())


def test_compose_file_is_valid() -> None:
    """Against the Compose specification's JSON schema, offline, with no Docker engine.

    Also passes `docker-compose -f docker-compose.gpu.yml config -q` (Debian's docker-compose
    1.29), which additionally type-checks interpolated values; the schema check is the one
    `make test` can install everywhere (pip, no root).
    """
    try:
        import check_jsonschema  # noqa: F401
    except ImportError:
        pytest.fail(
            "check-jsonschema is not installed: it is a test dependency "
            "(pyproject.toml [project.optional-dependencies] test); run `make test`",
            pytrace=False,
        )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "check_jsonschema",
            "--builtin-schema",
            "vendor.compose-spec",
            COMPOSE,
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_gpu_workers_run_vllm_with_the_flags_the_cpu_suite_proves(
    compose: dict[str, Any],
) -> None:
    cpu = worker_config(Path("model"), 9000)  # the integration suite's real-vLLM workers
    proven = kvgate_flags(cpu.server_args(), cpu.env({}))
    gpu_argv, gpu_env = _dry_run_gpu()
    generated = kvgate_flags(gpu_argv, gpu_env)
    assert generated == proven  # launch.py keeps kvgate's flags on GPU
    assert proven.prefix_caching and proven.prompt_tokens_details
    assert proven.kv_events is not None and proven.hash_seed == "0"

    workers = _vllm_services(compose)
    assert len(workers) >= 2
    for name, svc in workers.items():
        argv = [*svc["entrypoint"], *(_interpolate(str(a)) for a in svc["command"])]
        assert kvgate_flags(argv, _env(svc)) == proven, (
            f"{name}: kvgate-relevant vLLM settings differ from the ones the CPU suite proves; "
            f"regenerate the command from:\n{' '.join(gpu_argv)}"
        )
        assert argv[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
        assert option_value(argv, "--host") == "0.0.0.0"
        assert option_value(argv, "--port") == str(VLLM_PORT)
        assert option_value(argv, "--model") == option_value(argv, "--served-model-name")
        assert kv_event_ports(argv) == KV_EVENT_PORTS
        assert {str(p) for p in KV_EVENT_PORTS} <= {str(p) for p in svc["expose"]}


def test_gpu_workers_get_one_gpu_each_a_shared_cache_and_a_health_check(
    compose: dict[str, Any],
) -> None:
    workers = _vllm_services(compose)
    gpus, caches = [], set()
    for name, svc in workers.items():
        (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"], name
        assert len(dev["device_ids"]) == 1, name
        gpus.append(dev["device_ids"][0])
        caches |= {v for v in svc["volumes"] if v.endswith(":/root/.cache/huggingface")}
        assert "HF_TOKEN" in svc["environment"], name
        assert "/health" in " ".join(svc["healthcheck"]["test"]), name
    assert len(set(gpus)) == len(gpus), f"workers share a GPU: {gpus}"
    (cache,) = caches  # one named volume for all workers: weights downloaded once
    assert cache.split(":")[0] in compose["volumes"]


def test_gateway_config_lists_the_compose_workers(compose: dict[str, Any]) -> None:
    gw = compose["services"]["gateway"]
    assert gw["environment"]["KVGATE_SERVER__HOST"] == "0.0.0.0"
    mounts = {v.split(":")[1]: v.split(":")[0] for v in gw["volumes"]}
    config = REPO_ROOT / mounts[GATEWAY_CONFIG_IN_CONTAINER]
    settings = load_settings(config)  # the real loader: a typo in the file fails here
    listed = {w.name: w.url for w in settings.workers}
    assert listed == {name: f"http://{name}:{VLLM_PORT}" for name in _vllm_services(compose)}
    assert set(_vllm_services(compose)) <= set(gw["depends_on"])
    assert "redis" in gw["depends_on"]
    dockerfile = (REPO_ROOT / gw["build"]["dockerfile"]).read_text()
    assert f'"--config", "{GATEWAY_CONFIG_IN_CONTAINER}"' in dockerfile
    assert "FROM python:3.11-slim" in dockerfile


def test_dockerfile_copies_every_package_the_gateway_imports() -> None:
    """`pip install .` in the image only sees what was copied: every package of ours that the
    gateway's entry point imports must be copied, and none of them excluded by .dockerignore."""
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\w+) \./\1$", dockerfile, re.M))
    # Top-level names of the modules loaded from the work tree itself (not from .venv/).
    probe = (
        "import sys, pathlib, gateway.cli, gateway.asgi\n"
        f"root = pathlib.Path({str(REPO_ROOT)!r})\n"
        "files = [pathlib.Path(getattr(m, '__file__', None) or '/') for m in sys.modules.values()]\n"
        "parts = [f.relative_to(root).parts for f in files if f.is_relative_to(root)]\n"
        "print(' '.join({p[0] for p in parts if not p[0].startswith('.')}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    imported = set(out.stdout.split())
    assert "gateway" in imported and imported <= copied, imported - copied
    ignore = (REPO_ROOT / ".dockerignore").read_text().splitlines()
    patterns = {line.strip() for line in ignore if line.strip() and not line.startswith("#")}
    assert not copied & patterns


def test_prometheus_scrapes_the_gateway_and_every_worker(compose: dict[str, Any]) -> None:
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = {
        t: sc.get("labels", {})
        for job in prom["scrape_configs"]
        for sc in job["static_configs"]
        for t in sc["targets"]
    }
    assert "gateway:8000" in targets
    for name in _vllm_services(compose):
        # `worker` matches the gateway's worker name so panels can join the two sources.
        assert targets[f"{name}:{VLLM_PORT}"] == {"worker": name}


def _exported_names() -> set[str]:
    names = set()
    for fam in GatewayMetrics().registry.collect():
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
        names |= {fam.name + s for s in suffixes.get(fam.type, [""])}
    return names


def _vllm_names() -> set[str]:
    """Metric names real vLLM 0.32 exposes (recorded from a live server)."""
    text = (REPO_ROOT / "tests/fixtures/vllm-0.32/metrics.txt").read_text()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_dashboard_uses_real_metric_names() -> None:
    dash = json.loads((DEPLOY / "grafana/dashboards/kvgate.json").read_text())
    datasource = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"][0]
    exprs = [t["expr"] for p in dash["panels"] if p["type"] != "row" for t in p.get("targets", [])]
    assert exprs
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == datasource["uid"], p["title"]
    used_kvgate = {n for e in exprs for n in re.findall(r"\bkvgate_\w+", e)}
    used_vllm = {n for e in exprs for n in re.findall(r"\bvllm:\w+", e)}
    assert used_kvgate <= _exported_names(), used_kvgate - _exported_names()
    assert used_vllm <= _vllm_names(), used_vllm - _vllm_names()
    titles = " ".join(p["title"] for p in dash["panels"])
    for topic in ("TTFT", "TPOT", "Routing", "Prefix-match", "KV-cache", "Queue", "tenant"):
        assert topic in titles, topic
