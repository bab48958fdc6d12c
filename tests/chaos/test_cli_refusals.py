"""Every bad value on the chaos command lines is refused before anything launches or is
submitted: exit 2, naming the option or the field, and no run directory left behind.

`python -m chaos run` and `sbatch` (the plan, the job's options, the reference trainer's own
arguments and its backend), and `python -m chaos.slurm.cluster`. None of these launch torchrun,
so each takes milliseconds.
"""

import pytest
import torch

from chaos.__main__ import main as cli
from chaos.slurm.batch import main as batch_cli
from chaos.slurm.cluster import main as cluster_cli

BIG = "1" + "0" * 400
HUGE = "1" + "0" * 30


def _exit_code(argv):
    try:
        return cli(argv)
    except SystemExit as exited:  # argparse's own refusals
        return exited.code


@pytest.mark.parametrize("args, named, words", [
    # Impossible faults: each would overflow, or outlast the job, inside the rank.
    (["--fault", "delay:rank=1,step=3,duration_s=1e308"], ".duration_s", "expected duration_s to be a finite number"),
    (["--fault", "gil:rank=1,step=3,duration_s=1e308"], ".duration_s", "expected duration_s to be a finite number"),
    (["--fault", "hang:rank=1,step=3,duration_s=1e300,release=cont"], ".duration_s", "<= 604800"),
    (["--job-timeout", "60", "--fault", "hang:rank=1,step=3,duration_s=100,release=cont"], "faults[0].duration_s",
     "under the job's timeout of 60 s"),
    (["--fault", f"kill:rank=1,step={BIG}"], ".step", "expected step to be an integer in [0, 1e+15]"),
    (["--fault", f"delay:rank=1,step=3,duration_s={BIG}"], ".duration_s", "expected duration_s"),
    (["--fault", f"straggler:rank=1,ms={BIG}"], ".ms", "expected ms"),
    (["--fault", f"kill:rank=1,step=3,count={HUGE}"], ".count", "expected count to be an integer in [1, 1e+06]"),
    # The run's own options.
    (["--max-restarts", HUGE], "--max-restarts", "expected --max-restarts to be an integer in [0, 1e+06]"),
    (["--job-timeout", "1e308"], "--job-timeout", "expected --job-timeout to be a finite number of seconds"),
    (["--job-timeout", "nan"], "--job-timeout", "expected --job-timeout to be a finite number of seconds"),
    (["--nproc-per-node", BIG], "--nproc-per-node", "expected --nproc-per-node to be an integer in [1, 1024]"),
    (["--nnodes", "0"], "--nnodes", "expected --nnodes to be an integer in [1, 10000]"),
    (["--soak", HUGE], "--soak", "expected --soak to be an integer in [1, 10000]"),
    (["--soak", "2", "--seed", "-1"], "--seed", "expected --seed to be an integer in [0, 1e+15]"),
    (["--node-rank", "x"], "--node-rank", "expected --node-rank to be an integer"),
    (["--rdzv-endpoint", "nohost", "--node-rank", "0", "--rdzv-id", "j"], "--rdzv-endpoint", "expected HOST:PORT"),
    (["--rdzv-endpoint", "h:70000", "--node-rank", "0", "--rdzv-id", "j"], "--rdzv-endpoint",
     "expected its port to be an integer in [1, 65535]"),
    (["--rdzv-endpoint", "h:29400", "--node-rank", "0", "--rdzv-id", "a\nb"], "--rdzv-id", "printable"),
    (["--backend", "bogus"], "--backend", "expected --backend to be one of"),
    (["--reference-dir", "/proc/x"], "--reference-dir /proc/x", "expected a directory this process can create"),
    (["--plan", ""], "--plan", "expected --plan to be a non-empty line"),
    (["--fault", "kill:rank=1,step=3\nkill:rank=0,step=4"], "--fault", "expected --fault to be a non-empty line"),
    (["--nnodes", "600"], "Job", "expected at most 1024 ranks on this machine; found 600 local node(s) of 2"),
    # The reference trainer's arguments, read by the trainer's own parser.
    (["--", "--steps", "abc"], "--steps", "expected --steps to be an integer"),
    (["--", "--steps", "-1"], "--steps", "expected --steps to be an integer in [0, 1e+15]; found '-1'"),
    (["--", "--timeout", "-1"], "--timeout", "expected --timeout to be a finite number of seconds"),
    (["--", "--timeout", "nan"], "--timeout", "expected --timeout to be a finite number of seconds"),
    (["--", "--steps", "8", "--no-such-flag"], "the reference trainer's arguments", "--no-such-flag"),
    (["--", "--dim", "30", "--heads", "4"], "the reference trainer's arguments", "expected a multiple of n_heads=4"),
    (["--", "--backend", "nccl", "--device", "cpu"], "--device", "expected --device cuda with --backend nccl"),
])
def test_run_refuses_before_launching(tmp_path, capsys, args, named, words):
    run_dir = tmp_path / "run"
    assert _exit_code(["run", "--run-dir", str(run_dir), "--no-verify", *args]) == 2
    err = capsys.readouterr().err
    assert named in err and words in err, err
    assert not run_dir.exists()


def test_nccl_without_a_gpu_per_rank_is_refused_before_launching(tmp_path, capsys):
    run_dir = tmp_path / "run"
    ranks = max(2, torch.cuda.device_count() + 1)  # more than this machine has, with or without GPUs
    assert _exit_code(["run", "--run-dir", str(run_dir), "--no-verify", "--backend", "nccl",
                       "--nproc-per-node", str(ranks)]) == 2
    err = capsys.readouterr().err
    assert f"--backend nccl: expected a GPU for each of the {ranks} ranks of a node" in err, err
    assert not run_dir.exists()


def test_a_run_dir_that_cannot_be_made_is_refused_naming_it(capsys):
    assert _exit_code(["run", "--run-dir", "/proc/x", "--no-verify"]) == 2
    assert "--run-dir /proc/x: expected a directory this process can create" in capsys.readouterr().err
    assert _exit_code(["run", "--run-dir", "", "--no-verify"]) == 2
    assert "argument --run-dir: expected --run-dir to be a non-empty line" in capsys.readouterr().err


def test_a_plan_that_is_a_directory_is_said_to_be_one(tmp_path, capsys):
    assert _exit_code(["run", "--run-dir", str(tmp_path / "run"), "--plan", str(tmp_path)]) == 2
    assert f"{tmp_path}: expected a YAML or JSON plan file; found a directory" in capsys.readouterr().err


@pytest.mark.parametrize("args, named", [
    (["--rdzv-port", "70000"], "rdzv_port (--rdzv-port)"),
    (["--notice", "99999999"], "notice_s (--notice)"),
    (["--max-requeues", HUGE], "max_requeues (--max-requeues)"),
    (["--partition", "debug\n#SBATCH --nodelist=other"], "partition (--partition)"),
    (["--time", "10:00\nrm -rf /"], "time_limit (--time)"),
    (["--time", "soon"], "time_limit (--time)"),
    (["--sbatch-arg", "--exclusive\n#SBATCH --nodes=99"], "sbatch_args (--sbatch-arg)"),
    (["--run-dir", "with space"], "the run directory (--run-dir)"),
])
def test_sbatch_refuses_before_writing_or_submitting_anything(tmp_path, capsys, args, named):
    run_dir = tmp_path / "run"
    args = [str(tmp_path / a) if a == "with space" else a for a in args]  # in the test's directory
    assert _exit_code(["sbatch", "--run-dir", str(run_dir), "--nnodes", "2", *args]) == 2
    err = capsys.readouterr().err
    assert f"expected {named} to be" in err, err
    assert not run_dir.exists()


@pytest.mark.parametrize("args, words", [
    (["up", "--dir", "/proc/x", "--nodes", "2"], "--dir /proc/x: expected a directory this process can create"),
    (["up", "--nodes", HUGE], "expected --nodes to be an integer in [1, 200]"),
])
def test_the_cluster_command_refuses_before_bringing_anything_up(tmp_path, capsys, args, words):
    argv = [*args, "--dir", str(tmp_path / "cluster")] if "--dir" not in args else args
    try:
        code = cluster_cli(argv)
    except SystemExit as exited:
        code = exited.code
    assert code == 2
    assert words in capsys.readouterr().err
    assert not (tmp_path / "cluster").exists()


@pytest.mark.parametrize("command, needed", [("timings", "submitted_ns, report.json"), ("driver", "slurm.json"),
                                             ("node", "slurm.json")])
def test_the_batch_commands_refuse_a_directory_that_is_not_a_jobs(tmp_path, capsys, command, needed):
    assert batch_cli([command, str(tmp_path)]) == 2
    assert f"expected the run directory of a chaos sbatch job (with {needed}); found no" in capsys.readouterr().err


def test_a_run_dir_another_nodes_harness_makes_meanwhile_is_no_refusal(tmp_path, monkeypatch):
    """Two harnesses of one multi-node run check their shared --run-dir at the same moment: the
    one whose probe finds it just made by the other takes it as the directory it now is."""
    from pathlib import Path

    from chaos.options import directory_problem

    target, real_mkdir = tmp_path / "run", Path.mkdir

    def other_node_first(self, *args, **kwargs):
        if self == target and not target.exists():
            real_mkdir(self)  # the other node's harness, a moment earlier
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", other_node_first)
    assert directory_problem(target, "--run-dir", empty=True) is None
    assert directory_problem(tmp_path / "ref", "--reference-dir", empty=False) is None
