"""The report's timeline labels: faults close in time share a label instead of overprinting."""

from __future__ import annotations

from chaos.report import LABEL_GAP, FaultResult, Report, fault_labels


def _fault(kind: str, rank: int, at: float) -> FaultResult:
    return FaultResult(type=kind, index=0, firing=1, rank=rank, step=None, attempt=0, pid=None, node=None,
                       injected_at=at, injected_ts_ns=0)


def test_faults_closer_than_the_gap_share_one_label_and_others_keep_their_own() -> None:
    span = 100.0
    close = LABEL_GAP * span / 2
    faults = [_fault("kill", 1, 50.0), _fault("hang", 0, 10.0), _fault("delay", 1, 10.0 + close),
              _fault("raise", 0, 10.0 + 2 * close + 0.01)]
    assert fault_labels(faults, span) == [
        (10.0, "hang r0, delay r1"),  # the second is within the gap of the first
        (10.0 + 2 * close + 0.01, "raise r0"),  # within the gap of the second, not of the label's start
        (50.0, "kill r1"),
    ]


def test_the_summary_lists_the_files_the_report_wrote(tmp_path) -> None:
    report = Report(passed=True, checks={"job_completed": True}, bitwise_verified=True, run_dir=str(tmp_path))
    report.write(tmp_path, png=False)
    last = report.summary().splitlines()[-1]
    assert last == f"  report: {tmp_path / 'report.json'}", last


def test_the_summary_cuts_no_word_and_shows_each_fault_its_own_verdicts_and_problem(tmp_path) -> None:
    """A summary line past the width wraps at a word, never inside one; each fault shows the checks
    about it and the doctor's problem of its own window (its attempt holds the other fault's too),
    and the job line says what the ranks ran over."""
    s = 1_000_000_000
    delay, kill = _fault("delay", 0, 10.0), _fault("kill", 1, 20.0)
    delay.injected_ts_ns, kill.injected_ts_ns = 10 * s, 20 * s
    word = "x" * 150  # longer than a line: it stands alone, whole
    attempt = {"problems": [
        {"kind": "timeout", "ranks": [0], "ts_ns": 11 * s, "message": "all_reduce #7 timed out " + "on rank 1 " * 20},
        {"kind": "dead_rank", "ranks": [1], "ts_ns": 20 * s, "message": f"rank 1 stopped logging {word} end"},
    ]}
    delay.diagnosis, kill.diagnosis = attempt, attempt
    delay.verdicts, kill.verdicts = {"recovered": True, "diagnosis_names_faulted_rank": False}, {"recovered": True}
    report = Report(passed=False, checks={"job_completed": True}, bitwise_verified=True, run_dir=str(tmp_path),
                    faults=[delay, kill], problems=["steps_exact: expected " + "step " * 60 + "once each"],
                    job={"trainer": "my.train", "world_size": 2, "backend": "gloo"}, backend="commlib over gloo")
    lines = report.summary().splitlines()
    text = report.summary()
    assert "my.train on 2 ranks (commlib over gloo)" in lines[1]
    assert all(len(line) <= 120 or line.strip() == word for line in lines), [len(line) for line in lines]
    assert word in [line.strip() for line in lines] and all(w in text.split() for w in ("step", "once", "each", "end"))
    at_delay, at_kill = text.index("delay rank 0"), text.index("kill rank 1")
    assert at_delay < text.index("[FAILED] diagnosis_names_faulted_rank") < text.index("timeout [0]") < at_kill
    assert text.index("dead_rank [1]") > at_kill and text.count("timeout [0]") == 1
