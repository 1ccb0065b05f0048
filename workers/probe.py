"""Active health probes: one task per worker, each on its own schedule.

A worker is capacity only if it answers `/health` (or `/v1/models` where there is no `/health`)
and lists the model; `/metrics` feeds the load and KV signals but its absence is not a failure
(OpenAI-compatible servers without Prometheus still serve). Nor is its slowness: only `/health`
and `/v1/models` are under the probe's timeout, and `/metrics`, fetched beside `/v1/models`, has
what is left of it (`Prober._scrape`), body included; past that it is cut off and the probe has
no numbers this round, like a 404. A probe without numbers keeps the last ones, up to a bound
(`Registry.metrics_stale_after` probes in a row: then they are unknown, see
`Registry._metrics_missed`). Ejected workers are re-probed with exponential backoff so a dead
host is not hammered.

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

Every answer is read with a byte cap (`METRICS_MAX_BYTES`, `ANSWER_MAX_BYTES`), not whole: the
timeouts bound only time, and a worker whose `/metrics` was 100 MiB grew the gateway by ~600 MiB
and stalled its event loop for seconds every probe interval. An answer over its cap is cut off
(the connection is closed) and counts like an absent one: `/metrics` over the cap brings no new
numbers (the registry keeps the last for a while); `/health`, `/v1/models` or the deep probe's
answer over it is a failed probe. Warned once per worker and answer until it fits again.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from workers.deadlines import Deadlines, Wait
from workers.registry import Registry
from workers.vllm_metrics import MetricsTooLarge, WorkerMetrics, parse_vllm_metrics
from workers.worker import Health, Worker

log = logging.getLogger("kvgate.probe")

ProbeHook = Callable[[Worker, bool, float], None]

# The most of an answer a probe reads. A real vLLM 0.32 `/metrics` is ~59 KB for one engine
# (tests/fixtures/vllm-0.32), mostly histogram buckets, which grow with data-parallel ranks: 4 MiB
# is ~70 times that. Past it is no exposition, only memory and parse time (the cap bounds the
# bytes, not the parse: that runs in a thread, see `_parse_metrics`).
METRICS_MAX_BYTES = 4 << 20
# `/health` answers nothing, `/v1/models` a few hundred bytes per model card (1 MiB: thousands of
# LoRA adapters), the deep probe one token: 1 MiB is far above any real answer.
ANSWER_MAX_BYTES = 1 << 20
# JSON answers up to this size are decoded on the event loop (json.loads: ~10 us per KiB, so
# < 1 ms); larger ones, only possible from an odd server, in a thread (1 MiB: ~10 ms).
_JSON_INLINE_BYTES = 64 << 10
# How much longer than a probe's bound its requests may take: the bound forgives the gateway's
# own stalls up to its length again (`workers.deadlines`).
_STALL_SLACK = 2
# `/metrics` has what is left of the probe's bound once `/health` answered (it runs beside
# `/v1/models`), and never less than this share of it.
_METRICS_MIN_SHARE = 0.25


def _stalled(wait: Wait, e: BaseException) -> bool:
    """A timeout of a wait whose whole slack the gateway's own stalls used up: the loop was
    held up at least the bound's length again while it waited."""
    return isinstance(e, TimeoutError | httpx.TimeoutException) and wait.slack <= 0.0


class ProbeError(Exception):
    pass


class AnswerTooLarge(ProbeError):
    """An answer over its byte cap: cut off, not read."""

    def __init__(self, path: str, cap: int, detail: str) -> None:
        super().__init__(f"{path}: answer over the {cap}-byte cap ({detail}); not read")
        self.path = path


@dataclass(slots=True, frozen=True)
class _Answer:
    """What a probe keeps of a response: its status and its body, read up to a cap."""

    status_code: int
    content: bytes
    charset: str | None

    @property
    def text(self) -> str:
        return _decode(self.content, self.charset)


def _decode(content: bytes, charset: str | None) -> str:
    """As httpx's `Response.text` does: the declared charset, else UTF-8, bad bytes replaced."""
    encoding = "utf-8"
    if charset:
        with contextlib.suppress(LookupError):
            encoding = codecs.lookup(charset).name
    return content.decode(encoding, errors="replace")


async def _json(a: _Answer) -> Any:
    if len(a.content) <= _JSON_INLINE_BYTES:
        return json.loads(a.content)
    return await asyncio.to_thread(json.loads, a.content)


def _parse_metrics_body(content: bytes, charset: str | None) -> WorkerMetrics:
    return parse_vllm_metrics(_decode(content, charset))


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
        self._deadlines = Deadlines()  # every probe's bound, the gateway's stalls forgiven
        self.stalled_probes = 0  # timed out while the gateway stalled: not counted
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
        # Per worker: the answers (paths) that were over their cap at the last probe, so a
        # worker that keeps sending one warns once, not once per interval.
        self._too_large: dict[str, set[str]] = {}

    def sync(self) -> None:
        """Start a probe task for every new worker and stop those of removed ones."""
        for name in list(self._tasks):
            if name not in self.registry.workers:
                self._tasks.pop(name).cancel()
                self._wake.pop(name, None)
                self._since_deep.pop(name, None)
                self._deep_at.pop(name, None)
                self._raised.pop(name, None)
                self._too_large.pop(name, None)
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
        bound: the client keeps the timeout it was built with, and a longer reloaded one would
        otherwise still time out at the old value. Twice the bound, which is what the outer
        bound may wait when it forgives the gateway's own stalls (`_STALL_SLACK`): httpx counts
        them, and would time the probe out first."""
        t = self.timeout_s
        c = t if self.connect_s is None else min(self.connect_s, t)
        return httpx.Timeout(_STALL_SLACK * t, connect=_STALL_SLACK * c)

    async def _fetch(self, w: Worker, method: str, path: str, cap: int, **kwargs: Any) -> _Answer:
        """One request, its body read up to `cap` bytes. Raises AnswerTooLarge past it (leaving
        the stream closes the connection: the rest is never read) and notes, for the warning,
        which answers fit again."""
        url = f"{w.url}{path}"
        async with self.client.stream(method, url, **kwargs) as r:
            declared = r.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > cap:
                e = AnswerTooLarge(path, cap, f"{declared} declared")
                self._too_large_now(w, path, str(e))
                raise e
            buf = bytearray()
            # Chunks as they arrive (one network read each, <= 64 KiB): at most cap + one read.
            # Asked for identity (see `_headers`), so these are the bytes that came over the
            # wire; a server that compresses anyway is decoded per read, and still cut here.
            async for chunk in r.aiter_bytes():
                buf += chunk
                if len(buf) > cap:
                    e = AnswerTooLarge(path, cap, "cut off")
                    self._too_large_now(w, path, str(e))
                    raise e
            answer = _Answer(r.status_code, bytes(buf), r.charset_encoding)
        self._fits_now(w, path)
        return answer

    def _too_large_now(self, w: Worker, key: str, message: str) -> None:
        """Warn once per worker and answer (or `key`) while it stays too large (or too slow:
        "/metrics time"), not once per interval."""
        seen = self._too_large.setdefault(w.name, set())
        if key in seen:
            log.debug("worker %s: %s (again)", w.name, message)
        else:
            seen.add(key)
            log.warning("worker %s: %s", w.name, message)

    def _fits_now(self, w: Worker, key: str) -> None:
        """That answer fits again: the next time it does not is warned again."""
        seen = self._too_large.get(w.name)
        if seen:
            seen.discard(key)

    async def _parse_metrics(self, w: Worker, a: _Answer) -> WorkerMetrics | None:
        """The load and KV numbers from a `/metrics` answer; None where there are none.

        In a thread, not on the event loop: no cap both fits real expositions and keeps the
        parse to a few ms. The parser is pure Python, ~20 us per line of the families it reads,
        and a cap bounds bytes, not those lines: 64 KiB of them took ~20 ms, 4 MiB 2.3 s, a
        stall every probe interval. `vllm_metrics` now refuses more than MAX_RELEVANT_LINES
        (4096) of them, still ~100 ms inline at that limit. Measured in a thread: the real
        59 KB exposition 1-1.5 ms as inline; any 4 MiB text 10-20 ms (found without splitting
        it), 4096 lines read ~130 ms, with the loop waiting at most ~10 ms for the GIL."""
        try:
            metrics = await asyncio.to_thread(_parse_metrics_body, a.content, a.charset)
        except MetricsTooLarge as e:
            self._too_large_now(w, "/metrics lines", f"/metrics: {e}; not used")
            return None
        except ValueError as e:
            log.debug("worker %s: unparsable /metrics: %s", w.name, e)
            return None
        self._fits_now(w, "/metrics lines")
        return metrics

    async def probe_once(self, name: str) -> bool:
        w = self.registry.workers.get(name)
        if w is None:
            return False
        t0 = time.perf_counter()
        # The gateway's own stalls do not count (`workers.deadlines`), and a probe that timed
        # out while the gateway stalled for its whole bound proves nothing: a loop slowed by a
        # spike (0.25 s iterations) timed out every probe of healthy, serving workers and
        # ejected them all, and the spike's requests got 503s (review). A dead worker is still
        # found out: its connects are refused at once, and its requests fail.
        # Only `/health` and `/v1/models` are under this bound: `/metrics` has its own
        # (`_scrape`), and running out of it means no numbers this round, not a failed probe.
        wait = self._deadlines.within(self.timeout_s)
        start = asyncio.get_running_loop().time()
        try:
            with wait:
                models, scrape = await self._probe(w, start)
        except (ProbeError, httpx.HTTPError, TimeoutError, ValueError) as e:
            if self.registry.workers.get(name) is not w:
                return False  # a reload replaced it meanwhile (a new URL): not its result
            if _stalled(wait, e):
                self._inconclusive(name, e)
                return False
            self.registry.probe_failed(name, _describe(e))
            ok = False
        else:
            try:
                metrics_answer = await scrape  # bounded by its own wait
            finally:
                await _drop(scrape)  # cancelled with this task (stop): not left running
            # The answer is in; parsing it is bounded by the caps, and metrics that cannot be
            # read are no probe failure.
            metrics = (
                None if metrics_answer is None else await self._parse_metrics(w, metrics_answer)
            )
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
        wait = self._deadlines.within(self.deep_timeout_s)
        try:
            with wait:
                await self._deep(w, model)
        except (ProbeError, httpx.HTTPError, TimeoutError, ValueError) as e:
            if _stalled(wait, e):
                self._inconclusive(w.name, e)
                return None
            return f"deep probe ({model}): {_describe(e)}"
        return None

    def _inconclusive(self, name: str, e: BaseException) -> None:
        self.stalled_probes += 1
        log.warning(
            "worker %s: probe timed out while the gateway itself stalled for its whole bound; "
            "not counted (%s)",
            name,
            _describe(e),
        )

    def _pick_model(self, cards: list[dict[str, object]]) -> str | None:
        ids = [str(c["id"]) for c in cards]
        if self.deep_model and self.deep_model in ids:
            return self.deep_model
        base = [str(c["id"]) for c in cards if not c.get("parent")]  # not a LoRA adapter
        return (base or ids or [None])[0]

    async def _deep(self, w: Worker, model: str) -> None:
        headers = {
            **_headers(w),
            "content-type": "application/json",
            "x-request-id": "kvgate-deep-probe",
        }
        body = {"model": model, "prompt": "ping", "max_tokens": 1, "temperature": 0}
        r = await self._fetch(
            w,
            "POST",
            "/v1/completions",
            ANSWER_MAX_BYTES,
            json=body,
            headers=headers,
            timeout=_STALL_SLACK * self.deep_timeout_s,
        )
        if r.status_code != 200:
            raise ProbeError(f"/v1/completions returned {r.status_code}: {_error_text(r)}")
        data = await _json(r)
        choices = data.get("choices") if isinstance(data, dict) else None
        if not isinstance(choices, list) or not choices:
            raise ProbeError("/v1/completions: no choices in the response")

    async def _probe(
        self, w: Worker, start: float
    ) -> tuple[list[dict[str, object]], asyncio.Task[_Answer | None]]:
        """The model cards, and the `/metrics` fetch, started beside `/v1/models` with its own
        bound (`_scrape`): the caller awaits it once the cards are in. `start` is when the
        probe's bound began (loop time)."""
        headers = _headers(w)
        timeout = self._http_timeout()
        cap = ANSWER_MAX_BYTES
        r = await self._fetch(w, "GET", "/health", cap, headers=headers, timeout=timeout)
        if r.status_code == 404:
            pass  # no /health on this server: /v1/models below is the health check
        elif r.status_code != 200:
            raise ProbeError(f"/health returned {r.status_code}")
        # The rest of the probe's bound, at least a share of it (the stall forgiveness can
        # stretch the probe's own bound past `timeout_s`, leaving none by this clock).
        left = self.timeout_s - (asyncio.get_running_loop().time() - start)
        bound = max(left, _METRICS_MIN_SHARE * self.timeout_s)
        scrape = asyncio.create_task(
            self._scrape(w, bound, headers, timeout), name=f"probe-metrics-{w.name}"
        )
        try:
            models_r = await self._fetch(
                w, "GET", "/v1/models", cap, headers=headers, timeout=timeout
            )
            if models_r.status_code != 200:
                raise ProbeError(f"/v1/models returned {models_r.status_code}")
            body = await _json(models_r)
            if not isinstance(body, dict):  # `[]`, `null`: a proxy's or a half-started server's
                raise ProbeError(f"/v1/models: not a JSON object: {models_r.text[:80]!r}")
            data = body.get("data")
            if not isinstance(data, list):
                raise ProbeError("/v1/models: no data list")
        except BaseException:
            await _drop(scrape)
            raise
        models = [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
        return models, scrape

    async def _scrape(
        self, w: Worker, bound: float, headers: dict[str, str], timeout: httpx.Timeout
    ) -> _Answer | None:
        """The `/metrics` answer, or None where there is none to parse this round: absent (a
        404), failed, over its cap (warned in `_fetch`) or not all in within `bound` seconds.

        Its own bound, apart from the probe's: `/metrics` is no health check (module
        docstring), and under the probe's one a slow or trickling `/metrics` (a busy frontend
        rendering histograms, a proxy dribbling bytes) timed the whole probe out and ejected a
        worker that served fine; a fleet slow to scrape under load all went out (review). The
        bound is on the whole answer, its body included: httpx's read timeout is per read, and
        a trickle of a few bytes per read never trips it."""
        wait = self._deadlines.within(bound)
        try:
            with wait:
                a = await self._fetch(
                    w, "GET", "/metrics", METRICS_MAX_BYTES, headers=headers, timeout=timeout
                )
        except (TimeoutError, httpx.TimeoutException) as e:
            self._too_large_now(
                w,
                "/metrics time",
                f"/metrics not answered within {bound:.3g}s ({_describe(e)}); no load numbers "
                "from it until it is",
            )
            return None
        except Exception as e:  # no answer to use, whatever went wrong (as a 404)
            log.debug("worker %s: /metrics: %s", w.name, _describe(e))
            return None
        self._fits_now(w, "/metrics time")
        return a if a.status_code == 200 else None


async def _drop(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` if it still runs and wait for it to end (its connection closed)."""
    if not task.done():
        task.cancel()
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()  # retrieved: `_scrape` returns its failures, this is for a bug's


def _headers(w: Worker) -> dict[str, str]:
    # identity: so the cap counts the bytes that arrive; an answer compressed on request could
    # decode to far more than the cap from one network read (vLLM gzips /metrics when asked).
    headers = {"accept-encoding": "identity"}
    if w.spec.api_key:
        headers["authorization"] = f"Bearer {w.spec.api_key}"
    return headers


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _error_text(r: _Answer) -> str:
    """The worker's error message (OpenAI/vLLM envelope) or the start of the body."""
    try:
        # Only a short one on the event loop (it is up to ANSWER_MAX_BYTES): an error envelope
        # is a few hundred bytes.
        body = json.loads(r.content) if len(r.content) <= _JSON_INLINE_BYTES else None
    except ValueError:
        body = None
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])[:200]
    return r.text[:200]
