"""The reference trainer under real torchrun (2 ranks, gloo, tiny model), started as chaos
starts every trainer (`chaos.entry`, whose step probe records each optimizer step).

`torchrun_train` is also what test_checkpoint.py launches the trainer with. Two launches
giving the same bits, a resume equal to the uninterrupted run and a NaN stopped before the
optimizer are what every chaos run verifies against its fault-free reference (tests/chaos:
test_chaos_faults.py's `corrupt` is the NaN), so they are not launched again here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from chaos.comparison import compare, read_steps
from commlib.observe.events import read_events

# The tiniest config FlexAttention and FSDP2 take: each launch is dominated by process
# start (~2.5 s) and the compiled attention (~2 s per process with a warm inductor cache).
TINY = ("--backend", "gloo", "--dim", "16", "--layers", "2", "--heads", "2", "--seq-len", "64", "--vocab", "64",
        "--batch-size", "1")
PHASES = {"forward", "backward", "optimizer", "checkpoint"}
REPO = Path(__file__).resolve().parents[2]


def torchrun_train(workdir: Path, *args: object, extra_env: dict[str, str] | None = None,
                   torchrun_args: tuple[str, ...] = (), timeout: float = 240.0) -> None:
    """Run `torchrun --standalone --nproc-per-node 2 -m chaos.entry -m chaos.workload.train TINY args`;
    it must exit 0."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--log-dir", str(workdir / "torchrun"),  # its error files: not a /tmp directory left behind
           *torchrun_args, "-m", "chaos.entry", "-m", "chaos.workload.train", *TINY, *map(str, args)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CHAOS_", "TORCHELASTIC_", "COMMLIB_"))}
    # The ranks import this tree, whatever the editable install maps.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(OMP_NUM_THREADS="1", **(extra_env or {}))
    # A session of its own, so a timeout takes the ranks down with the launcher.
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"torchrun did not finish within {timeout} s:\n{out[-6000:]}")
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}:\n{out[-6000:]}"


@pytest.fixture(scope="module")
def reference(once: Callable[[str, Callable[[Path], Any]], tuple[Path, Any]]) -> Path:
    """An uninterrupted 4-step run, checkpointing at steps 2 and 4."""
    return once("train-reference", _reference)[0]


def _reference(run: Path) -> None:
    torchrun_train(run, "--steps", "4", "--ckpt-every", "2", "--ckpt-dir", run / "ckpt", "--log-dir", run / "logs")


STANDIN = REPO / "tests" / "torchcomms_standin"


def test_torchcomms_engine_trains_fsdp2_and_dcp_like_gloo(reference: Path, tmp_path: Path) -> None:
    """`--backend torchcomms`: the default group's engine is torchcomms (the stand-in here), so
    plain FSDP2's and DCP's collectives run on it, through commlib, to the same bits."""
    torchrun_train(tmp_path, "--steps", "4", "--ckpt-every", "2", "--ckpt-dir", tmp_path / "ckpt",
                   "--log-dir", tmp_path / "logs", "--backend", "torchcomms",
                   extra_env={"PYTHONPATH": os.pathsep.join([str(REPO), str(STANDIN)])})
    comparison = compare(read_steps(tmp_path), read_steps(reference))
    assert comparison.equal, comparison.problems
    starts = [e for e in read_events(tmp_path / "logs" / "rank0.jsonl") if e["event"] == "collective.start"]
    ops = {e["op"] for e in starts}
    assert {"all_gather_single", "reduce_scatter_single", "gather", "scatter", "broadcast"} <= ops  # FSDP2, DCP
    assert {e["backend"] for e in starts} == {"torchcomms:gloo"}


def test_log_has_each_steps_record_and_metrics(reference: Path) -> None:
    """The probe's record of every optimizer step (its loss the one the rank's backward ran
    from) beside the trainer's own metrics (the loss averaged over ranks)."""
    steps = read_steps(reference)
    assert (steps.step_source, steps.backend, steps.last_step) == ("optimizer", "commlib over gloo", 4)
    records = {rank: steps.records[(rank, 0)] for rank in (0, 1)}
    for rank in (0, 1):
        events = list(read_events(reference / "logs" / f"rank{rank}.jsonl"))
        assert [r.step for r in records[rank]] == [1, 2, 3, 4]
        assert all(r.params and r.optim and r.data and len(r.losses) == 1 for r in records[rank])
        metrics = [e for e in events if e["event"] == "train.metrics"]
        assert [e["step"] for e in metrics] == [1, 2, 3, 4]
        for e, r0, r1 in zip(metrics, records[0], records[1], strict=True):
            assert e["loss"] == (float.fromhex(r0.losses[0]) + float.fromhex(r1.losses[0])) / 2
            assert e["tokens"] == 2 * 64 * 1 and e["step_time_s"] > 0
            assert (e["rank"], e["size"], e["attempt"]) == (rank, 2, 0)
        phases = {e.get("phase") for e in events if e["event"] == "collective.start" and "step" in e}
        assert phases == PHASES
        assert [(e["event"], e["step"]) for e in events if e["event"] in ("ckpt.start", "ckpt.end")] == [
            ("ckpt.start", 2), ("ckpt.end", 2), ("ckpt.start", 4), ("ckpt.end", 4)]
    assert sorted(p.name for p in (reference / "ckpt").iterdir()) == ["step000002", "step000004"]


@pytest.mark.parametrize("argv, words", [
    (["--steps", "abc"], "argument --steps: expected --steps to be an integer in [0, 1e+15]; found 'abc'"),
    (["--steps", "-1"], "argument --steps: expected --steps to be an integer in [0, 1e+15]; found '-1'"),
    (["--ckpt-every", "1" + "0" * 400], "argument --ckpt-every: expected --ckpt-every to be an integer"),
    (["--timeout", "-1"], "argument --timeout: expected --timeout to be a finite number of seconds"),
    (["--timeout", "nan"], "argument --timeout: expected --timeout to be a finite number of seconds"),
    (["--timeout", "1e308"], "argument --timeout: expected --timeout to be a finite number of seconds"),
    (["--recovery-join-timeout", "0"], "argument --recovery-join-timeout: expected --recovery-join-timeout to be"),
    (["--lr", "inf"], "argument --lr: expected --lr to be a finite number"),
    (["--dim", "0"], "argument --dim: expected --dim to be an integer in [1, "),
    (["--backend", "bogus"], "argument --backend: expected --backend to be one of ['auto', 'gloo', 'nccl', "),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--dim", "30", "--heads", "4"], "ModelConfig.dim: expected a multiple of n_heads=4, found 30"),
    (["--backend", "nccl"], "expected --device cuda with --backend nccl"),
])
def test_bad_arguments_are_refused_naming_them(capsys: pytest.CaptureFixture[str], argv: list[str],
                                               words: str) -> None:
    """The same refusal from the trainer's own command line (exit 2) and, before anything is
    launched, from the harness's check of the arguments it would launch the trainer with."""
    from chaos.workload import train

    with pytest.raises(SystemExit) as exited:
        train.parse_args(argv)
    assert exited.value.code == 2 and words in capsys.readouterr().err
    with pytest.raises(ValueError) as refused:
        train.check_args(argv)
    assert words in str(refused.value)
