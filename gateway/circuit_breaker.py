"""The circuit breaker around the shared quota store: when to stop calling it, when to probe.

Pure state machine with an injected clock, like the rest of the quota core (`gateway.quota`); the
gateway's quota gate owns one and decides what a request gets while it is open (degraded local
limits or a fail-closed 503 with `Retry-After`).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Consecutive-failure breaker around the shared store; pure, the clock is passed in.

    closed -> open after `failure_threshold` consecutive failures; open -> half-open once
    `cooldown_s` has passed, letting ONE probe call through; the probe's success closes it, its
    failure reopens it. A probe that never reports (its task was cancelled) is replaced after
    another cooldown so the breaker cannot stick half-open. Failures reported while open (calls
    that started before it opened) do not extend the cooldown.
    """

    def __init__(
        self,
        *,
        failure_threshold: int = 3,
        cooldown_s: float = 5.0,
        on_transition: Callable[[BreakerState, BreakerState], None] | None = None,
    ) -> None:
        if failure_threshold < 1 or cooldown_s <= 0:
            raise ValueError("failure_threshold must be >= 1 and cooldown_s > 0")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self.on_transition = on_transition
        self.state = BreakerState.CLOSED
        self.failures = 0
        self._opened_at = 0.0
        self._probe_at = 0.0

    def _to(self, state: BreakerState) -> None:
        if state is not self.state:
            old, self.state = self.state, state
            if self.on_transition is not None:
                self.on_transition(old, state)

    def allow(self, now: float) -> bool:
        """Whether a call to the shared store should be attempted now."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            if now - self._opened_at < self.cooldown_s:
                return False
            self._to(BreakerState.HALF_OPEN)
            self._probe_at = now
            return True
        if now - self._probe_at >= self.cooldown_s:
            self._probe_at = now
            return True
        return False

    def retry_after_s(self, now: float) -> float:
        """Until the next probe may run (for a fail-closed 503's `Retry-After`)."""
        if self.state is BreakerState.CLOSED:
            return 0.0
        since = self._opened_at if self.state is BreakerState.OPEN else self._probe_at
        return max(0.0, self.cooldown_s - (now - since))

    def record_success(self, now: float) -> None:
        self.failures = 0
        self._to(BreakerState.CLOSED)

    def record_failure(self, now: float) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self._opened_at = now
            self._to(BreakerState.OPEN)
            return
        if self.state is BreakerState.OPEN:
            return
        self.failures += 1
        if self.failures >= self.failure_threshold:
            self._opened_at = now
            self._to(BreakerState.OPEN)
