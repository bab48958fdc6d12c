"""``python -m chaos run``: the command line of `chaos.run`; ``python -m chaos sbatch``: the same
run as a Slurm job, one harness per node (`chaos.slurm.batch`).

    python -m chaos run                                   # the main job: see harness.DEFAULT_*
    python -m chaos run --fault kill:rank=1,step=5 --fault hang:rank=0,step=9 -- --steps 12
    python -m chaos run --plan plan.yaml --nproc-per-node 4
    python -m chaos run --soak 20 --seed 7                # 20 faults drawn from seed 7 (chaos.soak)
    python -m chaos run --trainer my_train.py --fault kill:rank=1,step=20 -- --its-own-args
                                                          # any trainer, unmodified

One machine of a multi-node job runs its node's harness; node 0 gives the verdict once every
node is done (`chaos.multinode`)::

    python -m chaos run --nnodes 2 --node-rank 0 --rdzv-endpoint HOST0:29400 --rdzv-id myjob --run-dir /shared/run
    python -m chaos run --nnodes 2 --node-rank 1 --rdzv-endpoint HOST0:29400 --rdzv-id myjob --run-dir /shared/run

Under Slurm, submitted from a login node (the run directory on a shared file system)::

    python -m chaos sbatch --nnodes 2 --fault preempt:step=6 --fault node_loss:rank=3,step=12 --run-dir /shared/run

Everything after ``--`` goes to the trainer. Exit status: 0 when every check held, 1 when
one failed, 2 for a bad plan or command line, 130 when interrupted, 143 for one node of a
multi-node job stopped by SIGTERM (a preemption: the job goes on in its next launch).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

from chaos.harness import DEFAULT_FAULTS, REFERENCE_TRAINER, Job, check_plan, default_trainer_args
from chaos.options import LARGEST_INDEX, LONGEST_S, MOST_FIRINGS, MOST_NODES, MOST_PER_NODE, directory_problem, option
from chaos.plan import RESTART_MARGIN, Plan
from chaos.slurm.batch import DEFAULT_NOTICE_S, DEFAULT_RDZV_PORT, Settings
from chaos.soak import MOST_SOAK_FAULTS
from commlib import settings
from commlib.initialize import BACKENDS

EXIT_STOPPED = 143


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m chaos", description="Fault injection with bitwise-verified recovery.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser(
        "run",
        help="run a trainer under a fault plan and verify it recovered",
        description="Run a trainer under torchrun with a fault plan, then verify the run against a "
        "fault-free reference. Arguments after -- go to the trainer.",
    )
    _job_options(r)
    r.add_argument(
        "--node-rank",
        type=option(settings.integer, "--node-rank", low=0, high=MOST_NODES - 1),
        default=None,
        help="this machine's node (with --rdzv-endpoint)",
    )
    r.add_argument(
        "--rdzv-endpoint", type=_endpoint, default=None, help="HOST:PORT of a multi-node job's rendezvous, on node 0"
    )
    r.add_argument(
        "--rdzv-id",
        type=option(settings.text, "--rdzv-id"),
        default=None,
        help="the multi-node job's id, the same on every node",
    )
    r.add_argument("trainer_args", nargs=argparse.REMAINDER, help="-- then the trainer's arguments")
    b = sub.add_parser(
        "sbatch",
        help="submit the run as a Slurm job, one harness per node",
        description="Submit a chaos run as an sbatch job: one harness per node, preemption and "
        "requeue, the --signal notice; wait for its verdict. Arguments after -- go to "
        "the trainer.",
    )
    _job_options(b)
    # Checked, with the rest of the job's Slurm settings, by `chaos.slurm.batch.Settings`.
    b.add_argument("--partition", default=None, help="sbatch --partition")
    b.add_argument("--time", default=None, help="sbatch --time (the job's time limit)")
    b.add_argument(
        "--notice",
        default=DEFAULT_NOTICE_S,
        help="seconds before the end (a time limit, a preemption's grace) the notice comes (sbatch --signal=B:USR1@N)",
    )
    b.add_argument("--sbatch-arg", action="append", default=[], help="another sbatch option (repeatable)")
    b.add_argument("--max-requeues", default=5, help="refuse to run the job again past this")
    b.add_argument("--rdzv-port", default=DEFAULT_RDZV_PORT, help="the rendezvous port on node 0")
    b.add_argument("--no-wait", action="store_true", help="submit and return (the job writes its verdict)")
    b.add_argument("trainer_args", nargs=argparse.REMAINDER, help="-- then the trainer's arguments")
    from chaos.replicas_cli import add_command  # python -m chaos replicas: replica groups under torchft

    add_command(sub)
    return p


def _job_options(r: argparse.ArgumentParser) -> None:
    """The options of a run, with or without Slurm."""
    count = partial(option, settings.integer)
    r.add_argument("--plan", type=option(settings.text, "--plan", spaces=True), help="a YAML or JSON fault plan")
    r.add_argument(
        "--fault",
        type=option(settings.text, "--fault", spaces=True),
        action="append",
        default=[],
        metavar="TYPE:key=value,...",
        help="a fault, e.g. kill:rank=1,step=5 (repeatable; added to --plan's)",
    )
    r.add_argument(
        "--soak",
        type=count("--soak", low=1, high=MOST_SOAK_FAULTS),
        default=None,
        metavar="N",
        help="draw N faults from --seed over one longer run of the reference trainer (chaos.soak)",
    )
    r.add_argument(
        "--seed", type=count("--seed", low=0, high=LARGEST_INDEX), default=0, help="the seed --soak draws from"
    )
    r.add_argument(
        "--run-dir",
        type=option(settings.text, "--run-dir", spaces=True),
        help="where logs, checkpoints, plan and report go (default: a new dir under runs/)",
    )
    r.add_argument(
        "--trainer",
        type=option(settings.text, "--trainer", spaces=True),
        default=REFERENCE_TRAINER,
        help="a module (run with -m) or a script path",
    )
    r.add_argument("--nproc-per-node", type=count("--nproc-per-node", low=1, high=MOST_PER_NODE), default=2)
    r.add_argument(
        "--nnodes",
        type=count("--nnodes", low=1, high=MOST_NODES),
        default=1,
        help="nodes; for run without --rdzv-endpoint all of them run on this machine",
    )
    r.add_argument(
        "--backend",
        type=option(settings.choice, "--backend", choices=BACKENDS),
        default="gloo",
        help="passed to the reference trainer (gloo, nccl: then with --device cuda)",
    )
    r.add_argument(
        "--max-restarts",
        type=count("--max-restarts", low=0, high=MOST_FIRINGS),
        default=None,
        help=f"torchrun's; default: one per possible fault firing, plus {RESTART_MARGIN}",
    )
    r.add_argument(
        "--job-timeout",
        type=option(settings.number, "--job-timeout", above=0.0, high=LONGEST_S, unit="seconds"),
        default=900.0,
        help="stop the job (and the reference run) after this many seconds each",
    )
    r.add_argument(
        "--reference-dir",
        type=option(settings.text, "--reference-dir", spaces=True),
        default=None,
        help="cache of fault-free references (default: <runs>/.reference)",
    )
    r.add_argument(
        "--digest-every",
        type=count("--digest-every", low=1, high=LARGEST_INDEX),
        default=1,
        metavar="K",
        help="digest each rank's parameters and optimizer state every K steps (losses and data: every step)",
    )
    r.add_argument("--no-verify", action="store_true", help="skip the reference run and the bitwise checks")
    r.add_argument("--no-png", action="store_true", help="do not draw report.png")


def _endpoint(text: str) -> str:
    """An argparse type: HOST:PORT, the port a TCP port."""
    host, colon, port = text.rpartition(":")
    if not colon or not host:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT; found {text!r}")
    option(settings.text, "its host")(host)
    option(settings.integer, "its port", low=1, high=65535)(port)
    return text


def _progress(line: str) -> None:
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K" + line)
    else:
        sys.stderr.write(line + "\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    from chaos.plan import PlanError

    args = _parser().parse_args(argv)
    if args.command == "replicas":
        from chaos.replicas_cli import command

        return command(args)
    trainer_args = args.trainer_args[1:] if args.trainer_args[:1] == ["--"] else args.trainer_args
    slurm = args.command == "sbatch"
    try:
        plan, trainer_args = _plan(args, trainer_args)
        # What the job runs, on one node here or on every node of a Slurm job.
        shape = {
            "trainer": args.trainer,
            "trainer_args": tuple(trainer_args),
            "nnodes": args.nnodes,
            "nproc_per_node": args.nproc_per_node,
            "backend": args.backend,
        }
        if slurm:  # the job each node's harness will run (chaos.slurm.batch.node)
            submitted = Settings(
                **shape,
                max_restarts=args.max_restarts,
                job_timeout_s=args.job_timeout,
                verify=not args.no_verify,
                png=not args.no_png,
                rdzv_port=args.rdzv_port,
                notice_s=args.notice,
                partition=args.partition,
                time_limit=args.time,
                sbatch_args=tuple(args.sbatch_arg),
                max_requeues=args.max_requeues,
            )
            rendezvous = (f"{{first node}}:{submitted.rdzv_port}", 0, "{SLURM_JOB_ID}")
        else:
            rendezvous = (args.rdzv_endpoint, args.node_rank, args.rdzv_id)
        endpoint, node_rank, rdzv_id = rendezvous
        job = Job(
            **shape,
            rdzv_endpoint=endpoint,
            node_rank=node_rank,
            rdzv_id=rdzv_id,
        )
        # Fail here, before anything starts.
        check_plan(job, plan.resolve(job.world_size), args.job_timeout, notice_s=submitted.notice_s if slurm else None)
        if job.rdzv_endpoint is not None and not args.run_dir and not slurm:
            raise ValueError(
                "--run-dir: expected the run directory every node shares (with --rdzv-endpoint); found none"
            )
    except (PlanError, ValueError, TypeError) as exc:
        print(f"chaos: {exc}", file=sys.stderr)
        return 2
    joining = job.rdzv_endpoint is not None and not slurm  # a node's harness joins the shared run directory
    problems = [
        directory_problem(args.run_dir, "--run-dir", empty=not joining) if args.run_dir else None,
        directory_problem(args.reference_dir, "--reference-dir", empty=False) if args.reference_dir else None,
    ]
    for problem in filter(None, problems):
        print(f"chaos: {problem}", file=sys.stderr)
        return 2
    if not plan.faults:
        print("chaos: the plan has no faults: this run only checks the job against its reference", file=sys.stderr)
    if slurm:
        return _sbatch(args, submitted, plan.resolve(job.world_size))
    return _run(args, job, plan, trainer_args)


def _plan(args: argparse.Namespace, trainer_args: list[str]) -> tuple[Plan, list[str]]:
    """The plan of the command line (--plan, --fault, --soak) and the trainer's arguments (the
    job checked is the job run)."""
    from chaos.plan import load_plan, parse_shorthand
    from chaos.soak import soak_plan, soak_trainer_args

    plan = load_plan(args.plan) if args.plan else Plan()
    shorthand = list(args.fault)
    if args.soak is not None:
        if args.trainer != REFERENCE_TRAINER:
            raise ValueError(
                f"--soak: expected the reference trainer (its steps and checkpoints are placed "
                f"for the faults); found --trainer {args.trainer}"
            )
        plan = Plan(
            soak_plan(args.soak, args.seed, args.nproc_per_node * args.nnodes).faults + plan.faults, plan.max_restarts
        )
        trainer_args = trainer_args or list(soak_trainer_args(args.soak))
    elif not args.plan and not shorthand and args.trainer == REFERENCE_TRAINER:
        shorthand = list(DEFAULT_FAULTS)
    plan = Plan(plan.faults + tuple(parse_shorthand(s) for s in shorthand), plan.max_restarts)
    return plan, trainer_args or list(default_trainer_args(args.trainer))


def _run(args: argparse.Namespace, job: Job, plan: Plan, trainer_args: list[str]) -> int:
    import chaos
    from chaos.multinode import Stopped
    from chaos.plan import PlanError

    try:
        report = chaos.run(
            plan,
            args.run_dir,
            trainer_args or None,
            trainer=args.trainer,
            nproc_per_node=args.nproc_per_node,
            nnodes=args.nnodes,
            backend=args.backend,
            timeout_s=args.job_timeout,
            rdzv_endpoint=args.rdzv_endpoint,
            node_rank=args.node_rank,
            rdzv_id=args.rdzv_id,
            max_restarts=args.max_restarts,
            digest_every=args.digest_every,
            reference_dir=args.reference_dir,
            verify=not args.no_verify,
            png=not args.no_png,
            progress=_progress,
        )
    except PlanError as exc:  # what the trainer's fault-free run showed the plan cannot do
        print(f"\nchaos: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nchaos: interrupted; the job was stopped", file=sys.stderr)
        return 130
    except Stopped as exc:
        print(f"\nchaos: {exc}", file=sys.stderr)
        return EXIT_STOPPED
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    if report is None:
        print(
            f"chaos: node {job.node_rank}'s part of the job is done; node 0 writes the verdict to "
            f"{Path(args.run_dir) / 'report.json'}"
        )
        return 0
    print(report.summary())
    return 0 if report.passed else 1


def _sbatch(args: argparse.Namespace, submitted: Settings, plan: Plan) -> int:
    """Submit the run (`chaos.slurm.batch`), and unless --no-wait, wait for the job and print its verdict."""
    import chaos
    from chaos.report import Report
    from chaos.slurm.batch import submit, wait

    run_dir = (Path(args.run_dir) if args.run_dir else chaos.new_run_dir()).absolute()
    reference = args.reference_dir or str(run_dir.parent / ".reference")
    submitted = replace(submitted, reference_dir=str(Path(reference).absolute()))
    try:
        job_id = submit(submitted, plan, run_dir)
    except (RuntimeError, ValueError) as exc:
        print(f"chaos: {exc}", file=sys.stderr)
        return 2
    print(f"chaos: submitted job {job_id}; run directory {run_dir}", file=sys.stderr)
    if args.no_wait:
        return 0
    try:
        state = wait(job_id, submitted.job_timeout_s * 2 * (submitted.max_requeues + 1), progress=_progress)
    except KeyboardInterrupt:
        print(f"\nchaos: stopped waiting; job {job_id} goes on (scancel {job_id} to stop it)", file=sys.stderr)
        return 130
    report = Report.load(run_dir / "report.json")
    if report is None:
        output = run_dir / f"slurm-{job_id}.out"
        tail = output.read_text(errors="replace").splitlines()[-15:] if output.is_file() else []
        print(
            f"chaos: job {job_id} ended {state} without a verdict in {run_dir / 'report.json'}; "
            f"{output} ends:\n  " + "\n  ".join(tail),
            file=sys.stderr,
        )
        return 1
    print(report.summary())
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
