"""Active health probes: one task per worker, each on its own schedule.

A worker is capacity only if it answers `/health` (or `/v1/models` where there is no `/health`)
and lists the model; `/metrics` feeds the load and KV signals but its absence is not a failure
(OpenAI-compatible servers without Prometheus still serve). Ejected workers are re-probed with
exponential backoff so a dead host is not hammered.

Health transitions are logged by the registry's `on_change` hook (the gateway's), once per
transition whatever caused it; the prober does not log them a second time.

Deep probes (`deep_every` > 0): a process can answer `/health` while its engine cannot generate
(a wedged scheduler, a broken CUDA context behind a still-running HTTP frontend), and that is not
capacity. Every `deep_every`-th probe of a healthy worker therefore also asks for one token
(POST /v1/completions, max_tokens 1, temperature 0) and counts a non-200, a timeout or a body
without choices as a probe failure. A deep probe is also made on every probe of a worker that is
not healthy or has failures pending, so a failed one is retried at once (consecutive failures
build up to the ejection instead of being reset by the shallow probes in between) and
readmission requires generation to work. It is skipped when a proxied request succeeded since the
last one: real traffic already proved the worker generates, and a busy worker should not queue a
probe behind its load (that would also make the deep timeout fire on a merely busy worker).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable

import httpx

from workers.registry import Registry
from workers.vllm_metrics import WorkerMetrics, parse_vllm_metrics
from workers.worker import Health, Worker

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
        deep_every: int = 0,
        deep_timeout_s: float = 5.0,
        deep_model: str = "",
    ) -> None:
        self.registry = registry
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.on_probe = on_probe
        # Deep probe every N probes of a healthy worker (0 = off); its own timeout, since one
        # token waits in the worker's queue like any request; the model to ask ("" or a model
        # this worker does not serve: its first base model).
        self.deep_every = deep_every
        self.deep_timeout_s = deep_timeout_s
        self.deep_model = deep_model
        # Per worker: shallow probes since the last deep one, and when that was (registry clock).
        self._since_deep: dict[str, int] = {}
        self._deep_at: dict[str, float] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._wake: dict[str, asyncio.Event] = {}
        self._stopping = False
        # The client's connect timeout where it is tighter than the probe timeout (the gateway
        # builds it as min(connect_s, timeout_s)): still the connect bound after a reload changes
        # timeout_s, which the client's own timeout never learns.
        connect = client.timeout.connect
        self.connect_s = connect if connect is not None and connect < timeout_s else None
        # Per worker: the last unexpected probe exception logged, so a worker that keeps
        # raising the same one logs its traceback once, not once per interval.
        self._raised: dict[str, str] = {}

    def sync(self) -> None:
        """Start a probe task for every new worker and stop those of removed ones."""
        for name in list(self._tasks):
            if name not in self.registry.workers:
                self._tasks.pop(name).cancel()
                self._wake.pop(name, None)
                self._since_deep.pop(name, None)
                self._deep_at.pop(name, None)
                self._raised.pop(name, None)
        for name in self.registry.workers:
            if name not in self._tasks:
                self._wake[name] = asyncio.Event()
                self._tasks[name] = asyncio.create_task(self._loop(name), name=f"probe-{name}")

    def poke(self, name: str) -> None:
        """Probe now (a passive failure suggests the worker may have died).

        Not while the worker is held out by an ejection: no probe can readmit it before the hold
        ends, and its next scheduled probe is already the one at the end of the hold. (Before
        holds, this poke readmitted a worker that failed every request but answered `/health`
        within milliseconds of each ejection.)"""
        ev = self._wake.get(name)
        if ev is not None and not self.registry.held(name):
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
            try:
                await self.probe_once(name)
                delay = self.registry.next_probe_delay(name, self.interval_s)
            except Exception as e:
                delay = self._probe_raised(name, e)
            else:
                self._raised.pop(name, None)
            wake.clear()
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel and hang stop().
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await wake.wait()

    def _probe_raised(self, name: str, e: Exception) -> float:
        """An exception nothing in `probe_once` foresaw (an answer of an unexpected shape, or a
        bug) must not end this worker's probe task: nothing would restart it, and the worker
        would never be ejected or readmitted by probes again. It counts as a failed probe, so a
        worker that keeps raising goes out like one that does not answer. Returns the delay to
        the next probe."""
        error = f"probe raised {_describe(e)}"
        if self._raised.get(name) != error:
            log.error("worker %s: %s; counted as a failed probe", name, error, exc_info=e)
            self._raised[name] = error
        else:
            log.debug("worker %s: %s again", name, error)
        self.registry.probe_failed(name, error)
        return self.registry.next_probe_delay(name, self.interval_s)

    def _http_timeout(self) -> httpx.Timeout:
        """Per request, so that a reloaded `timeout_s` reaches httpx as well as the outer
        `asyncio.timeout`: the client keeps the timeout it was built with, and a longer reloaded
        one would otherwise still time out at the old value."""
        t = self.timeout_s
        return httpx.Timeout(t, connect=t if self.connect_s is None else min(self.connect_s, t))

    async def probe_once(self, name: str) -> bool:
        w = self.registry.workers.get(name)
        if w is None:
            return False
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout_s):
                models, metrics = await self._probe(w)
        except (ProbeError, httpx.HTTPError, TimeoutError, ValueError) as e:
            if self.registry.workers.get(name) is not w:
                return False  # a reload replaced it meanwhile (a new URL): not its result
            self.registry.probe_failed(name, _describe(e))
            ok = False
        else:
            deep_err = await self._maybe_deep(w, models)
            if self.registry.workers.get(name) is not w:
                # A reload moved the name to a new URL while the old one answered: the new
                # server has proved nothing yet and must not be readmitted on the old's word.
                return False
            if deep_err is not None:
                self.registry.probe_failed(name, deep_err, models, metrics)
                ok = False
            else:
                self.registry.probe_ok(name, models, metrics)
                ok = True
        if self.on_probe is not None:
            self.on_probe(w, ok, time.perf_counter() - t0)
        return ok

    def _deep_due(self, w: Worker) -> bool:
        if self.deep_every <= 0:
            return False
        name = w.name
        if w.health is not Health.HEALTHY or w.consecutive_failures > 0:
            return True
        n = self._since_deep.get(name, 0) + 1
        if n < self.deep_every:
            self._since_deep[name] = n
            return False
        if w.last_success_at > self._deep_at.get(name, -math.inf):
            # Traffic succeeded since the last deep probe: that was the proof.
            self._since_deep[name] = 0
            self._deep_at[name] = self.registry.clock()
            return False
        return True

    async def _maybe_deep(self, w: Worker, cards: list[dict[str, object]]) -> str | None:
        """Run the deep probe if due; the failure as a last_error string, or None."""
        if not self._deep_due(w):
            return None
        self._since_deep[w.name] = 0
        self._deep_at[w.name] = self.registry.clock()
        model = self._pick_model(cards)
        if model is None:
            return None  # serves nothing: candidates() never picks it anyway
        try:
            async with asyncio.timeout(self.deep_timeout_s):
                await self._deep(w, model)
        except (ProbeError, httpx.HTTPError, TimeoutError, ValueError) as e:
            return f"deep probe ({model}): {_describe(e)}"
        return None

    def _pick_model(self, cards: list[dict[str, object]]) -> str | None:
        ids = [str(c["id"]) for c in cards]
        if self.deep_model and self.deep_model in ids:
            return self.deep_model
        base = [str(c["id"]) for c in cards if not c.get("parent")]  # not a LoRA adapter
        return (base or ids or [None])[0]

    async def _deep(self, w: Worker, model: str) -> None:
        headers = {"content-type": "application/json", "x-request-id": "kvgate-deep-probe"}
        if w.spec.api_key:
            headers["authorization"] = f"Bearer {w.spec.api_key}"
        body = {"model": model, "prompt": "ping", "max_tokens": 1, "temperature": 0}
        r = await self.client.post(
            f"{w.url}/v1/completions", json=body, headers=headers, timeout=self.deep_timeout_s
        )
        if r.status_code != 200:
            raise ProbeError(f"/v1/completions returned {r.status_code}: {_error_text(r)}")
        data = r.json()
        choices = data.get("choices") if isinstance(data, dict) else None
        if not isinstance(choices, list) or not choices:
            raise ProbeError("/v1/completions: no choices in the response")

    async def _probe(self, w: Worker) -> tuple[list[dict[str, object]], WorkerMetrics | None]:
        headers = {"authorization": f"Bearer {w.spec.api_key}"} if w.spec.api_key else None
        timeout = self._http_timeout()
        r = await self.client.get(f"{w.url}/health", headers=headers, timeout=timeout)
        if r.status_code == 404:
            pass  # no /health on this server: /v1/models below is the health check
        elif r.status_code != 200:
            raise ProbeError(f"/health returned {r.status_code}")
        models_r, metrics_r = await asyncio.gather(
            self.client.get(f"{w.url}/v1/models", headers=headers, timeout=timeout),
            self.client.get(f"{w.url}/metrics", headers=headers, timeout=timeout),
            return_exceptions=True,
        )
        if isinstance(models_r, BaseException):
            raise models_r
        if models_r.status_code != 200:
            raise ProbeError(f"/v1/models returned {models_r.status_code}")
        body = models_r.json()
        if not isinstance(body, dict):  # `[]`, `null`: a proxy's or a half-started server's
            raise ProbeError(f"/v1/models: not a JSON object: {models_r.text[:80]!r}")
        data = body.get("data")
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


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _error_text(r: httpx.Response) -> str:
    """The worker's error message (OpenAI/vLLM envelope) or the start of the body."""
    try:
        body = r.json()
    except ValueError:
        body = None
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])[:200]
    return r.text[:200]
