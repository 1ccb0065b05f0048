"""Structured logging: one JSON object per line, so request lines can be shipped and queried.

Nothing is written on the event loop. Formatting and writing a request line cost ~14% of a
gateway core (py-spy under closed-loop load: `StreamHandler.emit` was the largest single frame),
and a write to stderr blocks when its reader is slow (a pipe, a terminal, a log shipper): every
stream on the process would stall behind it. The loop only queues the record (bounded: past
`QUEUE_MAX` lines waiting, lines are dropped and counted in kvgate_log_lines_dropped_total, never
waited for); a thread formats and writes them in batches.
"""

from __future__ import annotations

import atexit
import collections
import logging
import sys
import threading
import time

import orjson

QUEUE_MAX = 10_000  # lines waiting for the writer thread before new ones are dropped


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if fields:
            doc.update(fields)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(doc, default=str).decode()


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
        return line


class _OffLoopHandler(logging.Handler):
    """Queues records for a writer thread that formats and writes them in batches.

    The loop thread does one deque append per line: no lock, no thread wake-up (waking a writer
    per line, as `QueueHandler` does, cost ~9% of the loop thread in GIL handoffs); the writer
    wakes every `interval_s`, so lines reach the sink within that."""

    def __init__(self, max_lines: int = QUEUE_MAX, interval_s: float = 0.05) -> None:
        super().__init__()
        self.max_lines = max_lines
        self.interval_s = interval_s
        self.dropped = 0
        self.writer = logging.StreamHandler(sys.stderr)  # holds the formatter and the stream
        self._buf: collections.deque[logging.LogRecord] = collections.deque()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvgate-log-writer", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    def handle(self, record: logging.LogRecord) -> bool:
        if len(self._buf) >= self.max_lines:
            self.dropped += 1  # a stuck log sink must not become a stuck (or bloated) gateway
        else:
            self._buf.append(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        self.handle(record)

    def _run(self) -> None:
        while not self._stopping.wait(self.interval_s):
            self._write()
        self._write()

    def _write(self) -> None:
        buf, fmt, lines = self._buf, self.writer.format, []
        while buf:
            record = buf.popleft()
            try:
                lines.append(fmt(record))
            except Exception:
                self.writer.handleError(record)
        if lines:
            stream = self.writer.stream
            try:
                stream.write("\n".join(lines) + "\n")
                stream.flush()
            except Exception:
                self.dropped += len(lines)

    def stop(self) -> None:
        """Write what is queued, then end the writer thread (at exit; idempotent)."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


def log_handler() -> _OffLoopHandler | None:
    """The handler `setup_logging` installed (its `dropped` count), if any."""
    return next((h for h in logging.getLogger().handlers if isinstance(h, _OffLoopHandler)), None)


def setup_logging(level: str = "info", fmt: str = "json") -> None:
    # Neither formatter prints the caller's file/line, thread or process, so records need not
    # collect them: skipping the stack walk (the logging HOWTO's `_srcfile = None`) and the
    # lookups took a request line from 9.3 to 6.0 us on the event loop.
    logging._srcfile = None  # type: ignore[attr-defined]
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    root = logging.getLogger()
    handler = log_handler()
    if handler is None:
        handler = _OffLoopHandler()
        root.addHandler(handler)
    handler.writer.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root.setLevel(level.upper())
    # Uvicorn's access log duplicates our request line; probe and file-watch chatter is noise.
    logging.getLogger("uvicorn.access").disabled = True
    for noisy in ("httpx", "httpcore", "watchfiles"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
