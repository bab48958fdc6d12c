"""commlib.testing.run: results in rank order, a rank's exception with its rank, a hard timeout."""

from __future__ import annotations

import time

import pytest

from commlib import testing


def _rank_raises(comm) -> int:
    if comm.rank == 1:
        raise KeyError("boom on one")
    return comm.rank


def _sleeps() -> None:
    time.sleep(60)


def test_reraises_with_rank_and_traceback() -> None:
    with pytest.raises(testing.RankError) as info:
        testing.run(_rank_raises, 2)
    assert info.value.rank == 1 and isinstance(info.value.exc, KeyError)
    assert "boom on one" in info.value.traceback and "_rank_raises" in info.value.traceback


def test_never_outlives_its_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(testing.RankTimeout) as info:
        testing.run(_sleeps, 2, backend=None, timeout=3)
    assert info.value.ranks == [0, 1]
    assert time.monotonic() - start < 10
