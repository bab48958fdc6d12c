"""The sbatch job of ``python -m chaos sbatch``: its script, its batch step, and each node's task.

`submit` writes into the run directory the resolved plan, `Settings` (``slurm.json``: how
every node's harness runs) and the script (``job.sbatch``), then submits it. The script asks
for one task per node, ``--requeue``, output in append mode (a requeued job would truncate it
otherwise) and the notice ``--signal=B:USR1@<notice_s>``, sent to the batch step only (a
signal for the job's steps would reach every process of them, and SIGUSR1's default action
kills a torchrun agent). Its only command is the batch step's driver (`driver`):

- it runs ``srun`` with one `node` task per node: ``python -m chaos run`` for that node
  (``--node-rank $SLURM_NODEID``, the rendezvous on the job's first node, its id the job id),
  the same harness as a multi-machine job without Slurm (`chaos.multinode`);
- on the notice (SIGUSR1: a preemption with ``preempt_send_user_signal``, or the time limit
  coming) it sends SIGTERM to the job's steps (``scancel --signal=TERM``), which reaches every
  harness, torchrun agent and rank: the ranks stop together after the step in progress, with
  a checkpoint of it (`chaos.workload.train`), and each harness exits `EXIT_STOPPED`;
- when the step ended stopped (the notice, or a preemption's SIGTERM without one) it requeues
  the job itself (``scontrol requeue``, `requeue_job`): a job that ends within its grace period
  is otherwise not requeued but ends FAILED. One that outlasts it is requeued by Slurm, which
  then sends SIGTERM to the batch step (``batch.sigterm`` says the job was requeued), and the
  driver's own request fails (``batch.requeue`` says who requeued it, when the driver is still
  there to say it: Slurm SIGKILLs it KillWait after the SIGTERM). A requeued job runs the script again with
  ``SLURM_RESTART_COUNT`` one higher, the same job id and run directory: each harness joins
  the run, the ledger keeps every fault from firing twice, the trainer resumes from its
  checkpoint, and the attempt numbers go on (`commlib.attempt.attempt_number`);
- at its start in a requeued job it gives back the time limit a ``time_limit`` fault took
  (`chaos.slurm.faults.restore_time_limit`), and it refuses to go past `Settings.max_requeues`.

The verdict is node 0's harness's (``report.json`` in the run directory), given once every
node has finished and the reference has run as a job step of the same shape, or come from the
cache. `wait` follows the job from the submitting side until it is over.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, NoReturn

from chaos.plan import Plan
from commlib.observe.events import read_events
from commlib.record.log import event_log
from commlib.settings import env_integer, integer, text

SETTINGS = "slurm.json"
SCRIPT = "job.sbatch"
JOURNAL = "batch.jsonl"  # the driver's events: starts, notices, requeues, ends
REPORT = "report.json"
SUBMITTED = "submitted_ns"  # wall clock of the submission (submit to first step: the cost of starting under Slurm)
EXIT_STOPPED = 143  # a node's harness stopped by SIGTERM: the job requeues itself
DEFAULT_NOTICE_S = 90
DEFAULT_RDZV_PORT = 29400
POLL_S = 1.0
REQUEUE_TRIES = 5  # `scontrol requeue` again after a failure, POLL_S apart (`requeue_job`)
MOST_NOTICE_S = 65535  # sbatch --signal's largest
MOST_REQUEUES = 1000
_TIME_LIMIT = re.compile(r"\d{1,9}(?::\d{1,2}){0,2}|\d{1,5}-\d{1,2}(?::\d{1,2}){0,2}|UNLIMITED|INFINITE")
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


@dataclass(frozen=True)
class Settings:
    """Every node's harness settings, and the job's Slurm options (``slurm.json``)."""

    trainer: str
    trainer_args: tuple[str, ...]
    nnodes: int
    nproc_per_node: int = 2
    backend: str = "gloo"
    max_restarts: int | None = None
    job_timeout_s: float = 900.0
    reference_dir: str | None = None
    verify: bool = True
    png: bool = True
    rdzv_port: int = DEFAULT_RDZV_PORT
    notice_s: int = DEFAULT_NOTICE_S
    partition: str | None = None
    time_limit: str | None = None  # sbatch --time
    sbatch_args: tuple[str, ...] = ()
    max_requeues: int = 5
    python: str = field(default_factory=lambda: sys.executable)
    cwd: str = field(default_factory=os.getcwd)

    def __post_init__(self) -> None:
        """The Slurm options, each by the rule for its kind (`commlib.settings`; options given as
        text become numbers): none may overflow what Slurm takes or add a line to the script."""
        checked = {
            "rdzv_port": integer(self.rdzv_port, "rdzv_port (--rdzv-port)", low=1, high=65535),
            "notice_s": integer(self.notice_s, "notice_s (--notice)", low=1, high=MOST_NOTICE_S),
            "max_requeues": integer(self.max_requeues, "max_requeues (--max-requeues)", low=0, high=MOST_REQUEUES),
            "sbatch_args": tuple(text(a, "sbatch_args (--sbatch-arg)", spaces=True) for a in self.sbatch_args),
        }
        if self.partition is not None:
            checked["partition"] = text(self.partition, "partition (--partition)")
        if self.time_limit is not None and not _TIME_LIMIT.fullmatch(self.time_limit):
            raise ValueError(
                f"expected time_limit (--time) to be a Slurm time limit (MINUTES, MM:SS, HH:MM:SS, "
                f"D-HH[:MM[:SS]] or UNLIMITED); found {self.time_limit!r}"
            )
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    def save(self, run_dir: Path) -> None:
        (run_dir / SETTINGS).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, run_dir: Path) -> Settings:
        data = json.loads((run_dir / SETTINGS).read_text())
        names = {f.name for f in fields(cls)}
        data = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in names}
        return cls(**data)


def script(settings: Settings, run_dir: Path) -> str:
    """The batch script (module docstring)."""
    options = [
        f"--job-name=chaos-{run_dir.name}",
        f"--nodes={settings.nnodes}",
        "--ntasks-per-node=1",
        "--exclusive",
        "--requeue",
        "--open-mode=append",
        f"--output={run_dir}/slurm-%j.out",
        f"--signal=B:USR1@{settings.notice_s}",
    ]
    if settings.partition:
        options.append(f"--partition={settings.partition}")
    if settings.time_limit:
        options.append(f"--time={settings.time_limit}")
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {o}" for o in [*options, *settings.sbatch_args]),
        f"cd {shlex.quote(settings.cwd)}",
        f"exec {shlex.quote(settings.python)} -m chaos.slurm.batch driver {shlex.quote(str(run_dir))}",
    ]
    return "\n".join(lines) + "\n"


def submit(settings: Settings, plan: Plan, run_dir: Path) -> str:
    """Write the run directory's files and submit the job; returns its id. Raises RuntimeError
    saying what sbatch answered, with the run directory as it was before (nothing left in it);
    ValueError, before writing anything, for a run directory the script's lines cannot hold."""
    text(str(run_dir), "the run directory (--run-dir)")  # unquoted in #SBATCH --output
    made = next((p for p in [*reversed(run_dir.absolute().parents), run_dir.absolute()] if not p.exists()), None)
    run_dir.mkdir(parents=True, exist_ok=True)
    written = [run_dir / "plan.json", run_dir / SETTINGS, run_dir / SCRIPT, run_dir / SUBMITTED]
    plan.save(written[0])
    settings.save(run_dir)
    written[2].write_text(script(settings, run_dir))
    written[3].write_text(f"{time.time_ns()}\n")
    try:
        done = subprocess.run(["sbatch", "--parsable", str(run_dir / SCRIPT)], capture_output=True, text=True)
        why = None if done.returncode == 0 else f"it exited {done.returncode}: {(done.stderr or done.stdout).strip()}"
    except FileNotFoundError:
        why = "found no sbatch on PATH"
    if why is not None:
        for path in written:
            path.unlink()
        if made is not None:
            shutil.rmtree(made)  # only directories this made, now empty
        raise RuntimeError(f"sbatch: expected a job id; {why}")
    job_id = done.stdout.strip().split(";")[0]
    (run_dir / "job_id").write_text(job_id + "\n")
    return job_id


def job_state(job_id: str) -> tuple[str, int]:
    """The job's state and requeue count, from ``scontrol show job`` ("GONE" once Slurm forgot it)."""
    done = subprocess.run(["scontrol", "show", "job", "--oneliner", job_id], capture_output=True, text=True)
    found = dict(item.split("=", 1) for item in done.stdout.split() if "=" in item)
    return found.get("JobState", "GONE"), int(found.get("Restarts", "0") or 0)


def wait(job_id: str, timeout_s: float, progress: Callable[[str], None] | None = None) -> str:
    """Wait until the job is over (an end state read twice, POLL_S apart: a requeue passes through
    none); returns that state. Past `timeout_s` the job is cancelled."""
    deadline = time.monotonic() + timeout_s
    shown, ended = None, None
    while time.monotonic() < deadline:
        state, requeues = job_state(job_id)
        if progress is not None and (state, requeues) != shown:
            shown = (state, requeues)
            progress(f"job {job_id}: {state}, requeued {requeues} time(s)")
        if state in ENDED or state == "GONE":
            if ended == state:
                return state
            ended = state
        else:
            ended = None
        time.sleep(POLL_S)
    subprocess.run(["scancel", job_id], capture_output=True)
    return f"CANCELLED after {timeout_s:g} s (chaos sbatch --job-timeout)"


def requeue_count() -> int:
    return env_integer("SLURM_RESTART_COUNT", 0, low=0)


def driver(run_dir: Path) -> int:
    """The batch step (module docstring); its exit status is the job's."""
    from chaos.slurm.faults import restore_time_limit

    settings = Settings.load(run_dir)
    job_id = os.environ["SLURM_JOB_ID"]
    requeue = requeue_count()
    notes = event_log(run_dir / JOURNAL, pid=os.getpid(), requeue=requeue)
    notes.info("batch.start", job_id=job_id, nodes=os.environ.get("SLURM_JOB_NODELIST"))
    if requeue > settings.max_requeues:
        notes.error(
            "batch.refused",
            why=f"requeued {requeue} times; expected at most {settings.max_requeues} (chaos sbatch --max-requeues)",
        )
        return 1
    verdict = _verdict(run_dir)
    if verdict is not None:  # given before a requeue that came too late to matter
        notes.info("batch.end", passed=verdict, already=True)
        return 0 if verdict else 1
    if requeue > 0:
        restored = restore_time_limit(run_dir, job_id)
        if restored is not None:
            notes.info("batch.time_limit_restored", minutes=restored)
    noticed: list[int] = []

    def on_notice(signum: int, frame: Any) -> None:
        noticed.append(time.time_ns())
        notes.info("batch.notice", signal=signal.Signals(signum).name)
        if len(noticed) == 1:
            # To the job's steps, not this one: srun takes SIGTERM for "kill the tasks now".
            subprocess.run(["scancel", "--signal=TERM", job_id], capture_output=True)

    def on_term(signum: int, frame: Any) -> None:
        # Slurm is ending the job (a preemption's grace over, a requeue, a node failure), and
        # SIGKILLs what is left KillWait later: whether it requeued the job is said at once.
        notes.info("batch.sigterm", requeued=job_state(job_id)[1] > requeue)

    signal.signal(signal.SIGUSR1, on_notice)
    signal.signal(signal.SIGTERM, on_term)
    srun = subprocess.Popen(
        [
            "srun",
            f"--nodes={settings.nnodes}",
            "--ntasks-per-node=1",
            "--kill-on-bad-exit=0",
            settings.python,
            "-m",
            "chaos.slurm.batch",
            "node",
            str(run_dir),
        ]
    )
    code = srun.wait()
    notes.info("batch.step_end", srun_exit=code)
    verdict = _verdict(run_dir)
    if verdict is not None:
        notes.info("batch.end", passed=verdict)
        return 0 if verdict else 1
    if noticed or code == EXIT_STOPPED:
        requeue_job(job_id, requeue, notes)
        return EXIT_STOPPED
    notes.error("batch.end", passed=None, why=f"srun exited {code} without a verdict")
    return code or 1


def requeue_job(job_id: str, requeue: int, notes: Any) -> None:
    """Requeue this job (its step ended stopped), and say in ``batch.requeue`` whether it is: by
    this call, or by Slurm itself (a preemption whose grace period ran out before the step
    ended requeues the job, and `scontrol requeue` then fails), which the job's restart count
    tells (it passed `requeue`). A failed call is tried again (an answer lost to a busy
    controller: `chaos.slurm.cluster.MESSAGE_TIMEOUT_S`) until one of them holds."""
    for turn in range(REQUEUE_TRIES):
        done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
        restarts = job_state(job_id)[1]
        if done.returncode == 0 or restarts > requeue:
            notes.info(
                "batch.requeue",
                requeued=True,
                by="driver" if done.returncode == 0 else "slurm",
                exit=done.returncode,
                said=(done.stderr or done.stdout).strip(),
                tries=turn + 1,
            )
            return
        time.sleep(POLL_S)
    notes.error(
        "batch.requeue",
        requeued=False,
        exit=done.returncode,
        said=(done.stderr or done.stdout).strip(),
        tries=REQUEUE_TRIES,
    )


def timings(run_dir: Path) -> dict[str, float | None]:
    """What starting and restarting the job cost (s), from a finished run's directory: submission
    to the first completed step, and each whole-job fault to the job's next launch and to the
    first step completed after it."""
    submitted = int((run_dir / SUBMITTED).read_text())
    first = min(
        e["ts_ns"]
        for path in sorted((run_dir / "logs").glob("rank*.jsonl*"))
        for e in read_events(path)
        if e.get("event") == "train.step"
    )
    out: dict[str, float | None] = {"submit_to_first_step_s": (first - submitted) / 1e9}
    for f in json.loads((run_dir / REPORT).read_text())["faults"]:
        if f.get("requeued_after_s") is not None:
            out[f"{f['type']}_to_launch_s"] = f["requeued_after_s"]
            out[f"{f['type']}_to_first_step_s"] = f["first_step_after_s"]
    return out


def _verdict(run_dir: Path) -> bool | None:
    """Node 0's verdict, once it is written."""
    try:
        return bool(json.loads((run_dir / REPORT).read_text())["passed"])
    except (OSError, ValueError, KeyError):
        return None


def node(run_dir: Path) -> NoReturn:
    """One node's task: becomes ``python -m chaos run`` for this node of the job (same process,
    so Slurm's signals to the task reach the harness)."""
    settings = Settings.load(run_dir)
    hosts = subprocess.run(
        ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]], capture_output=True, text=True, check=True
    ).stdout.split()
    argv = [
        "run",
        "--run-dir",
        str(run_dir),
        "--plan",
        str(run_dir / "plan.json"),
        "--trainer",
        settings.trainer,
        "--nproc-per-node",
        str(settings.nproc_per_node),
        "--nnodes",
        str(settings.nnodes),
        "--node-rank",
        os.environ["SLURM_NODEID"],
        "--rdzv-endpoint",
        f"{hosts[0]}:{settings.rdzv_port}",
        "--rdzv-id",
        os.environ["SLURM_JOB_ID"],
        "--backend",
        settings.backend,
        "--job-timeout",
        str(settings.job_timeout_s),
    ]
    if settings.max_restarts is not None:
        argv += ["--max-restarts", str(settings.max_restarts)]
    if settings.reference_dir is not None:
        argv += ["--reference-dir", settings.reference_dir]
    if not settings.verify:
        argv.append("--no-verify")
    if not settings.png:
        argv.append("--no-png")
    os.execv(sys.executable, [sys.executable, "-m", "chaos", *argv, "--", *settings.trainer_args])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2 or argv[0] not in ("driver", "node", "timings"):
        print(
            "usage: python -m chaos.slurm.batch driver|node|timings RUN_DIR (driver, node: the lines of a chaos "
            "sbatch job; timings: what a finished one's starts and restarts cost)",
            file=sys.stderr,
        )
        return 2
    run_dir = Path(argv[1])
    needed = [SUBMITTED, REPORT] if argv[0] == "timings" else [SETTINGS]
    missing = [name for name in needed if not (run_dir / name).is_file()]
    if missing:
        print(
            f"chaos.slurm.batch {argv[0]}: expected the run directory of a chaos sbatch job (with "
            f"{', '.join(needed)}); found no {', '.join(missing)} in {run_dir}",
            file=sys.stderr,
        )
        return 2
    if argv[0] == "timings":
        print(json.dumps(timings(run_dir), indent=2))
        return 0
    return driver(run_dir) if argv[0] == "driver" else node(run_dir)


if __name__ == "__main__":
    sys.exit(main())
