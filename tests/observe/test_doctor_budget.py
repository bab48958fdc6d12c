"""Logs with a budget, read back whole; and a verdict only on what was read (issue 26).

One real 2-rank job logs under a tiny budget (`COMMLIB_LOG_MAX_MB`, `COMMLIB_LOG_KEEP`), so
each rank's log is rotated a dozen times and its oldest files removed, and ends with rank 1
skipping a collective (rank 0 times out). Its logs are read by the doctor, the trace and
chaos's reader; a real 3-rank job run with its own torchrun run id then writes into a copy of
the same directory, as two jobs do when given one log dir; copies with empty and garbled rank
files, and bad `--trace` paths, show what the doctor says of what it could not read.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import commlib
from commlib import testing
from commlib.attempt import attempt_number
from commlib.doctor import main, render
from commlib.observe import events
from commlib.observe.blame import Kind
from commlib.observe.diagnosis import diagnose
from commlib.observe.records import MixedJobsError
from commlib.observe.run_logs import load
from commlib.observe.trace import build_trace
from commlib.record import log
from doctor_logs import same_verdict

MAX_MB, KEEP = 0.02, 2  # 20 kB a file: a rotation every ~40 collectives
COLLECTIVES = 400
DEADLINE = 1.0


def _rotating_job(comm: commlib.Communicator, log_dir: str) -> dict[str, Any]:
    t = torch.ones(4)
    for step in range(COLLECTIVES):
        with commlib.context(step=step, phase="forward"):
            comm.all_reduce(t)
    if comm.rank == 0:
        try:
            comm.all_reduce(t, timeout=DEADLINE)
        except commlib.CollectiveTimeout as exc:
            return {"missing": exc.missing_ranks, "seq": exc.seq}
        raise AssertionError("expected rank 0's last all_reduce to time out")
    # Rank 1 skips it, and stays until rank 0 has timed out (its exit would be a peer failure).
    give_up = time.monotonic() + 60
    while time.monotonic() < give_up and not any(
            e["event"] == "collective.timeout" for e in events.read_rank(events.rank_segments(log_dir)[0])):
        time.sleep(0.05)
    return {}


def _job_b(comm: commlib.Communicator) -> int:
    for _ in range(5):
        comm.all_reduce(torch.ones(4))
    return comm.rank


@pytest.fixture(scope="module")
def runs(once: Callable[[str, Callable[[Path], Any]], tuple[Path, Any]]) -> dict[str, Any]:
    return once("doctor-budget", _runs)[1]


def _runs(root: Path) -> dict[str, Any]:
    logs = root / "run" / "logs"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(log.MAX_MB_ENV, str(MAX_MB))
        mp.setenv(log.KEEP_ENV, str(KEEP))
        mp.delenv(log.RUN_ID_ENV, raising=False)
        results = testing.run(_rotating_job, 2, timeout=180, args=(str(logs),), log_dir=logs)
    mixed = root / "mixed"
    shutil.copytree(logs, mixed)
    with pytest.MonkeyPatch.context() as mp:  # a torchrun job: its run id is its job
        mp.setenv(log.RUN_ID_ENV, "job-b")
        testing.run(_job_b, 3, timeout=180, log_dir=mixed)
    return {"logs": logs, "run": root / "run", "mixed": mixed, "results": results}


def _headers(paths: list[Path]) -> list[dict[str, Any]]:
    return [json.loads(line) for p in paths for line in p.read_text().splitlines() if '"event":"log.open"' in line]


def test_rotated_logs_stay_in_budget_and_are_read_as_one(runs: dict[str, Any]) -> None:
    logs = runs["logs"]
    assert runs["results"][0] == {"missing": [1], "seq": COLLECTIVES + 1}
    segments = events.rank_segments(logs)
    assert sorted(segments) == [0, 1]
    for rank, paths in segments.items():
        # The live file and the newest KEEP rotated ones: numbered up, the oldest removed.
        assert [p.name for p in paths[:-1]] == [f"rank{rank}.jsonl.{n}" for n in
                                                sorted(int(p.name.rsplit(".", 1)[1]) for p in paths[:-1])]
        assert len(paths) == KEEP + 1 and int(paths[0].name.rsplit(".", 1)[1]) > 1, [p.name for p in paths]
        for p in paths:
            lines = p.read_text().splitlines()
            assert p.stat().st_size <= MAX_MB * 1e6 + len(lines[-1]) + 1, (p, p.stat().st_size)
            assert json.loads(lines[0])["event"] == "log.open"  # each file says whose lines it holds
        # Read across the files: one stream, every collective once, in order, none missing.
        seqs = [e["seq"] for e in events.read_rank(paths) if e["event"] == "collective.start"]
        assert seqs == list(range(seqs[0], seqs[-1] + 1)) and seqs[0] > 1, seqs[:3]
        assert seqs[-1] == COLLECTIVES + (1 if rank == 0 else 0)
        assert all("host" in e and e["size"] == 2 for e in events.read_rank(paths))  # the header's fields, put back
    # One job, agreed through the store (no torchrun here): every process's header says the same id.
    jobs = {h["job"] for h in _headers([p for paths in segments.values() for p in paths])}
    assert len(jobs) == 1 and None not in jobs

    d = diagnose(logs)
    same_verdict(logs)  # read from the end: the same verdict, across the rotated files
    final = d.final
    assert final is not None and (final.status, final.culprits, d.unreadable) == ("failed", [1], [])
    [timeout] = [p for p in final.problems if p.kind is Kind.TIMEOUT]
    assert (timeout.ranks, timeout.op, timeout.seq, timeout.comm) == ([1], "all_reduce", COLLECTIVES + 1, "world")
    kept = {e["seq"] for paths in segments.values() for e in events.read_rank(paths)  # a start rotated away: its end
            if e["event"] in ("collective.start", "collective.end")}
    # What was read is what counts: the collectives of the kept files (rank 0's flight dump, of
    # its last 2000, adds none: it only fills in the end of a log cut short).
    assert final.collectives == len(kept)
    assert d.job in jobs

    trace = build_trace(logs)
    drawn = {e["args"]["seq"]: e["args"]["status"] for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 0}
    rank0 = {e["seq"] for e in events.read_rank(segments[0]) if e["event"] in ("collective.start", "collective.end")}
    assert sorted(drawn) == sorted(rank0) and drawn[COLLECTIVES + 1] == "timed_out"
    # chaos's verification reads the run's logs through the same readers.
    from chaos.verify import read_logs

    run_logs = read_logs(runs["run"])
    assert run_logs is not None
    starts = [e for e in run_logs.events() if e["event"] == "collective.start"]
    assert len(starts) == sum(1 for paths in segments.values() for e in events.read_rank(paths)
                              if e["event"] == "collective.start")


LINES = 600  # about 80 kB: rotated seven times


def _tail_across_rotations(log_dir: str) -> dict[str, Any]:
    os.environ[log.MAX_MB_ENV], os.environ[log.KEEP_ENV] = "0.01", "3"  # 10 kB a file (the least allowed)
    log.configure(0, 1, log_dir)
    tail = events.LogTail(Path(log_dir))
    seen: list[int] = []
    logger = log.get_logger()
    for i in range(LINES):
        logger.info("app.tick", i=i, pad="x" * 40)
        if i % 7 == 0:  # a poll every few lines: some between rotations, some across one
            seen += [e["i"] for e in tail.poll() if e["event"] == "app.tick"]
    seen += [e["i"] for e in tail.poll() if e["event"] == "app.tick"]
    return {"seen": seen, "files": len(events.rank_segments(log_dir)[0])}


def test_log_tail_follows_a_live_log_across_rotations(tmp_path: Path) -> None:
    [out] = testing.run(_tail_across_rotations, 1, backend=None, args=(str(tmp_path),), timeout=60)
    assert out["files"] == 4, out  # rotated many times, three kept
    assert out["seen"] == list(range(LINES)), "expected every line once, in order, across rotations"


def test_two_jobs_in_one_directory_are_refused_and_read_apart(runs: dict[str, Any], tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    mixed = runs["mixed"]
    trace = tmp_path / "t.json"
    assert main([str(mixed), "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    [job_a] = {h["job"] for h in _headers([p for ps in events.rank_segments(runs["logs"]).values() for p in ps])}
    assert f"job '{job_a}': ranks [0-1]" in err and "job 'job-b': ranks [0-2]" in err and "--job" in err, err
    assert not list(tmp_path.iterdir()), "expected no trace, and no part of one, from a refused directory"
    with pytest.raises(MixedJobsError):
        load(mixed)

    alone, a = diagnose(runs["logs"]), diagnose(mixed, job=job_a)
    assert [(x.attempt, x.status, x.culprits, x.ranks, [p.kind for p in x.problems]) for x in a.attempts] == [
        (x.attempt, x.status, x.culprits, x.ranks, [p.kind for p in x.problems]) for x in alone.attempts]
    b = diagnose(mixed, job="job-b")
    assert (b.job, b.exit_code, b.final.ranks, b.world_size, b.final.collectives) == ("job-b", 0, [0, 1, 2], 3, 5)
    assert main([str(mixed), "--job", "no-such-job"]) == 2
    assert "job 'job-b'" in capsys.readouterr().err


def test_unreadable_rank_files_are_named_and_nothing_readable_exits_2(runs: dict[str, Any], tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    some = tmp_path / "some"
    shutil.copytree(runs["logs"], some)
    (some / "rank7.jsonl").write_bytes(b"")
    (some / "rank8.jsonl").write_bytes(os.urandom(3000).replace(b"\n", b" ") + b"\n")
    d = diagnose(some)
    assert {Path(u["path"]).name: u["why"] for u in d.unreadable} == {
        "rank7.jsonl": "empty", "rank8.jsonl": "no event in 3001 bytes (1 line(s) not a JSON event)"}
    assert (d.final.status, d.final.culprits, d.exit_code) == ("failed", [1], 1)  # the verdict on what was read
    text = render(d)
    assert f"Not read: {some / 'rank7.jsonl'}: empty" in " ".join(text.split())

    nothing = tmp_path / "nothing"
    nothing.mkdir()
    (nothing / "rank0.jsonl").write_bytes(b"")
    (nothing / "rank1.jsonl").write_bytes(b"\x00\xff garbage\n{\"no\": \"clock\"}\n")
    assert main([str(nothing)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "found none: rank0.jsonl: empty; rank1.jsonl: no event in" in err, err


def test_a_bad_trace_path_exits_2_before_any_log_is_read(runs: dict[str, Any], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the logs were read before the trace path was checked")

    monkeypatch.setattr("commlib.doctor.load", never)
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for bad, says in ((tmp_path, "found a directory"), (a_file / "t.json", f"found {a_file} is a file"),
                      (Path("/proc/commlib/t.json"), "expected a file that can be written")):
        assert main([str(runs["logs"]), "--trace", str(bad)]) == 2, bad
        err = capsys.readouterr().err
        assert err.startswith(f"commlib-doctor: --trace {bad}: ") and says in err, err


def test_budget_and_attempt_settings_are_checked() -> None:
    for env, says in (({log.MAX_MB_ENV: "0"}, r"COMMLIB_LOG_MAX_MB to be a finite number of MB in \[0.01, 1e\+06\]; "
                                              "found '0'"),
                      ({log.MAX_MB_ENV: "lots"}, "found 'lots'"),
                      ({log.KEEP_ENV: "-1"}, r"COMMLIB_LOG_KEEP to be an integer in \[0, 10000\]; found '-1'")):
        with pytest.raises(ValueError, match=says):
            log.budget(env)
    assert log.budget({}) == (int(log.DEFAULT_MAX_MB * 1e6), log.DEFAULT_KEEP)
    with pytest.raises(ValueError, match="TORCHELASTIC_RESTART_COUNT to be an integer; found 'two'"):
        attempt_number({"TORCHELASTIC_RESTART_COUNT": "two"})
    assert attempt_number({"TORCHELASTIC_RESTART_COUNT": "3"}) == 3
