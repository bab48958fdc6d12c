"""Shared setup of the chaos tests: one cache of fault-free references, the tiny trainer
config every run uses, the check that a run left no process behind, and a run of the tiny
config that must pass."""

from pathlib import Path

import psutil
import pytest

import chaos
from chaos.harness import RUN_DIR_ENV

# The collective deadline of the chaos tests: what a timeout fault costs each test. The
# trainer compiles FlexAttention and meets at a barrier with its own startup deadline before
# its first step (ranks compile 24-46 s apart at a load of 10 on 2 cores), so this only has
# to cover a step and a checkpoint of the tiny model on a loaded machine.
DEADLINE_S = 10.0
# The smallest reference trainer run that still checkpoints and restarts: 8 steps,
# checkpoints every 2.
TINY = ("--steps", "8", "--ckpt-every", "2", "--timeout", str(DEADLINE_S), "--dim", "16", "--layers", "2",
        "--heads", "2", "--seq-len", "64", "--vocab", "64", "--batch-size", "1")


@pytest.fixture(scope="session")
def tiny_args():
    return TINY


@pytest.fixture(scope="session")
def deadline_s():
    return DEADLINE_S


@pytest.fixture(scope="session")
def reference_dir(session_dir):
    """One reference cache for the whole session, shared by pytest-xdist workers (a file
    lock in `chaos.verify.ensure_reference` makes the first caller compute it, the rest wait)."""
    path = session_dir / "chaos-reference"
    path.mkdir(exist_ok=True)
    return path


def _processes_of(run_dir: Path) -> list[psutil.Process]:
    """Every live process started for the run: all of them inherit its CHAOS_RUN_DIR."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(RUN_DIR_ENV) == str(run_dir.absolute()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _named(procs):
    """(pid, name) of each process still there to be named (one gone since it was found is no leftover)."""
    found = []
    for proc in procs:
        try:
            found.append((proc.pid, proc.name()))
        except psutil.NoSuchProcess:  # it exited between the scan and its name (seen in run AB)
            continue
    return found


@pytest.fixture
def leftovers():
    """leftovers(run_dir) -> the run's processes still alive (expected: none)."""
    return lambda run_dir: _named(_processes_of(Path(run_dir)))


@pytest.fixture
def passing_run(tmp_path, tiny_args, reference_dir, leftovers):
    """passing_run(faults, checks, nnodes=1, nproc_per_node=2) -> (report, run_dir): `faults` on
    the tiny config in that topology; the run passed, bitwise, with `checks` among its checks,
    and left nothing running."""
    def run(faults, checks, *, nnodes=1, nproc_per_node=2):
        run_dir = tmp_path / "run"
        report = chaos.run(faults, run_dir, tiny_args, reference_dir=reference_dir, png=False, nnodes=nnodes,
                           nproc_per_node=nproc_per_node)
        assert report.passed, report.summary()
        assert report.bitwise_verified
        assert set(checks) <= set(report.checks), report.checks
        assert leftovers(run_dir) == []
        # torchrun kept its workers' error files here, not in a /tmp directory nothing removes
        # (`chaos.job.torchrun_errors_dir`): it made the directory it was given.
        assert all((run_dir / "torchrun" / f"node{n}").is_dir() for n in range(nnodes)), list(run_dir.iterdir())
        return report, run_dir

    return run
