"""The verdict read from the end of each rank's logs (`commlib.observe.verdict_from_end`) is the full read's.

Small logs written by hand (`doctor_logs.Job`), read with windows of a few hundred bytes so that
the tail has to decide how far back to go: hangs at the start, middle and end of a long log,
a deadline that expired, a restart appended to the same files, rotated files, a send/recv
never matched; and the cases where it must read in full, saying why. (The figures at scale,
a thousand ranks and ten million lines, are scripts/bench_doctor.py's.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from commlib.doctor import main
from commlib.observe import verdict_from_end
from commlib.observe.records import MixedJobsError
from commlib.observe.verdict_from_end import GROWTH, InFull, from_the_end, verdict
from doctor_logs import Job, same_verdict

WINDOW = 600  # bytes: two or three lines of each rank's log at a time (`same_verdict`'s)
RANKS, TP, STEPS, CULPRIT = 8, 4, 60, 5


def _job(directory: Path, attempt: int = 0, job: Job | None = None, pids: int = 100, tick_ms: float = 0.05) -> Job:
    job = job or Job(directory, size=RANKS, tick_ms=tick_ms)
    for r in range(RANKS):
        job.start(r, f"node{r // TP}", pid=1000 * attempt + pids + r, attempt=attempt)
        job.comm(r)
        job.comm(r, f"tp{r // TP}", comm_rank=r % TP, size=TP)
    return job


def _steps(job: Job, steps: range, skip: int | None = None) -> None:
    for step in steps:
        for r in range(RANKS):
            job.collective(r, 2 * step + 1, step=step, phase="forward")
            job.collective(r, step + 1, comm=f"tp{r // TP}", comm_rank=r % TP, comm_size=TP, step=step,
                           phase="backward")
            job.collective(r, 2 * step + 2, op="broadcast", step=step, phase="backward")


def _hang(directory: Path, at: float, polls: bool = True, tick_ms: float = 0.05) -> Job:
    """The culprit never starts the world all_reduce of step `at` x STEPS; the others wait in it,
    polling it with short waits (a line every 2 ms) for as long as the steps left would have logged.
    `tick_ms`: the time between two lines of the job (of any ranks)."""
    job = _job(directory, tick_ms=tick_ms)
    hang = int(at * STEPS)
    _steps(job, range(hang))
    began = {r: job.collective(r, 2 * hang + 1, end=False, step=hang, phase="forward")
             for r in range(RANKS) if r != CULPRIT}
    for _ in range((STEPS - hang) * 6 if polls else 0):
        for r in began:
            job.tick(2)
            job.event(r, "collective.wait_timeout", comm="world", comm_rank=r, comm_size=RANKS, op="all_reduce",
                      seq=2 * hang + 1, peer=None, waited_s=0.002, elapsed_s=(job.now - began[r]) / 1e9,
                      deadline_s=300.0, step=hang, phase="forward")
    return job


@pytest.mark.parametrize("at", [0.02, 0.5, 0.7, 0.98])
def test_a_hang_anywhere_in_a_long_log_is_the_full_reads(tmp_path: Path, at: float) -> None:
    _hang(tmp_path, at)
    tail = same_verdict(tmp_path)
    [hang] = tail.final.problems  # type: ignore[union-attr]
    assert (hang.kind.value, hang.ranks, hang.seq) == ("hang", [CULPRIT], 2 * int(at * STEPS) + 1)
    read, total = tail.read.bytes_read, tail.read.bytes_total
    if at <= 0.5:  # the polls reach back to more than half of the logs: streamed in full, and said so
        assert "of the logs (small logs, or a problem far back): read in full" in tail.read.full_read_because
    else:  # read from the end, straight back to where the hang began
        beyond = RANKS * WINDOW * GROWTH ** 2  # two rounds of windows grown past what they need
        assert tail.read.full_read_because is None and read < total * (1 - at) * 1.5 + beyond, (read, total)


@pytest.mark.parametrize("at", [0.7, 0.98])
def test_a_hang_read_from_the_end_goes_straight_back_to_the_wait_with_the_lines_before_it(
    tmp_path: Path, at: float
) -> None:
    # Lines 2 ms apart: a rank's last finished call ends tens of ms before the op it hangs in,
    # beyond the jump's margin. The jump back to when the wait began must take the lines that
    # place the rank then as well (and keep a line its window begins at). It did not: the windows
    # grew once more past what they needed (a third round; at scale, past half the logs and into a
    # full read, `scripts/bench_doctor.py hangs`).
    _hang(tmp_path, at, tick_ms=2.0)
    tail = same_verdict(tmp_path)
    assert tail.read.full_read_because is None and tail.read.rounds == 2, tail.read


def test_a_deadline_that_expired_names_the_same_culprit_and_places(tmp_path: Path) -> None:
    job = _hang(tmp_path, 0.98, polls=False)
    for r in range(RANKS):
        if r != CULPRIT:
            job.tick(50)
            job.event(r, "collective.timeout", comm="world", comm_rank=r, comm_size=RANKS, op="all_reduce",
                      seq=2 * int(0.98 * STEPS) + 1, deadline=1.0, missing_ranks=[CULPRIT], stale_ranks=[],
                      level="error", status="timed_out", duration_s=1.0, error="timed out",
                      error_type="CollectiveTimeout")
    tail = same_verdict(tmp_path)
    assert tail.final.culprits == [CULPRIT] and tail.read.bytes_read < tail.read.bytes_total / 5  # type: ignore


def test_a_restart_appended_and_rotated_files_are_read_attempt_by_attempt(tmp_path: Path) -> None:
    job = _job(tmp_path)
    _steps(job, range(30))
    for r in range(RANKS):  # attempt 0 ends as rank 5 is killed: its peers see it go
        if r != CULPRIT:
            job.collective(r, 61, end=False)
            job.event(r, "peer.failure", comm="world", comm_rank=r, comm_size=RANKS, op="all_reduce", seq=61,
                      level="error", error="connection reset", error_type="PeerFailure", status="failed",
                      duration_s=0.1)
    _job(tmp_path, attempt=1, job=job)
    _steps(job, range(20))
    for r in range(RANKS):  # rotated: the older half of each file moved to rank{R}.jsonl.1
        live = tmp_path / f"rank{r}.jsonl"
        lines = live.read_bytes().splitlines(keepends=True)
        (tmp_path / f"rank{r}.jsonl.1").write_bytes(b"".join(lines[:len(lines) // 2]))
        live.write_bytes(b"".join(lines[len(lines) // 2:]))
    tail = same_verdict(tmp_path)
    assert [(a.attempt, a.status, a.culprits) for a in tail.attempts] == [(0, "failed", [CULPRIT]), (1, "ok", [])]
    assert tail.exit_code == 3 and tail.read.bytes_read < tail.read.bytes_total / 2


def test_a_send_never_matched_is_the_full_reads(tmp_path: Path) -> None:
    job = _job(tmp_path)
    _steps(job, range(20))
    for seq in range(1, 4):  # rank 0 sends to rank 1, which receives the first two only
        for r, op, peer in ((0, "send", 1), (1, "recv", 0)):
            if seq < 3 or r == 0:
                fields = {"comm": "world", "comm_rank": r, "comm_size": RANKS, "op": op, "seq": seq, "peer": peer}
                job.event(r, "collective.start", bytes=16, deadline_s=300.0, **fields)
                if seq < 3:
                    job.event(r, "collective.end", bytes=16, status="ok", duration_s=0.001, **fields)
    for r in range(2, RANKS):
        job.collective(r, 41, end=False)  # and the others wait in the next all_reduce
    tail = same_verdict(tmp_path)
    kinds = {(p.kind.value, tuple(p.ranks)) for p in tail.final.problems}  # type: ignore[union-attr]
    assert ("hang", (1,)) in kinds, kinds


def test_an_in_job_recovery_every_window_begins_after_is_found_by_its_flight_dumps(tmp_path: Path) -> None:
    # Every rank recovers in-job at step 40 (each writes its abort's flight dump then), and the
    # job then runs 20 more steps: every window begins long after the recovery. The attempt
    # recovered all the same (exit 3, not 0), as the full read says.
    job = _job(tmp_path)
    _steps(job, range(40))
    for r in range(RANKS):  # step 40: the culprit never starts the world all_reduce; rank 0 times out
        if r != CULPRIT:
            job.collective(r, 81, end=False, step=40, phase="forward")
    job.event(0, "collective.timeout", comm="world", comm_rank=0, comm_size=RANKS, op="all_reduce", seq=81,
              deadline=1.0, missing_ranks=[CULPRIT], level="error", status="timed_out", duration_s=1.0)
    for r in range(RANKS):  # every rank aborts (writing its dump), recovers and rebuilds its groups
        job.event(r, "comm.abort", comm="world", comm_rank=r, comm_size=RANKS, reason="in-job recovery",
                  level="warning")
        name = f"flight_rank{r}_world_node{r // TP}_{100 + r}_1_abort.json"
        path = job.flight_dump(r, f"node{r // TP}", "world", r, [], name)
        path.write_text(json.dumps({**json.loads(path.read_text()), "reason": "abort"}))
        job.event(r, "recovery.in_job", epoch=1, trigger="CollectiveTimeout", level="warning")
        job.comm(r)
        job.comm(r, f"tp{r // TP}", comm_rank=r % TP, size=TP)
    _steps(job, range(40, STEPS))
    tail = same_verdict(tmp_path)
    assert tail.exit_code == 3 and tail.final is not None and tail.final.status == "recovered", tail.final
    assert "recovered in-job" in (tail.read.full_read_because or ""), tail.read


def test_where_the_tail_cannot_decide_it_reads_in_full_and_says_why(tmp_path: Path) -> None:
    recovered = tmp_path / "recovered"
    job = _job(recovered)
    _steps(job, range(10))
    for r in range(RANKS):  # whether it recovered depends on what came before: all of it
        job.event(r, "recovery.in_job", epoch=1, trigger="CollectiveTimeout", level="warning")
    tail = verdict(recovered, window=WINDOW)
    assert "recovered in-job" in tail.read.full_read_because and tail.read.bytes_read == tail.read.bytes_total

    mixed = tmp_path / "mixed"  # a second job's logs appended to the first's
    _steps(_job(mixed), range(5))
    _steps(_job(mixed, job=Job(mixed, size=RANKS, job="job-2", t0_ns=1_900_000_000_000_000_000), pids=500), range(5))
    with pytest.raises(MixedJobsError):
        verdict(mixed, window=WINDOW)
    assert "asked for" in verdict(mixed, job="job-2", window=WINDOW).read.full_read_because


def test_early_hang_folds_no_window(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wait begun near the logs' start leaves the verdict to the full read before any builder."""
    _hang(tmp_path, 0.02)

    def never(*args: Any) -> Any:
        raise AssertionError("a model of the windows built before the full read")

    monkeypatch.setattr(verdict_from_end, "_build", never)
    found = from_the_end(tmp_path, window=WINDOW)
    far_back = "of the logs (small logs, or a problem far back)"
    assert isinstance(found, InFull) and far_back in (found.why or ""), found


def test_two_jobs_read_no_window(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two jobs in the `log.open` lines where windows start: the full read, before any window."""
    _steps(_job(tmp_path), range(20))
    for r in range(RANKS // 2, RANKS):  # the upper half of the ranks' files are another job's
        path = tmp_path / f"rank{r}.jsonl"
        path.write_text(path.read_text().replace('"job":"job-1"', '"job":"job-2"'))

    def never(*args: Any) -> Any:
        raise AssertionError("windows read before the full read")

    monkeypatch.setattr(verdict_from_end, "_read_window", never)
    two_jobs = "the directory holds the logs of more than one job: read in full"
    assert from_the_end(tmp_path, window=WINDOW) == InFull(two_jobs)
    with pytest.raises(MixedJobsError):
        verdict(tmp_path, window=WINDOW)


def test_the_verdict_on_the_command_line_says_rank_sets_as_ranges(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    _hang(tmp_path, 0.98, polls=False)
    assert main([str(tmp_path), "--verdict"]) == 1
    out = capsys.readouterr().out
    assert "ranks 0-4, 6-7 still in it" in out and "culprit rank 5" in out and "read from the end" in out
    assert max(len(line) for line in out.splitlines()) <= 112
    assert main([str(tmp_path), "--verdict", "--json"]) == 1
    found: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert found["read"]["bytes_read"] < found["read"]["bytes_total"] and found["attempts"][0]["collectives"] is None
    assert main([str(tmp_path), "--verdict", "--trace", os.devnull]) == 2


def test_verdict_then_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`commlib-doctor DIR`: the verdict from the end, then the full report (alone where the tail
    cannot decide)."""
    _hang(tmp_path / "late", 0.98, polls=False)
    assert main([str(tmp_path / "late")]) == 1
    first, report = capsys.readouterr().out.split("\n\ncommlib doctor: ")
    assert "read from the end" in first and "Collectives by op and size" not in first, first
    assert "Collectives by op and size" in report and "read from the end" not in report, report
    assert "culprit rank 5" in first and "culprit rank 5" in report
    _hang(tmp_path / "early", 0.02)
    assert main([str(tmp_path / "early")]) == 1
    out = capsys.readouterr().out
    assert out.count("commlib doctor: ") == 1 and "Collectives by op and size" in out, out
