"""Record real vLLM wire traffic as test fixtures for the simulator's protocol tests.

Why: the simulator (workers/sim) must match vLLM byte for byte, and the only trustworthy
reference is a live server. This script starts one real vLLM (CPU build, tiny offline model,
KV events on), sends a fixed set of requests over raw sockets, and saves every response body
*exactly as received* (after HTTP/1.1 de-chunking) plus an ``index.json`` with each request,
status, ordered headers and the HTTP chunk sizes (which show how vLLM frames SSE events).
It also probes behaviours the gateway depends on (prefix-cache hits, abort on disconnect) and
captures raw KV-event ZMQ messages. Re-record with::

    python -m tests.support.vllm.record_fixtures            # re-execs itself in .build/vllm-venv
    python -m tests.support.vllm.record_fixtures --out tests/fixtures/vllm-0.32 --port 8390

The HTTP side uses only the standard library so the bytes are never normalised by a client.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "vllm-0.32"
HOST = "127.0.0.1"
MODEL = "tiny-llama"

# Deterministic prompts. LONG_TEXT is ~10 blocks of 32 tokens so a repeat shows cached_tokens.
SHORT_CHAT = [{"role": "user", "content": "Explain how a hash map works."}]
LONG_TEXT = " ".join(
    f"Section {i}: the gateway routes request {i} to the worker that holds its prefix cache."
    for i in range(20)
)
# vLLM 0.32 rejects chat text by a character bound first (17 chars/token of context): the huge
# prompt trips that check, the ~1100-token one (4k chars) only the token-count check.
TOO_LONG_TEXT = " ".join(f"word{i} token{i} value{i}" for i in range(1500))
OVER_CONTEXT_TEXT = " ".join(f"word{i} token{i} value{i}" for i in range(180))


@dataclass
class RawResponse:
    """One HTTP response as it came off the socket."""

    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes
    chunk_sizes: list[int] = field(default_factory=list)

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.lower() == name.lower():
                return v
        return None


def _read_until(sock: socket.socket, buf: bytearray, marker: bytes) -> int:
    while (idx := buf.find(marker)) < 0:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError(f"connection closed before {marker!r}")
        buf += data
    return idx


def _read_exact(sock: socket.socket, buf: bytearray, n: int) -> None:
    while len(buf) < n:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("connection closed mid-body")
        buf += data


def _send(
    sock: socket.socket,
    method: str,
    path: str,
    body: bytes | None,
    port: int,
    headers: dict[str, str] | None,
) -> None:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {HOST}:{port}", "Connection: close"]
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b""))


def _read_head(sock: socket.socket, buf: bytearray) -> tuple[int, str, list[tuple[str, str]]]:
    idx = _read_until(sock, buf, b"\r\n\r\n")
    head = bytes(buf[:idx]).decode("latin-1").split("\r\n")
    del buf[: idx + 4]
    _, status, *reason = head[0].split(" ", 2)
    headers = [(k, v.strip()) for k, v in (line.split(":", 1) for line in head[1:])]
    return int(status), (reason[0] if reason else ""), headers


def raw_request(
    port: int,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> RawResponse:
    """Send one request and return the response exactly as received (chunked decoded)."""
    with socket.create_connection((HOST, port), timeout=timeout) as sock:
        _send(sock, method, path, body, port, headers)
        buf = bytearray()
        status, reason, hdrs = _read_head(sock, buf)
        te = next((v for k, v in hdrs if k.lower() == "transfer-encoding"), "")
        clen = next((v for k, v in hdrs if k.lower() == "content-length"), None)
        chunks: list[int] = []
        out = bytearray()
        if "chunked" in te.lower():
            while True:
                idx = _read_until(sock, buf, b"\r\n")
                size = int(bytes(buf[:idx]).split(b";")[0], 16)
                del buf[: idx + 2]
                if size == 0:
                    break
                _read_exact(sock, buf, size + 2)
                out += buf[:size]
                chunks.append(size)
                del buf[: size + 2]
        elif clen is not None:
            _read_exact(sock, buf, int(clen))
            out += buf[: int(clen)]
        else:
            while data := sock.recv(65536):
                buf += data
            out += buf
        return RawResponse(status, reason, hdrs, bytes(out), chunks)


class Recorder:
    """Writes fixture files and keeps the index of what each file is."""

    def __init__(self, out: Path, port: int) -> None:
        self.out = out
        self.port = port
        self.index: dict[str, Any] = {}
        out.mkdir(parents=True, exist_ok=True)
        # Start clean so a renamed or dropped fixture never lingers; README.md is hand-written.
        for old in out.iterdir():
            if old.is_file() and old.name != "README.md":
                old.unlink()

    def record(
        self,
        name: str,
        method: str,
        path: str,
        payload: Any = None,
        *,
        raw_body: bytes | None = None,
        headers: dict[str, str] | None = None,
        note: str = "",
    ) -> RawResponse:
        """Send a request, save its body to ``name`` byte for byte, and index it."""
        if raw_body is None and payload is not None:
            raw_body = json.dumps(payload, separators=(",", ":")).encode()
        resp = raw_request(self.port, method, path, raw_body, headers)
        # Repo-relative, as the index's server args: /v1/models names the model's directory
        # (`root`), which no fixture may point at outside the repository.
        (self.out / name).write_bytes(resp.body.replace(str(REPO_ROOT).encode(), b"."))
        self.index[name] = {
            "request": {
                "method": method,
                "path": path,
                "headers": headers or {},
                "body": raw_body.decode("utf-8", errors="replace") if raw_body else None,
            },
            "status": resp.status,
            "headers": resp.headers,
            "http_chunk_sizes": resp.chunk_sizes,
            "note": note,
        }
        print(f"[record] {name}: {resp.status} {len(resp.body)} bytes", file=sys.stderr)
        return resp

    def write_json(self, name: str, data: Any) -> None:
        (self.out / name).write_text(json.dumps(data, indent=2) + "\n")


def metric_samples(text: str, name: str) -> dict[str, float]:
    """Samples of one metric as {label-string: value}; a tiny parser for the abort probe only."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, _, value = line.rpartition(" ")
            found[key[len(name) :]] = float(value)
    return found


def probe_abort(rec: Recorder) -> dict[str, Any]:
    """Start a long stream, drop the TCP connection after two events, read the counters after.

    The gateway relies on vLLM aborting a request when its client goes away (it frees KV blocks
    and a slot); this shows how that surfaces in /metrics.
    """

    def counters() -> dict[str, Any]:
        text = raw_request(rec.port, "GET", "/metrics").body.decode()
        return {
            "request_success_total": metric_samples(text, "vllm:request_success_total"),
            "num_requests_running": metric_samples(text, "vllm:num_requests_running"),
            "generation_tokens_total": metric_samples(text, "vllm:generation_tokens_total"),
        }

    before = counters()
    body = json.dumps(
        {
            "model": MODEL,
            "messages": SHORT_CHAT,
            "max_tokens": 1000,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    sock = socket.create_connection((HOST, rec.port), timeout=30)
    _send(sock, "POST", "/v1/chat/completions", body, rec.port, {"X-Request-Id": "abort-probe"})
    buf = bytearray()
    _read_head(sock, buf)
    while buf.count(b"\n\n") < 2:
        buf += sock.recv(65536)
    # RST rather than FIN, like a client that crashed or timed out.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()
    t0 = time.monotonic()
    during = counters()
    after = during
    # Wait until the engine has dropped the request, then a little longer for counters.
    while time.monotonic() - t0 < 15 and any(after["num_requests_running"].values()):
        time.sleep(0.2)
        after = counters()
    time.sleep(2.0)
    after = counters()

    def delta(metric: str, label: str = "") -> float:
        b = sum(v for k, v in before[metric].items() if label in k)
        return sum(v for k, v in after[metric].items() if label in k) - b

    return {
        "what": "chat stream max_tokens=1000, connection reset after 2 SSE events",
        "abort_counter_delta": delta("request_success_total", 'finished_reason="abort"'),
        "request_success_delta": delta("request_success_total"),
        "generation_tokens_delta": delta("generation_tokens_total"),
        "running_after": sum(after["num_requests_running"].values()),
        "settle_seconds": round(time.monotonic() - t0, 2),
        "before": before,
        "right_after_disconnect": during,
        "after": after,
    }


class KvEventTap:
    """Subscribes to the server's KV-event publisher and keeps every multipart message raw."""

    def __init__(self, port: int, replay_port: int) -> None:
        import zmq

        self._zmq = zmq
        self.port = port
        self.replay_port = replay_port
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(f"tcp://{HOST}:{port}")
        self.messages: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sub.poll(100):
                frames = self.sub.recv_multipart()
                self.messages.append({"channel": "pub", "t": time.time(), "frames": frames})

    def replay(self, start_seq: int = 0, timeout_ms: int = 3000) -> None:
        """Ask the replay endpoint for everything from ``start_seq``; record the reply frames."""
        zmq = self._zmq
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://{HOST}:{self.replay_port}")
        # A DEALER must send the empty delimiter frame the server's ROUTER expects.
        dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        while dealer.poll(timeout_ms):
            frames = dealer.recv_multipart()
            self.messages.append({"channel": "replay", "t": time.time(), "frames": frames})
            if len(frames) >= 3 and frames[2] == (-1).to_bytes(8, "big", signed=True):
                break
        dealer.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sub.close(linger=0)
        self.ctx.term()

    def save(self, out: Path) -> int:
        """Write kv_events.bin (JSON lines, base64 frames) and a decoded companion file."""
        import msgspec

        lines, decoded = [], []
        for m in self.messages:
            frames: list[bytes] = m["frames"]
            lines.append(
                json.dumps(
                    {
                        "channel": m["channel"],
                        "frames": [base64.b64encode(f).decode() for f in frames],
                    }
                )
            )
            # pub: [topic, seq, payload]; replay (DEALER): ["", topic, seq, payload]
            parts = frames[1:] if m["channel"] == "replay" else frames
            entry: dict[str, Any] = {"channel": m["channel"], "n_frames": len(frames)}
            if len(parts) == 3:
                entry["topic"] = parts[0].decode(errors="replace")
                entry["seq"] = int.from_bytes(parts[1], "big", signed=True)
                entry["payload"] = msgspec.msgpack.decode(parts[2]) if parts[2] else None
            decoded.append(entry)
        (out / "kv_events.bin").write_text("\n".join(lines) + "\n")
        (out / "kv_events.decoded.json").write_text(
            json.dumps(decoded, indent=1, default=repr) + "\n"
        )
        return len(lines)


def record_all(rec: Recorder, kv: KvEventTap | None) -> dict[str, Any]:
    """The fixed request set. Order matters only for metrics.txt (taken last)."""
    base = {"model": MODEL, "max_tokens": 6, "ignore_eos": True, "temperature": 0.0}
    usage = {"stream_options": {"include_usage": True}}
    chat = "/v1/chat/completions"
    comp = "/v1/completions"

    rec.record("health.body", "GET", "/health", note="200 with an empty body")
    rec.record("models.json", "GET", "/v1/models")
    rec.record("version.json", "GET", "/version")

    r = rec.record(
        "chat_stream_usage.sse",
        "POST",
        chat,
        base | {"messages": SHORT_CHAT, "stream": True} | usage,
    )
    rec.write_json(
        "stream_headers.json",
        {"status": r.status, "headers": r.headers, "http_chunk_sizes": r.chunk_sizes},
    )
    rec.record("chat_stream.sse", "POST", chat, base | {"messages": SHORT_CHAT, "stream": True})
    rec.record(
        "chat_stream_sampled.sse",
        "POST",
        chat,
        base | {"messages": SHORT_CHAT, "stream": True, "temperature": 1.0, "seed": 7} | usage,
        note="default sampling (random model: special tokens may give '')",
    )
    rec.record(
        "completion_stream_usage.sse",
        "POST",
        comp,
        base | {"prompt": "Explain how a hash map works.", "stream": True} | usage,
    )
    rec.record(
        "completion_stream.sse",
        "POST",
        comp,
        base | {"prompt": "Explain how a hash map works.", "stream": True},
    )
    tok = rec.record(
        "tokenize.json",
        "POST",
        "/tokenize",
        {"model": MODEL, "prompt": "Explain how a hash map works."},
    )
    ids = json.loads(tok.body)["tokens"]
    rec.record(
        "tokenize_chat.json",
        "POST",
        "/tokenize",
        {"model": MODEL, "messages": SHORT_CHAT, "add_generation_prompt": True},
    )
    rec.record("detokenize.json", "POST", "/detokenize", {"model": MODEL, "tokens": ids})
    rec.record(
        "completion_stream_token_ids.sse",
        "POST",
        comp,
        base | {"prompt": ids, "stream": True} | usage,
        note="prompt given as token ids",
    )
    rec.record("chat.json", "POST", chat, base | {"messages": SHORT_CHAT})
    rec.record("completion.json", "POST", comp, base | {"prompt": "Explain how a hash map works."})
    rec.record(
        "chat_request_id.json",
        "POST",
        chat,
        base | {"messages": SHORT_CHAT},
        headers={"X-Request-Id": "fixture-req-1"},
        note="X-Request-Id reuse",
    )

    # Prefix caching: the same long prompt twice; the second reports cached_tokens > 0.
    long_chat = [{"role": "user", "content": LONG_TEXT}]
    rec.record(
        "prefix_first.sse", "POST", chat, base | {"messages": long_chat, "stream": True} | usage
    )
    rec.record(
        "prefix_second.sse",
        "POST",
        chat,
        base | {"messages": long_chat, "stream": True} | usage,
        note="same prompt again: usage.prompt_tokens_details.cached_tokens > 0",
    )
    rec.record(
        "prefix_second_salted.json",
        "POST",
        chat,
        base | {"messages": long_chat, "cache_salt": "tenant-b"},
        note="same prompt, different cache_salt: no reuse",
    )

    rec.record(
        "completion_long_output.json",
        "POST",
        comp,
        base | {"prompt": "Explain how a hash map works.", "max_tokens": 80},
        note="80 generated tokens: KV events show BlockStored for full decode blocks too",
    )

    # Errors.
    rec.record(
        "error_unknown_model.json",
        "POST",
        chat,
        base | {"messages": SHORT_CHAT, "model": "no-such-model"},
    )
    rec.record(
        "error_unknown_model_stream.body",
        "POST",
        chat,
        base | {"messages": SHORT_CHAT, "model": "no-such-model", "stream": True},
    )
    long_msgs = [{"role": "user", "content": TOO_LONG_TEXT}]
    rec.record("error_prompt_too_long.json", "POST", chat, base | {"messages": long_msgs})
    rec.record(
        "error_prompt_too_long_stream.body",
        "POST",
        chat,
        base | {"messages": long_msgs, "stream": True} | usage,
        note="stream=true: does it fail before or inside the stream?",
    )
    over_msgs = [{"role": "user", "content": OVER_CONTEXT_TEXT}]
    rec.record(
        "error_prompt_too_long_tokens.json",
        "POST",
        chat,
        base | {"messages": over_msgs},
        note="~1100 tokens but few characters: the token-count check",
    )
    rec.record(
        "error_prompt_too_long_tokens_stream.body",
        "POST",
        chat,
        base | {"messages": over_msgs, "stream": True} | usage,
        note="token-count check with stream=true",
    )
    rec.record(
        "error_prompt_too_long_completion_stream.body",
        "POST",
        comp,
        base | {"prompt": list(range(3, 1203)), "stream": True} | usage,
    )
    rec.record(
        "error_prompt_too_long_completion.json",
        "POST",
        comp,
        base | {"prompt": list(range(3, 1203))},
        note="1200 token ids > 1024 context",
    )
    rec.record(
        "max_tokens_clamped.json",
        "POST",
        comp,
        base | {"prompt": list(range(3, 1003)), "max_tokens": 100},
        note="1000-token prompt + max_tokens 100 > 1024 context: not an error, clamped",
    )
    rec.record(
        "error_stream_options_non_stream.json",
        "POST",
        chat,
        base | {"messages": SHORT_CHAT, "stream": False} | usage,
    )
    rec.record(
        "error_invalid_json.json",
        "POST",
        chat,
        raw_body=b'{"model": "tiny-llama", ',
        note="truncated JSON body",
    )
    rec.record(
        "error_missing_model.json",
        "POST",
        chat,
        {"messages": SHORT_CHAT, "max_tokens": 6, "ignore_eos": True},
        note="no model field",
    )
    rec.record("error_missing_messages.json", "POST", chat, {"model": MODEL, "max_tokens": 6})
    rec.record("error_unknown_route.json", "GET", "/v1/nope")

    abort = probe_abort(rec)
    rec.write_json("abort_probe.json", abort)
    if kv is not None:
        time.sleep(1.0)
        kv.replay(0)
    time.sleep(1.0)  # let the engine's stats loop publish the last steps
    rec.record("metrics.txt", "GET", "/metrics", note="after all requests above")
    return abort


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description="Record vLLM 0.32 wire fixtures.")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--port", type=int, default=8390)
    parser.add_argument("--kv-events-port", type=int, default=5590)
    parser.add_argument("--no-kv-events", action="store_true")
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    try:
        import zmq  # noqa: F401
    except ImportError:
        # KV events need pyzmq/msgspec, which live in the vLLM venv: re-run there.
        from tests.support.vllm.venv import ensure_venv

        py = ensure_venv()
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
        cmd = [str(py), "-m", "tests.support.vllm.record_fixtures", *argv]
        return subprocess.run(cmd, cwd=REPO_ROOT, env=env, check=False).returncode

    from tests.support.vllm.launch import rss_bytes, start_vllm, stop, wait_healthy
    from tests.support.vllm.tiny_model import DEFAULT_OUT as MODEL_OUT
    from tests.support.vllm.tiny_model import build_tiny_model

    model_dir = build_tiny_model(args.model_dir or MODEL_OUT, args.seed)
    kv_port = None if args.no_kv_events else args.kv_events_port
    log = REPO_ROOT / ".build" / "logs" / f"record-fixtures-{args.port}.log"
    t0 = time.monotonic()
    proc = start_vllm(
        model_dir, args.port, kv_events_port=kv_port, log_path=log, python=sys.executable
    )
    try:
        startup = wait_healthy(f"http://{HOST}:{args.port}", 300, proc=proc)
        rss = rss_bytes(proc.pid)
        print(f"[record] healthy after {startup:.1f}s, RSS {rss / 2**20:.0f} MiB", file=sys.stderr)
        rec = Recorder(args.out, args.port)
        kv = KvEventTap(kv_port, kv_port + 1) if kv_port is not None else None
        time.sleep(0.5)  # SUB connect is asynchronous; do not miss the first batches
        try:
            record_all(rec, kv)
        finally:
            if kv is not None:
                kv.close()
                n = kv.save(args.out)
                print(f"[record] kv_events.bin: {n} messages", file=sys.stderr)
        import vllm

        rec.write_json(
            "index.json",
            {
                "vllm_version": vllm.__version__,
                # Repo-relative so a re-recording on another checkout gives the same index.
                "server_args": [a.replace(str(REPO_ROOT), ".") for a in proc.config.server_args()],
                "startup_seconds": round(startup, 1),
                "rss_mib_after_start": round(rss / 2**20),
                "total_seconds": round(time.monotonic() - t0, 1),
                "files": rec.index,
            },
        )
    finally:
        stop(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
