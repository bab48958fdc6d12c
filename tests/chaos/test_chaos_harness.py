"""Harness mechanics on a toy trainer (a user's own, unmodified): faults, timings and the bitwise
proof for a trainer that knows nothing of chaos, the plan refused where the trainer's fault-free
run shows its faults could not fire, and cleanup after success, failure, Ctrl-C with a stopped
rank, and the harness's own timeout."""

import json
from pathlib import Path

import psutil
import pytest

import chaos
from chaos.__main__ import main as cli
from chaos.harness import Job, journal_name, run_job
from chaos.plan import Ledger, Plan, parse_shorthand
from commlib.observe.events import read_events
from commlib.observe.run_logs import load

TOY = str(Path(__file__).with_name("toy_trainer.py"))


def test_users_trainer_gets_faults_timings_and_the_bitwise_proof(tmp_path, reference_dir, leftovers, capsys):
    """A trainer that imports neither chaos nor commlib: its steps are counted, the kill lands at
    its step 3, and its run (restarted from scratch: it keeps no checkpoint) is its reference's, bitwise."""
    run_dir = tmp_path / "run"
    code = cli(["run", "--run-dir", str(run_dir), "--trainer", TOY, "--fault", "kill:rank=1,step=3",
                "--reference-dir", str(reference_dir), "--no-png", "--", "--steps", "5", "--step-time", "0.2"])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads((run_dir / "report.json").read_text())
    assert report["passed"] and report["bitwise_verified"], out
    assert {"steps_exact", "losses_bitwise", "steps_bitwise", "state_bitwise"} <= set(report["checks"])
    assert report["backend"] == "commlib over gloo" and "(commlib over gloo), 5 steps, 1 restart," in out
    [fault] = report["faults"]
    assert (fault["type"], fault["rank"], fault["step"], fault["resumed_from"]) == ("kill", 1, 3, 0)
    assert fault["steps_reexecuted"] == 2  # steps 1 and 2, trained again from scratch
    assert fault["detected_after_s"] < 1.0
    assert fault["restart_after_s"] is not None and fault["first_step_after_s"] >= fault["restart_after_s"]
    assert leftovers(run_dir) == []


@pytest.mark.parametrize("fault, trainer_args, field, words", [
    ("delay:rank=1,step=2", ["--optimizer", "sgd", "--backend", "gloo"], "faults[0].step",
     "expected a trainer whose optimizer keeps its own step count"),
    ("delay:rank=1,after_s=1", ["--optimizer", "sgd", "--backend", "gloo"], "faults[0].type",
     "a delay fault acts inside commlib's collectives; expected the trainer's default process group on commlib's "
     "backend (init_process_group(backend=\"commlib\")); found its fault-free run on gloo"),
    ("kill:rank=1,after_s=500", ["--optimizer", "sgd", "--backend", "gloo"], "faults[0].after_s",
     "expected a time before the trainer's last step"),
    ("kill:rank=1,step=6", ["--backend", "commlib"], "faults[0].step", "expected a step the run reaches (from 1, "
     "at most 5, its last step"),
])
def test_a_plan_the_trainer_cannot_fire_is_refused_before_its_launch(tmp_path, reference_dir, capsys, fault,
                                                                    trainer_args, field, words):
    """What the trainer's fault-free run showed refuses a plan that could not fire in it (exit 2),
    before the faulted job launches."""
    run_dir = tmp_path / "run"
    code = cli(["run", "--run-dir", str(run_dir), "--trainer", TOY, "--fault", fault, "--reference-dir",
                str(reference_dir), "--no-png", "--", "--steps", "5", *trainer_args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"chaos: {field}: " in err and words in err, err
    assert not (run_dir / "job.json").exists()  # nothing launched


def test_a_trainer_whose_fault_free_runs_differ_is_said_first_to_be_not_reproducible(tmp_path, reference_dir):
    """No fault at all, and the run differs from its reference: a second fault-free run differs
    too, and the report says first that the trainer is not reproducible, blaming no recovery."""
    report = chaos.run(None, tmp_path / "run", ["--steps", "3", "--unseeded"], trainer=TOY,
                       reference_dir=reference_dir, png=False)
    assert not report.passed and report.checks["reproducible"] is False, report.summary()
    assert report.problems[0].startswith(
        "reproducible: expected two fault-free runs of the trainer to compute the same steps bitwise; found step 1 "
        "on rank 0 differs from the reference's: its data, loss"), report.problems
    assert "may be the trainer's own, not the recovery's" in report.problems[0]
    assert list(report.checks).index("reproducible") < list(report.checks).index("steps_exact")


def test_failed_job_is_reported_and_leaves_nothing(tmp_path, leftovers):
    run_dir = tmp_path / "run"
    report = chaos.run(None, run_dir, ["--steps", "4", "--fail-rank", "1"], trainer=TOY, verify=False, png=False)
    assert not report.passed and report.checks == {"job_completed": False}
    assert report.exit_codes == [1]
    assert leftovers(run_dir) == []


def test_ctrl_c_with_a_stopped_rank_leaves_nothing(tmp_path, leftovers):
    run_dir = tmp_path / "run"
    # The hang is never released on its own: the collective deadline is far away.
    plan = Plan((parse_shorthand("hang:rank=1,step=2"),)).resolve(2)
    job = Job(trainer=TOY, trainer_args=("--steps", "50", "--step-time", "0.1", "--timeout", "600"))

    def interrupt_once_hung(line: str) -> None:
        if "faults injected 1/1" in line:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_job(job, plan, run_dir, timeout_s=300, progress=interrupt_once_hung)
    [hang] = Ledger(run_dir / "chaos_state").firings()
    assert not psutil.pid_exists(hang.detail["pid"]) or psutil.Process(hang.detail["pid"]).status() == "zombie"
    assert leftovers(run_dir) == []


def test_harness_timeout_stops_the_job(tmp_path, leftovers):
    run_dir = tmp_path / "run"
    job = Job(trainer=TOY, trainer_args=("--steps", "2", "--step-time", "1000"))
    # 45 s: the agent and its workers must be up when it expires. A loaded machine took over
    # 20 s to start them once (the agent's and each worker's imports: seconds of CPU each).
    outcome = run_job(job, Plan(), run_dir, timeout_s=45)
    assert outcome.timed_out and not outcome.ok and outcome.exit_codes == [None]
    assert len(outcome.pids) > 1  # the agent and its workers were running when the timeout hit
    assert leftovers(run_dir) == []
    # Before stopping the hung job, the harness asked every rank where it was: its stacks
    # (SIGUSR2) and its flight recorder (SIGUSR1), which the doctor shows.
    [timeout] = [e for e in read_events(run_dir / journal_name(job)) if e["event"] == "harness.timeout"]
    assert timeout["asked_for_dumps"] == [0, 1]
    logs = run_dir / "logs"
    assert len(list(logs.glob("stacks_*.txt"))) == 2 and len(list(logs.glob("flight_rank*_sigusr1.json"))) == 2
    sleeping = next(n for n, line in enumerate(Path(TOY).read_text().splitlines(), 1) if "time.sleep(" in line)
    [attempt] = load(logs).attempts.values()
    assert {r: rl.signal_stack[-1].strip() for r, rl in attempt.ranks.items()} == {  # type: ignore[index]
        r: f'File "{TOY}", line {sleeping}, in main' for r in (0, 1)}  # the step's sleep, where it hung
