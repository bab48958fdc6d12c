"""Errors name the right rank, never a live one; a caller's short wait breaks nothing.

Ranks are threads over gloo (`testing.run_threads`: the fast lane, marked `contract`), but where
a test kills a process or needs torch's default group (one per process). A SIGKILLed rank is
named by every survivor (its process is gone on this host), also by a survivor that reads the
announcement of the peer that met the broken connection first; a root waiting inside a gather
for a late rank is not blamed by a peer that left the gather and timed out in the next op (also
where that peer's timeout line comes late); a rank that aborts on purpose and leaves is named
for its abort, not as dead; a `Work.wait(timeout)` shorter than the op's deadline raises
`WaitTimeout` and leaves the op and the communicator alive.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import commlib
from commlib import communicator, testing
from commlib.engines import EngineOptions
from commlib.observe.blame import Kind
from commlib.observe.diagnosis import diagnose
from commlib.observe.verdict_from_end import verdict
from commlib.process_group import group_over_store


def _rank_killed_mid_collective(comm: commlib.Communicator, victim: int) -> dict[str, object]:
    t = torch.ones(2)
    comm.all_reduce(t)
    if comm.rank == victim:
        time.sleep(0.3)  # every survivor is blocked in all_reduce #2 by now
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        comm.all_reduce(t, timeout=30)
    except commlib.PeerFailure as exc:
        return {"elapsed": time.monotonic() - start, "failed": exc.failed_ranks, "message": str(exc)}
    except commlib.CommError as exc:
        return {"elapsed": time.monotonic() - start, "failed": None, "message": f"{type(exc).__name__}: {exc}"}
    return {"elapsed": time.monotonic() - start, "failed": None, "message": "no error"}


def test_a_killed_rank_is_the_one_every_survivor_names() -> None:
    """Every survivor of a SIGKILLed rank names that rank as gone, never a survivor."""
    for world, victim in ((3, 2), (4, 1)):
        results = testing.run(_rank_killed_mid_collective, world, backend="gloo", allow_dead_ranks=True,
                              args=(victim,), timeout=90)
        assert results[victim] is None
        for rank, r in enumerate(results):
            if rank == victim:
                continue
            assert r["failed"] == [victim], (world, rank, r)  # never a survivor, never "some peer"
            assert f"found rank {victim} gone" in r["message"], r
            assert r["elapsed"] < 5.0, r


def _root_waits_in_gather(comm: commlib.Communicator, done: threading.Barrier) -> dict[str, object]:
    t = torch.full((2,), float(comm.rank))
    comm.all_reduce(t)
    if comm.rank == 2:
        done.wait(30)  # late for the gather, until its peers are done
        return {}
    outputs = [torch.empty(2) for _ in range(3)] if comm.rank == 0 else None
    try:
        comm.gather(outputs, t, root=0, timeout=8.0)
        if comm.rank == 1:  # done with its part of the gather; the root is still in it
            comm.broadcast(t, root=0, timeout=1.5)
    except commlib.CollectiveTimeout as exc:
        return {"missing": exc.missing_ranks, "message": str(exc)}
    except commlib.CommError as exc:
        return {"missing": None, "message": f"{type(exc).__name__}: {exc}"}
    finally:
        done.wait(30)
    return {"missing": None, "message": "no error"}


@pytest.mark.contract
@pytest.mark.parametrize("slow_timeout_line", [False, True], ids=["", "timeout-line-late"])
def test_a_root_waiting_in_a_gather_is_not_blamed_for_the_next_op(
    tmp_path: Path, slow_timeout_line: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A root waiting in a gather for a late rank is not blamed by a peer that timed out in the
    next op. Also where that peer's timeout line comes late: the root's gather, ended by that
    rank's abort, must not end before the line (the doctor takes where every rank was there)."""
    if slow_timeout_line:
        # A loaded host: rank 1's timeout line is written a second after its deadline expired.
        fields = communicator._error_fields

        def late(error: commlib.CommError) -> dict[str, object]:
            if error.rank == 1:
                time.sleep(1.0)
            return fields(error)

        monkeypatch.setattr(communicator, "_error_fields", late)
    done = threading.Barrier(3)
    _, r1, _ = testing.run_threads(_root_waits_in_gather, 3, log_dir=tmp_path, args=(done,))
    # The doctor, reading the logs, blames the same rank and says why rank 0 is not one.
    timeouts = [p for p in diagnose(tmp_path).final.problems if p.kind is Kind.TIMEOUT]
    assert [(p.seq, p.ranks, p.details["waiting"]) for p in timeouts] == [(3, [2], [0])], timeouts
    assert "rank 0 was still in gather #2, waiting for rank 2" in timeouts[0].message
    assert r1["missing"] == [2], r1
    assert "broadcast #3 on 'world' timed out" in r1["message"], r1
    assert "rank 0 has not started it: it is still in gather #2, waiting for rank 2" in r1["message"], r1
    assert "rank 2 never started it (last reported finishing all_reduce #1" in r1["message"], r1


def _abort_and_leave(comm: commlib.Communicator, slow_abort_line: bool = False) -> dict[str, object]:
    t = torch.ones(2)
    comm.all_reduce(t)
    if comm.rank == 0:
        if slow_abort_line:  # a loaded host: rank 0's comm.abort line is written a second late
            warning = comm._log.warning

            def late(event: str, **fields: object) -> None:
                if event == "comm.abort":
                    time.sleep(1.0)
                warning(event, **fields)

            comm._log.warning = late
        time.sleep(0.5)  # rank 1 is in all_reduce #2 by now
        comm.abort("the operator stopped it")
        return {}  # and the process ends
    try:
        comm.all_reduce(t, timeout=20)
    except commlib.PeerFailure as exc:
        return {"failed": exc.failed_ranks}
    return {"failed": None}


@pytest.mark.contract
@pytest.mark.parametrize("slow_abort_line", [False, True], ids=["", "abort-line-late"])
def test_a_rank_that_aborted_on_purpose_and_left_is_named_for_its_abort_not_as_dead(
    tmp_path: Path, slow_abort_line: bool
) -> None:
    """A rank that aborted on purpose and left is named for its abort, not as dead. Also where
    its comm.abort line comes late: no peer may log the abort's consequence first."""
    _, r1 = testing.run_threads(_abort_and_leave, 2, log_dir=tmp_path, args=(slow_abort_line,))
    assert r1["failed"] == [0], r1
    for final in (diagnose(tmp_path).final, verdict(tmp_path).final):
        assert final is not None and final.culprits == [0], final
        kinds = [p.kind for p in final.problems]
        assert Kind.DEAD_RANK not in kinds, final.problems
        [failure] = [p for p in final.problems if p.kind is Kind.PEER_FAILURE]
        assert "rank 0 had aborted communicator 'world' on purpose (the operator stopped it)" in failure.message, failure


def _short_wait(store: dist.Store, rank: int, size: int) -> dict[str, object]:
    group = group_over_store(store, rank, size, 300.0, "world", EngineOptions(engine="gloo"))
    comm = group.communicator()
    t = torch.full((4,), float(comm.rank + 1))
    if comm.rank == 1:
        time.sleep(1.5)
        comm.all_reduce(t)
        p = torch.ones(2)
        time.sleep(1.0)
        dist.all_reduce(p, group=group)
        comm.finalize()
        return {"value": t.tolist(), "pg": p.tolist()}
    work = comm.all_reduce(t, async_op=True, timeout=20.0)
    start = time.monotonic()
    try:
        work.wait(timeout=0.5)
        short = None
    except commlib.WaitTimeout as exc:
        short = {"elapsed": time.monotonic() - start, "message": str(exc), "waited": exc.waited,
                 "deadline": exc.deadline}
    work.wait()  # the op went on: this wait picks it up
    # The same through torch.distributed's Work over the commlib backend (c10d says timedelta).
    p = torch.ones(2)
    pg_work = dist.all_reduce(p, group=group, async_op=True)
    try:
        pg_work.wait(timedelta(seconds=0.3))
        pg_short = None
    except commlib.WaitTimeout:
        pg_short = "WaitTimeout"
    pg_work.wait()
    out = {"short": short, "value": t.tolist(), "broken": comm.broken, "pg_short": pg_short,
           "pg": p.tolist()}
    comm.finalize()
    return out


@pytest.mark.contract
def test_a_wait_shorter_than_the_deadline_leaves_the_op_and_the_communicator_alive() -> None:
    """A wait shorter than the deadline raises WaitTimeout (a c10d Work's too); nothing breaks."""
    r0, r1 = testing.run_threads(_short_wait, 2, backend=None, timeout=60)
    short = r0["short"]
    assert short is not None and 0.45 <= short["elapsed"] < 1.2, r0
    assert (short["waited"], short["deadline"]) == (0.5, 20.0)
    assert "still running" in short["message"] and "wait again" in short["message"]
    assert r0["value"] == r1["value"] == [3.0] * 4  # the op completed, on both ranks
    assert not r0["broken"]  # and the peer saw nothing wrong either (it returned its values)
    assert r0["pg_short"] == "WaitTimeout" and r0["pg"] == r1["pg"] == [2.0, 2.0]


def _subgroup_member_absent(comm: commlib.Communicator) -> dict[str, object]:
    group = dist.new_group([1, 2])  # global ranks 1 and 2: their group ranks are 0 and 1
    if comm.rank != 1:
        time.sleep(3.0)  # rank 2 never joins the subgroup's collective; rank 0 is not in it
        return {}
    sub = commlib.current(group)
    try:
        sub.all_reduce(torch.ones(2), timeout=1.5)
    except commlib.CollectiveTimeout as exc:
        return {"missing": exc.missing_ranks, "rank": exc.rank, "message": str(exc)}
    return {"missing": None}


def test_a_subgroups_error_names_global_ranks() -> None:
    """A timeout on a torch subgroup (`dist.new_group`) names global ranks, and group ranks."""
    _, r1, _ = testing.run(_subgroup_member_absent, 3, backend="gloo", timeout=60)
    assert r1["missing"] == [2] and r1["rank"] == 1, r1
    assert "timed out after 1.5 s on rank 1 (rank 0 of 'group1')" in r1["message"], r1
    assert "rank 2 (rank 1 of 'group1') never started it" in r1["message"], r1


@pytest.mark.contract
def test_a_rank_frozen_inside_a_collective_is_named_under_a_short_deadline() -> None:
    """A rank whose heartbeat is older than half a short deadline is named as stopped."""
    # Rank 1 started #5 and stopped (SIGSTOP) at once: at rank 0's 2 s deadline its heartbeat is
    # 2 s old, under the 3 s an idle board may take, but past half the deadline.
    from commlib.members import Members
    from commlib.missing_ranks import explain_timeout
    from commlib.record.board import BoardEntry

    now = 100 * 10**9
    frozen = BoardEntry(started_seq=5, started_op="all_reduce", finished_seq=4, finished_op="all_reduce",
                        heartbeat_ns=now - 2 * 10**9)
    live = BoardEntry(started_seq=5, started_op="all_reduce", finished_seq=4, heartbeat_ns=now)
    said = explain_timeout("all_reduce", 5, Members.of("world", 3), 0, 2.0, 2.0, {0: live, 1: frozen, 2: live}, now)
    assert said.stale_ranks == [1] and said.missing_ranks == [], said
    assert "rank 1 started it but has sent no heartbeat for 2.0 s: possibly dead or stopped" in said.message, said


@pytest.mark.contract
def test_a_send_to_a_peer_that_finished_no_collective_says_so() -> None:
    """A send's timeout says the peer finished no collective yet (not "None")."""
    from commlib.members import Members
    from commlib.ops import Collective, OpName
    from commlib.record.board import BoardEntry
    from commlib.failure_reports import _explain_p2p_timeout

    call = Collective(OpName.SEND, "world", 0, 2, False, 5.0, 1, tensor=torch.ones(1), peer=1)
    message, named, _ = _explain_p2p_timeout(call, Members.of("world", 2), 5.0, {1: BoardEntry(heartbeat_ns=0)})
    assert named == [1] and "rank 1 has finished no collective yet" in message and "None" not in message, message


@pytest.mark.contract
def test_a_thousand_ranks_behind_are_said_in_a_line_as_ranges() -> None:
    """A thousand ranks behind are named in groups, as ranges, in one line."""
    # Rank 0 timed out in #5 of a 1,000-rank world. Rank 637 never started #4; every other rank
    # waits in #4 for it, ranks 10-13 having stopped beating meanwhile; rank 999 never published.
    from commlib.members import Members
    from commlib.missing_ranks import explain_timeout
    from commlib.record.board import BoardEntry

    now = 100 * 10**9
    def entry(started: int, beat_s_ago: float = 0.0) -> BoardEntry:
        return BoardEntry(started_seq=started, started_op="all_reduce", finished_seq=3, finished_op="all_reduce",
                          step=7, phase="backward", heartbeat_ns=now - int(beat_s_ago * 1e9))
    entries: dict[int, BoardEntry | None] = {r: entry(4, 10.0 if 10 <= r <= 13 else 0.0) for r in range(1, 999)}
    entries[637] = entry(3)
    entries[0] = BoardEntry(started_seq=5, finished_seq=4, heartbeat_ns=now)
    entries[999] = None
    said = explain_timeout("all_reduce", 5, Members.of("world", 1000), 0, 300.0, 300.0, entries, now)
    assert said.missing_ranks == [637, 999], said.missing_ranks
    assert said.stale_ranks == [10, 11, 12, 13, 999]
    assert said.message == (
        "all_reduce #5 on 'world' timed out after 300.0 s on rank 0: ranks 1-636, 638-998 have not started it: "
        "they are still in all_reduce #4, waiting for ranks 637, 999, which have not started that (rank 1, for one: "
        "last reported finishing all_reduce #3, at step 7, phase backward); of them, ranks 10-13 sent no heartbeat "
        "for over 3 s: possibly dead or stopped; rank 637 never started it (last reported finishing all_reduce #3, "
        "at step 7, phase backward); rank 999 never published progress (possibly dead)"
    ), said.message
