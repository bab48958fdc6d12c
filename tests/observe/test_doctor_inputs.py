"""The doctor on logs no single-machine run can stage, written by hand (`doctor_logs.Job`): processes
of two hosts with the same pid, lines cut mid-write, files that are not regular files."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import commlib
from commlib.doctor import main
from commlib.observe import events
from commlib.observe.diagnosis import diagnose
from commlib.observe.position import position
from commlib.observe.run_logs import load
from commlib.record import log
from doctor_logs import Job, same_verdict

_STACKS = """Thread 0x00007f0000000001 (most recent call first):
  File "/app/threading.py", line 320 in wait

Current thread 0x00007f0000000002 (most recent call first):
  File "/app/train.py", line {line} in {func}
  File "/app/train.py", line 120 in <module>
"""


def test_processes_of_two_hosts_with_one_pid_are_told_apart(tmp_path: Path) -> None:
    # Containers on two nodes both run their rank as pid 7, and each node has a communicator
    # of its own named "node". Each process's header, stacks file and flight dump is its own.
    # Lines 1 us apart: the doctor reads them as one window, in wall-clock order.
    job = Job(tmp_path, size=2, tick_ms=0.001)
    hosts = {0: "node-a", 1: "node-b"}
    for rank, host in hosts.items():
        job.start(rank, host, pid=7)
    for rank in (1, 0):
        job.comm(rank)
        job.comm(rank, "node", comm_rank=0, size=1)
    for rank in (0, 1):
        job.collective(rank, 1, step=0, phase="forward")
    job.collective(0, 2, end=False, step=1, phase="forward")
    job.event(1, "train.step", step=1, phase="data")
    job.event(0, "collective.timeout", comm="world", comm_rank=0, comm_size=2, op="all_reduce", seq=2,
              deadline=1.0, missing_ranks=[1], level="error", status="timed_out", duration_s=1.0)
    for rank, func in ((0, "rank_zero_place"), (1, "rank_one_place")):
        (tmp_path / f"stacks_{hosts[rank]}_7.txt").write_text(_STACKS.format(line=10 + rank, func=func))
    stuck = {"seq": 1, "op": "all_reduce", "comm": "node", "state": "started", "start_ns": job.tick(),
             "start_mono_ns": job.now, "nbytes": 16, "shapes": [[4]], "dtype": "torch.float32"}
    job.flight_dump(1, "node-b", "node", 0, [stuck], "flight_rank1_node_node-b_7_1_sigusr1.json")

    d = diagnose(tmp_path)
    assert d.final is not None and d.final.culprits == [1]
    where = {p.rank: p for p in d.final.positions}
    assert {r: (p.host, p.pid) for r, p in where.items()} == {0: ("node-a", 7), 1: ("node-b", 7)}
    assert where[0].stack and "rank_zero_place" in where[0].stack[-1]
    assert where[1].stack and "rank_one_place" in where[1].stack[-1]
    [dump] = d.dumps
    assert (dump.rank, dump.attempt, dump.host, dump.pid) == (1, 0, "node-b", 7)
    assert where[1].last_started is not None and where[1].last_started.describe() == "all_reduce #1 on 'node'"


def test_a_call_its_abort_ended_is_one_the_timed_out_rank_waited_behind_whatever_the_clocks(tmp_path: Path) -> None:
    # Rank 0, the root, waits in gather #2 for rank 2, which never starts it; rank 1 has done its
    # part and times out in broadcast #3 (rank 0 has not started it). Rank 1's abort then ends
    # rank 0's gather (a `peer.failure` naming rank 1). Their hosts' clocks differ by 5 ms, so by
    # the clocks that failure comes before rank 1's timeout line, though it followed it.
    job = Job(tmp_path, size=3)
    for rank, host in ((0, "node-a"), (1, "node-b"), (2, "node-b")):
        job.start(rank, host, pid=10 + rank)
        job.comm(rank)
    for rank in (0, 1, 2):
        job.collective(rank, 1, step=0, phase="forward")
    job.event(2, "train.step", step=1, phase="data")
    gather = {"comm": "world", "comm_size": 3, "op": "gather", "seq": 2, "step": 1, "phase": "forward"}
    job.collective(0, 2, op="gather", end=False, step=1, phase="forward")
    job.collective(1, 2, op="gather", step=1, phase="forward")
    job.comm(1, "solo", comm_rank=0, size=1)
    for seq in range(1, 41):  # lines enough that the verdict from the end must look back for the gather
        job.collective(1, seq, comm="solo", comm_rank=0, comm_size=1, step=1, phase="forward")
    job.collective(1, 3, op="broadcast", end=False, deadline_s=1.5, step=1, phase="forward")
    job.tick(1500)
    job.now -= 5_000_000  # rank 0's line, on node-a's clock (5 ms behind node-b's)
    job.event(0, "peer.failure", **gather, comm_rank=0, peer=None, failed_ranks=[1], level="error",
              status="failed", error_type="PeerFailure", duration_s=1.5)
    job.now += 5_000_000
    job.event(1, "collective.timeout", comm="world", comm_rank=1, comm_size=3, op="broadcast", seq=3, peer=None,
              deadline=1.5, missing_ranks=[0, 2], level="error", status="timed_out", duration_s=1.5)

    [timeout] = [p for p in same_verdict(tmp_path).final.problems if p.kind.value == "timeout"]
    assert (timeout.seq, timeout.ranks, timeout.details["waiting"]) == (3, [2], [0]), timeout.message
    assert "rank 0 was still in gather #2, waiting for rank 2" in timeout.message, timeout.message
    # Where rank 0 was at rank 1's deadline, as a finding says it: still in the gather.
    att = load(tmp_path).attempts[0]
    at_deadline = position(att, 0, timeout.ts_ns, timeout.reporters).last_started
    assert at_deadline is not None and (at_deadline.op, at_deadline.status) == ("gather", "started"), at_deadline


def _both_begin(job: Job, pid: int, attempt: int = 0, **first: Any) -> None:
    """Ranks 0 and 1 (pids `pid` and `pid + 1`, on host "vm") start, make the world communicator
    and log all_reduce #1 on it (`first`: that collective's fields, as `Job.collective` takes them)."""
    for rank in (0, 1):
        job.start(rank, "vm", pid=pid + rank, attempt=attempt)
        job.comm(rank)
        job.collective(rank, 1, **first)


def test_a_rank_that_aborted_went_on_and_was_then_killed_is_dead_not_aborted(tmp_path: Path) -> None:
    # Rank 0 aborts a communicator on purpose and goes on (an in-job recovery's abort, say): it
    # starts all_reduce #2. Then it is killed mid-op; rank 1's all_reduce #2 fails without it.
    job = Job(tmp_path, size=2)
    _both_begin(job, pid=10, step=0, phase="forward")
    job.event(0, "comm.abort", comm="world", comm_rank=0, comm_size=2, reason="rebuilding", level="warning")
    job.collective(0, 2, end=False, step=1, phase="forward")
    job.collective(1, 2, end=False, step=1, phase="forward")
    job.event(1, "peer.failure", comm="world", comm_rank=1, comm_size=2, op="all_reduce", seq=2, peer=None,
              failed_ranks=[0], level="error", status="failed", error_type="PeerFailure", duration_s=0.5)

    final = same_verdict(tmp_path).final
    assert final is not None and final.culprits == [0], final
    assert "dead_rank" in [p.kind.value for p in final.problems], final.problems
    [failure] = [p for p in final.problems if p.kind.value == "peer_failure"]
    assert "stopped logging before, without reporting an error" in failure.message, failure.message


def _aborted_and_left(job: Job, comm: str = "world") -> None:
    """Rank 1 aborts communicator `comm` on purpose, saying why, and its process ends there."""
    _both_begin(job, pid=10, step=0, phase="forward")
    job.event(1, "comm.abort", comm=comm, comm_rank=1, comm_size=2, reason="the operator stopped it",
              level="warning")


def test_a_rank_that_aborted_and_left_before_a_timeout_is_named_for_its_abort_not_as_dead(tmp_path: Path) -> None:
    # Rank 0's all_reduce #2 times out (the abort's news did not reach it: a store gone, say);
    # rank 1, which never started it, had stopped sending heartbeats because it had left.
    job = Job(tmp_path, size=2)
    _aborted_and_left(job)
    job.collective(0, 2, end=False, step=1, phase="forward")
    job.tick(1000)
    job.event(0, "collective.timeout", comm="world", comm_rank=0, comm_size=2, op="all_reduce", seq=2,
              deadline=1.0, missing_ranks=[1], stale_ranks=[1], level="error", status="timed_out", duration_s=1.0)

    final = same_verdict(tmp_path).final
    assert final is not None and final.culprits == [1], final
    assert [p.kind.value for p in final.problems] == ["timeout"], final.problems
    [timeout] = final.problems
    assert "Rank 1 had aborted communicator 'world' on purpose (the operator stopped it) and left." in \
        timeout.message, timeout.message


def test_a_rank_that_aborted_and_left_before_a_failure_outside_commlib_is_named_for_its_abort(
    tmp_path: Path,
) -> None:
    # Rank 0's own gloo call (DCP's, not commlib's) times out after rank 1 left; what rank 1
    # aborted was another communicator of its own (its node's), which the verdict names.
    job = Job(tmp_path, size=2)
    _aborted_and_left(job, comm="node")
    job.tick(1000)
    job.event(0, "train.error", level="error", error_type="RuntimeError", exit_code=1,
              error="[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 1000ms for send operation "
                    "to complete")

    final = same_verdict(tmp_path).final
    assert final is not None and final.culprits == [1], final
    assert [p.kind.value for p in final.problems] == ["error"], final.problems
    [error] = final.problems
    assert error.details["quiet"] == [] and error.details["aborted"] == [1], error.details
    assert "rank 1 had aborted communicator 'node' on purpose (the operator stopped it) and left" in \
        error.message, error.message


def _hang(directory: Path) -> Path:
    """Two ranks: rank 0 waits in all_reduce #2, which rank 1 never starts."""
    job = Job(directory, size=2)
    _both_begin(job, pid=100, step=0, phase="forward")
    job.collective(0, 2, end=False, step=1, phase="forward")
    job.event(1, "train.step", step=1, phase="data")
    return directory


def _doctor(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "commlib.doctor", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_trace_never_replaces_what_is_not_a_regular_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logs = _hang(tmp_path / "logs")
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    null = tmp_path / "null.json"
    null.symlink_to(os.devnull)
    for target, found in ((fifo, "a FIFO"), (null, "a character device")):
        assert main([str(logs), "--trace", str(target)]) == 2, target
        err = capsys.readouterr().err
        assert f"--trace {target}: " in err and found in err, err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and null.is_symlink() and stat.S_ISCHR(os.stat(os.devnull).st_mode)
    stdout = tmp_path / "stdout.json"
    stdout.symlink_to("/proc/self/fd/1")  # the doctor's own stdout: a pipe here
    done = _doctor(str(logs), "--trace", str(stdout))
    assert done.returncode == 2 and "a FIFO" in done.stderr and done.stdout == "", done
    assert main([str(logs), "--trace", ""]) == 2 and "--trace '': expected a file to write" in capsys.readouterr().err

    deep = tmp_path / "made" / "for" / "trace.json"  # the logs are missing: no trace, and no directory made for it
    assert main([str(tmp_path / "missing"), "--trace", str(deep)]) == 2
    assert not (tmp_path / "made").exists()

    real = tmp_path / "real.json"  # a symlink to a regular file: written through, the link kept
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    assert main([str(logs), "--trace", str(link)]) == 1
    assert link.is_symlink() and json.loads(real.read_text())["traceEvents"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo.json", "link.json", "logs", "null.json", "real.json",
                                                           "stdout.json"]  # no temporary file left


def test_files_named_like_logs_that_are_not_regular_files_are_named_not_read(tmp_path: Path) -> None:
    logs = _hang(tmp_path / "logs")
    for name in ("rank2.jsonl", "flight_rank2_world_vm_102_1_sigusr1.json", "stacks_vm_102.txt"):
        os.mkfifo(logs / name)  # opened to read, a FIFO waits for a writer that never comes
    done = _doctor(str(logs), "--json", timeout=30)
    assert done.returncode == 1, done
    unread = {u["path"]: u["why"] for u in json.loads(done.stdout)["unreadable"]}
    assert unread == {str(logs / name): "NotRegularFile: expected a regular file; found a FIFO"
                      for name in ("rank2.jsonl", "flight_rank2_world_vm_102_1_sigusr1.json", "stacks_vm_102.txt")}


def test_a_line_cut_by_a_kill_then_a_restart_appended_reads_as_two_attempts_of_one_job(tmp_path: Path) -> None:
    job = Job(tmp_path, size=2)
    _both_begin(job, pid=100)
    job.append(1, '{"op":"all_reduce","seq":2,"shapes":[[4]],"dtype":"torch.fl')  # killed mid-write
    _both_begin(job, pid=200, attempt=1)  # torchrun's restart appends to the same files
    for asked in (None, "job-1"):
        d = diagnose(tmp_path, job=asked)
        assert [(a.attempt, a.ranks) for a in d.attempts] == [(0, [0, 1]), (1, [0, 1])], asked
        assert d.final is not None and d.final.status == "ok"
    assert d.skipped_lines == {str(tmp_path / "rank1.jsonl"): 1}  # the cut line, and only it


def test_a_survivor_killed_while_writing_its_last_line_is_not_the_culprit(tmp_path: Path) -> None:
    # Rank 1 is frozen inside all_reduce #1 (its own timeout comes long after its deadline, once
    # it is let go); rank 0 times out and is killed while writing that line.
    job = Job(tmp_path, size=2, tick_ms=0.01)
    _both_begin(job, pid=100, end=False, deadline_s=1.0)
    job.tick(1000)
    job.append(0, '{"comm":"world","comm_rank":0,"op":"all_reduce","seq":1,"status":"timed_out","error":"all_re')
    job.tick(8000)
    job.event(1, "collective.timeout", comm="world", comm_rank=1, comm_size=2, op="all_reduce", seq=1,
              deadline=1.0, missing_ranks=[], level="error", status="timed_out", duration_s=9.5)
    d = diagnose(tmp_path)
    assert d.final is not None and d.final.culprits == [1], d.final


def test_a_new_process_ends_a_line_cut_short_before_its_own(tmp_path: Path) -> None:
    (tmp_path / "rank0.jsonl").write_text('{"event":"collective.start","op":"all_red')
    try:
        log.configure(0, 1, tmp_path)
        commlib.get_logger().info("app.started")
    finally:
        log.release()
    lines = (tmp_path / "rank0.jsonl").read_text().splitlines()
    assert lines[0] == '{"event":"collective.start","op":"all_red'
    assert [e["event"] for e in events.read_events(tmp_path / "rank0.jsonl")] == ["app.started"]
    assert json.loads(lines[1])["event"] == "log.open"


def test_a_log_dir_argument_that_is_no_directory_is_refused_saying_what_it_is(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    logs = _hang(tmp_path / "logs")
    monkeypatch.chdir(logs)  # `commlib-doctor "$UNSET"` run where logs are: still refused
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for arg, found in (("", "an empty path"), (str(logs / "rank0.jsonl"), "a regular file at"),
                       (str(fifo), "a FIFO at")):
        assert main([arg]) == 2, arg
        assert f"expected a log directory; found {found}" in capsys.readouterr().err


def test_events_with_fields_commlib_never_writes_are_skipped_not_a_traceback(tmp_path: Path) -> None:
    _hang(tmp_path)
    job = Job(tmp_path, size=2)
    for wrong in ({"attempt": "x"}, {"rank": "zero"}, {"error_type": ["x"], "level": "error"},
                  {"epoch": [1], "event": "recovery.in_job"}, {"duration_s": "slow", "event": "collective.end"},
                  {"missing_ranks": "all", "event": "collective.timeout", "level": "error"}):
        job.append(0, json.dumps({"event": "train.odd", "comm": "world", "op": "all_reduce", "seq": 9, "pid": 100,
                                  "rank": 0, "attempt": 0, "ts_ns": job.tick(), **wrong}) + "\n")
    for args in ([], ["--verdict"], ["--json"]):
        assert main([str(tmp_path), *args]) == 1, args  # a verdict, and no traceback
    # Not read: the lines without an integer rank or attempt, and the end whose duration is not a number.
    assert diagnose(tmp_path).skipped_lines == {str(tmp_path / "rank0.jsonl"): 3}
