"""The doctor's replica-group rule (`commlib.observe.replicas`) on logs it must still read."""

from __future__ import annotations

import json
from pathlib import Path

from commlib.observe.replicas import analyze_replicas


def test_groups_that_never_reached_a_quorum_are_reported_not_raised(tmp_path: Path) -> None:
    # Two replica groups whose every attempt timed out at the lighthouse before its first
    # quorum (met in a test run on a loaded machine): the proof's report must still be written.
    for replica in (0, 1):
        logs = tmp_path / f"replica{replica}"
        logs.mkdir()
        for rank in (0, 1):
            head = {"rank": rank, "pid": 100 + 10 * replica + rank, "attempt": 1}
            lines = [
                {"event": "log.open", "format": 2, "size": 2, "host": "h", "job": "j", "ts_ns": 1_000, **head},
                {"event": "replica.start", "replica": replica, "replicas": 2, "ts_ns": 2_000, **head},
                {"event": "train.error", "level": "error", "error_type": "TimeoutError", "error": "Timeout expired",
                 "ts_ns": 60_000_000_000, **head},
            ]
            (logs / f"rank{rank}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    findings = analyze_replicas(tmp_path)
    assert findings.quorums == [] and findings.groups == [0, 1], findings
    assert findings.render().startswith("Replica groups [0, 1] in "), findings.render()
    assert "0 quorums, 0 group(s) lost." in findings.render()
