"""``python -m chaos run``: the command line of `chaos.run`.

    python -m chaos run                                   # the main job: see harness.DEFAULT_*
    python -m chaos run --fault kill:rank=1,step=5 --fault hang:rank=0,step=9 -- --steps 12
    python -m chaos run --plan plan.yaml --nproc-per-node 4
    python -m chaos run --soak 20 --seed 7                # 20 faults drawn from seed 7 (chaos.soak)
    python -m chaos run --trainer my_train.py --fault kill:rank=1,after_s=20 -- --results {run_dir}/results.json

Everything after ``--`` goes to the trainer. Exit status: 0 when every check held, 1 when
one failed, 2 for a bad plan or command line, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from chaos.harness import DEFAULT_FAULTS, REFERENCE_TRAINER, Job, check_plan, default_trainer_args
from chaos.plan import RESTART_MARGIN


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m chaos", description="Fault injection with bitwise-verified recovery.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run a trainer under a fault plan and verify it recovered",
                       description="Run a trainer under torchrun with a fault plan, then verify the run against a "
                                   "fault-free reference. Arguments after -- go to the trainer.")
    r.add_argument("--plan", help="a YAML or JSON fault plan")
    r.add_argument("--fault", action="append", default=[], metavar="TYPE:key=value,...",
                   help="a fault, e.g. kill:rank=1,step=5 (repeatable; added to --plan's)")
    r.add_argument("--soak", type=_positive, default=None, metavar="N",
                   help="draw N faults from --seed over one longer run of the reference trainer (chaos.soak)")
    r.add_argument("--seed", type=int, default=0, help="the seed --soak draws from")
    r.add_argument("--run-dir", help="where logs, checkpoints, plan and report go (default: a new dir under runs/)")
    r.add_argument("--trainer", default=REFERENCE_TRAINER, help="a module (run with -m) or a script path")
    r.add_argument("--nproc-per-node", type=_positive, default=2)
    r.add_argument("--nnodes", type=_positive, default=1,
                   help="nodes; without --rdzv-endpoint all of them run on this machine")
    r.add_argument("--node-rank", type=int, default=None, help="this machine's node (with --rdzv-endpoint)")
    r.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of a multi-node job's rendezvous")
    r.add_argument("--backend", default="gloo",
                   help="passed to the reference trainer (gloo, nccl: then with --device cuda)")
    r.add_argument("--max-restarts", type=int, default=None,
                   help=f"torchrun's; default: one per possible fault firing, plus {RESTART_MARGIN}")
    r.add_argument("--job-timeout", type=float, default=900.0,
                   help="stop the job (and the reference run) after this many seconds each")
    r.add_argument("--reference-dir", default=None, help="cache of fault-free references (default: <runs>/.reference)")
    r.add_argument("--no-verify", action="store_true", help="skip the reference run and the bitwise checks")
    r.add_argument("--no-png", action="store_true", help="do not draw report.png")
    r.add_argument("trainer_args", nargs=argparse.REMAINDER, help="-- then the trainer's arguments")
    return p


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int; found {value}")
    return value


def _progress(line: str) -> None:
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K" + line)
    else:
        sys.stderr.write(line + "\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    import chaos
    from chaos.plan import Plan, PlanError, load_plan, parse_shorthand
    from chaos.soak import soak_plan, soak_trainer_args

    args = _parser().parse_args(argv)
    trainer_args = args.trainer_args[1:] if args.trainer_args[:1] == ["--"] else args.trainer_args
    try:
        plan = load_plan(args.plan) if args.plan else Plan()
        shorthand = list(args.fault)
        if args.soak is not None:
            if args.trainer != REFERENCE_TRAINER:
                raise ValueError(f"--soak: expected the reference trainer (its steps and checkpoints are placed "
                                 f"for the faults); found --trainer {args.trainer}")
            plan = Plan(soak_plan(args.soak, args.seed, args.nproc_per_node * args.nnodes).faults + plan.faults,
                        plan.max_restarts)
            trainer_args = trainer_args or list(soak_trainer_args(args.soak))
        elif not args.plan and not shorthand and args.trainer == REFERENCE_TRAINER:
            shorthand = list(DEFAULT_FAULTS)
        plan = Plan(plan.faults + tuple(parse_shorthand(s) for s in shorthand), plan.max_restarts)
        trainer_args = trainer_args or list(default_trainer_args(args.trainer))  # the job checked is the job run
        # Fail here, before anything starts.
        job = Job(trainer=args.trainer, trainer_args=tuple(trainer_args), nproc_per_node=args.nproc_per_node,
                  nnodes=args.nnodes, backend=args.backend, rdzv_endpoint=args.rdzv_endpoint,
                  node_rank=args.node_rank)
        check_plan(job, plan.resolve(job.world_size))
    except (PlanError, ValueError) as exc:
        print(f"chaos: {exc}", file=sys.stderr)
        return 2
    if args.run_dir and Path(args.run_dir).is_dir() and any(Path(args.run_dir).iterdir()):
        print(f"chaos: --run-dir {args.run_dir} is not empty; expected a new or empty directory", file=sys.stderr)
        return 2
    if not plan.faults:
        print("chaos: the plan has no faults: this run only checks the job against its reference", file=sys.stderr)
    try:
        report = chaos.run(plan, args.run_dir, trainer_args or None, trainer=args.trainer,
                           nproc_per_node=args.nproc_per_node, nnodes=args.nnodes, backend=args.backend,
                           timeout_s=args.job_timeout, rdzv_endpoint=args.rdzv_endpoint, node_rank=args.node_rank,
                           max_restarts=args.max_restarts, reference_dir=args.reference_dir,
                           verify=not args.no_verify, png=not args.no_png, progress=_progress)
    except KeyboardInterrupt:
        print("\nchaos: interrupted; the job was stopped", file=sys.stderr)
        return 130
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    print(report.summary())
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
