"""Logging never blocks the event loop: a stuck log sink costs dropped lines, not a stuck gateway."""

from __future__ import annotations

import logging
import os
import threading

import orjson

from gateway.logs import JsonFormatter, _OffLoopHandler


def test_lines_are_written_by_the_writer_thread_formatted_as_json() -> None:
    r, w = os.pipe()
    h = _OffLoopHandler(100)
    try:
        h.writer.setStream(os.fdopen(w, "w"))
        h.writer.setFormatter(JsonFormatter())
        log = logging.getLogger("kvgate.test.logs")
        log.propagate = False
        log.addHandler(h)
        log.warning("request", extra={"fields": {"request_id": "kvg-1", "status": 200}})
        h.stop()  # drains the queue
        line = os.read(r, 65536).splitlines()[0]
        doc = orjson.loads(line)
        assert doc["msg"] == "request" and doc["request_id"] == "kvg-1" and doc["status"] == 200
        assert doc["logger"] == "kvgate.test.logs"
    finally:
        log.removeHandler(h)
        os.close(r)


def test_a_stuck_sink_drops_lines_instead_of_blocking_the_caller() -> None:
    r, w = os.pipe()  # nobody reads it until the end: the writer thread blocks once it is full
    h = _OffLoopHandler(50)
    log = logging.getLogger("kvgate.test.stuck")
    log.propagate = False
    log.addHandler(h)
    try:
        h.writer.setStream(os.fdopen(w, "w"))
        h.writer.setFormatter(JsonFormatter())
        done = threading.Event()

        def flood() -> None:
            for i in range(5_000):  # ~1 MB of lines: far past the pipe's 64 KiB
                log.warning("line %d %s", i, "x" * 150)
            done.set()

        t = threading.Thread(target=flood)
        t.start()
        t.join(timeout=60)
        assert done.is_set(), "logging blocked the caller"
        assert h.dropped > 0
    finally:
        log.removeHandler(h)

        def drain() -> None:
            with os.fdopen(r, "rb") as f:
                while f.read(65536):
                    pass

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        h.stop()
        h.writer.stream.close()
        reader.join(timeout=10)
