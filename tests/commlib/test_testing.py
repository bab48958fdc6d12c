"""commlib.testing.run: results in rank order, a rank's exception with its rank, a hard timeout, ranks
forked from the server while the environment allows; run_threads: the same of ranks as threads, each
logging as itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import commlib
from commlib import testing
from commlib.observe.events import read_events
from commlib.record import log

REPO = Path(__file__).resolve().parents[2]
STANDIN = REPO / "tests" / "torchcomms_standin"


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


# Run as its own script: the fork server must not have started yet, as in a fresh xdist worker.
_FIRST_CALL_UNDER_THE_STANDIN = """
import json, os, sys
sys.path.insert(0, sys.argv[2])  # this checkout's commlib, as pytest's rootdir puts it first
from commlib import testing

def torchcomms_imported():
    return "torchcomms" in sys.modules

def pythonpath_written(real):
    def write(key, *value):
        if os.fsdecode(key) == "PYTHONPATH":
            written.append([os.fsdecode(v) for v in value])
        real(key, *value)
    return write

if __name__ == "__main__":
    standin = sys.argv[1]
    os.environ["PYTHONPATH"] = standin  # what tests/commlib/conftest.py's torchcomms backend sets
    sys.path.insert(0, standin)
    written = []
    os.putenv, os.unsetenv = pythonpath_written(os.putenv), pythonpath_written(os.unsetenv)
    first = testing.run(torchcomms_imported, 1, backend=None)  # the worker's first rank
    os.putenv, os.unsetenv = os.putenv.__closure__[0].cell_contents, os.unsetenv.__closure__[0].cell_contents
    del os.environ["PYTHONPATH"]
    sys.path.remove(standin)
    print(json.dumps({"first": first, "later": testing.run(torchcomms_imported, 2, backend=None),
                      "pythonpath_writes": written}))
"""


def test_a_fork_server_started_under_a_tests_pythonpath_does_not_hand_its_imports_to_later_ranks(
    tmp_path: Path,
) -> None:
    """A worker's first call under a test's PYTHONPATH leaves the process's environment alone, and
    the ranks of later calls, under the PYTHONPATH this module was imported with, never see what
    that test put on the path."""
    # torch looks for torchcomms once, as it is imported: in the server. Started while a test had
    # the stand-in on PYTHONPATH, it imported the stand-in, and every later rank of that worker
    # found torchcomms (test_auto_falls_back_quietly_without_torchcomms failed so, once).
    script = tmp_path / "first_call.py"
    script.write_text(_FIRST_CALL_UNDER_THE_STANDIN)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, str(script), str(STANDIN), str(REPO)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["later"] == [False, False], found
    # The first call's rank had the stand-in (its caller's path); nobody else saw PYTHONPATH change.
    assert found["first"] == [True] and found["pythonpath_writes"] == [], found


def _rank_raises_in_a_thread(comm) -> int:
    if comm.rank == 1:
        raise KeyError("boom on one")
    comm.all_reduce(torch.ones(1))  # its peer left: a PeerFailure, after rank 1's error
    return comm.rank


@pytest.mark.contract
def test_threads_reraise_the_first_rank_to_fail_with_its_traceback() -> None:
    """run_threads re-raises the first rank to fail, with its traceback; no peer is left waiting."""
    start = time.monotonic()
    with pytest.raises(testing.RankError) as info:
        testing.run_threads(_rank_raises_in_a_thread, 2, timeout=30)
    assert info.value.rank == 1 and isinstance(info.value.exc, KeyError)
    assert "boom on one" in info.value.traceback
    assert "_rank_raises_in_a_thread" in info.value.traceback
    assert time.monotonic() - start < 10


def _rank1_never_comes(comm, release: threading.Event) -> None:
    if comm.rank == 1:
        release.wait(30)
        return
    comm.all_reduce(torch.ones(1))


@pytest.mark.contract
def test_threads_never_outlive_their_timeout() -> None:
    """Past its timeout, run_threads aborts the ranks still running and RankTimeout names them."""
    release = threading.Event()
    start = time.monotonic()
    try:
        with pytest.raises(testing.RankTimeout) as info:
            testing.run_threads(_rank1_never_comes, 2, timeout=1.0, args=(release,))
    finally:
        release.set()
    assert info.value.ranks == [0, 1]
    assert time.monotonic() - start < 5


def _logs_as_itself(comm) -> str:
    commlib.get_logger().info("test.mine", said=comm.rank)
    return str(log.log_dir())


@pytest.mark.contract
def test_a_thread_rank_logs_as_itself_and_leaves_the_process_log_as_it_was(tmp_path: Path) -> None:
    """Each thread rank writes its own file with its own rank; the process's log stays as it was."""
    before = (log.log_dir(), log.STATE.enabled)
    assert testing.run_threads(_logs_as_itself, 3, log_dir=tmp_path) == [str(tmp_path)] * 3
    for rank in range(3):
        mine = [e for e in read_events(tmp_path / f"rank{rank}.jsonl") if e["event"] == "test.mine"]
        assert [(e["rank"], e["said"]) for e in mine] == [(rank, rank)], mine
    assert (log.log_dir(), log.STATE.enabled) == before
