"""``python -m chaos replicas``: its command line, read and checked before anything starts, then
the run (`chaos.replicas.run_replicas`), its proof (`chaos.replica_proof.prove`) and its report
(`report.json`; `report.png`, `chaos.replica_plot`).

Apart from `chaos.replicas` so that the harness of replica groups and the proof, which replays
a run through that harness, never import each other: the command line is the one place that
uses all three.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from chaos.options import directory_problem
from chaos.plan import Plan, PlanError, load_plan, parse_shorthand
from chaos.replica_plot import plot
from chaos.replica_proof import PNG, prove, read_record
from chaos.replicas import PGS, REPLICA_TRAINER, TRANSPORTS, ReplicaJob, check_plan, run_replicas
from commlib.settings import number

DEFAULT_FAULTS = ("hang:rank=1,step=5", "kill_during_checkpoint:rank=1,after_s=0")
DEFAULT_TRAINER_ARGS = ("--steps", "30", "--timeout", "5", "--min-step-s", "0.2", "--finish-together-s", "600")


def add_command(sub: Any) -> None:
    """The ``replicas`` subcommand of ``python -m chaos``."""
    p = sub.add_parser(
        "replicas",
        help="replica groups under torchft: break one, restart it alone, prove it",
        description="Run replica groups under torchft (one torchrun each, commlib's group between "
        "them, the lighthouse on loopback), break them as the plan says (ranks are "
        "replica x group size + group rank), then prove the run bitwise against a replay "
        "of its membership. Arguments after -- go to the trainer.",
    )
    p.add_argument("--replicas", type=int, default=2, help="replica groups")
    p.add_argument("--group-size", type=int, default=1, help="ranks per group (more than one: HSDP)")
    p.add_argument("--plan", help="a YAML or JSON fault plan")
    p.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="TYPE:key=value,...",
        help=f"a fault (repeatable); default {' '.join(DEFAULT_FAULTS)}",
    )
    p.add_argument("--replica-pg", choices=PGS, default="commlib", help="the process group between the groups")
    p.add_argument(
        "--heal-transport",
        choices=TRANSPORTS,
        default="http",
        help="how a group behind takes a peer's state: torchft's HTTPTransport or its PGTransport",
    )
    p.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=ReplicaJob.heartbeat_timeout_ms,
        help="the lighthouse's: how long a silent group stays in the quorums",
    )
    p.add_argument("--join-timeout-ms", type=int, default=ReplicaJob.join_timeout_ms)
    p.add_argument("--trainer", default=REPLICA_TRAINER)
    p.add_argument("--run-dir", help="a new or empty directory (default: a new one under runs/)")
    p.add_argument("--job-timeout", type=float, default=900.0, help="stop the job (and the replay) after this long")
    p.add_argument("--no-replay", action="store_true", help="skip the replay (and its check)")
    p.add_argument("--no-png", action="store_true", help="do not draw report.png")
    p.add_argument(
        "trainer_args", nargs="*", help=f"-- then the trainer's arguments; default {' '.join(DEFAULT_TRAINER_ARGS)}"
    )


def command(args: Any) -> int:
    """Run ``python -m chaos replicas``: 0 when the proof holds, 1 when not, 2 for a bad command line."""
    import chaos  # the package's new_run_dir: imported here, as the package imports its command lines

    try:
        number(args.job_timeout, "--job-timeout", above=0, high=86400, unit="seconds")
        plan = load_plan(args.plan) if args.plan else Plan()
        shorthand = args.fault or ([] if args.plan else list(DEFAULT_FAULTS))
        plan = Plan(plan.faults + tuple(parse_shorthand(s) for s in shorthand), plan.max_restarts)
        job = ReplicaJob(
            replicas=args.replicas,
            group_size=args.group_size,
            trainer=args.trainer,
            trainer_args=tuple(args.trainer_args or DEFAULT_TRAINER_ARGS),
            replica_pg=args.replica_pg,
            heal_transport=args.heal_transport,
            heartbeat_timeout_ms=args.heartbeat_timeout_ms,
            join_timeout_ms=args.join_timeout_ms,
        )
        check_plan(job, plan.resolve(job.world_size), args.job_timeout)
    except (PlanError, ValueError, TypeError) as exc:
        print(f"chaos replicas: {exc}", file=sys.stderr)
        return 2
    if args.run_dir and (problem := directory_problem(args.run_dir, "--run-dir", empty=True)):
        print(f"chaos replicas: {problem}", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir) if args.run_dir else chaos.new_run_dir()
    outcome = run_replicas(job, plan, run_dir, timeout_s=args.job_timeout, progress=print)
    proof = prove(run_dir, replay=not args.no_replay, timeout_s=args.job_timeout)
    proof.write()
    if not args.no_png:
        plot(proof, read_record(run_dir), run_dir / PNG)
    print(proof.summary())
    if not outcome.ok:
        print(
            f"chaos replicas: the job did not end cleanly (exit codes {outcome.exit_codes}, timed out "
            f"{outcome.timed_out}); see {run_dir}/torchrun*.log"
        )
    return 0 if proof.passed and outcome.ok else 1
