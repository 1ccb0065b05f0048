"""`kvgate bench tune`: the search stays in its space, ranks by the objective, and what it prints
is a config block the gateway accepts as is."""

from __future__ import annotations

import json
import random
import tomllib
from pathlib import Path

from bench.tune import (
    OPTION_SPACE,
    WEIGHT_SPACE,
    Candidate,
    baseline,
    main,
    perturb,
    random_candidate,
    score,
)
from gateway.config import load_settings

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "config.example.toml"


def result(goodput: float, p99: float | None, hit: float) -> dict:
    return {"goodput": {"fraction": goodput}, "ttft": {"p99": p99, "p50": 0.1}, "hit_rate": hit}


def in_space(c: Candidate) -> bool:
    return all(WEIGHT_SPACE[k][0] <= v <= WEIGHT_SPACE[k][1] for k, v in c.weights) and all(
        OPTION_SPACE[k][0] <= v <= OPTION_SPACE[k][1] for k, v in c.options
    )


def test_candidates_stay_in_the_space_and_the_baseline_is_the_config() -> None:
    rng = random.Random(0)
    for _ in range(200):
        c = random_candidate(rng)
        assert in_space(c)
        assert in_space(perturb(c, rng, 0.5))
    b = baseline(EXAMPLE)
    routing = tomllib.loads(EXAMPLE.read_text())["routing"]
    assert dict(b.weights)["prefix"] == routing["weights"]["prefix"]
    assert dict(b.options)["affinity_slack"] == routing["options"]["affinity_slack"]


def test_goodput_first_then_the_tail_then_hits() -> None:
    assert score(result(0.99, 5.0, 0.1), "goodput") > score(result(0.98, 0.5, 0.9), "goodput")
    assert score(result(0.99, 1.0, 0.1), "goodput") > score(result(0.99, 2.0, 0.9), "goodput")
    assert score(result(0.5, 1.0, 0.1), "p99") > score(result(0.99, 2.0, 0.9), "p99")
    assert score(result(0.99, None, 0.1), "goodput") < score(result(0.99, 9.0, 0.1), "goodput")


def test_a_run_writes_its_report_and_a_toml_block_the_gateway_loads(
    tmp_path: Path, capsys: object
) -> None:
    out = tmp_path / "tune.json"
    rc = main(
        [
            "--trace",
            "conversation:sessions=12,think_s=2",
            "--workers",
            "2",
            "--num-blocks",
            "2048",
            "--trials",
            "4",
            "--jobs",
            "1",
            "--quiet",
            "--config",
            str(EXAMPLE),
            "--json",
            str(out),
            "--png",
            str(tmp_path / "tune.png"),
            "--validate",
            "conversation:sessions=12,think_s=2,seed=1",
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert (
        len(report["trials"]) == 4 and report["trials"][0]["values"] == report["current"]["values"]
    )
    assert set(report["validation"]) >= {"current", "suggested", "no_worse"}
    assert (tmp_path / "tune.png").stat().st_size > 0
    printed = capsys.readouterr().out  # type: ignore[attr-defined]
    block = printed[printed.index("[routing.weights]") :].split("\n\n", 2)
    toml = "\n\n".join(block[:2])
    # Pasted into the example config (replacing its own two sections), the gateway loads it.
    text = EXAMPLE.read_text()
    cfg = tmp_path / "kvgate.toml"
    cfg.write_text(_replace_sections(text, toml))
    s = load_settings(cfg)
    assert s.routing.weights.prefix == report["suggested"]["values"]["prefix"]
    assert s.routing.options["affinity_slack"] == report["suggested"]["values"]["affinity_slack"]


def _replace_sections(text: str, block: str) -> str:
    """The example config with the suggested keys set in its own [routing.*] sections."""
    data = tomllib.loads(block)
    lines = text.splitlines()
    section = ""
    out = []
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("["):
            section = stripped.strip("[]")
        key = stripped.split("=", 1)[0].strip() if "=" in stripped else ""
        table = {"routing.weights": "weights", "routing.options": "options"}.get(section)
        if table and key in data["routing"][table] and not stripped.startswith("#"):
            line = f"{key} = {data['routing'][table][key]}"
        out.append(line)
    return "\n".join(out) + "\n"
