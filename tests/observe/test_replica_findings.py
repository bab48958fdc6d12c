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


def test_a_group_restarted_or_gone_on_purpose_is_never_said_never_back(tmp_path: Path) -> None:
    """A lost group whose restart reached no quorum is said restarted, and a group that finalized its
    quorum's communicator left; neither is NEVER BACK, and the run counts as recovered (exit 3)."""
    s = 1_000_000_000

    def quorum(qid: int, replicas: list[int], ts: int) -> dict:
        return {"event": "replicas.quorum", "quorum_id": qid, "replicas": replicas, "global_ranks": replicas,
                "group_size": 1, "ts_ns": ts}

    def ended(qid: int, ts: int) -> dict:
        return {"event": "collective.end", "comm": f"replicas.q{qid}", "status": "ok", "seq": 1, "ts_ns": ts}

    # Three groups of one rank: group 1 is lost after quorum 1 and restarted, and its restart never
    # reaches a quorum; group 2 ends its part after quorum 2 (it finalizes that quorum's communicator).
    logs = {
        0: [quorum(1, [0, 1, 2], 1 * s), ended(1, 2 * s), quorum(2, [0, 2], 3 * s), ended(2, 4 * s),
            quorum(3, [0], 8 * s), ended(3, 9 * s)],
        1: [quorum(1, [0, 1, 2], 1 * s), ended(1, 2 * s),
            {"event": "log.open", "format": 2, "size": 1, "host": "h", "job": "j", "pid": 201, "attempt": 1,
             "ts_ns": 5 * s},
            {"event": "replica.start", "pid": 201, "ts_ns": 5 * s},
            {"event": "train.error", "error_type": "TimeoutError", "pid": 201, "ts_ns": 65 * s}],
        2: [quorum(1, [0, 1, 2], 1 * s), ended(1, 2 * s), quorum(2, [0, 2], 3 * s), ended(2, 4 * s),
            {"event": "comm.finalize", "comm": "replicas.q2", "ts_ns": 7 * s}],
    }
    for replica, events in logs.items():
        (tmp_path / f"replica{replica}").mkdir()
        head = {"event": "log.open", "format": 2, "size": 1, "host": "h", "job": "j", "pid": 100 + replica,
                "attempt": 0, "ts_ns": 0}
        (tmp_path / f"replica{replica}" / "rank0.jsonl").write_text(
            "".join(json.dumps({"rank": 0, "pid": 100 + replica, **e}) + "\n" for e in [head, *events])
        )
    findings = analyze_replicas(tmp_path)
    assert [(g.replica, g.quorum_id, g.back_in_quorum) for g in findings.lost] == [(1, 1, None)], findings
    assert findings.lost[0].restarted_after_s == 3.0, findings.lost
    assert [(g.replica, g.quorum_id) for g in findings.left] == [(2, 2)], findings
    assert findings.never_back == [] and findings.exit_code == 3, findings
    text = findings.render()
    assert "NEVER BACK" not in text, text
    assert "restarted after 3.00 s, in no later quorum" in text, text
    assert "replica 2 left after quorum 2 (its ranks finalized that quorum's communicator)" in text, text
