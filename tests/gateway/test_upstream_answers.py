"""What the client gets, and what the tenant is charged, when a worker's answer is not the answer
it should be (review of the upstream answers, with raw-socket workers).

The rules (gateway/proxy.py `forward`, `_whole`, `_unrelayable`; gateway/settlement.py):
* a non-streaming 200 whose body breaks off (chunked body ending early, content-length longer
  than the body) was generated whole before its first byte: no retry (it ran twice), a 502
  `upstream_error` envelope, charged the reservation, the worker blamed;
* a non-streaming 200 that is no answer (text, truncated JSON, an empty body, an SSE body) and a
  stream answered whole (application/json): a 502 `upstream_invalid_response`, not retried,
  charged (by the answer's usage when it has one, else the reservation), the worker blamed;
* a 4xx whose body is not the OpenAI envelope (HTML, older vLLM's top-level error, empty): the
  status kept, the body rebuilt as the envelope, application/json;
* a 2xx other than 200: bodiless (204) it is a failure, retried elsewhere; with a body (a 201
  carrying the completion) it may have been generated: a 502, not retried, charged;
* a worker's 429 is a 503: retried on another worker, refunded when none serves it, answered
  `service_unavailable` with the worker's retry-after (capped at 60 s); a 503's retry-after is
  carried over too.

Every case drives the real gateway (the production server, both upstream clients) in front of
two raw workers sharing one script: the fleet's first answer(s) are the bad ones, every later
one is good. The tenant (memory store) has 1 request and 1 token a minute with bursts to spend,
so what the store holds afterwards is what was charged; its max_concurrent is 1, so the request
after each case succeeding proves the first left no lease behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest

from gateway.app import Gateway
from gateway.config import Settings
from tests.gateway.accounting_stubs import DONE, ROLE, RecordedSink, content, usage_chunk
from tests.gateway.conftest import MODEL, RunningGateway, run_gateway, settings_for, until
from tests.support.raw_worker import answer_probe, models_body, read_request, server

KEY = "kvg-upstream-answers"
HEADERS = {"authorization": f"Bearer {KEY}", "x-request-id": "client-rid-1"}
RPM_BURST, TPM_BURST = 10, 10_000
USAGE = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
USED = 4  # what the good answers report
ANSWER = {
    "id": "chatcmpl-x",
    "object": "chat.completion",
    "created": 1,
    "model": MODEL,
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
    ],
    "usage": USAGE,
}
OK = orjson.dumps(ANSWER)
SSE = ROLE + content("hi", "stop") + usage_chunk(3, 1) + DONE
CLIENTS = ["h1", "aiohttp"]


def resp(
    status: int, body: bytes, ctype: bytes | None = b"application/json", extra: bytes = b""
) -> bytes:
    """A whole HTTP/1.1 response, content-length framed (and closing its connection)."""
    head = b"HTTP/1.1 %d X\r\n" % status
    if ctype is not None:
        head += b"content-type: %b\r\n" % ctype
    return head + b"content-length: %d\r\nconnection: close\r\n%b\r\n%b" % (len(body), extra, body)


CHUNKED_CUT = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    b"20\r\n" + OK[:32] + b"\r\n"
)
LENGTH_CUT = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 5000\r\n\r\n" + OK
)
BIG = 40 * 1024  # past WHOLE_PARSE_MAX: checked by content-type and first byte only


@dataclass
class Fleet:
    """The workers' shared script: the first ``bad`` POSTs (fleet-wide) get ``bad_answer`` and
    their connection is closed; every later one gets a good answer (a stream when asked)."""

    bad_answer: bytes = b""
    bad: int = 1
    posts: list[str] = field(default_factory=list)  # the worker of each POST, in order

    def handler(self, name: str) -> Any:
        models = models_body(MODEL)

        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            while True:
                line, body = await read_request(r)
                if answer_probe(line, w, models):
                    await w.drain()
                    continue
                self.posts.append(name)
                if self.bad > 0:
                    self.bad -= 1
                    w.write(self.bad_answer)
                    await w.drain()
                    return  # closed: a cut answer ends here, a whole one said so
                if orjson.loads(body).get("stream"):
                    w.write(resp(200, SSE, b"text/event-stream; charset=utf-8"))
                else:
                    w.write(resp(200, OK))
                await w.drain()
                return

        return handle


def _settings(urls: list[str], client: str) -> Settings:
    base = settings_for(
        urls,
        quota={"backend": "memory"},
        # No probe between the requests, and no ejection: the next request finds both workers.
        probes={"interval_s": 60, "timeout_s": 1.0, "unhealthy_after": 1000},
        routing={"policy": "round_robin"},
        timeouts={"first_byte_s": 5, "idle_s": 5, "total_s": 20},
        upstream={"client": client},
    )
    data = base.model_dump()
    data["tenants"] = {
        "t": {
            "keys_sha256": [hashlib.sha256(KEY.encode()).hexdigest()],
            "rpm": 1,
            "burst_requests": RPM_BURST,
            "tpm": 1,
            "burst_tokens": TPM_BURST,
            "max_concurrent": 1,
        }
    }
    return Settings(**data)


@dataclass
class Rig:
    g: RunningGateway
    fleet: Fleet
    usage: RecordedSink
    client: httpx.AsyncClient

    @property
    def gw(self) -> Gateway:
        return self.g.gw

    async def post(self, stream: bool = False) -> tuple[httpx.Response, dict[str, Any]]:
        """One request, and its usage record ({} when there is none: a request the walk
        refunded, every worker having refused or failed it, is not settled)."""
        n = len(self.usage.records)
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 8,
            "stream": stream,
        }
        r = await self.client.post(self.g.url + "/v1/chat/completions", json=body, headers=HEADERS)
        await until(lambda: idle(self.gw), 10, "the workers' slots released")
        rec = self.usage.records[n] if len(self.usage.records) > n else {}
        return r, rec

    async def remaining(self) -> tuple[int, int, int]:
        """(requests, tokens, leases) the tenant has in the store."""
        u = await self.gw.quota.shared.usage("t", self.gw.tenants.by_name["t"].limits)
        return u["requests"]["remaining"], u["tokens"]["remaining"], int(u["in_flight"])

    async def follow_up_ok(self) -> None:
        """The next request (max_concurrent 1) is served: no lease or slot was left behind."""
        r, _ = await self.post()
        assert r.status_code == 200, r.content
        assert orjson.loads(r.content) == ANSWER
        assert idle(self.gw)


def idle(gw: Gateway) -> bool:
    return all(w.in_flight == 0 for w in gw.registry.workers.values())


@contextlib.asynccontextmanager
async def rig(client: str, bad_answer: bytes, bad: int = 1) -> AsyncIterator[Rig]:
    fleet = Fleet(bad_answer, bad)
    async with (
        server(fleet.handler("w0")) as (u0, _),
        server(fleet.handler("w1")) as (u1, _),
        run_gateway(_settings([u0, u1], client)) as g,
        httpx.AsyncClient(timeout=30) as c,
    ):
        await g.wait_healthy(2)
        usage = RecordedSink(g.gw.settlement.usage)
        g.gw.settlement.usage = usage  # type: ignore[assignment]
        yield Rig(g, fleet, usage, c)


def reservation(r: httpx.Response) -> int:
    """The tokens admission reserved for the request (its headers say what was left)."""
    return TPM_BURST - int(r.headers["x-ratelimit-remaining-tokens"])


def envelope(r: httpx.Response, status: int, code: str | int | None) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.content)
    assert r.headers["content-type"].startswith("application/json")
    assert r.headers["x-kvgate-request-id"]
    assert r.headers["x-request-id"] == "client-rid-1"
    doc = orjson.loads(r.content)
    assert set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "param", "code"}
    assert doc["error"]["code"] == code, doc
    return doc["error"]  # type: ignore[no-any-return]


async def wait_record(rig_: Rig, n: int) -> dict[str, Any]:
    await until(lambda: len(rig_.usage.records) >= n, 10, "the usage record")
    return rig_.usage.records[n - 1]


# -- 1. a whole 200 that breaks off ---------------------------------------------------------------
@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("answer", [CHUNKED_CUT, LENGTH_CUT], ids=["chunked-cut", "length-cut"])
async def test_a_whole_answer_that_breaks_off_is_a_charged_502_never_retried(
    client: str, answer: bytes
) -> None:
    async with rig(client, answer) as x:
        r, _ = await x.post()
        err = envelope(r, 502, "upstream_error")
        assert err["type"] == "upstream_error" and "broke off" in err["message"]
        assert len(x.fleet.posts) == 1  # generated once: not run again on the other worker
        bad = x.gw.registry.workers[x.fleet.posts[0]]
        assert r.headers["x-kvgate-worker"] == bad.name
        rec = await wait_record(x, 1)
        assert (rec["status"], rec["outcome"]) == (502, "upstream_broken")
        # Charged the reservation, as an answer cut off by its size or the total timeout is.
        assert rec["charged_tokens"] == reservation(r) > 0
        assert await x.remaining() == (RPM_BURST - 1, TPM_BURST - reservation(r), 0)
        assert bad.consecutive_failures == 1 and "broke off" in bad.last_error  # blamed
        await x.follow_up_ok()


# -- 2. a whole 200 that is no answer -------------------------------------------------------------
NOT_ANSWERS = {
    "text": resp(200, b"hello, not json", b"text/plain"),
    "truncated-json": resp(200, OK[:40]),
    "empty": resp(200, b""),
    "sse-body": resp(200, SSE, b"text/event-stream"),
    "json-array": resp(200, b"[1, 2]"),
    "big-not-object": resp(200, b"[" + b"1," * (BIG // 2) + b"1]"),
    "big-text": resp(200, b" {" + b"x" * BIG, b"text/plain; charset=utf-8"),
}


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("answer", list(NOT_ANSWERS.values()), ids=list(NOT_ANSWERS))
async def test_a_200_that_is_not_an_answer_is_a_charged_502_never_retried(
    client: str, answer: bytes
) -> None:
    async with rig(client, answer) as x:
        r, _ = await x.post()
        err = envelope(r, 502, "upstream_invalid_response")
        assert err["type"] == "upstream_error"
        assert len(x.fleet.posts) == 1
        rec = await wait_record(x, 1)
        assert (rec["status"], rec["outcome"]) == (502, "upstream_invalid_response")
        assert rec["charged_tokens"] == reservation(r) > 0  # the worker did generate
        assert await x.remaining() == (RPM_BURST - 1, TPM_BURST - reservation(r), 0)
        assert x.gw.registry.workers[x.fleet.posts[0]].consecutive_failures == 1
        await x.follow_up_ok()


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_big_answer_is_relayed_without_being_parsed_whole(client: str) -> None:
    """Past the parse limit only the content-type and the first byte are checked: a valid big
    answer (leading whitespace, a long field) is relayed as it came, charged by its usage."""
    body = b" \n" + orjson.dumps({**ANSWER, "pad": "x" * BIG})
    async with rig(client, resp(200, body, b"application/json; charset=utf-8")) as x:
        r, _ = await x.post()
        assert r.status_code == 200 and r.content == body
        rec = await wait_record(x, 1)
        assert (rec["outcome"], rec["charged_tokens"]) == ("ok", USED)
        assert await x.remaining() == (RPM_BURST - 1, TPM_BURST - USED, 0)


# -- 3. a worker's refusal not in the envelope ---------------------------------------------------
HTML = b"<html><body><h1>404 Not Found</h1>nginx</body></html>"
OLD_VLLM = (
    b'{"object":"error","message":"This model\'s maximum context length is 4096 tokens.",'
    b'"type":"BadRequestError","param":"messages","code":400}'
)
GENERIC = ("upstream_error", None, None)
REFUSALS: dict[str, tuple[bytes, int, str, tuple[str, int | None, str | None]]] = {
    "html-400": (resp(400, HTML, b"text/html"), 400, "worker returned HTTP 400", GENERIC),
    "html-404": (resp(404, HTML, b"text/html"), 404, "worker returned HTTP 404", GENERIC),
    "empty-422": (resp(422, b"", None), 422, "worker returned HTTP 422", GENERIC),
    "old-vllm-400": (
        resp(400, OLD_VLLM),
        400,
        "This model's maximum context length is 4096 tokens.",
        ("BadRequestError", 400, "messages"),
    ),
}


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("case", list(REFUSALS.values()), ids=list(REFUSALS))
async def test_a_refusal_reaches_the_client_as_the_envelope(
    client: str, case: tuple[bytes, int, str, tuple[str, int | None, str | None]]
) -> None:
    answer, status, message, (type_, code, param) = case
    async with rig(client, answer) as x:
        r, _ = await x.post()
        err = envelope(r, status, code)
        assert (err["message"], err["type"], err["param"]) == (message, type_, param)
        assert len(x.fleet.posts) == 1  # the request's doing: not retried
        rec = await wait_record(x, 1)
        assert (rec["status"], rec["outcome"], rec["charged_tokens"]) == (
            status,
            "upstream_4xx",
            0,
        )
        # An attempt (the request counts), no tokens.
        assert await x.remaining() == (RPM_BURST - 1, TPM_BURST, 0)
        await x.follow_up_ok()


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_refusal_in_the_envelope_is_relayed_verbatim(client: str) -> None:
    body = b'{"error":{"message":"bad","type":"BadRequestError","param":null,"code":400},"x":1}'
    async with rig(client, resp(400, body, b"text/plain")) as x:
        r, _ = await x.post()
        assert r.status_code == 400 and r.content == body
        assert r.headers["content-type"] == "application/json"
        await x.follow_up_ok()


# -- 3b. a 2xx other than 200 ---------------------------------------------------------------------
@pytest.mark.parametrize("client", CLIENTS)
async def test_a_bodiless_204_is_a_failure_retried_on_another_worker(client: str) -> None:
    async with rig(client, b"HTTP/1.1 204 No Content\r\nconnection: close\r\n\r\n") as x:
        r, _ = await x.post()
        assert r.status_code == 200 and orjson.loads(r.content) == ANSWER
        assert len(x.fleet.posts) == 2 and x.fleet.posts[0] != x.fleet.posts[1]
        assert r.headers["x-kvgate-worker"] == x.fleet.posts[1]
        assert x.gw.registry.workers[x.fleet.posts[0]].consecutive_failures == 1
        rec = await wait_record(x, 1)
        assert (rec["status"], rec["charged_tokens"]) == (200, USED)
        assert await x.remaining() == (RPM_BURST - 1, TPM_BURST - USED, 0)
        await x.follow_up_ok()


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_201_with_an_answer_is_a_charged_502_never_retried(client: str) -> None:
    async with rig(client, resp(201, OK)) as x:
        r, _ = await x.post()
        envelope(r, 502, "upstream_invalid_response")
        assert len(x.fleet.posts) == 1
        rec = await wait_record(x, 1)
        assert (rec["status"], rec["outcome"]) == (502, "upstream_invalid_response")
        assert rec["charged_tokens"] == reservation(r) > 0
        assert await x.remaining() == (RPM_BURST - 1, TPM_BURST - reservation(r), 0)
        assert x.gw.registry.workers[x.fleet.posts[0]].consecutive_failures == 1
        await x.follow_up_ok()


# -- 4. a worker's 429 and 503 --------------------------------------------------------------------
BUSY = b'{"error":{"message":"busy","type":"rate_limit","param":null,"code":null}}'


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_worker_429_is_retried_on_another_worker(client: str) -> None:
    async with rig(client, resp(429, BUSY, extra=b"retry-after: 7\r\n")) as x:
        r, _ = await x.post()
        assert r.status_code == 200 and orjson.loads(r.content) == ANSWER
        assert len(x.fleet.posts) == 2 and x.fleet.posts[0] != x.fleet.posts[1]
        rec = await wait_record(x, 1)
        assert (rec["status"], rec["charged_tokens"]) == (200, USED)
        # Charged once, as any served request: one request, the reported tokens.
        assert await x.remaining() == (RPM_BURST - 1, TPM_BURST - USED, 0)
        assert (await x.g.metrics())['kvgate_retries_total{reason="upstream_overloaded"}'] == 1
        await x.follow_up_ok()


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize(
    ("status", "retry_after", "want"),
    [(429, b"7", "7"), (429, b"3600", "60"), (503, b"7", "7"), (429, None, "1")],
    ids=["429", "429-capped", "503", "429-none"],
)
async def test_workers_that_are_all_busy_answer_503_with_their_retry_after(
    client: str, status: int, retry_after: bytes | None, want: str
) -> None:
    extra = b"retry-after: %b\r\n" % retry_after if retry_after is not None else b""
    async with rig(client, resp(status, BUSY, extra=extra), bad=2) as x:
        r, rec = await x.post()
        err = envelope(r, 503, "upstream_overloaded" if status == 429 else None)
        assert err["message"] == "busy"
        if status == 429:
            assert err["type"] == "service_unavailable"
        assert r.headers["retry-after"] == want
        assert sorted(x.fleet.posts) == ["w0", "w1"]  # each tried once
        assert rec == {}  # refunded: no settlement record
        assert await x.remaining() == (RPM_BURST, TPM_BURST, 0)  # nothing charged, not rpm
        await x.follow_up_ok()


# -- 5. a stream answered whole -------------------------------------------------------------------
@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("with_usage", [True, False], ids=["chat-completion", "text"])
async def test_a_stream_answered_whole_is_a_charged_502(client: str, with_usage: bool) -> None:
    answer = resp(200, OK) if with_usage else resp(200, b"oops", b"text/plain")
    async with rig(client, answer) as x:
        r, _ = await x.post(stream=True)
        err = envelope(r, 502, "upstream_invalid_response")
        assert "whole answer" in err["message"]
        assert len(x.fleet.posts) == 1
        rec = await wait_record(x, 1)
        assert (rec["status"], rec["outcome"]) == (502, "upstream_invalid_response")
        # By the answer's own usage when it is a chat.completion; else the reservation.
        cost = USED if with_usage else reservation(r)
        assert rec["charged_tokens"] == cost
        assert await x.remaining() == (RPM_BURST - 1, TPM_BURST - cost, 0)
        assert x.gw.registry.workers[x.fleet.posts[0]].consecutive_failures == 1
        r2, _ = await x.post(stream=True)
        assert r2.status_code == 200 and r2.content.endswith(DONE), r2.content
        assert b'"content":"hi"' in r2.content and b"error" not in r2.content


@pytest.mark.parametrize("client", CLIENTS)
async def test_sse_events_under_a_json_content_type_are_still_a_stream(client: str) -> None:
    """What decides is the body: SSE events that a sloppy server labels application/json are
    relayed as the stream they are, charged by their usage."""
    async with rig(client, resp(200, SSE)) as x:
        r, _ = await x.post(stream=True)
        assert r.status_code == 200 and r.content.endswith(DONE), r.content
        assert b'"content":"hi"' in r.content and b"error" not in r.content
        assert len(x.fleet.posts) == 1
        rec = await wait_record(x, 1)
        assert (rec["status"], rec["outcome"], rec["charged_tokens"]) == (200, "ok", USED)
