"""Users' own trainers under chaos, unmodified (none imports chaos or commlib; `--backend commlib`
is the one word changed): a plain DDP loop, FSDP2 with DCP checkpoints, gradient accumulation and
an LR schedule, and one that checkpoints with `torch.save`. Each recovers bitwise from a kill, a
hang past its deadline, a delay and a preemption in one run, every fault at its own step; and the
proof bites: the `torch.save` trainer resuming one step late, from a stale checkpoint, or without
its RNG state FAILS, naming the first step that differs and what differs in it.

Each case is one faulted torchrun job (the fault-free reference of each trainer is made once a
session, and so is the second fault-free run a failing comparison asks for).
"""

import json
from pathlib import Path

import pytest

import chaos
from chaos.__main__ import main as cli

HERE = Path(__file__).parent
DEADLINE_S = 6.0
ARGS = ("--backend", "commlib", "--steps", "10", "--ckpt-every", "2", "--timeout", str(DEADLINE_S))
# After the checkpoints of steps 2, 4 and 6, and at 9, which the preemption checkpoints itself.
FAULTS = ("kill:rank=1,step=3", "hang:rank=0,step=5", "delay:rank=1,step=7", "sigterm:rank=0,step=9")


@pytest.mark.parametrize("trainer", ["ddp_trainer.py", "fsdp_trainer.py", "torch_save_trainer.py"])
def test_a_users_trainer_recovers_bitwise_from_a_kill_a_hang_a_delay_and_a_preemption(
        trainer, tmp_path, reference_dir, leftovers, monkeypatch):
    """Each fault fired at its step, the doctor named the hung and the delayed rank, the preempted
    job resumed from the step it stopped after, and every step is its reference's, bitwise."""
    monkeypatch.setenv("RESUME_BUG", "none")
    run_dir = tmp_path / "run"
    report = chaos.run(list(FAULTS), run_dir, ARGS, trainer=str(HERE / trainer), reference_dir=reference_dir,
                       timeout_s=300, png=False)
    assert report.passed and report.bitwise_verified, report.summary()
    assert {"diagnosis_names_faulted_rank", "preempted_cleanly", "steps_exact", "losses_bitwise", "steps_bitwise",
            "state_bitwise"} <= set(report.checks), report.checks
    assert [(f.type, f.rank, f.step, f.resumed_from) for f in report.faults] == \
        [("kill", 1, 3, 2), ("hang", 0, 5, 4), ("delay", 1, 7, 6), ("sigterm", 0, 9, 9)], report.summary()
    assert (report.backend, report.step_source, report.steps_done) == ("commlib over gloo", "optimizer", 10)
    assert report.restarts >= 4
    for f in report.faults:
        assert f.verdicts and all(f.verdicts.values()), (f.type, f.verdicts)
    # Each run had a working directory of its own: the trainer's relative checkpoints/ are the run's.
    assert any((run_dir / "work" / "checkpoints").iterdir())
    assert (Path(report.reference_dir) / "work" / "checkpoints").is_dir()
    assert leftovers(run_dir) == []


@pytest.mark.parametrize("bug, first, found", [
    ("skip", "step 5 on rank 0 (the first step after attempt 1 resumed from step 4)", "it drew other data"),
    ("stale", "step 3 on rank 0 (the first step after attempt 1 resumed from step 2)", "it drew other data"),
    ("rng", "step 5 on rank 0 (the first step after attempt 1 resumed from step 4)",
     "torch's RNG state at its start differs too"),
], ids=["skip", "stale", "rng"])
def test_a_wrong_resume_fails_naming_the_first_step_that_differs(bug, first, found, tmp_path, reference_dir,
                                                                 capsys, leftovers, monkeypatch):
    """The job recovers as far as the harness can see (killed, restarted, finished); only the step
    records tell, and they say where and what: exit 1, FAILED, the trainer reproducible."""
    monkeypatch.setenv("RESUME_BUG", bug)  # the environment: every mode shares one reference
    run_dir = tmp_path / "run"
    code = cli(["run", "--run-dir", str(run_dir), "--trainer", str(HERE / "torch_save_trainer.py"), "--fault",
                "kill:rank=1,step=5", "--reference-dir", str(reference_dir), "--no-png", "--job-timeout", "300",
                "--", *ARGS])
    out = capsys.readouterr().out
    report = json.loads((run_dir / "report.json").read_text())
    assert code == 1 and out.startswith(f"chaos run {run_dir}: FAILED"), out
    assert report["bitwise_verified"] and report["checks"]["job_completed"] and report["checks"]["recovered"], out
    assert report["checks"]["reproducible"], out  # so the difference is the resume's, not the trainer's
    [difference] = [p for p in report["problems"] if p.startswith("first difference: ")]
    assert first in difference and found in difference, difference
    if bug != "rng":
        assert not report["checks"]["steps_exact"] and "missing [" in out, out
    assert leftovers(run_dir) == []
