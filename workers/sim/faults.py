"""Fault injection for the simulated vLLM worker.

The gateway's retry, ejection and disconnect paths only get exercised if workers misbehave on cue,
so every simulated worker carries one mutable `Faults` record. It is set from CLI flags at start
and changed at runtime through the admin endpoints (`GET/POST /sim/faults`, `POST /sim/reset`),
which lets a test flip one worker of a running fleet into a failure mode and back.

Semantics (all off by default):

- ``error_rate`` (0..1) with ``error_status`` (default 500): that fraction of generation requests
  is answered with vLLM's error envelope and that status, before any byte of a stream.
- ``added_latency_ms``: sleep before the first byte (before the request reaches the engine), which
  looks like a slow network or an overloaded frontend rather than a slow engine.
- ``stall_after_tokens``: a stream stops sending after N content tokens and never finishes (the
  engine request is aborted, so the stall costs no KV blocks); only a client timeout ends it.
- ``close_after_tokens``: the connection is closed abruptly after N content tokens, with no final
  chunk and no ``data: [DONE]``.
- ``unhealthy``: ``GET /health`` answers 503 (generation still works, as with a wedged engine
  monitor), so health-based ejection can be tested on its own.
- ``crash``: the whole process exits at once via ``os._exit`` (all workers of the process die
  together, like a segfaulting engine); ``crash_exit_code`` is its status.
- ``crash_after_requests``: the same crash, when this worker receives its N-th generation request
  (counted since start), so a crash can land in the middle of a load test.

Token counts for stall/close count generated tokens, so a request with ``max_tokens`` below the
threshold completes normally.
"""

from __future__ import annotations

import os
import random
from dataclasses import asdict, dataclass, field, fields
from typing import Any


class FaultValidationError(ValueError):
    """A fault update that is not valid; the admin endpoint turns it into a 400."""


_ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "UnauthorizedError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    409: "ConflictError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_type_for_status(status: int) -> str:
    """vLLM's error `type` for a status; unknown ones fall back by class, like vLLM's handlers."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "BadRequestError" if status < 500 else "InternalServerError"


@dataclass(slots=True)
class Faults:
    """Current fault settings of one worker (see the module docstring for what each does)."""

    error_rate: float = 0.0
    error_status: int = 500
    added_latency_ms: float = 0.0
    stall_after_tokens: int | None = None
    close_after_tokens: int | None = None
    unhealthy: bool = False
    crash: bool = False
    crash_after_requests: int | None = None
    crash_exit_code: int = 70
    _rng: random.Random = field(default_factory=random.Random, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("_rng", None)
        return d

    def update(self, changes: dict[str, Any]) -> None:
        """Apply a partial update atomically: validate everything first, then assign.

        Half-applied fault changes would leave a test in a state it never asked for.
        """
        if not isinstance(changes, dict):
            raise FaultValidationError("body must be a JSON object")
        known = {f.name for f in fields(self) if not f.name.startswith("_")}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise FaultValidationError(f"unknown fault field(s): {', '.join(unknown)}")
        staged: dict[str, Any] = {}
        for key, value in changes.items():
            staged[key] = _validate(key, value)
        for key, value in staged.items():
            setattr(self, key, value)
        if self.crash:
            self.trigger_crash()

    def reset(self) -> None:
        for f in fields(self):
            if not f.name.startswith("_"):
                setattr(self, f.name, f.default)

    def should_error(self) -> bool:
        return self.error_rate > 0.0 and self._rng.random() < self.error_rate

    def trigger_crash(self) -> None:
        """Exit the process now, skipping cleanup, as a real engine crash would."""
        os._exit(self.crash_exit_code)


def _validate(key: str, value: Any) -> Any:
    def num(v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise FaultValidationError(f"{key} must be a number")
        return float(v)

    def opt_count(v: Any) -> int | None:
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise FaultValidationError(f"{key} must be a non-negative integer or null")
        return v

    def boolean(v: Any) -> bool:
        if not isinstance(v, bool):
            raise FaultValidationError(f"{key} must be a boolean")
        return v

    if key == "error_rate":
        rate = num(value)
        if not 0.0 <= rate <= 1.0:
            raise FaultValidationError("error_rate must be within [0, 1]")
        return rate
    if key == "error_status":
        if isinstance(value, bool) or not isinstance(value, int) or not 400 <= value <= 599:
            raise FaultValidationError("error_status must be an HTTP error status (400-599)")
        return value
    if key == "added_latency_ms":
        ms = num(value)
        if ms < 0:
            raise FaultValidationError("added_latency_ms must be >= 0")
        return ms
    if key in ("stall_after_tokens", "close_after_tokens", "crash_after_requests"):
        return opt_count(value)
    if key in ("unhealthy", "crash"):
        return boolean(value)
    if key == "crash_exit_code":
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 255:
            raise FaultValidationError("crash_exit_code must be within 0..255")
        return value
    raise FaultValidationError(f"unknown fault field: {key}")  # pragma: no cover
