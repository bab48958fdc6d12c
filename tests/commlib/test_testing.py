"""commlib.testing.run: results in rank order, a rank's exception with its rank, a hard timeout, ranks
forked from the server while the environment allows."""

from __future__ import annotations

import os
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


def _started_how() -> dict[str, object]:
    import sys

    return {"parent": os.getppid(), "rank": os.environ["RANK"],
            "vars": [os.environ.get("COMMLIB_TESTING_PROBE"), os.environ.get("TORCH_COMMLIB_TESTING_PROBE")],
            "path": sys.path[:1]}


def test_ranks_fork_from_the_server_unless_an_import_time_variable_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    # A variable nothing reads at import: ranks are the fork server's children, and see it.
    monkeypatch.setenv("COMMLIB_TESTING_PROBE", "read at run time")
    forked = testing.run(_started_how, 2, backend=None)
    assert [r["rank"] for r in forked] == ["0", "1"]
    assert all(r["parent"] != os.getpid() and r["vars"] == ["read at run time", None] for r in forked), forked
    # A package put on sys.path and PYTHONPATH (as the torchcomms stand-in is): still forked, and
    # importable there (the caller's sys.path goes with each rank).
    monkeypatch.syspath_prepend("/nonexistent/probe")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, ["/nonexistent/probe", os.environ.get("PYTHONPATH")])))
    on_path = testing.run(_started_how, 2, backend=None)
    assert all(r["parent"] != os.getpid() and r["path"] == ["/nonexistent/probe"] for r in on_path), on_path
    # One torch might read at import: fresh interpreters, children of this process.
    monkeypatch.setenv("TORCH_COMMLIB_TESTING_PROBE", "read at import")
    spawned = testing.run(_started_how, 2, backend=None)
    assert all(r["parent"] == os.getpid() and r["vars"] == ["read at run time", "read at import"]
               for r in spawned), spawned
