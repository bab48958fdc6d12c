"""Soak: faults drawn from a seed in one run, through the command line, verified bitwise.

Seed 1 draws, for two faults, a kill during a checkpoint and a NaN: both recovery paths
(restart and in-job) in one run, neither of which waits out a deadline.
The plan is a pure function of (n, seed, world size).
"""

import json

from chaos.__main__ import main
from chaos.soak import SOAK_GAP, soak_plan, soak_trainer_args


def test_the_plan_is_drawn_from_the_seed_and_placed_after_checkpoints():
    plan = soak_plan(20, 7, 2)
    assert plan == soak_plan(20, 7, 2) and plan != soak_plan(20, 8, 2)
    steps = [int(f.trigger.value) for f in plan.faults]
    assert steps == [SOAK_GAP * (k + 1) + 1 for k in range(20)]
    args = soak_trainer_args(20)
    assert int(args[args.index("--steps") + 1]) > steps[-1]


def test_two_drawn_faults_in_one_run_recover_bitwise(tmp_path, reference_dir, leftovers, capsys):
    run_dir = tmp_path / "run"
    code = main(["run", "--soak", "2", "--seed", "1", "--run-dir", str(run_dir), "--reference-dir",
                 str(reference_dir)])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads((run_dir / "report.json").read_text())
    assert report["passed"] and report["bitwise_verified"], out
    assert [f["type"] for f in report["faults"]] == [f.type.value for f in soak_plan(2, 1, 2).faults]
    assert {f["recovery"] for f in report["faults"]} == {"in_job", "restart"}
    assert all(f["first_step_after_s"] is not None for f in report["faults"])
    assert (run_dir / "report.png").stat().st_size > 10_000
    assert leftovers(run_dir) == []
