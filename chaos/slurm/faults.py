"""What the faults of a Slurm job do, as the harness of the target rank's node fires them
(`chaos.external`), and what they need to be possible at all (`check`).

- ``preempt``: a job in a partition that preempts the job's (``partition``, default
  `PREEMPTOR_PARTITION`) asks for the job's nodes; Slurm preempts the job as it is
  configured to (a requeue, with the partition's grace period and the ``--signal`` notice
  first under ``preempt_send_user_signal``);
- ``time_limit``: the job's time limit is lowered (`time_limit_change`, `apply_time_limit`) so that it ends a
  minute or two from now: Slurm sends the ``--signal`` notice at its next time-limit check
  (slurmctld checks every 30 s, and sends the notice up to 30 s before the notice time),
  the job checkpoints and requeues itself, and the next run of the job gets its time limit back
  (`restore_time_limit`; raising a time limit is an operator's right);
- ``node_loss``: the node loses power (`power_off`): its ``chaos.slurm.init`` cuts its links
  and kills everything on it at once. Only the local cluster (`chaos.slurm.cluster`) has such
  a switch.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
from pathlib import Path

from chaos.plan import FaultType, Ledger

SLURM_FAULTS = (FaultType.PREEMPT, FaultType.TIME_LIMIT, FaultType.NODE_LOSS)
PREEMPTOR_PARTITION = "urgent"
# The notice must be able to come at the next time-limit check: the lowered limit leaves
# 60-120 s, and slurmctld sends the notice when the time left is under notice_s + 30 s.
TIME_LIMIT_NOTICE_S = 90
SLURM_CHECK_S = 30  # slurmctld's PERIODIC_TIMEOUT: how often it checks time limits and notices
INIT_MARK = "chaos.slurm.init"


class SlurmFaultError(RuntimeError):
    """A Slurm fault could not act (its command failed); the message says what Slurm answered."""


def job_id() -> str | None:
    return os.environ.get("SLURM_JOB_ID")


def check(fault_type: FaultType, *, notice_s: int | None) -> str | None:
    """Why a fault of `fault_type` cannot run in this process's job, or None. `notice_s`: the
    job's ``--signal`` notice time where known (the submitting side)."""
    if fault_type not in SLURM_FAULTS:
        return None
    if job_id() is None and notice_s is None:
        return (
            f"a {fault_type} fault acts on a Slurm job; expected to run in one (python -m chaos sbatch); "
            f"found no SLURM_JOB_ID"
        )
    if fault_type is FaultType.TIME_LIMIT and notice_s is not None and notice_s < TIME_LIMIT_NOTICE_S:
        return (
            f"a time_limit fault leaves the job 60 to 120 s; expected a notice of at least "
            f"{TIME_LIMIT_NOTICE_S} s (--notice) for Slurm to send it before the end; found {notice_s} s"
        )
    if fault_type is FaultType.NODE_LOSS and job_id() is not None and power_switch() is None:
        return (
            "a node_loss fault powers a node off; expected a node of the local cluster "
            "(scripts/slurm_cluster.sh), whose process 1 is chaos.slurm.init; found another process 1"
        )
    return None


def _slurm(*argv: str) -> str:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if done.returncode != 0:
        raise SlurmFaultError(f"`{' '.join(argv)}` exited {done.returncode}: {(done.stderr or done.stdout).strip()}")
    return done.stdout


def preempt(partition: str) -> str:
    """Submit a job to `partition` that needs every node of this job; returns its id."""
    nodes = os.environ["SLURM_JOB_NODELIST"]
    out = _slurm(
        "sbatch",
        "--parsable",
        f"--partition={partition}",
        f"--nodelist={nodes}",
        f"--nodes={os.environ.get('SLURM_JOB_NUM_NODES', '1')}",
        "--exclusive",
        "--job-name=chaos-preemptor",
        "--output=/dev/null",
        "--wrap=true",
    )
    return out.strip().split(";")[0]


def _job_fields(job: str) -> dict[str, str]:
    out = _slurm("scontrol", "show", "job", "--oneliner", job)
    return dict(item.split("=", 1) for item in out.split() if "=" in item)


def _seconds(text: str) -> int:
    """Slurm's [D-]HH:MM:SS (or MM:SS) as seconds."""
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    return int(days or 0) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]


def _minutes(text: str) -> int | None:
    """A TimeLimit field in minutes; None for UNLIMITED."""
    return None if text in ("UNLIMITED", "INFINITE") else math.ceil(_seconds(text) / 60)


def time_limit_change() -> dict[str, int | None]:
    """What the ``time_limit`` fault does to this job: its limit now, and one that ends it
    60-120 s from now (minutes); `apply_time_limit` makes the change."""
    job = job_id()
    assert job is not None  # `check` refuses the fault outside a job
    found = _job_fields(job)
    elapsed = _seconds(found["RunTime"])
    before = _minutes(found["TimeLimit"])
    after = math.ceil((elapsed + 60) / 60)
    if before is not None and after >= before:
        raise SlurmFaultError(
            f"time_limit: expected the job's time limit ({before} min) above {after} min, "
            f"{elapsed} s into the job; found it ends as soon by itself"
        )
    return {"limit_before_min": before, "limit_min": after, "elapsed_s": elapsed}


def apply_time_limit(minutes: int) -> None:
    job = job_id()
    assert job is not None
    _slurm("scontrol", "update", f"JobId={job}", f"TimeLimit={minutes}")


def restore_time_limit(run_dir: Path, job: str) -> int | None:
    """At the start of a requeued run: give back the time limit the last ``time_limit`` firing
    took; returns it (minutes, 0 for unlimited), or None when there was nothing to give back."""
    firings = [f for f in Ledger(run_dir / "chaos_state").firings() if f.type == FaultType.TIME_LIMIT.value]
    if not firings or "limit_min" not in firings[-1].detail:
        return None
    before = firings[-1].detail.get("limit_before_min")
    current = _minutes(_job_fields(job)["TimeLimit"])
    if current == before:
        return None
    _slurm("scontrol", "update", f"JobId={job}", f"TimeLimit={'UNLIMITED' if before is None else before}")
    return before or 0


def power_switch() -> int | None:
    """Process 1 of this node's PID namespace when it is a local-cluster node's init, else None."""
    try:
        cmdline = Path("/proc/1/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return 1 if INIT_MARK.encode() in cmdline else None


def power_off() -> None:
    """This node loses power (`chaos.slurm.init`); the caller dies with it."""
    from chaos.slurm.init import POWER_SIGNAL

    if power_switch() is None:
        raise SlurmFaultError(
            "node_loss: expected process 1 to be chaos.slurm.init (a local-cluster node); found another"
        )
    os.kill(1, POWER_SIGNAL)
    signal.pause()  # the node's init kills this process with everything else
