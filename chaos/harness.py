"""The harness: run a job under torchrun, break it as the plan says, and clean up after it.

`run_job(job, plan, run_dir)` launches ``python -m torch.distributed.run`` (the command lines
of `chaos.job`, which also owns what a `Job` is: every worker starts the trainer through
`chaos.entry`, in the run's working directory ``{run_dir}/work``; one agent, or
one agent per node when ``nnodes > 1`` runs on this machine, or with ``rdzv_endpoint`` the
agent of one node of a multi-node job whose nodes each have a harness, `chaos.multinode`,
joining their shared run directory) with ``--max-restarts``
from the plan, and then watches it until every agent exits or the harness's own deadline
passes, polling:

- the ranks' commlib logs (``{run_dir}/logs/rank{R}.jsonl``): ``chaos.step`` (a rank
  starting a step) and ``train.step`` (a step completed), both written by the step probe
  (`chaos.probe`), and typed errors;
- the plan's external faults (`chaos.external`): ``kill``, ``hang``, ``sigterm``,
  ``disk_full``, the network faults and the Slurm faults, fired at the worker of their rank
  (when it runs here), held and released;
- the progress line (`chaos.progress`): steps done, faults injected, restarts.

The job's processes are `chaos.processes`' to find, signal and stop: on its deadline, on
Ctrl-C and on SIGTERM the harness stops the whole job (SIGCONT, then SIGTERM to every
process of the job, then SIGKILL to what is left; a second Ctrl-C does not cut that short),
and after a normal end it kills anything still in the job's process groups (e.g. a compile
worker whose parent is gone). For one node
of a multi-node job SIGTERM is the scheduler's instead (a preemption, its notice, a requeue;
Slurm signals every process of the job's step): the harness passes it to its ranks, which
stop together after the step in progress with a checkpoint of it, and gives the job
`STOP_GRACE_S` to end by itself (`JobOutcome.stopped`).
`JobOutcome.pids` lists every process the job was seen to have. If the harness itself dies
(SIGKILL included), `chaos.cleanup` stops the job and removes its mounts and namespaces; what
a harness killed with its supervisor left is swept when the next one starts.

A plan with ``disk_full`` gets a small tmpfs on the checkpoint directory before the launch
(`chaos.disk`), unmounted after the run. A plan with a network fault (only such a plan) gets
one network namespace per local node, joined by `chaos.net`'s link emulator: each agent runs
in its node's namespace (``ip netns exec``), on a rendezvous at node 0's address instead of
127.0.0.1, with gloo bound to the node's device (``GLOO_SOCKET_IFNAME``); namespaces and
devices are removed after the run, whatever its end.

Every rank's environment makes its numbers the same in every run of the job
(`REPRODUCIBLE_ENV`: MKL's code path and thread count, cuBLAS's workspace; set before torch
loads, unless the caller's environment sets them), and says where ``chaos run`` was started
(`chaos.entry.LAUNCH_DIR_ENV`: a trainer module is imported from there).

The harness's own events (launches, firings, releases, its end) go to
``{run_dir}/harness.jsonl`` (``harness{N}.jsonl`` for node N of a multi-node job) in the
ranks' log format, each with the attempt number of its launch's first ranks (`first_attempt`:
a requeued Slurm job launches again into the same directory); `journal` reads them all. Ranks'
log lines older than the launch are an earlier launch's, and left alone. The in-rank
faults are the injector's (`chaos.inject`); the harness passes it the plan, the ledger's
directory and the job's start time through the environment.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from chaos.cleanup import Guard
from chaos.disk import SmallDisk
from chaos.entry import LAUNCH_DIR_ENV
from chaos.external import TYPED_ERRORS, ExternalFaults
from chaos.files import publish
from chaos.inject import PLAN_ENV, START_ENV, STATE_ENV
from chaos.job import REFERENCE_TRAINER, WORK_DIR, Job, free_port, torchrun_commands
from chaos.net import DEVICE, Network
from chaos.plan import FaultType, Ledger, Plan, PlanError, check_network, check_run
from chaos.probe import DIGEST_EVERY_ENV
from chaos.processes import JobProcesses, send
from chaos.progress import Progress
from commlib.attempt import MAX_RESTARTS_ENV, NODES_ENV, launch_base
from commlib.observe.events import LogTail, read_events
from commlib.record.log import LOG_DIR_ENV, event_log

# TYPED_ERRORS is chaos.external's, public here too: the verifier's detections are the same events.
# Job, REFERENCE_TRAINER, free_port and torchrun_commands are chaos.job's, public here too: where run_job is.
__all__ = [
    "DEFAULT_FAULTS",
    "DEFAULT_TRAINER_ARGS",
    "RECOVERY_ONLY_FLAGS",
    "REFERENCE_TRAINER",
    "RUN_DIR_ENV",
    "TYPED_ERRORS",
    "Job",
    "JobOutcome",
    "check_plan",
    "default_trainer_args",
    "first_attempt",
    "free_port",
    "journal",
    "journal_name",
    "run_job",
    "torchrun_commands",
    "trainer_deadline",
]

# The main job (`python -m chaos run` with no arguments): a small 30-step run of the
# reference trainer with a short collective deadline, a rank killed mid-run and, later,
# a collective held past that deadline.
DEFAULT_TRAINER_ARGS = ("--steps", "30", "--ckpt-every", "5", "--timeout", "10")
DEFAULT_FAULTS = ("kill:rank=1,step=12", "delay:rank=1,step=22")
# The reference trainer's flags that only change how it recovers from a fault, so a fault-free
# run gives the same numbers with or without them: its reference is shared (`chaos.verify.reference_key`).
RECOVERY_ONLY_FLAGS = ("--no-in-job-recovery",)


def default_trainer_args(trainer: str) -> tuple[str, ...]:
    """A trainer's arguments when none are given: `DEFAULT_TRAINER_ARGS` for the reference trainer."""
    return DEFAULT_TRAINER_ARGS if trainer == REFERENCE_TRAINER else ()


RUN_DIR_ENV = "CHAOS_RUN_DIR"
# MKL picks its code path and its thread count per call otherwise: on a loaded machine one step
# computed twice in a process differed in its last bits (tests/fsdp/test_shard.py's modes test,
# 3 of 51 runs two at a time). cuBLAS is deterministic only with a fixed workspace.
REPRODUCIBLE_ENV = {"MKL_CBWR": "COMPATIBLE", "MKL_DYNAMIC": "FALSE", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
JOURNAL = "harness.jsonl"
STOP_GRACE_S = 30.0  # SIGTERM'd from outside: how long the job has to stop by itself (torchrun's own wait)
POLL_S = 0.02


@dataclass
class JobOutcome:
    run_dir: Path
    start_ns: int  # wall clock at launch
    end_ns: int
    exit_codes: list[int | None]  # one per local agent; None: killed by the harness
    timed_out: bool = False
    interrupted: bool = False
    stopped: bool = False  # SIGTERM'd from outside (one node of a multi-node job): let it stop by itself
    first_step_ns: int | None = None  # wall clock of the first train.step of any rank
    restarts: int = 0  # the highest torchrun restart count seen (logs and workers)
    pids: set[int] = field(default_factory=set)  # every process of the job ever seen
    pgids: list[int] = field(default_factory=list)  # the job's process groups (one per agent)

    @property
    def ok(self) -> bool:
        return not self.timed_out and not self.interrupted and not self.stopped and all(c == 0 for c in self.exit_codes)

    @property
    def cold_start_s(self) -> float | None:
        """Launch to the first completed step: the plain cost of starting the job."""
        return None if self.first_step_ns is None else (self.first_step_ns - self.start_ns) / 1e9


def journal(run_dir: Path) -> list[dict[str, Any]]:
    """The harnesses' events of a run (one journal per node of a multi-node job), in time order."""
    return sorted(
        (e for path in sorted(run_dir.glob("harness*.jsonl")) for e in read_events(path)), key=lambda e: e["ts_ns"]
    )


def journal_name(job: Job) -> str:
    """The harness's journal: one per node when each node has its own harness (`chaos.multinode`)."""
    return JOURNAL if job.rdzv_endpoint is None else f"harness{job.node_rank or 0}.jsonl"


def first_attempt(job: Job, plan: Plan) -> int:
    """The attempt number of this launch's first ranks: 0, or further on in a requeued Slurm job
    (`commlib.attempt.launch_base`, from torchrun's settings for this job)."""
    return launch_base({**os.environ, MAX_RESTARTS_ENV: str(plan.restarts), NODES_ENV: str(job.nnodes)})


def check_plan(
    job: Job,
    plan: Plan,
    timeout_s: float | None = None,
    *,
    notice_s: int | None = None,
    steps: int | None = None,
    deadline_s: float | None = None,
) -> None:
    """What of the plan depends on the job beyond its world size (`Plan.resolve`): its triggers and
    stragglers against the run's steps, deadline and `timeout_s` (`chaos.plan.check_run`), its network
    faults' topology and lengths (`chaos.plan.check_network`), its Slurm faults against the Slurm job
    it runs in, or, with `notice_s` (its ``--signal`` notice), is submitted as (`chaos.slurm.faults.check`).
    Raises PlanError naming the fault. The reference trainer's steps and deadline are read by its
    own parser, which checks its arguments, and, where the job launches here (no `notice_s`), its
    devices against this machine's (`chaos.workload.arguments.check_devices`): ValueError naming
    the argument. Another trainer's `steps` and `deadline_s` are what its fault-free run showed
    (`chaos.verify.check_against_reference`), or unknown (None): what depends on them is not
    checked."""
    args = _reference_args(job)
    if args is not None and notice_s is None:
        from chaos.workload.arguments import check_devices

        check_devices(args, job.nproc_per_node)
    deadline = deadline_s
    if args is not None:
        steps, deadline = args.steps, float(args.timeout)
    check_run(plan, steps=steps, deadline_s=deadline, timeout_s=timeout_s)
    if any(f.type.network for f in plan.faults):
        check_network(
            plan, nnodes=job.nnodes, local=job.rdzv_endpoint is None, backend=job.backend, deadline_s=deadline
        )
    if any(f.type.slurm for f in plan.faults):
        from chaos.slurm.faults import check

        for i, f in enumerate(plan.faults):
            why = check(f.type, notice_s=notice_s)
            if why is not None:
                raise PlanError(f"faults[{i}].type", why)


def trainer_deadline(job: Job) -> float | None:
    """The collective deadline the reference trainer runs with (default included); None for another trainer."""
    args = _reference_args(job)
    return None if args is None else float(args.timeout)


def _reference_args(job: Job) -> Any:
    """The reference trainer's own parser's reading of the arguments the job would launch it with
    (an argparse Namespace, defaults included); None for another trainer. Arguments it refuses
    are refused here, before anything starts (ValueError naming the argument)."""
    if not job.is_reference_trainer:
        return None
    from chaos.workload.arguments import ArgumentsRefused, check_args

    try:
        return check_args(job.trainer_argv(Path("{run_dir}"))[2:])
    except ArgumentsRefused as exc:
        raise ValueError(f"the reference trainer's arguments {list(job.trainer_args)}: {exc}") from None


def _flag(args: tuple[str, ...], name: str) -> int | None:
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return int(args[i + 1]) if args[i + 1].isdigit() else None
        if a.startswith(name + "="):
            value = a.split("=", 1)[1]
            return int(value) if value.isdigit() else None
    return None


def run_job(
    job: Job,
    plan: Plan,
    run_dir: str | os.PathLike[str],
    *,
    timeout_s: float = 600.0,
    progress: Callable[[str], None] | None = None,
    inject: bool = True,
) -> JobOutcome:
    """Run `job` under the resolved `plan` in `run_dir`; see the module docstring.

    `inject=False` runs it without the in-rank injector (the fault-free reference).
    Never returns while a process of the job is alive.
    """
    run_dir = Path(run_dir).absolute()
    check_plan(job, plan, timeout_s)  # before anything starts
    _prepare(job, plan, run_dir)
    start_ns = time.time_ns()
    env = _environment(job, plan, run_dir, start_ns, inject)
    stop = _OutsideStop(job.rdzv_endpoint is not None)
    with stop, Guard(run_dir) as guard, _fault_resources(job, plan, run_dir, guard) as (disk, network):
        notes = event_log(run_dir / journal_name(job), pid=os.getpid(), first_attempt=first_attempt(job, plan))
        if network is not None:
            notes.info(
                "harness.network",
                namespaces=[n.netns for n in network.nodes],
                addresses=[n.address for n in network.nodes],
                device=DEVICE,
            )
        processes = JobProcesses(guard.token)
        ledger = Ledger(run_dir / "chaos_state")
        faults = ExternalFaults(plan, ledger, notes, processes, start_ns, disk, network)
        status = Progress(
            plan,
            ledger,
            processes,
            start_ns,
            _flag(job.trainer_args, "--steps") if job.is_reference_trainer else None,
            progress,
        )
        tail = LogTail(run_dir / "logs")
        outcome = JobOutcome(run_dir, start_ns, start_ns, [])
        try:
            for n, cmd in enumerate(torchrun_commands(job, plan.restarts, run_dir, network)):
                node = n if job.node_rank is None else job.node_rank
                agent = processes.launch(cmd, env, run_dir / f"torchrun{node}.log", cwd=run_dir / WORK_DIR)
                notes.info("harness.launch", node=node, agent_pid=agent.pid, cmd=cmd)
            deadline = time.monotonic() + timeout_s
            while processes.running():
                if time.monotonic() > deadline:
                    outcome.timed_out = not outcome.stopped
                    if outcome.timed_out:
                        notes.info("harness.timeout", timeout_s=timeout_s, asked_for_dumps=processes.ask_for_dumps())
                    else:
                        notes.info("harness.stop_grace_over", timeout_s=timeout_s)
                    break
                if stop.requested_ns is not None and not outcome.stopped:
                    # The job's own preemption path: the ranks stop together after the step in
                    # progress, with a checkpoint of it. SIGTERM goes to the ranks (again, under
                    # Slurm, which signals every process of the step): never twice to torchrun,
                    # which gives up waiting for its workers on a second one.
                    outcome.stopped = True
                    notes.info("harness.stop", why="SIGTERM", grace_s=STOP_GRACE_S)
                    for w in processes.workers():
                        send(w.proc, signal.SIGTERM)
                    deadline = min(deadline, time.monotonic() + STOP_GRACE_S)
                _poll(tail, processes, faults, status, start_ns)
                time.sleep(POLL_S)
                if network is not None:
                    network.check()  # a dead forwarder is a dead network: stop rather than time out
            _poll(tail, processes, faults, status, start_ns)
        except KeyboardInterrupt:
            outcome.interrupted = True
            notes.info("harness.interrupt")
            raise
        finally:
            faults.release_holds(force=True)
            processes.stop()  # before the network goes: no process of the job is left in a namespace
            outcome.pids, outcome.pgids = set(processes.seen), processes.pgids
            outcome.first_step_ns, outcome.restarts = status.first_step_ns, status.restarts
            outcome.exit_codes = [
                None if (outcome.timed_out or outcome.interrupted or outcome.stopped) else a.returncode
                for a in processes.agents
            ]
            outcome.end_ns = time.time_ns()
            if network is not None:
                for event in tail.poll():  # the last lines: steps the notes count (no worker is left to fault)
                    faults.on_event(event)
                faults.note_step_times()
                notes.info("harness.network_totals", links=[asdict(network.stats(n)) for n in range(job.nnodes)])
            notes.info(
                "harness.end",
                exit_codes=outcome.exit_codes,
                timed_out=outcome.timed_out,
                stopped=outcome.stopped,
                first_step_ns=outcome.first_step_ns,
            )
    return outcome


def _prepare(job: Job, plan: Plan, run_dir: Path) -> None:
    """The run directory, new or empty, with the plan and the job in it; for one node of a
    multi-node job, also one that holds this very job (`_join`)."""
    if job.rdzv_endpoint is not None:
        _join(job, plan, run_dir)
        return
    if run_dir.is_dir() and any(run_dir.iterdir()):
        # Logs, checkpoints and the ledger of an earlier run would leak into this one.
        raise ValueError(
            f"run_job: expected a new or empty run directory; found {run_dir} holding "
            f"{sorted(p.name for p in run_dir.iterdir())[:5]}"
        )
    for sub in ("logs", "ckpt", "chaos_state", WORK_DIR):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    plan.save(run_dir / "plan.json")
    (run_dir / "job.json").write_text(json.dumps(job.to_dict(), indent=2) + "\n")


def _join(job: Job, plan: Plan, run_dir: Path) -> None:
    """The run directory of a multi-node job, made by the first of its nodes' harnesses; the
    others, and the same nodes again in a requeued Slurm job, join it. It must hold the same job
    (its rendezvous id too: another job's, or a run that went on without this node, is refused)
    and the same plan, and no verdict yet."""
    for sub in ("logs", "ckpt", "chaos_state", WORK_DIR):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    shared = {**job.to_dict(), "node_rank": None, "rdzv_endpoint": None}  # the head may move on a requeue
    for name, data in (("job.json", shared), ("plan.json", plan.to_dict())):
        path = run_dir / name
        if not publish(path, json.dumps(data, indent=2) + "\n"):  # a peer's came first
            found = json.loads(path.read_text())
            if found != data:
                differ = sorted(k for k in data.keys() | found.keys() if data.get(k) != found.get(k))
                raise ValueError(
                    f"run_job: expected {path} to be this job's, to join it; found another "
                    f"({differ[0]}: {found.get(differ[0])!r} there, {data.get(differ[0])!r} here)"
                )
    if (run_dir / "report.json").exists():
        raise ValueError(
            f"run_job: expected a multi-node run still going on in {run_dir}; found its verdict written (report.json)"
        )


def _environment(job: Job, plan: Plan, run_dir: Path, start_ns: int, inject: bool) -> dict[str, str]:
    """The agents' environment: reproducible numbers, where the ranks log, the run, the ledger,
    the start time, where the harness was started, how often the probe digests, and (with
    `inject`) the plan for the in-rank injector."""
    env = {
        **REPRODUCIBLE_ENV,
        **os.environ,
        LAUNCH_DIR_ENV: os.getcwd(),
        DIGEST_EVERY_ENV: str(job.digest_every),
        LOG_DIR_ENV: str(run_dir / "logs"),
        RUN_DIR_ENV: str(run_dir),
        STATE_ENV: str(run_dir / "chaos_state"),
        START_ENV: str(start_ns),
        "PYTHONUNBUFFERED": "1",
    }
    if inject:
        env[PLAN_ENV] = str(run_dir / "plan.json")
    else:
        env.pop(PLAN_ENV, None)
    if any(f.type.network for f in plan.faults):
        env["GLOO_SOCKET_IFNAME"] = DEVICE  # else gloo binds what the hostname resolves to: 127.0.0.1
    return env


@contextlib.contextmanager
def _fault_resources(
    job: Job, plan: Plan, run_dir: Path, guard: Guard
) -> Iterator[tuple[SmallDisk | None, Network | None]]:
    """What the plan's faults need before the launch: the small disk of ``disk_full``, the
    nodes' network of a network fault; noted in `guard` before they are made, taken down after
    the run, whatever its end."""
    with contextlib.ExitStack() as undo:
        disk = network = None
        if any(f.type is FaultType.DISK_FULL for f in plan.faults):
            disk = SmallDisk(job.checkpoint_dir(run_dir))
            guard.note_mount(disk.directory)
            disk.mount()  # raises DiskFullUnavailable, saying why, before anything starts
            undo.callback(disk.unmount)
        if any(f.type.network for f in plan.faults):
            # Loss is drawn from the plan's seed (the first net_loss fault's), as `p` triggers are.
            seed = next((f.seed for f in plan.faults if f.type is FaultType.NET_LOSS), 0)
            network = Network(job.nnodes, seed=seed)
            guard.note_namespaces([n.netns for n in network.nodes])
            network.open()  # raises NetworkUnavailable, saying why
            undo.callback(network.close)
        yield disk, network


def _poll(tail: LogTail, processes: JobProcesses, faults: ExternalFaults, status: Progress, since_ns: int) -> None:
    """One look at the job: the ranks' new log lines (from `since_ns` on: a run directory joined
    again holds an earlier launch's), the workers (now and then), the external faults now due or
    over, the progress line."""
    for event in tail.poll():
        if event.get("ts_ns", since_ns) < since_ns:
            continue
        processes.note(event.get("pid"))
        status.on_event(event)
        faults.on_event(event)
    status.scan()
    faults.poll()
    status.show()


class _OutsideStop:
    """SIGINT and SIGTERM while the job runs (main thread only). For one node of a multi-node
    job SIGTERM is the scheduler taking the job back (a preemption, its notice, a requeue): noted
    in `requested_ns`, and `run_job` lets the job stop by itself, up to `STOP_GRACE_S`. Otherwise
    the first of them raises KeyboardInterrupt, as Ctrl-C does, and `run_job` stops the job.

    Only the first: a signal after it (a second Ctrl-C) changes nothing, so that no signal can
    cut short the stop of the job's processes, which must all be gone before the harness removes
    their namespaces and its record and says it stopped them."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, graceful: bool) -> None:
        self.graceful = graceful
        self.requested_ns: int | None = None
        self.interrupted = False
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        if self.interrupted:
            return
        if signum == signal.SIGTERM and self.graceful:
            if self.requested_ns is None:
                self.requested_ns = time.time_ns()
        else:
            self.interrupted = True
            raise KeyboardInterrupt(f"signal {signum}")

    def __enter__(self) -> _OutsideStop:
        try:
            self._previous = {sig: signal.signal(sig, self._handler) for sig in self.SIGNALS}
        except ValueError:  # not the main thread: the caller owns signals
            self._previous = {}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
