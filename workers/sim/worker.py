"""One simulated vLLM worker: request validation, the engine, and vLLM 0.32's response bytes.

The gateway relays SSE bytes without re-serializing them and reads vLLM's metrics by name, so the
simulator must be indistinguishable on the wire: the same chunk field order, the same `data: ...`
framing, the same error envelope and metric names (recorded in `tests/fixtures/vllm-0.32/`). Where
vLLM's choice is arbitrary we copy it anyway, because a test that passes against the simulator must
also pass against real vLLM.

Hot path: a streamed token costs one pre-built byte prefix + an orjson-escaped string + a constant
suffix, not a dict and a `json.dumps` per chunk. All tokens of one engine step for one request go
out in one SSE event, as vLLM does with its DELTA outputs.
"""

from __future__ import annotations

import asyncio
import codecs
import hashlib
import itertools
import secrets
import time
from collections.abc import Sequence
from dataclasses import fields, replace
from typing import Any

import orjson
from prometheus_client import CollectorRegistry
from starlette.types import Send

from workers.sim import tokenizer as tok
from workers.sim.config import VLLM_VERSION, SimWorkerConfig
from workers.sim.engine import Engine
from workers.sim.engine_types import KVEvent, SimRequest
from workers.sim.errors import AbruptClose, HTTPError, error_body, invalid, schema_error
from workers.sim.kv_publisher import LAYOUTS, KVEventPublisher
from workers.sim.metrics import EngineCollector, Metrics, Tracker
from workers.sim.parsing import (
    GenRequest,
    is_int,
    opt_bool,
    parse_completion_prompt,
    request_base_id,
)
from workers.sim.profiles import TimingProfile, get_profile
from workers.sim.realtime import EngineLoop, RequestHandle

__all__ = ["SimWorker"]

_SIMREQ_FIELDS = frozenset(f.name for f in fields(SimRequest))
_DONE = b"data: [DONE]\n\n"


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
        self.metrics = Metrics()
        self.registry.register(EngineCollector(self))
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
        # vLLM's --enable-request-id-headers (off by default, as in vLLM 0.32): every response
        # carries X-Request-Id, the client's or a fresh uuid4 hex (`create_app` may override).
        self.request_id_headers = cfg.enable_request_id_headers
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

    def parse_generation(self, chat: bool, raw: bytes, headers: dict[bytes, bytes]) -> GenRequest:
        """Validate as vLLM does, in vLLM's order: schema, then model, then context length."""
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise schema_error(
                f"body.{e.pos}", "JSON decode error", "json_invalid", given={}
            ) from None
        if not isinstance(body, dict):
            raise schema_error("body", "Input should be a valid dictionary", "dict_type", body)

        stream = opt_bool(body, "stream")
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
            stream_options and opt_bool(stream_options, "include_usage", loc="body.stream_options")
        )
        continuous = bool(
            stream_options
            and opt_bool(stream_options, "continuous_usage_stats", loc="body.stream_options")
        )
        continuous_usage = include_usage and continuous  # vLLM: only with include_usage
        ignore_eos = opt_bool(body, "ignore_eos")

        n = body.get("n")
        if n is not None and (not is_int(n) or n != 1):
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
            if not is_int(max_tokens):
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
            add_gen = opt_bool(body, "add_generation_prompt", True)
            try:
                text = tok.render_chat(messages, tools, add_gen)
            except ValueError as e:
                raise schema_error("body.messages", str(e), given=messages) from None
            self._check_model(body)
            self._check_chars(text)
            prompt_ids = tok.encode(text)
        else:
            ids, text_prompt = parse_completion_prompt(body.get("prompt"))
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
        return GenRequest(
            chat=chat,
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            stream=stream,
            include_usage=include_usage,
            ignore_eos=ignore_eos,
            cache_salt=cache_salt,
            base_id=request_base_id(headers, body),
            continuous_usage=continuous_usage,
        )

    def submit(self, g: GenRequest) -> RequestHandle:
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
        if not self.loop.alive:
            raise self.engine_dead()
        try:
            return self.loop.submit(SimRequest(**kwargs))
        except ValueError as e:  # e.g. a request larger than the whole KV cache
            raise HTTPError(str(e)) from None
        except RuntimeError:  # the loop is not running (EngineLoop.submit)
            raise self.engine_dead() from None

    def engine_dead(self) -> HTTPError:
        """What vLLM answers once its engine is dead (EngineDeadError): a 500 in the envelope."""
        err = self.loop.error
        cause = "" if err is None else f" ({type(err).__name__}: {err})"
        return HTTPError(
            "EngineCore encountered an issue. See stack trace (above) for the root cause." + cause,
            500,
            "InternalServerError",
        )

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

    def stream_prefix(self, g: GenRequest, created: int) -> bytes:
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
        self, g: GenRequest, handle: RequestHandle, tracker: Tracker, send: Send
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
        num_prompt = len(g.prompt_ids)
        # Continuous usage: every event carries the usage so far, after `choices` (vLLM 0.32).
        live = (
            b',"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d,'
            b'"completion_tokens_details":null}'
            if g.continuous_usage
            else b""
        )
        if g.chat:
            head = prefix + b',"choices":[{"index":0,"delta":{"content":'
            mid_tail = b'},"logprobs":null,"finish_reason":null,"token_ids":null}]'
            fin_mid = b'},"logprobs":null,"finish_reason":"'
            fin_tail = b'","stop_reason":null,"token_ids":null}]'
            role = (
                prefix + b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
                b'"logprobs":null,"finish_reason":null}]'
                + (live % (num_prompt, num_prompt, 0) if live else b"")
                + b',"prompt_token_ids":null,"prompt_text":null}\n\n'
            )
        else:
            head = prefix + b',"choices":[{"index":0,"text":'
            mid_tail = (
                b',"logprobs":null,"finish_reason":null,"stop_reason":null,'
                b'"prompt_token_ids":null,"token_ids":null}]'
            )
            fin_mid = b',"logprobs":null,"finish_reason":"'
            fin_tail = b'","stop_reason":null,"prompt_token_ids":null,"token_ids":null}]'
            role = b""
        if not live:
            mid_tail += b"}\n\n"
        fin_end = final_fp + b"}\n\n"
        sent_tokens = 0
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
                        if live:
                            n = sent_tokens + cut
                            buf += live % (num_prompt, num_prompt + n, n) + b"}\n\n"
                        role = b""
                        await send({"type": "http.response.body", "body": buf, "more_body": True})
                    sent_tokens += cut
                    handle.abort()
                    tracker.finish("abort")
                    if close_at is not None and sent_tokens >= close_at:
                        raise AbruptClose()
                    await asyncio.Event().wait()  # stall: only a client disconnect ends this
                text = dumps(detok.text(ids, final=out.finished))
                buf = role
                role = b""
                sent_tokens += len(ids)
                usage = live % (num_prompt, num_prompt + sent_tokens, sent_tokens) if live else b""
                if not out.finished:
                    buf += head + text + mid_tail
                    if live:
                        buf += usage + b"}\n\n"
                    await send({"type": "http.response.body", "body": buf, "more_body": True})
                    continue
                reason = (out.finish_reason or "length").encode()
                buf += head + text + fin_mid + reason + fin_tail + usage + fin_end
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

    async def run_full(self, g: GenRequest, handle: RequestHandle, tracker: Tracker) -> bytes:
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
        g: GenRequest,
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
