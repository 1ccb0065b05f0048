"""OpenAI-shaped errors: every refusal the gateway itself makes goes through here.

Clients (the official SDKs included) branch on `status`, `error.type` and `error.code`, and honour
`retry-after`; a bare text 500 would make them retry blindly or crash their parsers.
"""

from __future__ import annotations

import logging
import math

import orjson
from starlette.responses import Response

JSON = "application/json"

log = logging.getLogger("kvgate.gateway")


class APIError(Exception):
    """Raised anywhere in the walk; the app turns it into the envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s
        self.headers = dict(headers or {})

    def body(self) -> bytes:
        return error_body(self.message, self.type, param=self.param, code=self.code)

    def response(self, extra_headers: dict[str, str] | None = None) -> Response:
        headers = {**self.headers, **(extra_headers or {})}
        if self.retry_after_s is not None:
            headers["retry-after"] = str(max(1, math.ceil(self.retry_after_s)))
            headers["retry-after-ms"] = str(max(1, math.ceil(self.retry_after_s * 1000)))
        return Response(self.body(), self.status, headers=headers, media_type=JSON)


def error_body(
    message: str, type_: str, *, param: str | None = None, code: str | int | None = None
) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    )


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param=param)


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        "invalid_request_error",
        param="model",
        code="model_not_found",
    )


def no_capacity(message: str, retry_after_s: float = 1.0) -> APIError:
    return APIError(
        503, message, "service_unavailable", code="service_unavailable", retry_after_s=retry_after_s
    )


def internal_error() -> APIError:
    """A bug of the gateway's own, whichever path it broke: one envelope (and `code`) for
    clients to branch on, the traceback only in the log (under the request's id)."""
    return APIError(500, "internal gateway error", "internal_error", code="internal_error")


def log_internal_error(
    exc: BaseException, rid: str, client_rid: str | None, method: str, path: str
) -> dict[str, object]:
    """The one log line of a bug answered with `internal_error`: its traceback under the id the
    client was given (the walk's, Starlette's handler's or the ASGI guard's), so that a report
    quoting the id finds it. Returns the line's fields for the caller's follow-up lines."""
    fields: dict[str, object] = {"request_id": rid, "client_request_id": client_rid, "path": path}
    log.error(
        "request %s failed inside the gateway (%s %s)",
        rid,
        method,
        path,
        exc_info=exc,
        extra={"fields": fields},
    )
    return fields


def sse_error_event(message: str, type_: str = "upstream_error", code: int = 502) -> bytes:
    """The in-band error vLLM itself sends once a stream has started, then the terminator."""
    return b"data: " + error_body(message, type_, code=code) + b"\n\ndata: [DONE]\n\n"
