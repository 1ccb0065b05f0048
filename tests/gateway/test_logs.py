"""Logging never blocks the event loop: a stuck log sink costs dropped lines, not a stuck gateway."""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest

from gateway.logs import JsonFormatter, TextFormatter, _OffLoopHandler, log_fields


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


def _writer_to_pipe(fmt: logging.Formatter) -> tuple[_OffLoopHandler, int]:
    r, w = os.pipe()
    h = _OffLoopHandler(100)
    h.writer.setStream(os.fdopen(w, "w"))
    h.writer.setFormatter(fmt)
    return h, r


@pytest.fixture
def root_with() -> Iterator[Callable[[logging.Handler], None]]:
    """Root's handlers replaced by the given ones for one test (pytest's capture included)."""
    root = logging.getLogger()
    saved, level = root.handlers[:], root.level

    def install(*handlers: logging.Handler) -> None:
        root.handlers[:] = list(handlers)
        root.setLevel(logging.INFO)

    yield install
    root.handlers[:] = saved
    root.setLevel(level)


FIELDS = {"request_id": "kvg-1", "status": 200, "ttft_ms": 1.5, "cached_tokens": None}


def test_a_request_line_reads_as_the_same_json_as_a_logged_record(root_with: Any) -> None:
    h, r = _writer_to_pipe(JsonFormatter())
    root_with(h)
    log = logging.getLogger("kvgate.test.fast")
    try:
        log_fields(log, "request", dict(FIELDS))
        log.info("request", extra={"fields": dict(FIELDS)})
        h.stop()
        fast, slow = (orjson.loads(x) for x in os.read(r, 65536).splitlines()[:2])
        assert fast.pop("ts")[:17] == slow.pop("ts")[:17]  # same minute, same shape
        assert (
            fast
            == slow
            == {
                "level": "info",
                "logger": "kvgate.test.fast",
                "msg": "request",
                **FIELDS,
            }
        )
    finally:
        os.close(r)


def test_a_request_line_takes_the_record_path_when_anything_else_listens(
    root_with: Any,
) -> None:
    """A test's capture, an operator's extra handler or a filter sees an ordinary record."""
    h, r = _writer_to_pipe(JsonFormatter())
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    root_with(h, Keep())
    log = logging.getLogger("kvgate.test.fast2")
    try:
        log_fields(log, "request", dict(FIELDS))
        assert len(seen) == 1 and seen[0].fields == FIELDS and seen[0].getMessage() == "request"
        root_with(h)
        log.addFilter(lambda rec: False)  # a filter on the way drops it, as for log.info
        log_fields(log, "request", dict(FIELDS))
        h.stop()
        assert len(os.read(r, 65536).splitlines()) == 1  # only the first line
    finally:
        os.close(r)


def test_a_request_line_under_the_text_format_is_the_record_s_text(root_with: Any) -> None:
    h, r = _writer_to_pipe(TextFormatter())
    root_with(h)
    log = logging.getLogger("kvgate.test.fast3")
    try:
        log_fields(log, "request", {"request_id": "kvg-9", "status": 200})
        h.stop()
        line = os.read(r, 65536).decode().splitlines()[0]
        assert line.endswith(" INFO kvgate.test.fast3: request request_id=kvg-9 status=200")
    finally:
        os.close(r)


def test_json_timestamps_keep_their_milliseconds_across_seconds() -> None:
    f = JsonFormatter()
    assert f._ts(1_700_000_000.25) == "2023-11-14T22:13:20.250Z"
    assert f._ts(1_700_000_000.999) == "2023-11-14T22:13:20.999Z"
    assert f._ts(1_700_000_001.0) == "2023-11-14T22:13:21.000Z"


FORGED = "2030-01-01 00:00:00,000 WARNING kvgate.gateway: admin key accepted (FORGED)"


def test_text_lines_escape_what_a_client_can_put_in_a_message_or_a_field() -> None:
    """Review: an unknown model's name holding a newline wrote a forged record into the text log
    (the 404's message quotes it). Every control character and Unicode line break is escaped, in
    the message and in the fields; a traceback still gets its own lines."""
    f = TextFormatter()
    model = "x`\n" + FORGED + "\r\x1b[2J\x85\u2028\x00"
    rec = logging.LogRecord("kvgate.gateway", logging.INFO, "", 0, "rejected %s", (model,), None)
    rec.fields = {"error": f"The model `{model}` does not exist", "status": 404}
    line = f.format(rec)
    assert len(line.splitlines()) == 1, line
    assert "\\n" + FORGED + "\\r\\x1b[2J\\x85\\u2028\\x00" in line
    assert line.count(FORGED) == 2  # the message and the field, each escaped on the one line
    try:
        raise ValueError("boom")
    except ValueError:
        err = logging.LogRecord("kvgate.x", logging.ERROR, "", 0, "a\nb", None, sys.exc_info())
    text = f.format(err)
    assert text.splitlines()[0].endswith("kvgate.x: a\\nb")
    assert "Traceback (most recent call last):" in text.splitlines()[1]
    assert text.rstrip().endswith("ValueError: boom")
