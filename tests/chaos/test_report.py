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
