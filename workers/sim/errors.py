"""vLLM's error envelope, and the errors the simulated worker raises on the way to it.

Clients (and the gateway's retry logic) branch on the envelope's `type` and `param`, which vLLM
fills differently for request-schema failures and for its own validation errors, so each kind has
its own constructor here. `AbruptClose` is no HTTP error: it lets a stream make uvicorn drop the
connection mid-body, as a dying worker would, and uvicorn's log is told to keep quiet about it
because an injected fault is not a simulator bug.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson

from workers.sim.faults import error_type_for_status

__all__ = ["AbruptClose", "HTTPError", "error_body", "invalid", "schema_error"]


class HTTPError(Exception):
    """An OpenAI/vLLM-style error that becomes `{"error": {...}}` with `status` as HTTP code."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        err_type: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type or error_type_for_status(status)
        self.param = param

    def body(self) -> bytes:
        return error_body(self.message, self.err_type, self.param, self.status)


def error_body(message: str, err_type: str, param: str | None, code: int) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": err_type, "param": param, "code": code}}
    )


def schema_error(loc: str, msg: str, etype: str = "value_error", given: Any = None) -> HTTPError:
    """A request-schema failure, shaped like vLLM's FastAPI validation handler's.

    vLLM reports these with type "Bad Request" and the pydantic location as `param`, unlike the
    errors its serving code raises ("BadRequestError"); clients that branch on `type` see both.
    """
    if isinstance(given, dict):
        shown = f"<dict of {len(given)} items>"
    elif isinstance(given, list):
        shown = f"<list of {len(given)} items>"
    else:
        shown = repr(given)
    message = (
        f"1 validation error:\n  {{'type': '{etype}', 'loc': '{loc}', 'msg': '{msg}', "
        f"'input': '{shown}'}}"
    )
    return HTTPError(message, 400, "Bad Request", param=loc)


def invalid(message: str, param: str | None = None, value: Any = None) -> HTTPError:
    """A semantic 400 (vLLM's VLLMValidationError): the message names the parameter."""
    if param is not None:
        suffix = f"parameter={param}" if value is None else f"parameter={param}, value={value}"
        message = f"{message} ({suffix})"
    return HTTPError(message, 400, "BadRequestError", param=param)


class AbruptClose(Exception):
    """Raised by a stream to make uvicorn drop the connection mid-body (close_after_tokens)."""


class _DropAbruptCloseLog(logging.Filter):
    """uvicorn logs every exception that ends a response; an injected close is not an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, AbruptClose)


_uvicorn_error_log = logging.getLogger("uvicorn.error")
if not any(isinstance(f, _DropAbruptCloseLog) for f in _uvicorn_error_log.filters):
    _uvicorn_error_log.addFilter(_DropAbruptCloseLog())
