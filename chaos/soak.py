"""Soak: many faults in one run, drawn from a seed, verified bitwise at the end.

`soak_plan(n, seed, world_size)` draws `n` faults (kind and rank) from `seed` and places
them one per `SOAK_GAP` steps, each at the step after a checkpoint (`--ckpt-every` is
`SOAK_CKPT_EVERY`), so that every fault hits a job that has just checkpointed. The gap is
two checkpoints wide: a checkpoint fault armed at its step acts at the next checkpoint, and
the job must be done with it (restarted) before the next fault fires. `soak_trainer_args(n)`
is the reference trainer's command line that fits them: enough steps, small model, a short
deadline (the timeout faults cost one each).

Kinds drawn (`SOAK_KINDS`): the process deaths, hangs, timeouts, in-step errors, checkpoint
faults, preemption and the GIL hold. Left out: ``straggler`` (it stays slow for the rest of
the run, so more than one would stack), ``disk_full`` (it needs root to mount its tmpfs;
give it with ``--fault`` next to ``--soak`` where that works) and ``kill`` on a second node
(soak runs one node). The same (n, seed, world size) always gives the same plan.
"""

from __future__ import annotations

import random

from chaos.fault import Fault, FaultType, Trigger, TriggerKind
from chaos.plan import Plan
from commlib import settings

SOAK_KINDS = (
    FaultType.KILL,
    FaultType.SEGFAULT,
    FaultType.EXIT,
    FaultType.HANG,
    FaultType.DELAY,
    FaultType.RAISE,
    FaultType.CORRUPT,
    FaultType.KILL_DURING_CHECKPOINT,
    FaultType.CORRUPT_CHECKPOINT,
    FaultType.SIGTERM,
    FaultType.GIL,
)
SOAK_CKPT_EVERY = 2
SOAK_GAP = 2 * SOAK_CKPT_EVERY  # steps between faults
SOAK_DEADLINE_S = 5.0
# Each fault costs a recovery or a restart (seconds) and SOAK_GAP steps: past this many, a
# soak outlasts any job timeout (`chaos.options.LONGEST_S`).
MOST_SOAK_FAULTS = 10**4
# A small model: the soak is about recovery, not about the kernels' speed.
SOAK_MODEL_ARGS = (
    "--dim",
    "16",
    "--layers",
    "2",
    "--heads",
    "2",
    "--seq-len",
    "64",
    "--vocab",
    "64",
    "--batch-size",
    "1",
)


def fault_steps(n: int) -> list[int]:
    """The step of each fault: the first step after each of the first `n` checkpoints."""
    return [SOAK_GAP * (k + 1) + 1 for k in range(n)]


def soak_plan(n: int, seed: int, world_size: int) -> Plan:
    n = settings.integer(n, "the soak's number of faults", low=1, high=MOST_SOAK_FAULTS)
    if not isinstance(world_size, int) or world_size < 2:
        raise ValueError(
            f"soak: expected a world of at least 2 ranks (survivors detect the faults); found {world_size!r}"
        )
    draw = random.Random(f"soak:{seed}")
    faults = []
    for step in fault_steps(n):
        kind = draw.choice(SOAK_KINDS)
        rank = 0 if kind is FaultType.CORRUPT_CHECKPOINT else draw.randrange(world_size)
        faults.append(Fault(kind, rank, Trigger(TriggerKind.STEP, float(step))))
    return Plan(tuple(faults))


def soak_trainer_args(n: int) -> tuple[str, ...]:
    steps = fault_steps(n)[-1] + SOAK_GAP
    return (
        "--steps",
        str(steps),
        "--ckpt-every",
        str(SOAK_CKPT_EVERY),
        "--timeout",
        str(SOAK_DEADLINE_S),
        "--max-in-job-recoveries",
        str(n),
        *SOAK_MODEL_ARGS,
    )
