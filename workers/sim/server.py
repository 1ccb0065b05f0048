"""The simulated vLLM worker's HTTP surface, byte-compatible with vLLM 0.32's OpenAI server.

The gateway relays SSE bytes without re-serializing them and reads vLLM's metrics by name, so the
simulator must be indistinguishable on the wire: the same chunk field order, the same `data: ...`
framing, the same error envelope and metric names (recorded in `tests/fixtures/vllm-0.32/`). Where
vLLM's choice is arbitrary we copy it anyway, because a test that passes against the simulator must
also pass against real vLLM.

One `create_app` call is one worker: its own engine, real-time loop, fault switches and Prometheus
registry, so many workers can share a process (`serve_workers`) without sharing any state.

Hot path: a streamed token costs one pre-built byte prefix + an orjson-escaped string + a constant
suffix, not a dict and a `json.dumps` per chunk. All tokens of one engine step for one request go
out in one SSE event, as vLLM does with its DELTA outputs.
"""

from __future__ import annotations

import asyncio
import bisect
import codecs
import contextlib
import hashlib
import itertools
import logging
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import orjson
import uvicorn
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from workers.sim import tokenizer as tok
from workers.sim.engine import Engine, EngineConfig, KVEvent, RequestOutput, SimRequest
from workers.sim.faults import Faults, FaultValidationError, error_type_for_status
from workers.sim.kv_publisher import LAYOUTS, KVEventPublisher
from workers.sim.profiles import TimingProfile, get_profile
from workers.sim.realtime import EngineLoop, RequestHandle

__all__ = [
    "SimWorker",
    "SimWorkerConfig",
    "bind_sockets",
    "create_app",
    "serve_workers",
]

VLLM_VERSION = "0.32.0"
_SIMREQ_FIELDS = frozenset(f.name for f in fields(SimRequest))
_JSON_CT = b"application/json"
_SSE_CT = b"text/event-stream; charset=utf-8"
_DONE = b"data: [DONE]\n\n"

# vLLM's histogram buckets (vllm/v1/metrics/loggers.py), so dashboards and the gateway's probe see
# the same bucket edges from the simulator as from a real server.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
_REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


@dataclass(slots=True)
class SimWorkerConfig:
    """Everything one simulated worker needs; the CLI builds one per port."""

    name: str = "sim-1"
    port: int = 8101
    model: str = "sim-llama"
    profile: str | TimingProfile = "default"
    engine: EngineConfig = field(default_factory=EngineConfig)
    # Used when a request names no max_tokens; always capped by max_model_len - prompt.
    default_max_tokens: int = 64
    faults: Faults = field(default_factory=Faults)
    # KV events as vLLM's `--kv-events-config` publishes them: a ZMQ PUB socket and a ROUTER
    # replay socket on `kv_events_host`. Port 0 takes any free port (see SimWorker.kv_endpoint);
    # `kv_replay_port=None` serves no replay. Publishing turns on the engine's event recording.
    kv_events: bool = False
    kv_events_host: str = "127.0.0.1"
    kv_events_port: int = 0
    kv_replay_port: int | None = 0
    kv_events_topic: str = "kv"
    kv_events_layout: str = "0.32"  # "0.32": maps tagged by "type"; "0.11": positional arrays
    kv_events_buffer_steps: int = 10_000  # batches kept for replay (vLLM's buffer_steps)


class HTTPError(Exception):
    """An OpenAI/vLLM-style error that becomes `{"error": {...}}` with `status` as HTTP code."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        err_type: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type or error_type_for_status(status)
        self.param = param

    def body(self) -> bytes:
        return error_body(self.message, self.err_type, self.param, self.status)


def error_body(message: str, err_type: str, param: str | None, code: int) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": err_type, "param": param, "code": code}}
    )


def schema_error(loc: str, msg: str, etype: str = "value_error", given: Any = None) -> HTTPError:
    """A request-schema failure, shaped like vLLM's FastAPI validation handler's.

    vLLM reports these with type "Bad Request" and the pydantic location as `param`, unlike the
    errors its serving code raises ("BadRequestError"); clients that branch on `type` see both.
    """
    if isinstance(given, dict):
        shown = f"<dict of {len(given)} items>"
    elif isinstance(given, list):
        shown = f"<list of {len(given)} items>"
    else:
        shown = repr(given)
    message = (
        f"1 validation error:\n  {{'type': '{etype}', 'loc': '{loc}', 'msg': '{msg}', "
        f"'input': '{shown}'}}"
    )
    return HTTPError(message, 400, "Bad Request", param=loc)


def invalid(message: str, param: str | None = None, value: Any = None) -> HTTPError:
    """A semantic 400 (vLLM's VLLMValidationError): the message names the parameter."""
    if param is not None:
        suffix = f"parameter={param}" if value is None else f"parameter={param}, value={value}"
        message = f"{message} ({suffix})"
    return HTTPError(message, 400, "BadRequestError", param=param)


class _AbruptClose(Exception):
    """Raised by a stream to make uvicorn drop the connection mid-body (close_after_tokens)."""


class _DropAbruptCloseLog(logging.Filter):
    """uvicorn logs every exception that ends a response; an injected close is not an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, _AbruptClose)


_uvicorn_error_log = logging.getLogger("uvicorn.error")
if not any(isinstance(f, _DropAbruptCloseLog) for f in _uvicorn_error_log.filters):
    _uvicorn_error_log.addFilter(_DropAbruptCloseLog())


# --------------------------------------------------------------------------------------------
# Request parsing
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _GenRequest:
    """A validated generation request, whichever endpoint it came from."""

    chat: bool
    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    ignore_eos: bool
    cache_salt: str | None
    base_id: str


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _opt_bool(body: dict[str, Any], key: str, default: bool = False, loc: str = "body") -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise schema_error(f"{loc}.{key}", "Input should be a valid boolean", "bool_type", v)
    return v


def _parse_completion_prompt(prompt: Any) -> tuple[list[int] | None, str | None]:
    """vLLM accepts str | list[str] | list[int] | list[list[int]]; the sim serves one prompt."""
    if isinstance(prompt, str):
        if not prompt:
            raise schema_error(
                "body",
                "Value error, Either prompt or prompt_embeds must be provided and non-empty.",
                given={"prompt": prompt},
            )
        return None, prompt
    if isinstance(prompt, list) and prompt:
        if all(_is_int(t) for t in prompt):
            if any(t < 0 for t in prompt):
                raise invalid("Token ids must be non-negative.", "prompt")
            return list(prompt), None
        if len(prompt) == 1:
            return _parse_completion_prompt(prompt[0])
        if all(isinstance(p, str | list) for p in prompt):
            raise invalid("The simulator serves one prompt per request.", "prompt")
    if prompt is None:
        raise schema_error(
            "body",
            "Value error, Either prompt or prompt_embeds must be provided and non-empty.",
            given={},
        )
    raise schema_error("body.prompt", "Input should be a valid string", "string_type", prompt)


def _request_base_id(headers: dict[bytes, bytes], body: dict[str, Any]) -> str:
    """vLLM reuses X-Request-Id, then the body's request_id, else a fresh random id."""
    hdr = headers.get(b"x-request-id")
    if hdr:
        return hdr.decode("latin-1")
    rid = body.get("request_id")
    if isinstance(rid, str) and rid:
        return rid
    return secrets.token_hex(8)


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------


class _EngineCollector(Collector):
    """Gauges and counters read from `engine.stats()` at scrape time.

    The engine already keeps cumulative counts; mirroring them into prometheus_client objects on
    every step would cost the hot loop for nothing.
    """

    def __init__(self, worker: SimWorker) -> None:
        self._w = worker

    def collect(self) -> Iterable[Metric]:
        w = self._w
        s = w.engine.stats()
        lv = [w.model, "0"]
        ln = ["model_name", "engine"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=ln)
            g.add_metric(lv, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=ln)
            c.add_metric(lv, value, created=w.started_at)
            return c

        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            s.num_running,
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            s.num_waiting,
        )
        yield gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_usage
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_cache_queries,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_cache_hits,
        )
        yield counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            s.num_preemptions,
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*ln, "finished_reason"],
        )
        # vLLM pre-creates every finished_reason child, so all exist from the first scrape.
        counts = {"stop": 0, "length": 0, "abort": 0, "error": 0, "repetition": 0}
        counts.update(s.request_success)
        for reason, count in counts.items():
            success.add_metric([*lv, reason], count, created=w.started_at)
        yield success
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
        yield counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens
        )
        cfg = w.engine_config
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[
                "block_size",
                "cache_dtype",
                "enable_prefix_caching",
                "engine",
                "num_gpu_blocks",
                "prefix_caching_hash_algo",
            ],
        )
        info.add_metric(
            [
                str(cfg.block_size),
                "auto",
                str(bool(cfg.enable_prefix_caching)),
                "0",
                str(cfg.num_blocks),
                "sha256",
            ],
            1.0,
        )
        yield info
        for hist in w.metrics.all():
            yield hist.metric(ln, lv)


class _Histogram:
    """A lock-free histogram for the per-token path.

    prometheus_client's Histogram takes a lock and walks its buckets on every observe (about
    4 us); the inter-token histogram is observed once per streamed event, so that alone was ~15%
    of a worker's CPU. One event loop owns each worker, so plain counters are safe here.
    """

    __slots__ = ("counts", "created", "doc", "edges", "name", "total")

    def __init__(self, name: str, doc: str, edges: Sequence[float]) -> None:
        self.name = name
        self.doc = doc
        self.edges = list(edges)
        self.counts = [0] * (len(self.edges) + 1)  # the last slot is +Inf
        self.total = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.edges, value)] += 1
        self.total += value

    def metric(self, labelnames: list[str], labelvalues: list[str]) -> Metric:
        m = Metric(self.name, self.doc, "histogram")
        labels = dict(zip(labelnames, labelvalues, strict=True))
        cumulative = 0
        for edge, count in zip([*self.edges, float("inf")], self.counts, strict=True):
            cumulative += count
            m.add_sample(self.name + "_bucket", {**labels, "le": floatToGoString(edge)}, cumulative)
        m.add_sample(self.name + "_count", labels, cumulative)
        m.add_sample(self.name + "_sum", labels, self.total)
        m.add_sample(self.name + "_created", labels, self.created)
        return m


class _Metrics:
    """Per-worker latency histograms, observed per request as vLLM's frontend does."""

    def __init__(self) -> None:
        self.ttft = _Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            _TTFT_BUCKETS,
        )
        self.itl = _Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            _ITL_BUCKETS,
        )
        self.e2e = _Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            _REQUEST_BUCKETS,
        )
        self.queue = _Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            _REQUEST_BUCKETS,
        )

    def all(self) -> list[_Histogram]:
        return [self.ttft, self.itl, self.e2e, self.queue]


# --------------------------------------------------------------------------------------------
# Per-request stream state
# --------------------------------------------------------------------------------------------


class _Detok:
    """Incremental detokenizer: a byte-chunk token may end mid-way through a UTF-8 character."""

    __slots__ = ("_dec", "_pending")

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")
        self._pending = False

    def text(self, ids: Sequence[int], final: bool = False) -> str:
        if not self._pending and all(0 <= t < tok.BYTE_BASE for t in ids):
            vocab = tok.VOCAB
            return "".join([vocab[t] for t in ids])
        out = self._dec.decode(tok.decode_bytes(ids), final)
        self._pending = bool(self._dec.getstate()[0])
        return out


class _Tracker:
    """Latency bookkeeping for one request, feeding the vLLM histograms.

    The engine reports no scheduling timestamp, so the queue time is estimated as TTFT minus what
    the timing profile says the request's own prefill costs (its uncached tokens). That is exact
    for an unchunked prefill in an otherwise idle step and a close bound otherwise, which is what
    the metric is used for (seeing queueing build up on a worker).
    """

    __slots__ = ("arrival", "finished", "first", "last", "metrics", "num_tokens", "profile")

    def __init__(self, metrics: _Metrics, profile: TimingProfile, arrival: float) -> None:
        self.metrics = metrics
        self.profile = profile
        self.arrival = arrival
        self.first: float | None = None
        self.last = arrival
        self.num_tokens = 0
        self.finished = False

    def on_output(self, out: RequestOutput) -> None:
        n = len(out.new_token_ids)
        if n:
            now = time.monotonic()
            if self.first is None:
                self.first = now
                ttft = now - self.arrival
                self.metrics.ttft.observe(ttft)
                uncached = max(0, out.num_prompt_tokens - out.num_cached_tokens)
                prefill = self.profile.step_seconds(
                    uncached, 0, 0.0, uncached * out.num_cached_tokens
                )
                self.metrics.queue.observe(max(0.0, ttft - prefill))
            else:
                self.metrics.itl.observe(now - self.last)
            self.last = now
            self.num_tokens += n
        if out.finished:
            self.finish(out.finish_reason or "length")

    def finish(self, reason: str) -> None:
        """Record the end of a request; aborted ones stay out of the latency histograms.

        Recorded vLLM 0.32 behaviour: a client abort records no finished-request stats, so
        disconnects do not drag the e2e/queue distributions the gateway reads.
        """
        if self.finished:
            return
        self.finished = True
        if reason == "abort":
            return
        now = time.monotonic()
        self.metrics.e2e.observe(now - self.arrival)


# --------------------------------------------------------------------------------------------
# The worker
# --------------------------------------------------------------------------------------------


class SimWorker:
    """State of one simulated worker: engine loop, faults, metrics and the request handlers."""

    def __init__(self, cfg: SimWorkerConfig) -> None:
        self.cfg = cfg
        self.model = cfg.model
        self.engine_config = cfg.engine
        profile = (
            cfg.profile if isinstance(cfg.profile, TimingProfile) else get_profile(cfg.profile)
        )
        self.profile = profile
        engine_cfg = cfg.engine
        if cfg.kv_events and not engine_cfg.enable_kv_events:
            engine_cfg = replace(engine_cfg, enable_kv_events=True)
            self.engine_config = engine_cfg
        if cfg.kv_events and cfg.kv_events_layout not in LAYOUTS:
            raise ValueError(f"kv_events_layout must be one of {LAYOUTS}")
        self.engine = Engine(engine_cfg, profile)
        self.loop = EngineLoop(self.engine)
        self.faults = cfg.faults
        self.registry = CollectorRegistry(auto_describe=False)
        self.metrics = _Metrics()
        self.registry.register(_EngineCollector(self))
        self.created = int(time.time())
        self.started_at = time.time()
        self._model_json = orjson.dumps(self.model)
        # vLLM's fingerprint is "vllm-<version>-<hash of the serving config>": stable per config.
        digest = hashlib.blake2b(
            repr((self.model, cfg.engine, profile)).encode(), digest_size=4
        ).hexdigest()
        self.fingerprint = f"vllm-{VLLM_VERSION}-{digest}"
        self._fingerprint_json = orjson.dumps(self.fingerprint)
        self.perm_id = f"modelperm-{secrets.token_hex(8)}"
        self._seq = itertools.count()
        self.num_requests = 0
        # Last, so nothing after the bind can fail and leave its sockets open.
        self.kv_publisher: KVEventPublisher | None = None
        if cfg.kv_events:
            self.kv_publisher = KVEventPublisher(
                cfg.kv_events_host,
                cfg.kv_events_port,
                cfg.kv_replay_port,
                topic=cfg.kv_events_topic,
                layout=cfg.kv_events_layout,  # type: ignore[arg-type]
                buffer_steps=cfg.kv_events_buffer_steps,
            )
            self.loop.on_kv_events = self.kv_publisher.publish

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        await self.loop.start()
        if self.kv_publisher is not None:
            self.kv_publisher.start()

    async def stop(self) -> None:
        await self.loop.stop()
        if self.kv_publisher is not None:
            await self.kv_publisher.close()

    def close_sockets(self) -> None:
        """Release the KV-event sockets of a worker whose server never ran its shutdown."""
        if self.kv_publisher is not None:
            self.kv_publisher.close_now()

    # -- KV events -------------------------------------------------------------------------

    @property
    def kv_endpoint(self) -> str | None:
        """The bound PUB endpoint (`tcp://host:port`), or None when not publishing."""
        return self.kv_publisher.endpoint if self.kv_publisher is not None else None

    @property
    def kv_replay_endpoint(self) -> str | None:
        return self.kv_publisher.replay_endpoint if self.kv_publisher is not None else None

    def reset_prefix_cache(self) -> bool:
        """vLLM's /reset_prefix_cache: False (nothing dropped) while requests hold blocks.

        The resulting AllBlocksCleared goes out at once rather than with the next step's batch:
        an idle worker may not step again for a long time, and subscribers should not keep
        routing to blocks that are gone.
        """
        ok = self.engine.reset_prefix_cache()
        self._flush_kv_events()
        return ok

    def _flush_kv_events(self) -> None:
        if self.kv_publisher is not None:
            events: list[KVEvent] = self.engine.take_kv_events()
            if events:
                self.kv_publisher.publish(events)

    # -- request validation ----------------------------------------------------------------

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is None:
            return
        if not isinstance(model, str):
            raise schema_error("body.model", "Input should be a valid string", "string_type", model)
        if model != self.model:
            raise HTTPError(
                f"The model `{model}` does not exist. Valid aliases: {self.model}.",
                404,
                "NotFoundError",
                param="model",
            )

    def _too_long(self, n_prompt: int, exact: bool) -> HTTPError:
        max_len = self.engine_config.max_model_len
        # vLLM stops tokenizing a text prompt one token past the limit, hence "at least".
        count = f"{n_prompt}" if exact else f"at least {max_len + 1}"
        return invalid(
            f"This model's maximum context length is {max_len} tokens. However, your prompt "
            f"contains {count} input tokens, which exceeds this limit even without any output "
            "tokens. Please reduce the length of the input prompt.",
            "input_tokens",
            n_prompt if exact else max_len + 1,
        )

    def _check_chars(self, text: str) -> None:
        """vLLM's cheap pre-check: more than 17 characters per context token cannot fit."""
        max_len = self.engine_config.max_model_len
        limit = max_len * 17
        if len(text) > limit:
            raise invalid(
                f"This model's maximum context length is {max_len} tokens. However, your prompt "
                f"contains {len(text)} characters (more than {limit} characters, which is the "
                f"upper bound for {max_len} input tokens). Please reduce the length of the input "
                "prompt.",
                "input_text",
                len(text),
            )

    def parse_generation(self, chat: bool, raw: bytes, headers: dict[bytes, bytes]) -> _GenRequest:
        """Validate as vLLM does, in vLLM's order: schema, then model, then context length."""
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise schema_error(
                f"body.{e.pos}", "JSON decode error", "json_invalid", given={}
            ) from None
        if not isinstance(body, dict):
            raise schema_error("body", "Input should be a valid dictionary", "dict_type", body)

        stream = _opt_bool(body, "stream")
        stream_options = body.get("stream_options")
        if stream_options is not None and not isinstance(stream_options, dict):
            raise schema_error(
                "body.stream_options",
                "Input should be a valid dictionary",
                "dict_type",
                stream_options,
            )
        if stream_options and not stream:
            raise invalid(
                "Stream options can only be defined when `stream=True`.", "stream_options"
            )
        include_usage = bool(
            stream_options and _opt_bool(stream_options, "include_usage", loc="body.stream_options")
        )
        ignore_eos = _opt_bool(body, "ignore_eos")

        n = body.get("n")
        if n is not None and (not _is_int(n) or n != 1):
            raise invalid("The simulator supports only n=1.", "n", n)
        user = body.get("user")
        if user is not None and not isinstance(user, str):
            raise schema_error("body.user", "Input should be a valid string", "string_type", user)
        cache_salt = body.get("cache_salt")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise schema_error(
                "body",
                "Value error, Parameter 'cache_salt' must be a non-empty string if provided.",
                given=body,
            )

        max_key = "max_tokens"
        max_tokens = body.get("max_tokens")
        if chat and body.get("max_completion_tokens") is not None:
            max_key = "max_completion_tokens"
            max_tokens = body["max_completion_tokens"]
        if max_tokens is not None:
            if not _is_int(max_tokens):
                raise schema_error(
                    f"body.{max_key}", "Input should be a valid integer", "int_type", max_tokens
                )
            if max_tokens < 1:
                raise invalid(
                    f"max_tokens must be at least 1, got {max_tokens}.", max_key, max_tokens
                )

        exact = False
        if chat:
            messages = body.get("messages")
            if messages is None:
                raise schema_error("body.messages", "Field required", "missing", body)
            if not isinstance(messages, list) or not messages:
                raise schema_error(
                    "body.messages", "Input should be a valid list", "list_type", messages
                )
            tools = body.get("tools")
            if tools is not None and not isinstance(tools, list):
                raise schema_error("body.tools", "Input should be a valid list", "list_type", tools)
            add_gen = _opt_bool(body, "add_generation_prompt", True)
            try:
                text = tok.render_chat(messages, tools, add_gen)
            except ValueError as e:
                raise schema_error("body.messages", str(e), given=messages) from None
            self._check_model(body)
            self._check_chars(text)
            prompt_ids = tok.encode(text)
        else:
            ids, text_prompt = _parse_completion_prompt(body.get("prompt"))
            self._check_model(body)
            if ids is None:
                self._check_chars(text_prompt or "")
                prompt_ids = tok.encode(text_prompt or "")
            else:
                prompt_ids, exact = ids, True

        max_len = self.engine_config.max_model_len
        n_prompt = len(prompt_ids)
        if n_prompt >= max_len:
            raise self._too_long(n_prompt, exact)
        # Like vLLM 0.32, an explicit max_tokens that does not fit is clamped, not refused.
        room = max_len - n_prompt
        max_tokens = min(self.cfg.default_max_tokens if max_tokens is None else max_tokens, room)
        return _GenRequest(
            chat=chat,
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            stream=stream,
            include_usage=include_usage,
            ignore_eos=ignore_eos,
            cache_salt=cache_salt,
            base_id=_request_base_id(headers, body),
        )

    def submit(self, g: _GenRequest) -> RequestHandle:
        # The engine needs unique ids even when clients reuse X-Request-Id; the response id keeps
        # the client's value, as vLLM's does.
        kwargs: dict[str, Any] = {
            "request_id": f"{g.base_id}-{next(self._seq)}",
            "prompt_token_ids": g.prompt_ids,
            "max_tokens": g.max_tokens,
            "cache_salt": g.cache_salt,
        }
        if "ignore_eos" in _SIMREQ_FIELDS:
            kwargs["ignore_eos"] = g.ignore_eos
        try:
            return self.loop.submit(SimRequest(**kwargs))
        except ValueError as e:  # e.g. a request larger than the whole KV cache
            raise HTTPError(str(e)) from None

    async def apply_pre_faults(self) -> None:
        """Faults that act before the first byte: crash, injected errors, added latency."""
        f = self.faults
        self.num_requests += 1
        if f.crash or (
            f.crash_after_requests is not None and self.num_requests >= f.crash_after_requests
        ):
            f.trigger_crash()
        if f.should_error():
            raise HTTPError("Simulated failure (fault injection).", f.error_status, param=None)
        if f.added_latency_ms > 0:
            await asyncio.sleep(f.added_latency_ms / 1000.0)

    # -- response building ------------------------------------------------------------------

    def stream_prefix(self, g: _GenRequest, created: int) -> bytes:
        """Everything of a chunk before `"choices"`; constant for the whole stream."""
        rid = orjson.dumps(("chatcmpl-" if g.chat else "cmpl-") + g.base_id)
        obj = b"chat.completion.chunk" if g.chat else b"text_completion"
        return (
            b'data: {"id":' + rid + b',"object":"' + obj + b'","created":'
            + str(created).encode() + b',"model":' + self._model_json
        )  # fmt: skip

    def created_cache_tokens(self, num_prompt: int, cached: int) -> int:
        """Prompt tokens this request newly wrote to the prefix cache (full blocks only)."""
        if not self.engine_config.enable_prefix_caching:
            return 0
        bs = self.engine_config.block_size
        return max(0, (num_prompt // bs) * bs - cached)

    async def run_stream(
        self, g: _GenRequest, handle: RequestHandle, tracker: _Tracker, send: Send
    ) -> None:
        """Produce one SSE stream. Cancellation (client gone) aborts the engine request.

        Layouts copied from recorded vLLM 0.32 streams: the chat role chunk carries null
        `prompt_token_ids`/`prompt_text`, chat choices a null `token_ids`, and the last event
        before `[DONE]` (the finishing chunk, or the usage chunk when requested) carries
        `system_fingerprint`.
        """
        created = int(time.time())
        prefix = self.stream_prefix(g, created)
        faults = self.faults
        detok = _Detok()
        dumps = orjson.dumps
        fp = b',"system_fingerprint":' + self._fingerprint_json
        final_fp = b"" if g.include_usage else fp
        if g.chat:
            head = prefix + b',"choices":[{"index":0,"delta":{"content":'
            mid_tail = b'},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
            fin_mid = b'},"logprobs":null,"finish_reason":"'
            fin_tail = b'","stop_reason":null,"token_ids":null}]' + final_fp + b"}\n\n"
            role = (
                prefix + b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
                b'"logprobs":null,"finish_reason":null}],"prompt_token_ids":null,'
                b'"prompt_text":null}\n\n'
            )
        else:
            head = prefix + b',"choices":[{"index":0,"text":'
            mid_tail = (
                b',"logprobs":null,"finish_reason":null,"stop_reason":null,'
                b'"prompt_token_ids":null,"token_ids":null}]}\n\n'
            )
            fin_mid = b',"logprobs":null,"finish_reason":"'
            fin_tail = (
                b'","stop_reason":null,"prompt_token_ids":null,"token_ids":null}]'
                + final_fp + b"}\n\n"
            )  # fmt: skip
            role = b""
        sent_tokens = 0
        num_prompt = len(g.prompt_ids)
        cached = 0
        stall_at = faults.stall_after_tokens
        close_at = faults.close_after_tokens
        try:
            async for out in handle:
                tracker.on_output(out)
                ids = out.new_token_ids
                if not ids and not out.finished:
                    continue
                cached = out.num_cached_tokens
                if out.num_prompt_tokens:
                    num_prompt = out.num_prompt_tokens
                cut: int | None = None
                if stall_at is not None and sent_tokens + len(ids) >= stall_at:
                    cut = stall_at - sent_tokens
                if close_at is not None and sent_tokens + len(ids) >= close_at:
                    close_cut = close_at - sent_tokens
                    cut = close_cut if cut is None else min(cut, close_cut)
                if cut is not None:
                    if cut > 0:
                        buf = role + head + dumps(detok.text(ids[:cut])) + mid_tail
                        role = b""
                        await send({"type": "http.response.body", "body": buf, "more_body": True})
                    sent_tokens += cut
                    handle.abort()
                    tracker.finish("abort")
                    if close_at is not None and sent_tokens >= close_at:
                        raise _AbruptClose()
                    await asyncio.Event().wait()  # stall: only a client disconnect ends this
                text = dumps(detok.text(ids, final=out.finished))
                buf = role
                role = b""
                sent_tokens += len(ids)
                if not out.finished:
                    buf += head + text + mid_tail
                    await send({"type": "http.response.body", "body": buf, "more_body": True})
                    continue
                reason = (out.finish_reason or "length").encode()
                buf += head + text + fin_mid + reason + fin_tail
                if g.include_usage:
                    details = b'{"cached_tokens":%d' % cached
                    if g.chat:
                        created_tokens = self.created_cache_tokens(num_prompt, cached)
                        details += b',"created_cache_tokens":%d' % created_tokens
                    buf += (
                        prefix
                        + b',"choices":[],"usage":{"prompt_tokens":%d,"total_tokens":%d,'
                        b'"completion_tokens":%d,"prompt_tokens_details":'
                        % (num_prompt, num_prompt + sent_tokens, sent_tokens)
                        + details + b"}}" + fp + b"}\n\n"
                    )  # fmt: skip
                buf += _DONE
                await send({"type": "http.response.body", "body": buf, "more_body": True})
                break
            else:
                # The loop ended without a finished output: the worker is shutting down. vLLM
                # reports an engine failure inside the stream, then still ends it with [DONE].
                err = error_body(
                    "The engine stopped before the request finished.",
                    "InternalServerError",
                    None,
                    500,
                )
                buf = b"data: " + err + b"\n\n" + _DONE
                await send({"type": "http.response.body", "body": buf, "more_body": True})
        finally:
            if not tracker.finished:
                handle.abort()
                tracker.finish("abort")

    async def run_full(self, g: _GenRequest, handle: RequestHandle, tracker: _Tracker) -> bytes:
        """Collect a whole non-streaming response; cancellation aborts the engine request."""
        created = int(time.time())
        ids: list[int] = []
        reason = "length"
        cached = 0
        num_prompt = len(g.prompt_ids)
        try:
            async for out in handle:
                tracker.on_output(out)
                ids.extend(out.new_token_ids)
                cached = out.num_cached_tokens
                if out.num_prompt_tokens:
                    num_prompt = out.num_prompt_tokens
                if out.finished:
                    reason = out.finish_reason or "length"
                    break
            else:
                raise HTTPError("The engine stopped before the request finished.", 500)
        finally:
            if not tracker.finished:
                handle.abort()
                tracker.finish("abort")
        return self.full_response(g, created, ids, reason, num_prompt, cached)

    def full_response(
        self,
        g: _GenRequest,
        created: int,
        ids: list[int],
        reason: str,
        num_prompt: int,
        cached: int,
    ) -> bytes:
        """A non-streaming body with vLLM 0.32's exact key set and order (see the fixtures)."""
        text = tok.decode(ids)
        usage = {
            "prompt_tokens": num_prompt,
            "total_tokens": num_prompt + len(ids),
            "completion_tokens": len(ids),
            "prompt_tokens_details": {
                "cached_tokens": cached,
                # vLLM fills this for chat only; completions report null.
                "created_cache_tokens": (
                    self.created_cache_tokens(num_prompt, cached) if g.chat else None
                ),
                "multimodal_tokens": None,
            },
            "completion_tokens_details": None,
        }
        if g.chat:
            return orjson.dumps(
                {
                    "id": "chatcmpl-" + g.base_id,
                    "object": "chat.completion",
                    "created": created,
                    "model": self.model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {
                                "role": "assistant",
                                "content": text,
                                "refusal": None,
                                "annotations": None,
                                "audio": None,
                                "function_call": None,
                                "reasoning": None,
                            },
                            "logprobs": None,
                            "finish_reason": reason,
                            "stop_reason": None,
                            "token_ids": None,
                            "routed_experts": None,
                        }
                    ],
                    "service_tier": None,
                    "system_fingerprint": self.fingerprint,
                    "usage": usage,
                    "prompt_logprobs": None,
                    "prompt_token_ids": None,
                    "prompt_text": None,
                    "kv_transfer_params": None,
                    "ec_transfer_params": None,
                    "metrics": None,
                }
            )
        return orjson.dumps(
            {
                "id": "cmpl-" + g.base_id,
                "object": "text_completion",
                "created": created,
                "model": self.model,
                "choices": [
                    {
                        "index": 0,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": reason,
                        "stop_reason": None,
                        "token_ids": None,
                        "prompt_logprobs": None,
                        "prompt_token_ids": None,
                        "routed_experts": None,
                    }
                ],
                "service_tier": None,
                "system_fingerprint": self.fingerprint,
                "usage": usage,
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "metrics": None,
            }
        )


# --------------------------------------------------------------------------------------------
# ASGI plumbing
# --------------------------------------------------------------------------------------------


class _ClientGone(Exception):
    """The client disconnected before its request body arrived: nothing to answer."""


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise _ClientGone()
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body", False):
            return b"".join(chunks)


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        msg: Message = await receive()
        if msg["type"] == "http.disconnect":
            return


def _headers(status: int, ctype: bytes, rid: bytes | None, length: int | None = None) -> Message:
    hdrs = [(b"content-type", ctype)]
    if length is not None:
        hdrs.append((b"content-length", str(length).encode()))
    if rid:
        hdrs.append((b"x-request-id", rid))
    hdrs.append((b"vary", b"Origin"))
    return {"type": "http.response.start", "status": status, "headers": hdrs}


async def _send_json(send: Send, status: int, body: bytes, rid: bytes | None = None) -> None:
    await send(_headers(status, _JSON_CT, rid, len(body)))
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _race_disconnect(receive: Receive, work: asyncio.Future[Any]) -> bool:
    """Run `work` until it ends or the client goes away; True if the client went away.

    vLLM aborts requests whose client disconnected (streaming or not); watching `receive` in a
    side task is the one signal that works even while the stream is idle (queued, stalled).
    """
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        watcher.cancel()
        raise
    if work in done:
        watcher.cancel()
        return False
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError, _AbruptClose):
        await work
    return True


class _GenerateEndpoint:
    """Raw ASGI endpoint for the two generation routes: the hot path skips Starlette's Request."""

    def __init__(self, worker: SimWorker, chat: bool) -> None:
        self.worker = worker
        self.chat = chat

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        w = self.worker
        if scope.get("method") != "POST":
            body = b'{"detail":"Method Not Allowed"}'
            start = _headers(405, _JSON_CT, None, len(body))
            start["headers"].append((b"allow", b"POST"))
            await send(start)
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        headers = dict(scope.get("headers", ()))
        rid_hdr = headers.get(b"x-request-id")
        try:
            raw = await _read_body(receive)
        except _ClientGone:
            return
        try:
            g = w.parse_generation(self.chat, raw, headers)
            await w.apply_pre_faults()
            tracker = _Tracker(w.metrics, w.profile, time.monotonic())
            handle = w.submit(g)
        except HTTPError as e:
            await _send_json(send, e.status, e.body(), rid_hdr)
            return
        rid = rid_hdr or g.base_id.encode("latin-1", "replace")
        if g.stream:
            try:
                await send(_headers(200, _SSE_CT, rid))
            except BaseException:
                handle.abort()  # never leave an engine request nobody will read
                raise
            work = asyncio.ensure_future(self._stream(g, handle, tracker, send))
            await _race_disconnect(receive, work)
            if work.done() and not work.cancelled():
                exc = work.exception()
                if exc is not None:
                    raise exc
            return
        task = asyncio.ensure_future(w.run_full(g, handle, tracker))
        if await _race_disconnect(receive, task):
            return
        try:
            body = task.result()
        except HTTPError as e:
            await _send_json(send, e.status, e.body(), rid)
            return
        await _send_json(send, 200, body, rid)

    async def _stream(
        self, g: _GenRequest, handle: RequestHandle, tracker: _Tracker, send: Send
    ) -> None:
        await self.worker.run_stream(g, handle, tracker, send)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


# --------------------------------------------------------------------------------------------
# Small endpoints
# --------------------------------------------------------------------------------------------


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def _err(e: HTTPError) -> Response:
    return Response(e.body(), status_code=e.status, media_type="application/json")


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as e:
        raise HTTPError(f"Invalid JSON body: {e}") from None
    if not isinstance(body, dict):
        raise HTTPError("The request body must be a JSON object.")
    return body


def _routes(w: SimWorker) -> list[Route]:
    async def health(_: Request) -> Response:
        if w.faults.unhealthy:
            return Response(b"", status_code=503)
        return Response(b"", status_code=200)

    async def models(_: Request) -> Response:
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": w.model,
                        "object": "model",
                        "created": w.created,
                        "owned_by": "vllm",
                        "root": w.model,
                        "parent": None,
                        "max_model_len": w.engine_config.max_model_len,
                        "permission": [
                            {
                                "id": w.perm_id,
                                "object": "model_permission",
                                "created": w.created,
                                "allow_create_engine": False,
                                "allow_sampling": True,
                                "allow_logprobs": True,
                                "allow_search_indices": False,
                                "allow_view": True,
                                "allow_fine_tuning": False,
                                "organization": "*",
                                "group": None,
                                "is_blocking": False,
                            }
                        ],
                    }
                ],
            }
        )

    async def version(_: Request) -> Response:
        return _json({"version": VLLM_VERSION})

    async def tokenize(request: Request) -> Response:
        try:
            body = await _json_body(request)
            w._check_model(body)
            if "messages" in body:
                messages = body["messages"]
                if not isinstance(messages, list):
                    raise HTTPError("'messages' must be a list", param="messages")
                try:
                    text = tok.render_chat(
                        messages, body.get("tools"), _opt_bool(body, "add_generation_prompt", True)
                    )
                except ValueError as e:
                    raise HTTPError(str(e), param="messages") from None
            else:
                prompt = body.get("prompt")
                if not isinstance(prompt, str):
                    raise HTTPError("'prompt' must be a string", param="prompt")
                text = prompt
            ids = tok.encode(text)
            strs = [tok.token_str(t) for t in ids] if _opt_bool(body, "return_token_strs") else None
        except HTTPError as e:
            return _err(e)
        return _json(
            {
                "count": len(ids),
                "max_model_len": w.engine_config.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def detokenize(request: Request) -> Response:
        try:
            body = await _json_body(request)
            w._check_model(body)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
                raise HTTPError("'tokens' must be a list of integers", param="tokens")
        except HTTPError as e:
            return _err(e)
        return _json({"prompt": tok.decode(tokens)})

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(w.registry), media_type=CONTENT_TYPE_LATEST)

    async def faults_get(_: Request) -> Response:
        return _json(w.faults.to_dict())

    async def faults_post(request: Request) -> Response:
        try:
            body = await _json_body(request)
            w.faults.update(body)
        except HTTPError as e:
            return _err(e)
        except FaultValidationError as e:
            return _err(HTTPError(str(e)))
        return _json(w.faults.to_dict())

    async def faults_reset(_: Request) -> Response:
        # Back to a clean worker: no faults and, when nothing is running, a cold prefix cache.
        w.faults.reset()
        w.reset_prefix_cache()
        return _json(w.faults.to_dict())

    async def reset_prefix_cache(_: Request) -> Response:
        return _json({"success": w.reset_prefix_cache()})

    return [
        Route("/v1/chat/completions", _GenerateEndpoint(w, chat=True)),
        Route("/v1/completions", _GenerateEndpoint(w, chat=False)),
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/sim/faults", faults_get, methods=["GET"]),
        Route("/sim/faults", faults_post, methods=["POST"]),
        Route("/sim/reset", faults_reset, methods=["POST"]),
        Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
    ]


async def _not_found(_: Request, __: Exception) -> Response:
    return JSONResponse({"detail": "Not Found"}, status_code=404)


async def _not_allowed(_: Request, __: Exception) -> Response:
    return JSONResponse({"detail": "Method Not Allowed"}, status_code=405)


class _VaryOrigin:
    """vLLM's CORS middleware adds `vary: Origin` to every response; so do we, for parity."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_vary(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (b"vary", b"Origin")]
            await send(message)

        await self.app(scope, receive, send_vary)


class _SimApp(Starlette):
    """Starlette for everything, except that the two generation routes skip its middleware.

    Every streamed event goes through each middleware's `send` wrapper; three wrappers cost
    about 3 us per event, a sixth of a worker's per-token CPU. The generation endpoints set
    their own headers (incl. `vary`) and need no exception handling from Starlette.
    """

    fast_paths: dict[str, _GenerateEndpoint]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            endpoint = self.fast_paths.get(scope["path"])
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def create_app(cfg: SimWorkerConfig) -> Starlette:
    """One simulated worker as an ASGI app; the engine loop lives in the app's lifespan."""
    worker = SimWorker(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await worker.start()
        try:
            yield
        finally:
            await worker.stop()

    app = _SimApp(
        routes=_routes(worker),
        lifespan=lifespan,
        exception_handlers={404: _not_found, 405: _not_allowed},
        middleware=[Middleware(_VaryOrigin)],
    )
    app.fast_paths = {
        "/v1/chat/completions": _GenerateEndpoint(worker, chat=True),
        "/v1/completions": _GenerateEndpoint(worker, chat=False),
    }
    app.state.worker = worker
    return app


# --------------------------------------------------------------------------------------------
# Serving several workers in one process
# --------------------------------------------------------------------------------------------


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signal handling to `serve_workers` (one handler for all)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


def bind_sockets(host: str, ports: Sequence[int]) -> list[socket.socket]:
    """Bind every port up front so a taken port fails the whole start with a clear error."""
    socks: list[socket.socket] = []
    try:
        for port in ports:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            s = socket.socket(family, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                s.close()
                raise OSError(e.errno, f"cannot bind {host}:{port}: {e.strerror}") from e
            s.set_inheritable(True)
            socks.append(s)
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


def _loop_impl() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def build_servers(
    cfgs: Sequence[SimWorkerConfig], host: str, graceful_timeout_s: float = 3.0
) -> list[uvicorn.Server]:
    servers: list[uvicorn.Server] = []
    try:
        for cfg in cfgs:
            servers.append(_build_server(cfg, host, graceful_timeout_s))
    except BaseException:  # e.g. a taken KV-event port: release what the others bound
        for s in servers:
            s.config.app.state.worker.close_sockets()
        raise
    return servers


def _build_server(cfg: SimWorkerConfig, host: str, graceful_timeout_s: float) -> uvicorn.Server:
    config = uvicorn.Config(
        create_app(cfg),
        host=host,
        port=cfg.port,
        loop=_loop_impl(),
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level="warning",
        timeout_graceful_shutdown=graceful_timeout_s,
        timeout_keep_alive=30,
    )
    return _Server(config)


async def serve_workers(
    cfgs: Sequence[SimWorkerConfig],
    host: str = "127.0.0.1",
    *,
    sockets: Sequence[socket.socket] | None = None,
    on_started: Callable[[list[uvicorn.Server]], None] | None = None,
    stop: asyncio.Event | None = None,
    graceful_timeout_s: float = 3.0,
    handle_signals: bool | None = None,
) -> None:
    """Run one uvicorn server per config in this event loop until `stop` is set or a signal.

    `sockets` (one per config, already bound) lets callers use port 0; otherwise each config's
    port is bound here. With `handle_signals` (default: when binding here, i.e. when this is the
    process's main job) SIGINT/SIGTERM stop every server gracefully; a second one forces it.
    uvicorn's own per-server signal capture is disabled: with several servers in one loop only
    the last one installed would ever see the signal.
    """
    socks = list(sockets) if sockets is not None else bind_sockets(host, [c.port for c in cfgs])
    if len(socks) != len(cfgs):
        raise ValueError("one socket per worker config is required")
    try:
        servers = build_servers(cfgs, host, graceful_timeout_s)
    except BaseException:  # as after serving: the HTTP sockets are closed either way
        for sk in socks:
            sk.close()
        raise
    loop = asyncio.get_running_loop()

    def request_exit() -> None:
        for s in servers:
            if s.should_exit:
                s.force_exit = True
            s.should_exit = True

    installed: list[int] = []
    if handle_signals is None:
        handle_signals = sockets is None
    if handle_signals:
        import signal

        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, request_exit)
                installed.append(sig)

    async def watch_stop() -> None:
        if stop is None:
            return
        await stop.wait()
        request_exit()

    async def announce() -> None:
        while not all(s.started for s in servers):
            if any(s.should_exit for s in servers):
                return
            await asyncio.sleep(0.01)
        if on_started is not None:
            on_started(servers)

    stopper = asyncio.ensure_future(watch_stop())
    announcer = asyncio.ensure_future(announce())
    try:
        await asyncio.gather(*(s.serve(sockets=[sk]) for s, sk in zip(servers, socks, strict=True)))
    finally:
        stopper.cancel()
        announcer.cancel()
        for sig in installed:
            loop.remove_signal_handler(sig)
        for sk in socks:
            sk.close()
        # A server stopped before its startup finished skips its lifespan shutdown.
        for s in servers:
            s.config.app.state.worker.close_sockets()
