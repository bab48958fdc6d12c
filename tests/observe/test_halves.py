"""The full read on two processes (`commlib.observe.halves`): the same model as one pass, every
line counted once, and nothing left running whatever happens to either half."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from commlib.observe import halves
from commlib.observe.doctor import analyze
from commlib.observe.events import rank_segments
from commlib.observe.model import load
from commlib.observe.reading import read
from commlib.observe.records import MixedJobsError
from doctor_logs import Job, assert_same


def _job(directory: Path) -> Job:
    """Three ranks: collectives on two communicators, a send/recv pair, odd lines (a field of a
    type commlib never writes, a garbled line), rank 1 killed mid-line and restarted into
    attempt 1, and there a deadline that expires on an odd seq and one on an even seq."""
    job = Job(directory, size=3)
    for rank in range(3):
        job.start(rank, "node0", 100 + rank)
        job.comm(rank)
        job.comm(rank, "pair", comm_rank=rank % 2, size=2) if rank < 2 else None
    for seq in range(1, 8):
        for rank in range(3):
            job.collective(rank, seq, step=seq // 2, phase="forward" if seq % 2 else "backward")
    for seq, (op, rank) in enumerate((("send", 0), ("recv", 1), ("send", 1), ("recv", 0)), start=1):
        fields = {"comm": "pair", "comm_rank": rank, "comm_size": 2, "op": op, "seq": (seq + 1) // 2,
                  "peer": 1 - rank}
        job.event(rank, "collective.start", shapes=[[2]], dtype="torch.float32", bytes=8, root=None,
                  deadline_s=30.0, async_op=False, **fields)
        job.event(rank, "collective.end", bytes=8, duration_s=0.002, status="ok", **fields)
    job.append(0, json.dumps({"event": "collective.end", "comm": "world", "op": "all_reduce", "seq": 9, "pid": 100,
                              "rank": 0, "attempt": 0, "ts_ns": job.tick(), "duration_s": "slow"}) + "\n")
    job.append(2, "not a line of commlib's\n")
    job.append(1, '{"op":"all_reduce","seq":8,"shapes":[[4]],"dtype":"torch.fl')  # killed mid-write
    for rank in range(3):
        job.start(rank, "node0", 200 + rank, attempt=1)
        job.comm(rank)
    for seq in (1, 2):
        for rank in (0, 1):
            job.collective(rank, seq, end=False, deadline_s=1.0)
        job.tick(1000)
        for rank in (0, 1):
            job.event(rank, "collective.timeout", comm="world", comm_rank=rank, comm_size=3, op="all_reduce", seq=seq,
                      deadline=1.0, missing_ranks=[2], level="error", status="timed_out", duration_s=1.0)
    return job


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children()}  # a zombie too: a child never waited for


def test_two_halves_make_the_model_of_one_pass_and_count_each_line_once(tmp_path: Path) -> None:
    job = _job(tmp_path / "logs")
    before = _children()
    one, two = load(job.directory, halves=False), load(job.directory, halves=True)
    assert [(f.path, f.events, f.garbled, f.headers, f.bytes) for f in two.files] == [
        (f.path, f.events, f.garbled, f.headers, f.bytes) for f in one.files]
    assert sum(f.garbled for f in one.files) == 3 and sum(f.headers for f in one.files) == 6
    expected = analyze(one).to_dict()
    assert_same(analyze(two).to_dict(), expected, "diagnosis")
    [_, final] = expected["attempts"]
    assert (final["culprits"], [p["seq"] for p in final["problems"]]) == ([2], [1, 2])  # an odd seq and an even
    assert one.attempts[0].p2p_ops == two.attempts[0].p2p_ops == 2
    assert _children() == before


def test_each_half_holds_only_its_own_seqs_and_the_merge_knows_every_seq_of_one_pass(tmp_path: Path) -> None:
    """A half counts the collectives of its parity two at a time: none of them is held as seen
    out of order (at 10^7 lines that was every seq of the half); merged, every communicator
    knows each seq one pass knows, and goes on counting new ones (a flight dump's) one at a time."""
    job = _job(tmp_path / "logs")
    segments = rank_segments(job.directory)
    for parity in (0, 1):
        fold, _ = read(job.directory, segments, None, [], parity)
        world = fold.attempts[0].comms["world"].seqs
        assert (list(world), world.above) == ([s for s in range(1, 8) if s % 2 == parity], set())
    one, two = load(job.directory, halves=False), load(job.directory, halves=True)
    for attempt, att in one.attempts.items():
        for label, comm in att.comms.items():
            merged = two.attempts[attempt].comms[label].seqs
            assert (list(merged), merged.step) == (list(comm.seqs), 1), label
    world = two.attempts[0].comms["world"].seqs
    assert world.add(9) and world.add(8) and not world.add(9) and list(world) == list(range(1, 10))
    solo = Job(tmp_path / "solo", size=2)  # a communicator with no comm.init, and one odd seq only
    for rank in range(2):
        solo.start(rank, "node0", 300 + rank)
        solo.collective(rank, 1, comm="solo")
    alone, split = load(solo.directory, halves=False), load(solo.directory, halves=True)
    seqs = split.attempts[0].comms["solo"].seqs
    assert (list(seqs), seqs.step) == ([1], 1)
    # This process's half saw nothing of them but their headers: their job and pids are the other's.
    assert_same(analyze(split).to_dict(), analyze(alone).to_dict(), "diagnosis")
    one_fold, _ = read(solo.directory, rank_segments(solo.directory), None, [])
    two_fold, _ = halves.read_in_halves(solo.directory, rank_segments(solo.directory), None)
    assert (two_fold.jobs, two_fold.pids) == (one_fold.jobs, one_fold.pids)


def test_a_second_half_that_fails_leaves_the_read_to_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = _job(tmp_path / "logs")
    read = halves.read

    def failing(*args: object, parity: int | None = None) -> object:
        if parity == 1:
            raise MemoryError("the second half could not finish")
        return read(*args, parity=parity)  # type: ignore[arg-type]

    monkeypatch.setattr(halves, "read", failing)
    before = _children()
    with pytest.warns(RuntimeWarning, match=r"the second half .* failed \(exit status 1\); read again in one process"):
        two = load(job.directory, halves=True)
    assert_same(analyze(two).to_dict(), analyze(load(job.directory, halves=False)).to_dict(), "diagnosis")
    assert _children() == before


def test_a_directory_of_two_jobs_is_refused_and_the_second_half_is_not_left_running(tmp_path: Path) -> None:
    job = _job(tmp_path / "logs")
    other = Job(job.directory, size=3, job="job-2")
    other.start(0, "node1", 900)
    other.comm(0)
    before = _children()
    with pytest.raises(MixedJobsError, match="found 2"):
        load(job.directory, halves=True)
    assert _children() == before


def test_only_large_logs_are_read_on_two_processes_and_never_forked_from_threads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _job(tmp_path / "logs")
    segments = rank_segments(tmp_path / "logs")
    monkeypatch.setattr(halves.threading, "active_count", lambda: 1)  # as in a process of one thread
    assert not halves.worth_halves(segments)
    for rank in range(2):  # sparse: large without being written
        with open(tmp_path / "logs" / f"rank{rank}.jsonl", "r+b") as f:
            f.truncate(halves.HALVES_FROM_BYTES // 2)
    assert halves.worth_halves(segments) == ((os.cpu_count() or 1) >= 2)
    monkeypatch.setattr(halves.threading, "active_count", lambda: 2)  # a fork copies only the calling thread
    assert not halves.worth_halves(segments)


def test_a_parent_killed_mid_read_takes_its_second_half_with_it(tmp_path: Path) -> None:
    job = _job(tmp_path / "logs")
    script = (
        "import sys, time\n"
        "from commlib.observe import halves\n"
        "from commlib.observe.model import load\n"
        "read = halves.read\n"
        "def slow(*args, parity=None):\n"
        "    if parity == 1:\n"
        "        print('second half reading', flush=True)\n"
        "        time.sleep(120)  # a read of very large logs\n"
        "    return read(*args, parity=parity)\n"
        "halves.read = slow\n"
        "load(sys.argv[1], halves=True)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script, str(job.directory)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None and parent.stdout.readline() == "second half reading\n"
        [child] = psutil.Process(parent.pid).children()
        parent.kill()
        parent.wait()
        child.wait(timeout=10)  # raises TimeoutExpired if it was left reading for nobody
    finally:
        parent.kill()
