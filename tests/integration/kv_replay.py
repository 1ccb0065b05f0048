"""Fetch a vLLM server's buffered KV events from its replay endpoint and print them as JSON.

Runs under the vLLM virtualenv's interpreter (which has pyzmq and msgspec; kvgate's own
environment does not need them yet), as `python kv_replay.py PORT [START_SEQ]`. The replay
endpoint is used rather than the PUB socket because it is deterministic: a SUB socket misses
whatever was published before it connected, the replay buffer does not.

Protocol (vLLM 0.32, see tests/fixtures/vllm-0.32/README.md): a DEALER sends
`[b"", start_seq as 8-byte big-endian]`, receives `[b"", topic, seq, msgpack payload]` per
buffered batch, and `[b"", b"", seq=-1, b""]` at the end.
"""

from __future__ import annotations

import json
import sys

import msgspec
import zmq

END = (-1).to_bytes(8, "big", signed=True)


def fetch(port: int, start_seq: int = 0, timeout_ms: int = 5000) -> list[dict[str, object]]:
    """Events replayed from `start_seq`, each a map with `seq` added, in publication order."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
    events: list[dict[str, object]] = []
    try:
        while True:
            if not sock.poll(timeout_ms):
                raise TimeoutError(f"no replay end marker from port {port} in {timeout_ms} ms")
            frames = sock.recv_multipart()
            if len(frames) >= 3 and frames[2] == END:
                return events
            _, _topic, seq, payload = frames
            _ts, batch, _rank = msgspec.msgpack.decode(payload)
            for ev in batch:
                if isinstance(ev, dict):  # 0.32: maps tagged by "type"
                    events.append({**ev, "seq": int.from_bytes(seq, "big", signed=True)})
                else:  # 0.11: positional arrays, type first
                    events.append({"type": ev[0], "raw": ev[1:]})
    finally:
        sock.close(linger=0)
        ctx.term()


if __name__ == "__main__":
    start = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    print(json.dumps(fetch(int(sys.argv[1]), start)))
