"""Active health probes: one task per worker, each on its own schedule.

A worker is capacity only if it answers `/health` (or `/v1/models` where there is no `/health`)
and lists the model; `/metrics` feeds the load and KV signals but its absence is not a failure
(OpenAI-compatible servers without Prometheus still serve). Ejected workers are re-probed with
exponential backoff so a dead host is not hammered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import httpx

from workers.registry import Registry, Worker
from workers.vllm_metrics import WorkerMetrics, parse_vllm_metrics

log = logging.getLogger("kvgate.probe")

ProbeHook = Callable[[Worker, bool, float], None]


class ProbeError(Exception):
    pass


class Prober:
    def __init__(
        self,
        registry: Registry,
        client: httpx.AsyncClient,
        *,
        interval_s: float,
        timeout_s: float,
        on_probe: ProbeHook | None = None,
    ) -> None:
        self.registry = registry
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.on_probe = on_probe
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._wake: dict[str, asyncio.Event] = {}
        self._stopping = False

    def sync(self) -> None:
        """Start a probe task for every new worker and stop those of removed ones."""
        for name in list(self._tasks):
            if name not in self.registry.workers:
                self._tasks.pop(name).cancel()
                self._wake.pop(name, None)
        for name in self.registry.workers:
            if name not in self._tasks:
                self._wake[name] = asyncio.Event()
                self._tasks[name] = asyncio.create_task(self._loop(name), name=f"probe-{name}")

    def poke(self, name: str) -> None:
        """Probe now (a passive failure suggests the worker may have died)."""
        ev = self._wake.get(name)
        if ev is not None:
            ev.set()

    async def stop(self) -> None:
        self._stopping = True
        for ev in self._wake.values():
            ev.set()
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    async def _loop(self, name: str) -> None:
        wake = self._wake[name]
        while name in self.registry.workers and not self._stopping:
            await self.probe_once(name)
            delay = self.registry.next_probe_delay(name, self.interval_s)
            wake.clear()
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel and hang stop().
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await wake.wait()

    async def probe_once(self, name: str) -> bool:
        w = self.registry.workers.get(name)
        if w is None:
            return False
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout_s):
                models, metrics = await self._probe(w)
        except (ProbeError, httpx.HTTPError, TimeoutError, ValueError) as e:
            err = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            was = w.health
            self.registry.probe_failed(name, err)
            if w.health is not was:
                log.warning("worker %s -> %s (%s)", name, w.health, err)
            ok = False
        else:
            was = w.health
            self.registry.probe_ok(name, models, metrics)
            if w.health is not was:
                log.info("worker %s -> %s (models: %s)", name, w.health, sorted(w.models))
            ok = True
        if self.on_probe is not None:
            self.on_probe(w, ok, time.perf_counter() - t0)
        return ok

    async def _probe(self, w: Worker) -> tuple[list[dict[str, object]], WorkerMetrics | None]:
        headers = {"authorization": f"Bearer {w.spec.api_key}"} if w.spec.api_key else None
        r = await self.client.get(f"{w.url}/health", headers=headers)
        if r.status_code == 404:
            pass  # no /health on this server: /v1/models below is the health check
        elif r.status_code != 200:
            raise ProbeError(f"/health returned {r.status_code}")
        models_r, metrics_r = await asyncio.gather(
            self.client.get(f"{w.url}/v1/models", headers=headers),
            self.client.get(f"{w.url}/metrics", headers=headers),
            return_exceptions=True,
        )
        if isinstance(models_r, BaseException):
            raise models_r
        if models_r.status_code != 200:
            raise ProbeError(f"/v1/models returned {models_r.status_code}")
        data = models_r.json().get("data")
        if not isinstance(data, list):
            raise ProbeError("/v1/models: no data list")
        models = [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
        metrics = None
        if not isinstance(metrics_r, BaseException) and metrics_r.status_code == 200:
            try:
                metrics = parse_vllm_metrics(metrics_r.text)
            except ValueError as e:
                log.debug("worker %s: unparsable /metrics: %s", w.name, e)
        return models, metrics
