"""Percentiles over a sliding window, in bounded memory: the p95s the autoscaling formula reads.

A module of its own because it is a data structure, not a policy: ``DesiredWorkers``
(gateway/desired_workers.py) keeps two per model (TTFT, admission wait) and knows nothing of
their buckets.

``WindowQuantile`` keeps one small log-bucketed histogram per ``slot_s`` (1 s) of the window
(DDSketch-style buckets: a value is reported as its bucket's midpoint, within ``rel_err`` = 1 %
of the true order statistic). Memory is bounded by ``slots x buckets`` (60 x ~1,150 at worst, a
few hundred entries in practice) whatever the request rate; observing is O(1); a percentile
merges the slots at scrape time. A fixed-size reservoir was the alternative: its memory is
smaller but its p95 error is random and grows as traffic rises (fewer of the window's samples
kept), and it cannot drop expired samples without keeping their timestamps. The window is exact
to one slot: a sample counts while ``floor(now/slot) - floor(t/slot) < window_s/slot``.
"""

from __future__ import annotations

import math
from collections import deque

__all__ = ["WindowQuantile"]


class WindowQuantile:
    """Quantiles of the samples of the last ``window_s`` seconds (module docstring).

    Buckets follow DDSketch: ``v`` in ``(g**(i-1), g**i]`` goes to bucket ``i`` and is reported
    as ``2 g**i / (g + 1)``, within ``rel_err`` of ``v``. Values at or below ``min_value`` share
    one bucket reported as 0.0 (a fast-path queue wait is 0, and sub-0.1 ms differences do not
    matter to an autoscaler); values above ``max_value`` are clamped, which bounds the bucket
    count and so the memory.
    """

    __slots__ = (
        "_gamma",
        "_ln_gamma",
        "_max_i",
        "_min_i",
        "_min_value",
        "_slots",
        "slot_s",
        "window_s",
    )

    def __init__(
        self,
        window_s: float = 60.0,
        slot_s: float = 1.0,
        rel_err: float = 0.01,
        min_value: float = 1e-4,
        max_value: float = 1e5,
    ) -> None:
        if not 0 < rel_err < 1:
            raise ValueError("rel_err must be in (0, 1)")
        self.window_s = window_s
        self.slot_s = slot_s
        self._gamma = (1 + rel_err) / (1 - rel_err)
        self._ln_gamma = math.log(self._gamma)
        self._min_value = min_value
        self._min_i = math.ceil(math.log(min_value) / self._ln_gamma)
        self._max_i = math.ceil(math.log(max_value) / self._ln_gamma)
        # (slot index, {bucket: count}), oldest first; slots without samples are not stored.
        self._slots: deque[tuple[int, dict[int, int]]] = deque()

    @property
    def n_slots(self) -> int:
        return max(1, math.ceil(self.window_s / self.slot_s - 1e-9))

    def _bucket(self, v: float) -> int:
        if v <= self._min_value:
            return self._min_i - 1  # the "zero" bucket, below every other
        return min(math.ceil(math.log(v) / self._ln_gamma), self._max_i)

    def _value(self, i: int) -> float:
        if i < self._min_i:
            return 0.0
        return 2 * self._gamma**i / (self._gamma + 1)

    def observe(self, v: float, now: float) -> None:
        if not math.isfinite(v):
            return
        slot = math.floor(now / self.slot_s)
        s = self._slots
        if s and s[-1][0] == slot:  # the common case (per request): nothing can expire
            counts = s[-1][1]
            b = self._bucket(max(v, 0.0))
            counts[b] = counts.get(b, 0) + 1
            return
        newest = max(slot, s[-1][0]) if s else slot
        self._expire(newest)
        if newest - slot >= self.n_slots:
            return  # already outside the window
        counts = self._slot(slot)
        b = self._bucket(max(v, 0.0))
        counts[b] = counts.get(b, 0) + 1

    def _slot(self, slot: int) -> dict[int, int]:
        s = self._slots
        if not s or slot > s[-1][0]:
            counts: dict[int, int] = {}
            s.append((slot, counts))
            return counts
        # Out of order (a caller's clock read earlier): rare, so a linear search is fine.
        for idx in range(len(s) - 1, -1, -1):
            k, counts = s[idx]
            if k == slot:
                return counts
            if k < slot:
                counts = {}
                s.insert(idx + 1, (slot, counts))
                return counts
        counts = {}
        s.appendleft((slot, counts))
        return counts

    def _expire(self, slot: int) -> None:
        oldest = slot - self.n_slots + 1
        s = self._slots
        while s and s[0][0] < oldest:
            s.popleft()

    def _merged(self, now: float, since: float | None) -> tuple[int, list[tuple[int, int]]]:
        slot = math.floor(now / self.slot_s)
        self._expire(slot)
        first = -math.inf if since is None else math.floor(since / self.slot_s)
        total: dict[int, int] = {}
        for k, counts in self._slots:
            if first <= k <= slot:
                for b, n in counts.items():
                    total[b] = total.get(b, 0) + n
        return sum(total.values()), sorted(total.items())

    def count(self, now: float, since: float | None = None) -> int:
        """Samples in the window (from the slot of ``since`` on, when given)."""
        return self._merged(now, since)[0]

    def quantile(self, q: float, now: float, since: float | None = None) -> float | None:
        """The nearest-rank ``q`` quantile (the ``ceil(q*n)``-th smallest), None when empty."""
        return self.summary(q, now, since)[1]

    def summary(self, q: float, now: float, since: float | None = None) -> tuple[int, float | None]:
        """(sample count, ``q`` quantile) from one merge of the slots."""
        n, buckets = self._merged(now, since)
        if n == 0:
            return 0, None
        rank = max(1, math.ceil(q * n - 1e-9))
        seen = 0
        for b, c in buckets:
            seen += c
            if seen >= rank:
                return n, self._value(b)
        return n, self._value(buckets[-1][0])  # unreachable: seen ends at n >= rank
