"""The proof fails a run that recovered wrongly: ``python -m chaos run`` on a trainer whose
resume after a kill forgets the optimizer state, or skips the step after its checkpoint,
ends FAILED with exit status 1; the same trainer resuming correctly passes.

Both jobs do recover in the harness's sense (they restart, resume from the checkpoint and
finish): only the bitwise comparison with the fault-free reference can tell them apart.
The trainer is `bad_resume_trainer.py` (a linear model, Adam, 6 steps, a checkpoint every 2),
so each case costs two short torchrun jobs (its reference and the faulted run).
"""

import json
from pathlib import Path

import pytest

from chaos.__main__ import main as cli

TRAINER = str(Path(__file__).with_name("bad_resume_trainer.py"))
FAULT = "kill:rank=1,step=3"  # after the checkpoint of step 2: the restart resumes from it


def _run(tmp_path, reference_dir, capsys, monkeypatch, resume_bug):
    run_dir = tmp_path / "run"
    # Through the environment, so the three cases share one fault-free reference.
    monkeypatch.setenv("BAD_RESUME_BUG", resume_bug)
    code = cli(["run", "--run-dir", str(run_dir), "--trainer", TRAINER, "--fault", FAULT,
                "--reference-dir", str(reference_dir), "--no-png", "--job-timeout", "120"])
    out = capsys.readouterr().out
    report = json.loads((run_dir / "report.json").read_text())
    # The job recovered as far as the harness can see: killed, restarted, resumed, finished.
    assert report["bitwise_verified"], out
    assert {k: report["checks"][k] for k in ("job_completed", "faults_injected", "recovered")} == \
        {"job_completed": True, "faults_injected": True, "recovered": True}, out
    [fault] = report["faults"]
    assert (fault["type"], fault["rank"], fault["step"], fault["resumed_from"]) == ("kill", 1, 3, 2), fault
    # At least the one the kill caused: on 2 loaded cores a restart can itself fail (a slow rank
    # misses the rendezvous) and cost one more, which the plan's restart margin allows for.
    assert report["restarts"] >= 1
    return code, out, report, run_dir


def test_correct_resume_passes(tmp_path, reference_dir, capsys, leftovers, monkeypatch):
    code, out, report, run_dir = _run(tmp_path, reference_dir, capsys, monkeypatch, "none")
    assert code == 0, out
    assert "PASSED" in out.splitlines()[0]
    assert report["passed"] and report["checks"]["losses_bitwise"] and report["checks"]["history_exact"] \
        and report["checks"]["state_bitwise"], out
    assert leftovers(run_dir) == []


@pytest.mark.parametrize("resume_bug, failed, problem", [
    ("optimizer", {"losses_bitwise", "state_bitwise"}, "optim.state.bias.exp_avg"),
    ("skip", {"losses_bitwise", "history_exact", "state_bitwise"}, "missing [3]"),
])
def test_wrong_resume_fails(tmp_path, reference_dir, capsys, leftovers, monkeypatch, resume_bug, failed, problem):
    code, out, report, run_dir = _run(tmp_path, reference_dir, capsys, monkeypatch, resume_bug)
    assert code == 1, out
    assert "FAILED" in out.splitlines()[0], out
    assert not report["passed"]
    assert {name for name, ok in report["checks"].items() if not ok} == failed, out
    assert any(problem in p for p in report["problems"]), report["problems"]
    assert leftovers(run_dir) == []
