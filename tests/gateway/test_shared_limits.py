"""One gateway among several replicas refuses to start on the memory quota backend when tenants
have rate or concurrency limits: each replica would enforce them on its own.

Review finding: two replicas with `[cluster] enabled = true` (and `quota.replicas = 2`) on the
memory backend admitted 10 requests against a burst of 5, with no word in either log; `kvgate
serve --processes N` already refused the same for processes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import Settings, load_settings
from gateway.supervisor import shared_state_problem

BASE = '[logging]\nlevel = "warning"\n[[workers]]\nname = "w"\nurl = "http://127.0.0.1:9001"\n'
TENANT = '[tenants.a]\nkeys_sha256 = ["' + "a" * 64 + '"]\n'
CLUSTER = "[cluster]\nenabled = true\n"


def _settings(tmp_path: Path, text: str) -> Settings:
    p = tmp_path / "kvgate.toml"
    p.write_text(BASE + text, encoding="utf-8")
    return load_settings(p)


@pytest.mark.parametrize("replicas", [CLUSTER, "[quota]\nreplicas = 2\n"])
@pytest.mark.parametrize("limit", ["rpm = 60", "max_concurrent = 2", "model_limits.m.tpm = 9"])
def test_several_replicas_with_memory_quotas_and_shared_limits_are_refused(
    tmp_path: Path, replicas: str, limit: str
) -> None:
    problem = shared_state_problem(_settings(tmp_path, replicas + TENANT + limit + "\n"), 1)
    assert problem is not None and "tenants ['a'] on its own" in problem


def test_per_request_caps_one_replica_or_redis_are_fine(tmp_path: Path) -> None:
    caps = "max_input_tokens = 100\nmax_output_tokens = 50\n"
    assert shared_state_problem(_settings(tmp_path, CLUSTER + TENANT + caps), 1) is None
    assert shared_state_problem(_settings(tmp_path, TENANT + "rpm = 60\n"), 1) is None
    redis = '[quota]\nbackend = "redis"\nreplicas = 2\n'
    assert shared_state_problem(_settings(tmp_path, redis + TENANT + "rpm = 60\n"), 1) is None


def test_kvgate_serve_refuses_to_start_so(tmp_path: Path) -> None:
    cfg = tmp_path / "kvgate.toml"
    cfg.write_text(BASE + CLUSTER + TENANT + "rpm = 60\n", encoding="utf-8")
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg), "--port", "0"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert 'set [quota] backend = "redis"' in r.stderr
