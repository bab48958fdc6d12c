"""The doctor's quantile sketch (`commlib.observe.sketch.Quantiles`): exact while small, within
half a bucket once large, and the same whether values come one at a time, a block at a time
(`extend`, how the builder feeds it) or from two sketches merged (a read on two processes)."""

from __future__ import annotations

import math
import random

import pytest

from commlib.observe.sketch import EXACT_LIMIT, GROWTH, Quantiles

QS = (0.01, 0.25, 0.5, 0.9, 0.99, 1.0)


def _values(n: int, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [0.0 if rng.random() < 0.1 else rng.lognormvariate(-6, 2) for _ in range(n)]


def _state(q: Quantiles) -> tuple[object, ...]:
    return (q.count, q.total, q.zeros, None if q._exact is None else q._exact.tolist(), q._buckets)


def _nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def test_a_small_sketch_gives_the_nearest_rank_quantile_exactly() -> None:
    values = _values(EXACT_LIMIT // 2)
    q = Quantiles()
    for v in values:
        q.add(v)
    assert q.exact
    assert q.count == len(values) and q.total == sum_in_order(values)
    for p in QS:
        assert q.quantile(p) == _nearest_rank(values, p)


def test_a_large_sketch_is_within_half_a_bucket() -> None:
    values = _values(EXACT_LIMIT * 20, seed=1)
    q = Quantiles()
    q.extend(values)
    assert not q.exact
    half_bucket = math.sqrt(GROWTH)  # a value and its bucket's middle are at most this factor apart
    for p in QS:
        want, got = _nearest_rank(values, p), q.quantile(p)
        if want == 0.0:
            assert got == 0.0
        else:
            assert want / half_bucket <= got <= want * half_bucket, (p, want, got)


@pytest.mark.parametrize("n", [0, 1, EXACT_LIMIT, EXACT_LIMIT + 200, EXACT_LIMIT * 2, EXACT_LIMIT * 3 + 7])
def test_extend_is_add_one_at_a_time(n: int) -> None:
    values = _values(n, seed=n)
    one, block = Quantiles(), Quantiles()
    for v in values:
        one.add(v)
    for start in range(0, n, 256):  # the builder's blocks (`builder.LATENCY_BLOCK`)
        block.extend(values[start : start + 256])
    assert _state(block) == _state(one)


@pytest.mark.parametrize(("left", "right"), [(10, 20), (EXACT_LIMIT, 5), (5, EXACT_LIMIT * 2), (EXACT_LIMIT * 2, EXACT_LIMIT * 3)])
def test_two_sketches_merged_give_the_quantiles_of_all_their_values(left: int, right: int) -> None:
    a_values, b_values = _values(left, seed=1), _values(right, seed=2)
    a, b, both = Quantiles(), Quantiles(), Quantiles()
    a.extend(a_values)
    b.extend(b_values)
    both.extend(a_values + b_values)
    a.merge(b)
    assert (a.count, a.zeros) == (both.count, both.zeros)
    assert a.total == pytest.approx(both.total, rel=1e-12)
    for p in QS:
        assert a.quantile(p) == both.quantile(p)


def sum_in_order(values: list[float]) -> float:
    total = 0.0
    for v in values:
        total += v
    return total
