"""The progress board's publisher: it keeps beating while its rank blocks on the store, survives
a store's hiccup, and stops (saying so in the log) only once the store is gone."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import commlib
from commlib.missing_ranks import ask_for_stacks
from commlib.observe import events
from commlib.record import board as board_mod
from commlib.record.board import HEARTBEAT_S, STALE_AFTER_S, BoardEntry, ProgressBoard
from commlib.record.files import STACKS_SIGNAL
from commlib.testing import run

PEER_LATE_S = 5.0  # longer than STALE_AFTER_S: a heartbeat that stops is called stale by then


def _late_peer(comm: commlib.Communicator) -> dict[str, Any]:
    # The check through the store alone, as on a GPU (a CPU engine's compares digests on the engine first).
    comm._consistency.via_engine = False
    comm.barrier()
    if comm.rank == 0:
        # Blocks in the consistency check's store.wait until rank 1 arrives.
        comm.all_reduce(torch.ones(2))
        return {}
    time.sleep(0.5)  # rank 0 is in the check by now
    ages = []
    until = time.monotonic() + PEER_LATE_S
    while time.monotonic() < until:
        entry = comm.board.read()[0]
        assert entry is not None, "rank 1: expected rank 0's board entry published; found none"
        ages.append((time.time_ns() - entry.heartbeat_ns) / 1e9)
        time.sleep(0.1)
    comm.all_reduce(torch.ones(2))
    return {"ages": ages}


def test_heartbeat_goes_on_while_the_rank_waits_in_the_consistency_check() -> None:
    _, late = run(_late_peer, world_size=2, timeout=120, check_consistency=True)
    ages = late["ages"]
    assert len(ages) > 10
    # A heartbeat is published every HEARTBEAT_S; a loaded 2-core machine may delay it a little.
    assert max(ages) < HEARTBEAT_S + 1.5 < STALE_AFTER_S, (
        f"expected rank 0's heartbeat to stay younger than {HEARTBEAT_S + 1.5} s while it waited in the "
        f"consistency check; found ages up to {max(ages):.2f} s")


class _FlakyStore(dist.Store):
    """A real store (a HashStore underneath) whose writes fail until `heal_at` (a monotonic time)."""

    def __init__(self, heal_at: float) -> None:
        super().__init__()
        self._inner = dist.HashStore()
        self.heal_at = heal_at
        self.failed = 0

    def set(self, key: str, value: Any) -> None:
        if time.monotonic() < self.heal_at:
            self.failed += 1
            raise RuntimeError("Connection reset by peer (the store's host is busy)")
        self._inner.set(key, value)

    def get(self, key: str) -> bytes:
        return self._inner.get(key)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)


def _events(path: Path, name: str) -> list[dict[str, Any]]:
    return [e for e in events.read_events(path) if e["event"] == name]


def _store_hiccup_and_loss(_: commlib.Communicator, logdir: str) -> dict[str, Any]:
    # (1) A store that fails for a second, then works: the board publishes again, and says what happened.
    flaky = _FlakyStore(heal_at=time.monotonic() + 1.0)
    board = ProgressBoard(flaky, 0, 1, os.getpid())
    board.started(1, "all_reduce", {"step": 4})
    give_up = time.monotonic() + 20
    while not flaky._inner.check(["board/0"]) and time.monotonic() < give_up:
        time.sleep(0.05)
    published = flaky._inner.check(["board/0"])
    entry = BoardEntry(**json.loads(flaky._inner.get("board/0"))) if published else None
    out: dict[str, Any] = {"failed": flaky.failed, "closed_after_hiccup": board.closed,
                           "published": entry is not None and entry.started_seq == 1}
    board.close()

    # (2) The store's server goes away for good: the board gives up, and says so.
    board_mod.GIVE_UP_FAILURES, board_mod.GIVE_UP_S = 5, 0.5
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, 1, is_master=False)
    lost = ProgressBoard(client, 0, 1, os.getpid())
    while not server.check(["board/0"]) and time.monotonic() < give_up:
        time.sleep(0.05)
    del server
    gc.collect()
    lost.started(1, "all_reduce", {})
    until = time.monotonic() + 20
    while not lost.closed and time.monotonic() < until:
        time.sleep(0.05)
    out["closed_when_gone"] = lost.closed
    return out


def test_publisher_survives_a_store_hiccup_and_stops_only_when_the_store_is_gone(tmp_path: Path) -> None:
    [out] = run(_store_hiccup_and_loss, world_size=1, timeout=120, args=(str(tmp_path),), log_dir=tmp_path)
    assert out["failed"] >= 3, "the store was to fail several publications"
    assert out["published"] and not out["closed_after_hiccup"], (
        f"expected the board to publish again once the store healed; found {out}")
    path = tmp_path / "rank0.jsonl"
    warned = _events(path, "board.publish_failed")
    assert warned and "Connection reset by peer" in warned[0]["error"] and warned[0]["level"] == "warning"
    # Rate-limited: one warning per WARN_EVERY_S, not one per failed publication.
    hiccup = [e for e in warned if "Connection reset" in e["error"]]
    assert len(hiccup) < out["failed"]
    assert _events(path, "board.publish_recovered")[0]["failures"] >= 3
    assert out["closed_when_gone"]
    assert [e for e in warned if e["gave_up"]], f"expected a warning that the board gave up; found {warned}"


def _board_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "commlib-board" and t.is_alive()]


def test_publisher_thread_ends_with_the_last_board() -> None:
    board = ProgressBoard(dist.HashStore(), 0, 1, os.getpid())
    assert _board_threads() == ["commlib-board"]
    board.close()
    until = time.monotonic() + 10
    while _board_threads() and time.monotonic() < until:
        time.sleep(0.02)
    assert _board_threads() == [], "expected the publisher thread to end once no board is open"
    reopened = ProgressBoard(dist.HashStore(), 0, 1, os.getpid())  # and to start again with the next one
    assert _board_threads() == ["commlib-board"]
    reopened.close()


# Registered before commlib is imported, so it runs after commlib's own exit handler (atexit is LIFO).
_EXIT_PROBE = """
import atexit, threading
atexit.register(lambda: print("alive at exit:", [t.name for t in threading.enumerate() if t.is_alive()]))
import os, torch.distributed as dist
from commlib.record.board import ProgressBoard
board = ProgressBoard(dist.HashStore(), 0, 1, os.getpid())  # left open, as a trainer that just returns does
print("alive before exit:", [t.name for t in threading.enumerate()])
"""


def test_publisher_thread_is_stopped_before_the_interpreter_finalizes() -> None:
    # A daemon thread that returns from a store call into a finalizing interpreter is ended by
    # pthread_exit, and its forced unwinding through pybind11's frames aborts a clean run (SIGABRT).
    done = subprocess.run([sys.executable, "-c", _EXIT_PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    before, at_exit = done.stdout.splitlines()[-2:]
    assert "commlib-board" in before, done.stdout
    assert "commlib-board" not in at_exit, f"expected the publisher stopped and joined at exit; found {at_exit}"


def test_stacks_are_asked_only_of_the_process_that_published_the_entry() -> None:
    # SIGUSR2 ends a process without commlib's handler: a pid reused by another process must
    # not be signalled on the strength of a dead rank's board entry.
    child = subprocess.Popen(["sleep", "30"])
    try:
        started = board_mod.process_start_time(child.pid)
        assert started, "expected /proc to give the child's start time"
        entry = BoardEntry(pid=child.pid, host=board_mod.HOST, dumps_stacks=True, started=started + 1)
        assert ask_for_stacks({1: entry}, [1]) == []  # another process's start time: not signalled
        time.sleep(0.2)
        assert child.poll() is None
        entry.started = started
        assert ask_for_stacks({1: entry}, [1]) == [1]
        assert child.wait(timeout=10) == -STACKS_SIGNAL
    finally:
        child.kill()
        child.wait()


class _CountedSets(dist.Store):
    """A HashStore underneath, counting the sets of one key."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self._inner, self.key, self.sets = dist.HashStore(), key, 0

    def set(self, key: str, value: Any) -> None:
        self.sets += key == self.key
        self._inner.set(key, value)

    def get(self, key: str) -> bytes:
        return self._inner.get(key)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)


def test_the_boards_of_a_large_job_are_published_less_often_within_the_stores_budget() -> None:
    from commlib.record.board import JOB_SETS_PER_S, PUBLISH_INTERVAL_S, publish_interval_s

    assert publish_interval_s(8, 1) == PUBLISH_INTERVAL_S == publish_interval_s(1000, 2)
    for world, boards in ((1000, 2), (4000, 2), (5000, 2)):
        # What every rank's boards ask of the job's store together, in sets a second.
        assert world * boards / publish_interval_s(world, boards) <= JOB_SETS_PER_S * 1.0001
    assert publish_interval_s(16_000, 3) == HEARTBEAT_S / 2  # never staler than that: MIN_STALE_S

    # The publisher keeps to it: rank 0 of an 8,000-rank communicator, its board changing every
    # 10 ms for 2 s, publishes every 0.2 s (about 10 times), not every 50 ms (about 40).
    store = _CountedSets("board/0")
    board = ProgressBoard(store, 0, 8000, os.getpid())
    try:
        until = time.monotonic() + 2.0
        seq = 0
        while time.monotonic() < until:
            seq += 1
            board.started(seq, "all_reduce", {})
            time.sleep(0.01)
    finally:
        board.close()
    assert 5 <= store.sets <= 16, f"expected about 10 publications in 2 s; found {store.sets}"


def test_a_board_dropped_without_close_is_let_go_while_another_publishes() -> None:
    # The publisher holds the open boards only through its pass, never across its sleep: else a
    # board it held would be open again at the next pass, and kept (with its store client) for good.
    import weakref

    kept = ProgressBoard(dist.HashStore(), 0, 1, os.getpid())
    dropped = ProgressBoard(dist.HashStore(), 0, 1, os.getpid())
    time.sleep(4 * board_mod.PUBLISH_INTERVAL_S)  # in the publisher's passes meanwhile
    ref = weakref.ref(dropped)
    del dropped
    try:
        until = time.monotonic() + 5.0
        while ref() is not None and time.monotonic() < until:
            gc.collect()
            time.sleep(0.05)
    finally:
        kept.close()
    assert ref() is None, "expected the dropped board collected within 5 s; the publisher kept it"
