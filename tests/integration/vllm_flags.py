"""The vLLM server settings kvgate depends on, extracted from a command line and its environment.

Why a shared extractor: the integration suite proves these settings on real vLLM (CPU build), and
`docker-compose.gpu.yml` must start its GPU workers with the same ones. Comparing the *whole*
command lines would fail on every harmless difference (ports, model, GPU sizing); comparing only
what kvgate relies on catches the differences that would silently break routing or accounting:

* prefix caching on (KV-aware routing has nothing to exploit without it),
* prompt-token details on (`usage.prompt_tokens_details.cached_tokens`, the per-request hit truth),
* KV events published on a *bound* ZMQ endpoint with a replay endpoint (the precise prefix index),
* a fixed `PYTHONHASHSEED` (stable block hashes across restarts on older vLLM).
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SWITCHES = ("--enable-prefix-caching", "--enable-prompt-tokens-details")
_PORT = re.compile(r":\d+$")


@dataclass(frozen=True)
class KvgateFlags:
    """What kvgate needs from one vLLM server; ports normalised to `PORT` (they differ per host)."""

    prefix_caching: bool
    prompt_tokens_details: bool
    kv_events: tuple[tuple[str, Any], ...] | None
    hash_seed: str | None


def option_value(argv: Sequence[str], name: str) -> str | None:
    """Value of `--name value` or `--name=value` (last one wins, as with argparse)."""
    found = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith(name + "="):
            found = arg.split("=", 1)[1]
    return found


def _normalise_events(raw: str) -> tuple[tuple[str, Any], ...]:
    cfg = json.loads(raw)
    for key in ("endpoint", "replay_endpoint"):
        if isinstance(cfg.get(key), str):
            cfg[key] = _PORT.sub(":PORT", cfg[key])
    return tuple(sorted(cfg.items()))


def kvgate_flags(argv: Sequence[str], env: Mapping[str, str]) -> KvgateFlags:
    """Extract the kvgate-relevant settings from vLLM CLI arguments and environment."""
    events = option_value(argv, "--kv-events-config")
    return KvgateFlags(
        prefix_caching="--enable-prefix-caching" in argv
        and "--no-enable-prefix-caching" not in argv,
        prompt_tokens_details="--enable-prompt-tokens-details" in argv,
        kv_events=_normalise_events(events) if events else None,
        hash_seed=env.get("PYTHONHASHSEED"),
    )


def split_dry_run(line: str) -> tuple[list[str], dict[str, str]]:
    """`PYTHONHASHSEED=0 python -m vllm... --flag x` (launch.py --dry-run) -> (argv, env)."""
    words = shlex.split(line)
    env: dict[str, str] = {}
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    return words, env


def kv_event_ports(argv: Sequence[str]) -> tuple[int, int] | None:
    """(publisher, replay) ports of a bound `--kv-events-config`, or None when events are off."""
    raw = option_value(argv, "--kv-events-config")
    if raw is None:
        return None
    cfg = json.loads(raw)
    pub, replay = (int(str(cfg[k]).rsplit(":", 1)[1]) for k in ("endpoint", "replay_endpoint"))
    return pub, replay
