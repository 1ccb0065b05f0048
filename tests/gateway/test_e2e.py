"""The gateway in front of simulated vLLM workers, end to end over real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator

import httpx
import openai
import orjson
import pytest

from gateway.server import DisconnectWatch, GuardedHttpProtocol
from tests.gateway.conftest import (
    MODEL,
    SCRIPTED_EVENTS,
    flat_metrics,
    run_gateway,
    run_scripted_worker,
    settings_for,
    until,
)

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about KV caches."}]}


async def post(url: str, body: dict, **kw) -> httpx.Response:  # type: ignore[no-untyped-def]
    async with httpx.AsyncClient(timeout=30) as c:
        return await c.post(url, json=body, **kw)


async def sim_faults(url: str, **faults: object) -> None:
    async with httpx.AsyncClient() as c:
        r = await c.post(url + "/sim/faults", json=faults)
        r.raise_for_status()


async def worker_metrics(url: str) -> dict[str, float]:
    async with httpx.AsyncClient() as c:
        return flat_metrics((await c.get(url + "/metrics")).text)


async def aborts(url: str) -> int:
    """Requests the simulated worker's engine aborted (its own books: vLLM's /metrics, which
    the simulator follows, counts a client's abort nowhere)."""
    async with httpx.AsyncClient() as c:
        stats = (await c.get(url + "/sim/stats")).json()
    return int(stats["finished_by_reason"].get("abort", 0))


async def test_openai_client_streams_and_non_streams_through_the_gateway(sims) -> None:  # type: ignore[no-untyped-def]
    fleet = sims(2)
    async with run_gateway(settings_for(fleet.urls)) as g:
        await g.wait_healthy(2)
        client = openai.AsyncOpenAI(base_url=g.url + "/v1", api_key="unused", max_retries=0)
        stream = await client.chat.completions.create(
            model=MODEL, messages=CHAT["messages"], stream=True, max_tokens=12
        )
        pieces, finish = [], None
        async for chunk in stream:
            assert chunk.usage is None  # not asked for: the gateway strips what it forced
            for c in chunk.choices:
                pieces.append(c.delta.content or "")
                finish = c.finish_reason or finish
        assert "".join(pieces) and finish == "length"

        stream = await client.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            stream=True,
            max_tokens=7,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 7
        assert "".join(c.choices[0].text for c in chunks if c.choices)

        chat = await client.chat.completions.create(
            model=MODEL, messages=CHAT["messages"], max_tokens=5
        )
        assert chat.usage.completion_tokens == 5 and chat.choices[0].message.content
        comp = await client.completions.create(model=MODEL, prompt=[1001, 1002, 1003], max_tokens=3)
        assert comp.usage.prompt_tokens == 3 and comp.choices[0].text

        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=CHAT["messages"], max_tokens=2
        )
        assert raw.headers["x-kvgate-worker"] in {"w0", "w1"}
        assert raw.headers["x-request-id"]

        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]


async def test_sse_bytes_are_the_workers_bytes_across_odd_chunk_boundaries() -> None:
    # Usage at the end and on every event: what the gateway asks every worker for.
    opts = {"include_usage": True, "continuous_usage_stats": True}
    body = {**CHAT, "stream": True, "stream_options": opts}
    async with run_scripted_worker() as (url, received), run_gateway(settings_for([url])) as g:
        await g.wait_healthy(1)
        via = await post(g.url + "/v1/chat/completions", body, headers={"x-request-id": "same-id"})
    assert via.status_code == 200
    assert via.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert via.headers["x-request-id"] == "same-id"
    assert via.content == b"".join(SCRIPTED_EVENTS)
    assert orjson.loads(received[0]) == body  # asked for both: forwarded untouched


async def test_the_worker_header_can_be_turned_off() -> None:
    # Security review: the header names the fleet's workers to every client; `worker_header =
    # false` keeps them from tenants (streams and whole answers alike).
    async with run_scripted_worker() as (url, _received):
        for on in (True, False):
            s = settings_for([url], server={"worker_header": on})
            async with run_gateway(s) as g:
                await g.wait_healthy(1)
                for stream in (True, False):
                    r = await post(g.url + "/v1/chat/completions", {**CHAT, "stream": stream})
                    assert r.status_code == 200 and r.headers["x-request-id"]
                    assert r.headers.get("x-kvgate-worker") == ("w0" if on else None)


class _CountedWrites:
    """A client connection's transport that keeps what each ``write`` carried."""

    def __init__(self, transport: asyncio.Transport, writes: list[bytes]) -> None:
        self._t = transport
        self._writes = writes

    def write(self, data: bytes) -> None:
        self._writes.append(bytes(data))
        self._t.write(data)

    def __getattr__(self, name: str) -> object:
        return getattr(self._t, name)


async def test_a_stream_reaches_the_client_in_one_write_per_worker_read(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The head goes out with the first events, a read's several HTTP chunks as one, and the
    events that came with [DONE] with it and the terminator: two writes for a worker that sent
    its first event and then the rest at once (six, one per event, before)."""
    writes: list[bytes] = []
    made = GuardedHttpProtocol.connection_made

    def counted(self: GuardedHttpProtocol, transport: asyncio.Transport) -> None:
        made(self, _CountedWrites(transport, writes))  # type: ignore[arg-type]

    monkeypatch.setattr(GuardedHttpProtocol, "connection_made", counted)
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    async with (
        run_scripted_worker(burst=True) as (url, _),
        run_gateway(settings_for([url])) as g,
    ):
        await g.wait_healthy(1)
        writes.clear()
        via = await post(g.url + "/v1/chat/completions", body)
    assert via.content == b"".join(SCRIPTED_EVENTS)
    assert len(writes) == 2, writes
    assert writes[0].startswith(b"HTTP/1.1 200 ") and writes[0].endswith(
        SCRIPTED_EVENTS[0] + b"\r\n"
    )
    assert writes[1].endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    assert writes[1].count(b"\n\ndata: ") == len(SCRIPTED_EVENTS) - 2


async def test_a_finished_request_is_freed_without_the_cycle_collector(sims) -> None:  # type: ignore[no-untyped-def]
    """Nothing a request builds refers back to itself, so reference counting frees it when it
    ends. Before, the relay and its wait helper referred to each other: every stream's relay,
    call, route and upstream response stayed until the cyclic collector ran (~60 containers per
    request; under load a 30-50 ms collection every ~1,000 requests, once 220 ms)."""
    from gateway.call import Call
    from gateway.relay import RelayResponse

    fleet = sims(1)
    async with run_gateway(settings_for(fleet.urls)) as g:
        await g.wait_healthy(1)
        gc.collect()
        gc.disable()
        try:
            for stream in (True, True, False):
                body = {**CHAT, "stream": stream, "max_tokens": 8}
                assert (await post(g.url + "/v1/chat/completions", body)).status_code == 200
            await until(lambda: not g.gw.life.streams, 5, "streams ended")

            def alive() -> list[str]:
                return [
                    type(o).__name__
                    for o in gc.get_objects()
                    if isinstance(o, RelayResponse | Call)
                ]

            # Polled, not one fixed pause: the request tasks' own last steps after the last byte
            # may come late on a loaded host; with the collector off, a cycle never frees them.
            with contextlib.suppress(AssertionError):
                await until(lambda: not alive(), 10, "every request freed", step=0.05)
            left = alive()
        finally:
            gc.enable()
    assert left == [], left


async def test_usage_chunk_forced_upstream_is_stripped_for_clients_that_did_not_ask() -> None:
    body = {**CHAT, "stream": True}
    async with run_scripted_worker() as (url, received), run_gateway(settings_for([url])) as g:
        await g.wait_healthy(1)
        via = await post(g.url + "/v1/chat/completions", body)
    sent = orjson.loads(received[0])
    assert sent["stream_options"] == {"include_usage": True}  # no tenants: nothing to charge
    expected = b"".join(e for e in SCRIPTED_EVENTS if b'"choices":[],"usage"' not in e)
    assert via.content == expected


async def test_sim_stream_through_gateway_has_vllm_framing(sims) -> None:  # type: ignore[no-untyped-def]
    fleet = sims(1)
    body = {**CHAT, "stream": True, "max_tokens": 16, "stream_options": {"include_usage": True}}
    async with run_gateway(settings_for(fleet.urls)) as g:
        await g.wait_healthy(1)
        via = await post(g.url + "/v1/chat/completions", body, headers={"x-request-id": "rid-1"})
    events = via.content.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    docs = [orjson.loads(e[6:]) for e in events[:-2]]
    # The worker keys the request by the gateway's own id, never by the client's (clients reuse
    # ids); the client's id is echoed back.
    assert via.headers["x-request-id"] == "rid-1"
    assert all(d["id"] == f"chatcmpl-{via.headers['x-kvgate-request-id']}" for d in docs)
    assert docs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert docs[-1]["usage"]["completion_tokens"] == 16


async def test_unknown_model_404_and_no_healthy_worker_503(sims) -> None:  # type: ignore[no-untyped-def]
    fleet = sims(1)
    async with run_gateway(settings_for(fleet.urls)) as g:
        await g.wait_healthy(1)
        r = await post(g.url + "/v1/chat/completions", {**CHAT, "model": "gpt-nope"})
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "model_not_found"
        fleet.kill()
        await until(lambda: not g.gw.registry.healthy(), 10, "the worker is seen down")
        r = await post(g.url + "/v1/chat/completions", CHAT)
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "service_unavailable"
        assert int(r.headers["retry-after"]) >= 1
        ready = await post_get(g.url + "/ready")
        assert ready.status_code == 503


async def post_get(url: str) -> httpx.Response:
    async with httpx.AsyncClient() as c:
        return await c.get(url)


async def test_worker_500_is_retried_transparently_on_another(sims) -> None:  # type: ignore[no-untyped-def]
    fleet = sims(2)
    await sim_faults(fleet.urls[0], error_rate=1.0, error_status=500)
    settings = settings_for(
        fleet.urls, routing={"policy": "round_robin"}, probes={"unhealthy_after": 100}
    )
    async with run_gateway(settings) as g:
        await g.wait_healthy(2)
        for stream in (False, True, False, True):
            r = await post(
                g.url + "/v1/chat/completions", {**CHAT, "stream": stream, "max_tokens": 3}
            )
            assert r.status_code == 200 and r.headers["x-kvgate-worker"] == "w1"
        m = await g.metrics()
        assert sum(v for k, v in m.items() if k.startswith("kvgate_retries_total")) >= 2


async def test_all_workers_500_passes_the_upstream_envelope_through(sims) -> None:  # type: ignore[no-untyped-def]
    fleet = sims(2)
    for u in fleet.urls:
        await sim_faults(u, error_rate=1.0, error_status=503)
    async with run_gateway(settings_for(fleet.urls, probes={"unhealthy_after": 100})) as g:
        await g.wait_healthy(2)
        r = await post(g.url + "/v1/chat/completions", CHAT)
        assert r.status_code == 503
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


async def test_refused_connections_are_retried_and_the_dead_worker_ejected(sims) -> None:  # type: ignore[no-untyped-def]
    a, b = sims(1), sims(1)
    settings = settings_for(
        a.urls + b.urls,
        routing={"policy": "round_robin"},
        probes={"interval_s": 30, "unhealthy_after": 2},
    )
    async with run_gateway(settings) as g:
        await g.wait_healthy(2)
        a.kill()  # probes are 30 s apart: only passive failures can notice
        for _ in range(6):
            r = await post(g.url + "/v1/chat/completions", {**CHAT, "max_tokens": 2})
            assert r.status_code == 200 and r.headers["x-kvgate-worker"] == "w1"
        assert g.gw.registry.workers["w0"].health.value == "unhealthy"


async def test_worker_dying_mid_stream_gives_an_sse_error_event_and_done(sims) -> None:  # type: ignore[no-untyped-def]
    fleet = sims(1)
    await sim_faults(fleet.urls[0], close_after_tokens=3)
    async with run_gateway(settings_for(fleet.urls, probes={"unhealthy_after": 100})) as g:
        await g.wait_healthy(1)
        r = await post(g.url + "/v1/chat/completions", {**CHAT, "stream": True, "max_tokens": 50})
        assert r.status_code == 200
        events = [e for e in r.content.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]"
        err = orjson.loads(events[-2][len(b"data: ") :])["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert any(b'"content"' in e for e in events[:-2])  # some tokens made it first
        m = await g.metrics()
        assert m['kvgate_stream_errors_total{reason="upstream_broken"}'] == 1


async def test_stalled_stream_is_ended_by_the_idle_timeout(sims) -> None:  # type: ignore[no-untyped-def]
    fleet = sims(1)
    await sim_faults(fleet.urls[0], stall_after_tokens=2)
    settings = settings_for(fleet.urls, timeouts={"idle_s": 0.5}, probes={"unhealthy_after": 100})
    async with run_gateway(settings) as g:
        await g.wait_healthy(1)
        r = await post(g.url + "/v1/chat/completions", {**CHAT, "stream": True, "max_tokens": 50})
        assert r.content.endswith(b"data: [DONE]\n\n") and b'"error"' in r.content
        assert g.gw.registry.workers["w0"].in_flight == 0


@contextlib.asynccontextmanager
async def long_stream_started(url: str) -> AsyncIterator[None]:
    """A 2,000-token stream, three events in; leaving the block hangs up."""
    async with httpx.AsyncClient(timeout=30) as c:
        body = {**CHAT, "stream": True, "max_tokens": 2000, "ignore_eos": True}
        async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
            got = 0
            async for line in r.aiter_lines():
                got += line.startswith("data: ")
                if got >= 3:
                    break
            yield


async def test_client_disconnect_aborts_the_request_on_the_worker(sims) -> None:  # type: ignore[no-untyped-def]
    fleet = sims(1, profile="default")  # GPU-like timing: 2,000 tokens take many seconds
    async with run_gateway(settings_for(fleet.urls)) as g:
        await g.wait_healthy(1)
        before = await aborts(fleet.urls[0])
        async with long_stream_started(g.url):
            pass  # hung up after three events
        for _ in range(100):
            if await aborts(fleet.urls[0]) > before:
                break
            await asyncio.sleep(0.05)
        assert await aborts(fleet.urls[0]) == before + 1
        m = await worker_metrics(fleet.urls[0])
        assert m['vllm:num_requests_running{engine="0",model_name="sim-llama"}'] == 0
        for _ in range(100):
            if g.gw.registry.workers["w0"].in_flight == 0:
                break
            await asyncio.sleep(0.02)
        assert g.gw.registry.workers["w0"].in_flight == 0
        assert (await g.metrics())["kvgate_client_disconnects_total"] == 1


async def test_a_stream_needs_no_disconnect_watcher_task_under_kvgates_server(sims) -> None:  # type: ignore[no-untyped-def]
    # The server calls back on a disconnect (DisconnectWatch), so a stream is its request's
    # task alone; the disconnect tests above show the callback still cancels it.
    fleet = sims(1, profile="default")
    async with run_gateway(settings_for(fleet.urls)) as g:
        await g.wait_healthy(1)
        async with long_stream_started(g.url):
            assert len(g.gw.life.streams) == 1
            names = [t.get_coro().__qualname__ for t in asyncio.all_tasks()]
            assert not [n for n in names if n.endswith(".watch")], names


async def test_under_another_server_a_watcher_task_reports_the_disconnect() -> None:
    # A receive the server cannot call back through (any other ASGI server): no callback is
    # armed, a watcher task waits for http.disconnect and then cancels the watched task.
    left = asyncio.Event()

    async def receive() -> dict[str, str]:
        await left.wait()
        return {"type": "http.disconnect"}

    async def work() -> None:
        await asyncio.sleep(30)

    task = asyncio.create_task(work())
    watch = DisconnectWatch(receive, task)
    await asyncio.sleep(0)
    assert not watch.gone and not task.done()
    names = [t.get_coro().__qualname__ for t in asyncio.all_tasks()]
    assert [n for n in names if n.endswith(".watch")], names
    left.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert watch.gone
    watch.stop()  # nothing left to stop: a no-op
    watch.stop()


async def test_unhealthy_worker_stops_getting_traffic_and_comes_back(sims) -> None:  # type: ignore[no-untyped-def]
    fleet = sims(2)
    interval = 0.3
    settings = settings_for(
        fleet.urls,
        routing={"policy": "round_robin"},
        probes={
            "interval_s": interval,
            "unhealthy_after": 1,
            "backoff_initial_s": 0.3,
            "backoff_max_s": 0.6,
        },
    )
    async with run_gateway(settings) as g:
        await g.wait_healthy(2)
        await sim_faults(fleet.urls[0], unhealthy=True)
        # Until the probes have seen it (2 intervals on a quiet machine; polled, not a fixed pause)
        await until(lambda: [w.name for w in g.gw.registry.healthy()] == ["w1"], 10, "w0 down")
        seen = set()
        for _ in range(6):
            r = await post(g.url + "/v1/chat/completions", {**CHAT, "max_tokens": 1})
            seen.add(r.headers["x-kvgate-worker"])
        assert seen == {"w1"}
        await sim_faults(fleet.urls[0], unhealthy=False)
        await g.wait_healthy(2, timeout=5)
        seen = set()
        for _ in range(6):
            r = await post(g.url + "/v1/chat/completions", {**CHAT, "max_tokens": 1})
            seen.add(r.headers["x-kvgate-worker"])
        assert seen == {"w0", "w1"}
        m = await g.metrics()
        assert m['kvgate_worker_up{worker="w0"}'] == 1


async def test_gateway_metrics_are_exposed(sims) -> None:  # type: ignore[no-untyped-def]
    fleet = sims(1)
    async with run_gateway(settings_for(fleet.urls)) as g:
        await g.wait_healthy(1)
        await post(g.url + "/v1/chat/completions", {**CHAT, "stream": True, "max_tokens": 3})
        await post(g.url + "/v1/chat/completions", {**CHAT, "model": "nope"})
        m = await g.metrics()
    assert m[f'kvgate_requests_total{{model="{MODEL}",status="200",worker="w0"}}'] == 1
    assert m[f'kvgate_time_to_first_token_seconds_count{{model="{MODEL}",pool="default"}}'] == 1
    assert m[f'kvgate_time_per_output_token_seconds_count{{model="{MODEL}",pool="default"}}'] == 1
    decisions = {
        k: v
        for k, v in m.items()
        if k.startswith('kvgate_routing_decisions_total{policy="kv_aware"')
    }
    assert sum(decisions.values()) == 1  # the 404 never reached routing
    assert m[f'kvgate_e2e_request_seconds_count{{model="{MODEL}"}}'] == 1
    assert m['kvgate_rejected_requests_total{reason="404"}'] == 1
    assert m['kvgate_worker_up{worker="w0"}'] == 1
    assert m['kvgate_worker_in_flight{worker="w0"}'] == 0
    assert any(k.startswith("kvgate_probe_duration_seconds_count") for k in m)


@pytest.mark.parametrize(
    "content, headers, status",
    [
        (b"{not json", {}, 400),
        (b'{"model": 5, "messages": []}', {}, 400),
        (b'{"messages": [{"role": "user", "content": "x"}]}', {}, 400),
        (b'{"model": "sim-llama", "messages": [{"role": "user", "content": "\xff\xfe"}]}', {}, 400),
        (
            b'{"model": "sim-llama", "messages": [{"role": "user", "content": "'
            + b"x" * 70000
            + b'"}]}',
            {},
            413,
        ),
    ],
)
async def test_bad_input_gets_the_envelope_and_never_reaches_a_worker(
    sims, content, headers, status
) -> None:  # type: ignore[no-untyped-def]
    fleet = sims(1)
    settings = settings_for(fleet.urls, server={"max_body_bytes": 65536})
    async with run_gateway(settings) as g:
        await g.wait_healthy(1)
        before = await worker_metrics(fleet.urls[0])
        async with httpx.AsyncClient() as c:
            r = await c.post(
                g.url + "/v1/chat/completions",
                content=content,
                headers={"content-type": "application/json", **headers},
            )
        assert r.status_code == status
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        after = await worker_metrics(fleet.urls[0])
    key = 'vllm:prompt_tokens_total{engine="0",model_name="sim-llama"}'
    assert after.get(key, 0) == before.get(key, 0)


async def test_the_request_log_says_how_long_the_walk_took_before_the_worker_had_it(
    sims, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    """`sent_ms` (head -> written to the worker) splits a slow TTFT into the gateway's share and
    the worker's; a walk held back (here: 300 ms the worker adds) shows on the worker's side,
    never the gateway's, and no share exceeds the whole."""
    fleet = sims(1)
    async with run_gateway(settings_for(fleet.urls)) as g:
        await g.wait_healthy(1)
        await sim_faults(fleet.urls[0], added_latency_ms=300)
        with caplog.at_level("INFO", logger="kvgate.request"):
            r = await post(g.url + "/v1/chat/completions", {**CHAT, "stream": True})
            assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
            await until(lambda: any(r.msg == "request" for r in caplog.records), 10, "log")
    (rec,) = [rec for rec in caplog.records if rec.msg == "request"]
    f = rec.fields  # type: ignore[attr-defined]
    assert f["sent_ms"] is not None and f["ttft_ms"] is not None
    assert 0 <= f["sent_ms"] <= f["ttft_ms"] <= f["e2e_ms"]
    assert f["ttft_ms"] - f["sent_ms"] >= 300  # the worker's delay is on the worker's side
