"""The bench tools' one streaming client: a request to an OpenAI-style SSE endpoint, timed.

Every load generator in bench/ (replay, and compare through it; overhead; spike, and soak through
it; sim_capacity) sends its streaming requests through this module and adapts the `StreamResult`
into its own record, so the timing definitions below are the only ones:

- every time is `time.perf_counter()` seconds from `sent_at`, taken just before the request
  is written;
- **ttfb**: the first body bytes of a 200 response (the first chunk the transport hands over);
- **ttft**: with `parse=True`, the first SSE event whose `choices` is non-empty (an event with
  `choices: []` or none, such as a usage-only or keep-alive event, does not count; a choice with
  a role-only delta does). With `parse=False` nothing is parsed and ttft = ttfb (the simulated
  worker, like vLLM, sends its role chunk with the first token);
- **itl** (parse mode): the gaps between consecutive events with choices;
- **e2e**: to the end of the response: the `data: [DONE]` event (parse mode) or the end of the
  body (byte mode; a 200), the end of the error body (any other status). None when the request
  ended in an exception or, in parse mode, stopped at an error event or an unparseable payload,
  or its body ended without `data: [DONE]`;
- **tokens** (parse mode, from the last `usage` seen): prompt_tokens, output_tokens
  (`completion_tokens`), cached_tokens (`prompt_tokens_details.cached_tokens`, 0 when absent);
  `chunks` counts the events with choices, the output fallback when there is no usage.

Parse mode (`bench.replay`) reads line by line and decodes every `data:` payload with orjson; an
event with `error` and no choices, or a payload that is not a JSON object, ends the request with
an error; a body that ends without `data: [DONE]` is an error (`"stream ended without [DONE]"`:
vLLM ends every stream it completes, failed ones included, with it, so a stream without it was
cut), and so is a stream that ends without a token. Byte mode (overhead, spike: the
generator shares cores with the system under test, so it must stay cheap) decodes nothing: per
chunk it keeps the last `TAIL` bytes (`done`: the stream ended with `data: [DONE]`), counts
`\\n\\n` event ends (`events`) and flags a `{"error"` anywhere in the body (`stream_error`); the
tool decides what an incomplete stream means for it. `stream_http1` is byte mode over a raw
keep-alive HTTP/1.1 connection, for a generator cheaper still (sim_capacity): there ttfb is the
first read carrying `data: `.

Errors: a status other than 200 gives `error = "HTTP <status>"` with the body in `body`/`text`;
an exception of a type in `catch` (by default aiohttp's client errors, timeouts and OS errors)
gives `error = "<Type>: <message>"` and `exc`; any other exception propagates, as does
cancellation, with the result (when passed in as `result`) holding what was measured so far.
`ttft_timeout` bounds the wait for the first token (parse mode) or first bytes (byte mode), then
`stream_timeout` the rest; either raises TimeoutError, reported as above.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import aiohttp
import orjson

TAIL = 64  # bytes of the body kept in byte mode (enough for `data: [DONE]` and a chunk trailer)
DEFAULT_CATCH: tuple[type[BaseException], ...] = (aiohttp.ClientError, TimeoutError, OSError)
WORKER_HEADER = "x-kvgate-worker"


@dataclass(slots=True)
class StreamResult:
    """One streamed request, as measured (definitions: the module docstring)."""

    sent_at: float = 0.0  # time.perf_counter() when the request was sent
    status: int = 0  # HTTP status; 0 = no response
    headers: Mapping[str, str] | None = None  # the response's headers
    ttfb: float | None = None
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)  # parse mode
    e2e: float | None = None
    chunks: int = 0  # parse mode: events with choices
    events: int = 0  # byte mode: `\n\n` event ends
    prompt_tokens: int | None = None  # parse mode, usage.prompt_tokens
    output_tokens: int | None = None  # parse mode, usage.completion_tokens
    cached_tokens: int | None = None  # parse mode, usage.prompt_tokens_details.cached_tokens
    tail: bytes = b""  # byte mode: the body's last TAIL bytes
    stream_error: bool = False  # byte mode: an `{"error"` in the body
    error: str | None = None  # None: no error found (byte mode: check `done` / `stream_error`;
    # parse mode has checked both: an error event or a missing [DONE] is an error)
    exc: BaseException | None = None  # the exception behind `error`, if one
    body: bytes = b""  # the body of a response other than 200
    encoding: str = "utf-8"  # that body's charset (aiohttp's resolution)

    @property
    def worker(self) -> str | None:
        """x-kvgate-worker, when the server is kvgate."""
        return None if self.headers is None else self.headers.get(WORKER_HEADER)

    @property
    def text(self) -> str:
        """The error body decoded (undecodable bytes replaced)."""
        return self.body.decode(self.encoding, errors="replace")

    @property
    def done(self) -> bool:
        """Byte mode: the body ended with `data: [DONE]` (trailing whitespace aside)."""
        return self.tail.rstrip().endswith(b"[DONE]")


async def stream(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: Mapping[str, str],
    *,
    parse: bool,
    result: StreamResult | None = None,
    ttft_timeout: float | None = None,
    stream_timeout: float | None = None,
    catch: tuple[type[BaseException], ...] = DEFAULT_CATCH,
) -> StreamResult:
    """POST `body` to `url` and read the SSE response to its end; see the module docstring.

    `result` is filled in place (pass one to keep what was measured when the call is
    cancelled)."""
    res = StreamResult() if result is None else result
    res.sent_at = start = time.perf_counter()
    try:
        async with asyncio.timeout(ttft_timeout) as tmo:
            async with session.post(url, data=body, headers=headers) as resp:
                res.status = resp.status
                res.headers = resp.headers
                if resp.status != 200:
                    res.body = await resp.read()
                    res.encoding = resp.get_encoding()
                    res.e2e = time.perf_counter() - start
                    res.error = f"HTTP {resp.status}"
                    return res
                later = None if stream_timeout is None else _rescheduler(tmo, stream_timeout)
                if parse:
                    await _read_events(resp, res, start, later)
                else:
                    await _read_bytes(resp, res, start, later)
    except catch as e:
        res.exc = e
        res.error = f"{type(e).__name__}: {e}"
    return res


def _rescheduler(tmo: asyncio.Timeout, seconds: float) -> Callable[[], None]:
    """Moves the deadline to `seconds` from now (called at the first token or bytes)."""
    loop = asyncio.get_running_loop()

    def later() -> None:
        tmo.reschedule(loop.time() + seconds)

    return later


async def _read_bytes(
    resp: aiohttp.ClientResponse, res: StreamResult, start: float, later: Callable[[], None] | None
) -> None:
    tail = b""
    events = 0
    try:
        async for chunk in resp.content.iter_any():
            if res.ttfb is None:
                res.ttfb = res.ttft = time.perf_counter() - start
                if later is not None:
                    later()
            buf = tail + chunk
            if b'{"error"' in buf:
                res.stream_error = True
            events += chunk.count(b"\n\n")
            tail = buf[-TAIL:]
        res.e2e = time.perf_counter() - start
    finally:
        res.tail, res.events = tail, events


async def _read_events(
    resp: aiohttp.ClientResponse, res: StreamResult, start: float, later: Callable[[], None] | None
) -> None:
    last: float | None = None
    done = False
    async for raw in resp.content:
        if res.ttfb is None:
            res.ttfb = time.perf_counter() - start
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            done = True
            break
        now = time.perf_counter()
        try:
            ev = orjson.loads(payload)
        except orjson.JSONDecodeError:
            ev = None
        if not isinstance(ev, dict):
            res.error = f"bad SSE payload: {payload[:100]!r}"
            return
        if "error" in ev and not ev.get("choices"):
            res.error = str(ev["error"])
            return
        if ev.get("choices"):
            res.chunks += 1
            if res.ttft is None:
                res.ttft = now - start
                if later is not None:
                    later()
            elif last is not None:
                res.itl.append(now - last)
            last = now
        usage = ev.get("usage")
        if usage:
            res.prompt_tokens = usage.get("prompt_tokens")
            res.output_tokens = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            res.cached_tokens = int(details.get("cached_tokens") or 0)
    if not done:  # cut: no finish_reason, no usage, no [DONE]; not read to its end
        res.error = "stream ended without [DONE]"
        return
    res.e2e = time.perf_counter() - start
    if res.ttft is None:
        res.error = "stream ended without a token"


async def stream_http1(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> StreamResult:
    """Byte mode over a raw keep-alive HTTP/1.1 connection: `request` is the whole request
    (head and body); the response must be chunked (its end is the `0` chunk).

    Exceptions (a closed or reset connection mid-head) propagate; a status other than 200 or a
    connection closed mid-body is an error after which the connection is unusable."""
    res = StreamResult()
    res.sent_at = start = time.perf_counter()
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        code = head[9:12]
        res.status = int(code) if code.isdigit() else 0
        res.error = f"HTTP {res.status}"
        return res
    res.status = 200
    first = last = 0.0
    tail = b""
    while True:
        data = await reader.read(65536)
        if not data:
            res.tail = tail
            res.error = "connection closed mid-stream"
            return res
        now = time.perf_counter()
        if not first and b"data: " in data:
            first = now
        last = now
        tail = (tail + data)[-TAIL:]
        if tail.endswith(b"\r\n0\r\n\r\n"):
            break
    res.tail = tail
    if first:
        res.ttfb = res.ttft = first - start
    res.e2e = last - start
    if b"[DONE]" not in tail:
        res.error = "stream ended without [DONE]"
    return res
