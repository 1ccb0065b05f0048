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
    def __init__(self) -> None:
        super().__init__()
        self._second: tuple[int, str] = (-1, "")  # the last whole second, rendered

    def _ts(self, created: float) -> str:
        """ISO 8601 UTC with milliseconds; the seconds part rendered once per second (strftime
        and gmtime were a third of a request line's formatting)."""
        sec = int(created)
        last = self._second
        if last[0] != sec:
            last = self._second = (sec, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec)))
        return f"{last[1]}.{int((created - sec) * 1000):03d}Z"

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": self._ts(record.created),
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

    def format_line(self, line: RequestLine) -> str:
        doc = {"ts": self._ts(line.created), "level": "info", "logger": line.name, "msg": line.msg}
        doc.update(line.fields)
        return orjson.dumps(doc, default=str).decode()


class RequestLine:
    """An INFO line with fields, as the event loop hands it to the writer thread: a `LogRecord`
    costs ~8 us to build (a dozen attributes, clocks, the caller's level name), this ~0.5 us; the
    writer turns it into a record only for a formatter other than JSON (`record`)."""

    __slots__ = ("created", "fields", "msg", "name")

    def __init__(self, name: str, msg: str, fields: dict[str, object]) -> None:
        self.created = time.time()
        self.name = name
        self.msg = msg
        self.fields = fields

    def record(self) -> logging.LogRecord:
        r = logging.LogRecord(self.name, logging.INFO, "", 0, self.msg, None, None)
        r.created = self.created
        r.msecs = int((self.created - int(self.created)) * 1000) + 0.0
        r.fields = self.fields
        return r


# Control characters (C0, DEL, C1) and Unicode line breaks, as escapes: one record, one line.
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0))}
_ESCAPES.update({0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r", 0x2028: "\\u2028", 0x2029: "\\u2029"})


def one_line(text: str) -> str:
    """``text`` with its control characters escaped. Messages quote what clients sent (an unknown
    model's name, a worker's error text): printed raw, a model name holding a newline wrote a
    forged record of the client's choosing into the text log (review). JSON lines escape them."""
    return text if text.isprintable() else text.translate(_ESCAPES)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        # The message only: a traceback after it (exc_text) keeps its lines.
        record.message = one_line(record.message)
        return super().formatMessage(record)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(
                f"{k}={one_line(str(v))}" for k, v in fields.items() if v is not None
            )
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
        self._buf: collections.deque[logging.LogRecord | RequestLine] = collections.deque()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvgate-log-writer", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    def handle(self, record: logging.LogRecord | RequestLine) -> bool:  # type: ignore[override]
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
        json = self.writer.formatter if isinstance(self.writer.formatter, JsonFormatter) else None
        while buf:
            record = buf.popleft()
            try:
                if isinstance(record, RequestLine):
                    if json is not None:
                        lines.append(json.format_line(record))
                        continue
                    record = record.record()
                lines.append(fmt(record))
            except Exception:
                self.writer.handleError(record)  # type: ignore[arg-type]
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


def log_fields(logger: logging.Logger, msg: str, fields: dict[str, object]) -> None:
    """``logger.info(msg, extra={"fields": fields})``, at a fraction of the event loop's cost
    when that call would only reach the off-loop handler (no handler or filter on the way, as
    `setup_logging` leaves it; a test's log capture or an operator's extra handler gets the
    ordinary record). Callers check ``logger.isEnabledFor(logging.INFO)`` first."""
    h = _only_handler(logger)
    if h is None:
        logger.info(msg, extra={"fields": fields})
    else:
        h.handle(RequestLine(logger.name, msg, fields))


def _only_handler(logger: logging.Logger) -> _OffLoopHandler | None:
    root = logging.root
    hs = root.handlers
    if len(hs) != 1 or root.filters:
        return None
    h = hs[0]
    if type(h) is not _OffLoopHandler or h.filters or h.level > logging.INFO:
        return None
    lg: logging.Logger | None = logger
    while lg is not None and lg is not root:
        if lg.handlers or lg.filters or not lg.propagate:
            return None
        lg = lg.parent
    return h


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
