"""kvgate as a bench target: one `kvgate serve` process, or N replicas sharing one Redis.

Why a module of its own: a routing claim about several gateway replicas has to be
measured on real replicas: N separate `kvgate serve` processes in front of one fleet, with their
quotas (`[quota] backend = "redis"`) and their learned state and per-worker load (`[cluster]
enabled = true`) shared through one real `redis-server` (`bench.redis_server.RedisServer`),
and clients spread over them by an L4 balancer (`bench.replay` with several URLs). Every tool that
starts kvgate for a measurement builds its config here, so one target means the same gateway in
every report.

Each target gets a fresh key prefix on the shared Redis (its own `{hash tag}`), so what one
target learned or counted can never leak into the next one's run. Policies are the simulator's
names (`bench.simulate.PolicySpec`): `kv_aware_precise` is `kv_aware` in token mode (the
simulated workers' own tokenizer) over the workers' KV events, which the fleet must publish
(`kvgate sim --kv-events-port`; worker i on BASE+2i, its replay socket on BASE+2i+1).
"""

from __future__ import annotations

import secrets
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.peers import HOST, MODEL, Proc, free_ports, start, wait_for, warm
from bench.simulate import PRECISE, PolicySpec

__all__ = ["Shared", "kv_event_endpoints", "kvgate_config", "needs_kv_events", "start_kvgates"]


@dataclass(slots=True, frozen=True)
class Shared:
    """Where N replicas share their state: one Redis, and a namespace for this target only."""

    redis_url: str
    namespace: str  # `bench-<tag>-<random>`: no earlier target used it
    # False: quotas only, no [cluster]: each replica learns and counts only its own dispatches
    # (the "before" figure, measured the same way as the "after").
    cluster: bool = True

    @classmethod
    def fresh(cls, redis_url: str, tag: str, cluster: bool = True) -> Shared:
        safe = "".join(c if c.isalnum() else "-" for c in tag)[:40]
        return cls(redis_url, f"bench-{safe}-{secrets.token_hex(4)}", cluster)

    @property
    def quota_prefix(self) -> str:
        """The quota store adds its own hash tags, and refuses braces in its prefix."""
        return f"kvgate:{self.namespace}:"

    @property
    def cluster_prefix(self) -> str:
        """The cluster's keys in one hash slot (`{...}`), as `[cluster]`'s default prefix is."""
        return f"kvgate:{{{self.namespace}}}:"


def needs_kv_events(spec: PolicySpec) -> bool:
    """Whether the fleet must publish KV events for this policy (the precise index's mode)."""
    return spec.name == PRECISE


def kv_event_endpoints(base_port: int, workers: int) -> list[tuple[str, str]]:
    """(PUB, replay) endpoints of `kvgate sim --kv-events-port base_port`'s workers."""
    return [
        (f"tcp://{HOST}:{base_port + 2 * i}", f"tcp://{HOST}:{base_port + 2 * i + 1}")
        for i in range(workers)
    ]


def kvgate_config(
    spec: PolicySpec,
    port: int,
    urls: Sequence[str],
    *,
    kv_events: Sequence[tuple[str, str]] = (),
    shared: Shared | None = None,
) -> str:
    """A minimal open (no tenants) gateway config for one policy variant, as TOML text.

    `kv_events`: the workers' (PUB, replay) endpoints, for `kv_aware_precise`. `shared`: this
    process is one of several replicas (quotas and `[cluster]` on that Redis and prefix)."""
    precise = needs_kv_events(spec)
    if precise and len(kv_events) != len(urls):
        raise ValueError(f"{spec.label}: needs the KV-event endpoints of all {len(urls)} workers")
    lines = [
        "[server]",
        f'host = "{HOST}"',
        f"port = {port}",
        "max_body_bytes = 16777216",
        "[logging]",
        'level = "warning"',
        "requests = false",
        "[probes]",
        "interval_s = 0.5",
        "[timeouts]",
        "first_byte_s = 600",
        "idle_s = 120",
        "total_s = 1200",
        "[routing]",
        f'policy = "{"kv_aware" if precise else spec.name}"',
    ]
    if spec.weights:
        lines.append("[routing.weights]")
        lines += [f"{k} = {v!r}" for k, v in spec.weights]
    if spec.options:
        lines.append("[routing.options]")
        lines += [f"{k} = {v!r}" for k, v in spec.options]
    if precise:  # token mode with the simulator's tokenizer: the precise index's keys
        lines += ["[routing.token_mode]", f'models = {{ "{MODEL}" = "sim" }}']
    if shared is not None:
        lines += [
            "[quota]",
            'backend = "redis"',
            f'redis_url = "{shared.redis_url}"',
            f'key_prefix = "{shared.quota_prefix}"',
            f'usage_stream = "{shared.quota_prefix}usage"',
        ]
        if shared.cluster:
            lines += ["[cluster]", "enabled = true", f'key_prefix = "{shared.cluster_prefix}"']
    for i, u in enumerate(urls):
        lines += ["[[workers]]", f'name = "w{i}"', f'url = "{u}"']
        if precise:
            pub, replay = kv_events[i]
            lines += [f'kv_events = "{pub}"', f'kv_events_replay = "{replay}"']
    return "\n".join(lines) + "\n"


def events_trusted(url: str, workers: int) -> bool:
    """Whether the gateway routes every worker on its KV events yet (subscribed, replayed, in
    sync): before that a precise target would measure the approximate index's first requests."""
    text = httpx.get(url + "/metrics", timeout=2.0).text
    trusted = [
        line
        for line in text.splitlines()
        if line.startswith("kvgate_kv_events_trusted{") and line.rstrip().endswith(" 1.0")
    ]
    return len(trusted) >= workers


def start_kvgates(
    spec: PolicySpec,
    urls: list[str],
    logs: Path,
    tag: str,
    *,
    gateways: int = 1,
    kv_events: Sequence[tuple[str, str]] = (),
    redis_url: str | None = None,
    cluster: bool = True,
    ready_timeout: float = 60.0,
) -> tuple[list[Proc], list[str], Shared | None]:
    """Start `gateways` kvgate processes on ports of their own and wait until each has every
    worker healthy and routes one real completion; returns them, their base URLs and where they
    share state (None for one gateway, which runs as it always did: memory quotas, no cluster).

    Several gateways need `redis_url`; `cluster` False leaves `[cluster]` off (replicas that
    share quotas only). On any failure the processes started so far are stopped.
    """
    if gateways < 1:
        raise ValueError("gateways must be >= 1")
    if gateways > 1 and not redis_url:
        raise ValueError("several gateways share state through Redis: give redis_url")
    shared = Shared.fresh(redis_url, tag, cluster) if gateways > 1 and redis_url else None
    logs.mkdir(parents=True, exist_ok=True)
    procs: list[Proc] = []
    bases: list[str] = []
    try:
        for g in range(gateways):
            port = free_ports(1)
            while f"http://{HOST}:{port}" in bases:
                port = free_ports(1)
            name = f"kvgate-{tag}" if gateways == 1 else f"kvgate-{tag}-g{g}"
            cfg = logs / f"{name}.toml"
            cfg.write_text(
                kvgate_config(spec, port, urls, kv_events=kv_events, shared=shared),
                encoding="utf-8",
            )
            argv = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg)]
            procs.append(start(name, argv, logs))
            bases.append(f"http://{HOST}:{port}")
        for proc, url in zip(procs, bases, strict=True):

            def ready(url: str = url) -> bool:
                r = httpx.get(url + "/ready", timeout=1.0)
                return r.status_code == 200 and r.json().get("healthy_workers") == len(urls)

            wait_for(ready, proc, ready_timeout, f"{proc.name}")
            if kv_events:
                wait_for(lambda url=url: events_trusted(url, len(urls)), proc, 30, proc.name)
            wait_for(lambda url=url: warm(url), proc, 30, f"{proc.name} warm-up")
    except BaseException:
        for p in reversed(procs):
            p.stop()
        raise
    return procs, bases, shared
