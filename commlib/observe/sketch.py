"""A quantile sketch of non-negative durations in bounded memory: the doctor's statistics of any log size.

Exact up to `EXACT_LIMIT` values (kept as an array of doubles); past that, a histogram with
logarithmic buckets, each `GROWTH` times wider than the one below it, so a quantile is off by
at most half a bucket: 0.5 % of its value. Zeros (a rank that was not the last to arrive
waited for nobody) are counted apart, exactly. Quantiles are nearest-rank, as over a sorted
list of every value.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Sequence

EXACT_LIMIT = 1024
GROWTH = 1.01
_LOG_GROWTH = math.log(GROWTH)


class Quantiles:
    """Count, sum and nearest-rank quantiles of the values added (every value >= 0)."""

    __slots__ = ("count", "total", "zeros", "_exact", "_buckets")

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.zeros = 0
        self._exact: array | None = array("d")  # None once past EXACT_LIMIT
        self._buckets: dict[int, int] = {}

    @property
    def exact(self) -> bool:
        return self._exact is not None

    def add(self, value: float) -> None:
        self.extend((value,))

    def extend(self, values: Sequence[float]) -> None:
        """`add` each of `values`, in their order (a block at a time: the builder's latencies)."""
        total = self.total
        for value in values:
            total += value  # one at a time, in order: a float sum depends on its order
        self.total = total
        self.count += len(values)
        positive = [value for value in values if not value <= 0.0]
        self.zeros += len(values) - len(positive)
        exact = self._exact
        if exact is None:
            self._count_in_buckets(positive)
            return
        exact.extend(positive)
        if len(exact) > EXACT_LIMIT:
            self._to_buckets()

    def add_zeros(self, n: int) -> None:
        self.count += n
        self.zeros += n

    def merge(self, other: Quantiles) -> None:
        self.add_zeros(other.zeros)
        if other._exact is not None:
            self.extend(other._exact.tolist())
            return
        self.count += other.count - other.zeros
        self.total += other.total
        if self._exact is not None:
            self._to_buckets()
        for key, n in other._buckets.items():
            self._buckets[key] = self._buckets.get(key, 0) + n

    def _to_buckets(self) -> None:
        assert self._exact is not None
        values, self._exact = self._exact, None
        self._count_in_buckets(values)

    def _count_in_buckets(self, values: Iterable[float]) -> None:
        """Each of `values` (every one > 0) counted in its logarithmic bucket."""
        buckets, log, floor = self._buckets, math.log, math.floor
        for value in values:
            key = floor(log(value) / _LOG_GROWTH)
            buckets[key] = buckets.get(key, 0) + 1

    def quantile(self, q: float) -> float:
        """The nearest-rank q-quantile (0 < q <= 1); 0.0 when nothing was added."""
        if self.count == 0:
            return 0.0
        index = max(0, math.ceil(q * self.count) - 1)  # in the sorted list of every value
        if index < self.zeros:
            return 0.0
        index -= self.zeros
        if self._exact is not None:
            return sorted(self._exact)[index]
        for key in sorted(self._buckets):
            index -= self._buckets[key]
            if index < 0:
                return GROWTH ** (key + 0.5)  # the bucket's middle: within half a bucket of the value
        raise AssertionError("quantile past the last bucket")
