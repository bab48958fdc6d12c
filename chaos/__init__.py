"""chaos: break a training job on purpose, and prove it recovered bitwise-exactly.

    report = chaos.run(["kill:rank=1,step=5", "delay:rank=0,step=9"],
                       trainer_args=["--steps", "12", "--ckpt-every", "2", "--timeout", "10"])
    assert report.passed, report.summary()

or, from a shell, ``python -m chaos run`` (see ``chaos/__main__.py``).

`run` runs (or finds cached) a fault-free reference of the job and checks the plan against
what it showed of the trainer (`chaos.verify`), launches the trainer under torchrun with
restarts allowed (`chaos.harness`; each rank through `chaos.entry`, which records its steps:
`chaos.probe`), injects the plan's faults (`chaos.plan`; from outside with signals, or from
inside the ranks through commlib's hooks: `chaos.inject`), then compares the run with the
reference step by step (`chaos.verify`) and writes ``report.json`` and ``report.png`` in the
run directory (`chaos.report`). Any trainer runs unmodified: docs/own-trainer.md.

Ranks import `chaos.entry`, `chaos.inject` and `chaos.probe`; this package's own import stays
light so they do not pay for the harness, psutil or matplotlib.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chaos.plan import Plan
    from chaos.report import Report

DEFAULT_RUNS = "runs"


def run(
    plan: Plan | dict[str, Any] | str | os.PathLike[str] | Sequence[str] | None,
    run_dir: str | os.PathLike[str] | None = None,
    trainer_args: Sequence[str] | None = None,
    *,
    trainer: str = "chaos.workload.train",
    nproc_per_node: int = 2,
    nnodes: int = 1,
    backend: str = "gloo",
    timeout_s: float = 600.0,
    rdzv_endpoint: str | None = None,
    node_rank: int | None = None,
    rdzv_id: str | None = None,
    max_restarts: int | None = None,
    digest_every: int = 1,
    reference_dir: str | os.PathLike[str] | None = None,
    verify: bool = True,
    png: bool = True,
    progress: Callable[[str], None] | None = None,
) -> Report | None:
    """Run `trainer` under `plan`, verify it against the fault-free reference, and report.

    `plan`: a `Plan`, its dict form, a YAML/JSON file, a list of CLI shorthands
    (``"kill:rank=1,step=5"``), or None for no faults. It is validated against the world
    size before anything starts (`chaos.plan.PlanError`).
    `run_dir`: default a new directory under ``runs/``. `trainer_args`: the trainer's
    arguments (``{run_dir}`` is replaced); default, for the reference trainer, a small
    30-step run (`chaos.harness.DEFAULT_TRAINER_ARGS`).
    `reference_dir`: where fault-free references are cached by config (default
    ``<run_dir>/../.reference``); `verify=False` skips the reference and the bitwise checks.
    `digest_every`: every how many steps the ranks digest their state (`chaos.probe`).
    `timeout_s` bounds each of the faulted and the reference runs; the job is stopped
    when it expires. Returns the `Report`; `report.passed` is the verdict. A bad value (of the
    plan, a directory that cannot be made, the reference trainer's arguments or the devices
    they need here) raises before anything starts: `chaos.plan.PlanError`, or ValueError
    naming the value; so does, before the faulted run starts, a plan whose faults could not
    fire in the trainer as its fault-free run showed it (`chaos.verify.check_against_reference`).

    With `rdzv_endpoint`, this process is the harness of one node (`node_rank`) of a
    multi-node job with rendezvous id `rdzv_id`, whose nodes share `run_dir` (`chaos.multinode`):
    the verdict is node 0's, and the other nodes, or a node stopped by SIGTERM, return None.
    """
    from chaos import harness
    from chaos import verify as verifier
    from chaos.options import LONGEST_S, directory_problem
    from chaos.plan import Plan, load_plan, parse_shorthand
    from commlib import settings

    timeout_s = settings.number(timeout_s, "timeout_s", above=0.0, high=LONGEST_S, unit="seconds")
    for name, directory in (("run_dir", run_dir), ("reference_dir", reference_dir)):
        problem = None if directory is None else directory_problem(directory, name, empty=False)
        if problem is not None:
            raise ValueError(problem)
    if plan is None:
        plan = Plan()
    elif isinstance(plan, dict):
        plan = Plan.from_dict(plan)
    elif isinstance(plan, (str, os.PathLike)):
        plan = load_plan(plan)
    elif not isinstance(plan, Plan):
        plan = Plan(tuple(parse_shorthand(s) for s in plan))
    if max_restarts is not None:
        plan = Plan(plan.faults, max_restarts)
    if trainer_args is None:
        trainer_args = harness.default_trainer_args(trainer)
    job = harness.Job(
        trainer=trainer,
        trainer_args=tuple(trainer_args),
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        backend=backend,
        rdzv_endpoint=rdzv_endpoint,
        node_rank=node_rank,
        rdzv_id=rdzv_id,
        digest_every=digest_every,
    )
    plan = plan.resolve(job.world_size)
    run_dir = Path(run_dir) if run_dir is not None else new_run_dir()
    if rdzv_endpoint is not None:
        from chaos.multinode import run_node

        shared = Path(reference_dir) if reference_dir is not None else run_dir.absolute().parent / ".reference"
        return run_node(
            job,
            plan,
            run_dir,
            reference_root=shared if verify else None,
            png=png,
            timeout_s=timeout_s,
            progress=progress,
        )
    harness.check_plan(job, plan, timeout_s)  # what needs no reference is refused before it runs
    root = None
    reference: Path | verifier.ReferenceRunError | None = None
    if verify:
        root = Path(reference_dir) if reference_dir is not None else run_dir.absolute().parent / ".reference"
        try:
            reference = verifier.ensure_reference(job, root, timeout_s=timeout_s, progress=progress)
        except verifier.ReferenceRunError as exc:
            reference = exc  # the verdict says why there is no bitwise check
        else:
            verifier.check_against_reference(job, plan, reference, timeout_s)
    outcome = harness.run_job(job, plan, run_dir, timeout_s=timeout_s, progress=progress)
    report = verifier.verify(
        job, plan, outcome, reference_root=root, timeout_s=timeout_s, progress=progress, reference=reference
    )
    report.write(run_dir, png=png)
    return report


def new_run_dir(base: str | os.PathLike[str] = DEFAULT_RUNS) -> Path:
    """A fresh directory under `base`, named by the time."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        path = Path(base) / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"new_run_dir: expected a free name under {base}; found {stamp} to {stamp}-999 taken")


def __getattr__(name: str) -> Any:
    # Lazy public names, so `import chaos.inject` in a rank stays cheap.
    if name in ("Plan", "PlanError", "load_plan", "parse_shorthand"):
        from chaos import plan

        return getattr(plan, name)
    if name == "Report":
        from chaos.report import Report

        return Report
    raise AttributeError(f"module 'chaos' has no attribute {name!r}")
