"""The doctor on logs no single-machine run can stage, written by hand (`doctor_logs.Job`): processes
of two hosts with the same pid, lines cut mid-write, files that are not regular files."""

from __future__ import annotations

from pathlib import Path

from commlib.observe.doctor import diagnose
from doctor_logs import Job

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
