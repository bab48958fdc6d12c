"""The harness: run a job under torchrun, break it as the plan says, and clean up after it.

`run_job(job, plan, run_dir)` launches ``python -m torch.distributed.run`` (one agent, or
one agent per node when ``nnodes > 1`` runs on this machine) with ``--max-restarts``
from the plan, in its own session so that nothing of the job can outlive the harness,
and then watches it until every agent exits or the harness's own deadline passes:

- it tails the ranks' commlib logs (``{run_dir}/logs/rank{R}.jsonl``) for progress:
  ``chaos.step`` (a rank starting a step; written by the in-rank injector) and
  ``train.step`` (a step completed), and typed errors;
- it applies the plan's external faults, ``kill`` (SIGKILL), ``hang`` (SIGSTOP, then
  SIGKILL or SIGCONT) and ``sigterm`` (SIGTERM: a scheduler's preemption notice), to worker processes of this job only: children of its own torchrun
  agents, matched to ranks by their environment (``RANK``,
  ``TORCHELASTIC_RESTART_COUNT``), never by name. ``step`` and ``p`` triggers are
  evaluated when the target rank's log shows it starting a step, ``after_s`` once that
  much time has passed; each firing is claimed in the ledger before the signal and
  recorded in ``{run_dir}/harness.jsonl`` with its timestamp;
- a hung rank stays stopped for the fault's ``duration_s``, or by default until a
  survivor logs a typed error (the failure was detected), and is then released;
- ``disk_full`` mounts a small tmpfs on the checkpoint directory before the launch
  (`chaos.disk`), fills it at the fault's step, and frees the space the same way a hang is
  released (any rank's typed error, or ``duration_s``); it is unmounted after the run;
- network faults (``partition``, ``net_delay``, ``net_loss``) need the job's nodes in
  network namespaces of their own: for such a plan (only), `chaos.net.Network` makes one
  namespace per local node, joined by its link emulator, before the launch; each agent runs
  in its node's namespace (``ip netns exec``), on a rendezvous at node 0's address instead
  of 127.0.0.1, with gloo bound to the node's device (``GLOO_SOCKET_IFNAME``). At the
  fault's step the harness impairs the link of the node running the rank, and lifts it
  after ``duration_s``; namespaces and devices are removed after the run, whatever its end;
- it shows a progress line (steps done, faults injected, restarts);
- on its deadline, on Ctrl-C and on SIGTERM it stops the whole job: SIGCONT, then SIGTERM
  to every process of the job, then SIGKILL to what is left; and after a normal end it
  kills anything still in the job's process groups (e.g. a compile worker whose parent
  is gone). `JobOutcome.pids` lists every process the job was seen to have.

The in-rank faults are the injector's (`chaos.inject`); the harness passes it the plan,
the ledger's directory and the job's start time through the environment.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from chaos.disk import SmallDisk
from chaos.inject import PLAN_ENV, START_ENV, STATE_ENV
from chaos.net import DEVICE, Impairment, Network
from chaos.plan import Fault, FaultType, Ledger, Plan, Release, TriggerKind, check_network
from commlib.observe.log import LOG_DIR_ENV, LineWriter, LogTail, read_events, render_json_line

REFERENCE_TRAINER = "chaos.workload.train"
# The main job (`python -m chaos run` with no arguments): a small 30-step run of the
# reference trainer with a short collective deadline, a rank killed mid-run and, later,
# a collective held past that deadline.
DEFAULT_TRAINER_ARGS = ("--steps", "30", "--ckpt-every", "5", "--timeout", "10")
DEFAULT_FAULTS = ("kill:rank=1,step=12", "delay:rank=1,step=22")
RUN_DIR_ENV = "CHAOS_RUN_DIR"
POLL_S = 0.02
SCAN_S = 0.5  # how often the worker processes are listed (to count restarts)
TERM_GRACE_S = 5.0
HANG_MAX_HOLD_S = 300.0  # a hang with no duration is released at the latest after this
# A survivor's event that says the fault was noticed (`train.failed_in_step`: the trainer
# caught it in a step and is recovering in-job, e.g. a NonFiniteError, which is no CommError;
# `train.preempted`: every rank agreed to stop after a SIGTERM).
TYPED_ERRORS = frozenset({"collective.timeout", "peer.failure", "collective.error", "collective.mismatch",
                          "train.error", "train.failed_in_step", "train.preempted"})
_FAULT_SIGNALS = {FaultType.KILL: signal.SIGKILL, FaultType.HANG: signal.SIGSTOP, FaultType.SIGTERM: signal.SIGTERM}
RDZV_PORT = 29400  # in node 0's own namespace nothing else listens


@dataclass(frozen=True)
class Job:
    """What to launch. `trainer` is a module name (run with ``-m``) or a script path.

    `trainer_args` may contain ``{run_dir}``, replaced by the run directory. For the
    reference trainer the harness adds ``--log-dir``, ``--ckpt-dir`` and ``--results``
    in the run directory, and ``--backend`` (and ``--device cuda`` for nccl) unless the
    arguments already name them.
    With `rdzv_endpoint` this machine runs one node (`node_rank`) of a multi-node job;
    without it, all `nnodes` nodes run here, on a c10d rendezvous on 127.0.0.1 (or, for a plan
    with a network fault, each node in a network namespace of its own: `chaos.net`).
    """

    trainer: str = REFERENCE_TRAINER
    trainer_args: tuple[str, ...] = ()
    nproc_per_node: int = 2
    nnodes: int = 1
    backend: str = "gloo"
    rdzv_endpoint: str | None = None
    rdzv_backend: str = "c10d"
    rdzv_id: str | None = None
    node_rank: int | None = None

    def __post_init__(self) -> None:
        for name in ("nproc_per_node", "nnodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Job.{name}: expected a positive int; found {value!r}")
        if not (Path(self.trainer).is_file() if self.is_script else _importable(self.trainer)):
            raise ValueError(f"Job.trainer: expected a script file or an importable module; found neither: "
                             f"{self.trainer!r}")
        if self.node_rank is not None and self.rdzv_endpoint is None:
            raise ValueError(f"Job.node_rank: expected only with rdzv_endpoint (a multi-node job); "
                             f"found node_rank={self.node_rank} and no endpoint")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def local_nodes(self) -> int:
        """Agents this machine runs."""
        return 1 if self.rdzv_endpoint is not None else self.nnodes

    @property
    def is_reference_trainer(self) -> bool:
        return self.trainer == REFERENCE_TRAINER

    @property
    def is_script(self) -> bool:
        return self.trainer.endswith(".py") or os.sep in self.trainer

    def trainer_argv(self, run_dir: Path) -> list[str]:
        argv = [self.trainer] if self.is_script else ["-m", self.trainer]
        argv += [a.replace("{run_dir}", str(run_dir)) for a in self.trainer_args]
        if self.is_reference_trainer:
            argv += ["--log-dir", str(run_dir / "logs"), "--ckpt-dir", str(run_dir / "ckpt"),
                     "--results", str(run_dir / "results.json")]
            if not _has_flag(self.trainer_args, "--backend"):
                argv += ["--backend", self.backend]
            if self.backend == "nccl" and not _has_flag(self.trainer_args, "--device"):
                argv += ["--device", "cuda"]
        return argv

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "trainer_args": list(self.trainer_args), "world_size": self.world_size}


@dataclass
class JobOutcome:
    run_dir: Path
    start_ns: int  # wall clock at launch
    end_ns: int
    exit_codes: list[int | None]  # one per local agent; None: killed by the harness
    timed_out: bool = False
    interrupted: bool = False
    first_step_ns: int | None = None  # wall clock of the first train.step of any rank
    restarts: int = 0  # the highest torchrun restart count seen in the logs
    pids: set[int] = field(default_factory=set)  # every process of the job ever seen
    pgids: list[int] = field(default_factory=list)  # the job's process groups (one per agent)

    @property
    def ok(self) -> bool:
        return not self.timed_out and not self.interrupted and all(c == 0 for c in self.exit_codes)

    @property
    def cold_start_s(self) -> float | None:
        """Launch to the first completed step: the plain cost of starting the job."""
        return None if self.first_step_ns is None else (self.first_step_ns - self.start_ns) / 1e9


class _Journal:
    """The harness's own events, ``{run_dir}/harness.jsonl``, in the ranks' log format."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._writer = LineWriter(self._fd)  # commlib's: one event, one line, one write(2)

    def write(self, event: str, **fields: Any) -> None:
        record = {"event": event, "ts_ns": time.time_ns(), "mono_ns": time.monotonic_ns(), "pid": os.getpid(),
                  **fields}
        self._writer.msg(render_json_line(None, event, record))

    def close(self) -> None:
        os.close(self._fd)


def journal(run_dir: Path) -> list[dict[str, Any]]:
    """The harness's events of a run."""
    path = run_dir / "harness.jsonl"
    return list(read_events(path)) if path.exists() else []


@dataclass
class _Hold:
    """A rank stopped by a hang fault, waiting to be released."""

    fault: Fault
    index: int
    proc: psutil.Process
    rank: int
    since_ns: int
    node: int | None = None  # network faults: the node whose link is impaired
    link_before: dict[str, int] | None = None  # network faults: that link's counters when it was impaired


class _Watch:
    """One run in progress: the agents, what the logs said so far, and the external faults."""

    def __init__(self, job: Job, plan: Plan, run_dir: Path, agents: list[subprocess.Popen[bytes]],
                 start_ns: int, notes: _Journal, progress: Callable[[str], None] | None,
                 disk: SmallDisk | None = None, network: Network | None = None) -> None:
        self.job, self.plan, self.run_dir = job, plan, run_dir
        self.disk = disk
        self.network = network
        self.agents = agents
        self.start_ns = start_ns
        self.notes = notes
        self.progress = progress
        self.tail = LogTail(run_dir / "logs")
        self.ledger = Ledger(run_dir / "chaos_state")
        self.external = [(i, f) for i, f in enumerate(plan.faults) if f.type.external]
        self.tried: set[tuple[int, int, int]] = set()  # (fault index, pid, step) already evaluated
        self.holds: list[_Hold] = []
        self.pids: set[int] = set(a.pid for a in agents)
        self.ranks_with_step_events: set[int] = set()
        self.steps_done = 0
        self.max_attempt = 0
        self.first_step_ns: int | None = None
        self.errors_after: list[tuple[int, int]] = []  # (ts_ns, pid) of typed errors seen
        # (start ns, rank, step, step_time_s) of completed steps, but a process's first (it warms up)
        self.step_times: list[tuple[int, int, int, float]] = []
        self._stepped: set[int] = set()  # pids that completed a step
        self.windows: list[tuple[_Hold, int]] = []  # lifted network faults, and when they were lifted
        self.total_steps = _flag(job.trainer_args, "--steps") if job.is_reference_trainer else None
        self._last_line = ""
        self._next_scan = 0.0
        self._scanned: set[int] = set()

    # -- one poll ----------------------------------------------------------------------
    def step(self) -> None:
        for event in self.tail.poll():
            self._on_event(event)
        if time.monotonic() >= self._next_scan:
            self._scan_workers()
        if self.external:
            self._after_s_triggers()
        self.release_holds()
        self._show()

    def _on_event(self, event: dict[str, Any]) -> None:
        name, rank, pid = event.get("event"), event.get("rank"), event.get("pid")
        self.max_attempt = max(self.max_attempt, int(event.get("attempt", 0)))
        if isinstance(pid, int):
            self.pids.add(pid)
        if name == "train.step":
            self.steps_done = max(self.steps_done, int(event.get("step", 0)))
            if self.first_step_ns is None:
                self.first_step_ns = int(event["ts_ns"])
            took = event.get("step_time_s")
            if isinstance(rank, int) and isinstance(took, (int, float)) and pid in self._stepped:
                self.step_times.append((int(event["ts_ns"] - took * 1e9), rank, int(event["step"]), float(took)))
            self._stepped.add(pid)
        if name in TYPED_ERRORS and isinstance(pid, int):
            self.errors_after.append((int(event["ts_ns"]), pid))
        if not isinstance(rank, int) or not isinstance(pid, int):
            return
        # The step a rank is starting: the injector's chaos.step, or else the step after a train.step.
        if name == "chaos.step":
            self.ranks_with_step_events.add(rank)
            self._step_triggers(rank, pid, int(event["step"]), int(event.get("attempt", 0)))
        elif name == "train.step" and rank not in self.ranks_with_step_events:
            self._step_triggers(rank, pid, int(event["step"]) + 1, int(event.get("attempt", 0)))

    def _scan_workers(self) -> None:
        """Note every worker and its attempt: an attempt that dies before logging anything
        (say, in the backend's connect) is a restart all the same."""
        self._next_scan = time.monotonic() + SCAN_S
        for agent in self.agents:
            try:
                children = psutil.Process(agent.pid).children()
            except psutil.NoSuchProcess:
                continue
            for child in children:
                if child.pid not in self._scanned:
                    self._scanned.add(child.pid)
                    self.pids.add(child.pid)
                    self.max_attempt = max(self.max_attempt, _attempt_of(child))

    # -- external faults ---------------------------------------------------------------
    def _step_triggers(self, rank: int, pid: int, step: int, attempt: int) -> None:
        elapsed = (time.time_ns() - self.start_ns) / 1e9
        for i, f in self.external:
            if f.rank != rank or f.trigger.kind is TriggerKind.AFTER_S or (i, pid, step) in self.tried:
                continue
            self.tried.add((i, pid, step))
            if f.trigger.matches_step(f.seed, i, attempt, step, elapsed) and self.ledger.fired(i) < f.count:
                worker = self._worker(rank, pid)
                if worker is not None:
                    self._fire(i, f, *worker, step, attempt)

    def _after_s_triggers(self) -> None:
        elapsed = (time.time_ns() - self.start_ns) / 1e9
        for i, f in self.external:
            if f.trigger.kind is not TriggerKind.AFTER_S or elapsed < f.trigger.value:
                continue
            if self.ledger.fired(i) >= f.count or any(h.index == i for h in self.holds):
                continue
            worker = self._worker(int(f.rank))
            if worker is not None and (i, worker[0].pid, -1) not in self.tried:
                self.tried.add((i, worker[0].pid, -1))
                self._fire(i, f, *worker, None, _attempt_of(worker[0]))

    def _fire(self, index: int, fault: Fault, proc: psutil.Process, node: int, step: int | None,
              attempt: int) -> None:
        if fault.type is FaultType.DISK_FULL:
            self._fill_disk(index, fault, proc, node, step, attempt)
            return
        if fault.type.network:
            self._impair(index, fault, proc, node, step, attempt)
            return
        firing = self.ledger.claim(fault, index, attempt, step, pid=proc.pid, node=node)
        if firing is None:
            return
        sig = _FAULT_SIGNALS[fault.type]
        error = _signal(proc, sig)
        self.notes.write("chaos.fault", fault=fault.type.value, index=index, firing=firing.n,
                         target_rank=int(fault.rank), pid=proc.pid, node=node, fault_step=step, attempt=attempt,
                         signal=sig.name, error=error, fired_ts_ns=firing.ts_ns)
        if fault.type is FaultType.HANG and error is None:
            self.holds.append(_Hold(fault, index, proc, int(fault.rank), firing.ts_ns))

    def _fill_disk(self, index: int, fault: Fault, proc: psutil.Process, node: int, step: int | None,
                   attempt: int) -> None:
        # Filled before the claim, unlike the signals: the rank starts its step SIGNAL_GRACE_S
        # after the claim, and filling takes a while on a loaded machine.
        assert self.disk is not None  # mounted by run_job for a plan with a disk_full fault
        filled = self.disk.fill()
        firing = self.ledger.claim(fault, index, attempt, step, pid=proc.pid, node=node)
        if firing is None:
            self.disk.drain()
            return
        self.notes.write("chaos.fault", fault=fault.type.value, index=index, firing=firing.n,
                         target_rank=int(fault.rank), pid=proc.pid, node=node, fault_step=step, attempt=attempt,
                         filled_bytes=filled, free_bytes=self.disk.free_bytes(), fired_ts_ns=firing.ts_ns)
        self.holds.append(_Hold(fault, index, proc, int(fault.rank), firing.ts_ns))

    def _impair(self, index: int, fault: Fault, proc: psutil.Process, node: int, step: int | None,
                attempt: int) -> None:
        assert self.network is not None  # opened by run_job for a plan with a network fault
        if any(h.fault.type is fault.type and h.node == node for h in self.holds):
            return  # that link has this impairment already: not fired at this step (nor claimed)
        # Applied before the claim, like the disk: the rank starts its step SIGNAL_GRACE_S after it.
        before = asdict(self.network.stats(node))
        link = _set_impairment(self.network, fault, node, on=True)
        firing = self.ledger.claim(fault, index, attempt, step, pid=proc.pid, node=node)
        if firing is None:
            _set_impairment(self.network, fault, node, on=False)
            return
        self.notes.write("chaos.fault", fault=fault.type.value, index=index, firing=firing.n,
                         target_rank=int(fault.rank), pid=proc.pid, node=node, fault_step=step, attempt=attempt,
                         netns=self.network.nodes[node].netns, address=self.network.address(node), link=asdict(link),
                         duration_s=fault.duration_s, fired_ts_ns=firing.ts_ns)
        self.holds.append(_Hold(fault, index, proc, int(fault.rank), firing.ts_ns, node, before))

    def _lift(self, hold: _Hold, held_s: float, reason: str) -> None:
        """A network fault's end: the link back, with what crossed it meanwhile."""
        assert self.network is not None and hold.node is not None and hold.link_before is not None
        _set_impairment(self.network, hold.fault, hold.node, on=False)
        counts = asdict(self.network.stats(hold.node))
        self.windows.append((hold, time.time_ns()))
        self.notes.write("chaos.release", fault=hold.fault.type.value, index=hold.index, target_rank=hold.rank,
                         pid=hold.proc.pid, node=hold.node, held_s=held_s, reason=reason,
                         link={k: counts[k] - hold.link_before[k] for k in counts})

    def note_step_times(self) -> None:
        """Once the job is over: per lifted network fault, the target rank's steps that started
        while it was on, against that rank's steps that started outside every such window."""
        for event in self.tail.poll():  # the last lines (no worker is left to fault)
            self._on_event(event)

        def inside(start: int) -> bool:
            return any(h.since_ns <= start < lifted for h, lifted in self.windows)

        for hold, lifted in self.windows:
            mine = [(start, step, took) for start, r, step, took in self.step_times if r == hold.rank]
            during = [(step, took) for start, step, took in mine if hold.since_ns <= start < lifted]
            outside = [took for start, _, took in mine if not inside(start)]
            self.notes.write("chaos.net_steps", fault=hold.fault.type.value, index=hold.index,
                             target_rank=hold.rank, steps=[s for s, _ in during],
                             step_time_s_during=_median([t for _, t in during]), step_time_s_outside=_median(outside),
                             steps_outside=len(outside))

    def release_holds(self, force: bool = False) -> None:
        now = time.time_ns()
        for hold in list(self.holds):
            held_s = (now - hold.since_ns) / 1e9
            if force:
                reason = "harness stopping"
            elif hold.fault.duration_s is not None:
                reason = "duration" if held_s >= hold.fault.duration_s else ""
            elif any(ts >= hold.since_ns and (pid != hold.proc.pid or hold.fault.type is FaultType.DISK_FULL)
                     for ts, pid in self.errors_after):
                reason = "a survivor reported the failure"
            elif not any(a.poll() is None for a in self.agents):
                reason = "the job ended"
            else:
                reason = "maximum hold" if held_s >= HANG_MAX_HOLD_S else ""
            if not reason:
                continue
            self.holds.remove(hold)
            if hold.fault.type.network:
                self._lift(hold, held_s, reason)
                continue
            if hold.fault.type is FaultType.DISK_FULL:  # space freed, as an operator would
                assert self.disk is not None
                self.disk.drain()
                self.notes.write("chaos.release", fault=hold.fault.type.value, index=hold.index,
                                 target_rank=hold.rank, pid=hold.proc.pid, held_s=held_s, reason=reason,
                                 free_bytes=self.disk.free_bytes())
                continue
            release = Release.KILL if force else hold.fault.release
            sig = signal.SIGKILL if release is Release.KILL else signal.SIGCONT
            error = _signal(hold.proc, sig)
            self.notes.write("chaos.release", fault=hold.fault.type.value, index=hold.index, target_rank=hold.rank,
                             pid=hold.proc.pid, signal=sig.name, held_s=held_s, reason=reason, error=error)

    def _worker(self, rank: int, pid: int | None = None) -> tuple[psutil.Process, int] | None:
        """The live worker process of `rank` in this job (the newest, or the one with `pid`), and
        the node (agent index) it runs under."""
        found = []
        for node, agent in enumerate(self.agents):
            try:
                children = psutil.Process(agent.pid).children()
            except psutil.NoSuchProcess:
                continue
            for child in children:
                self.pids.add(child.pid)
                env = _environ(child)
                if env.get("RANK") == str(rank) and (pid is None or child.pid == pid) and _alive(child):
                    found.append((child, node))
        return max(found, key=lambda pn: (_attempt_of(pn[0]), pn[0].create_time()), default=None)

    # -- progress ----------------------------------------------------------------------
    def _show(self) -> None:
        if self.progress is None:
            return
        total = f"/{self.total_steps}" if self.total_steps else ""
        faults = self.ledger.total() if self.plan.faults else 0
        state = (f"step {self.steps_done}{total} | faults injected {faults}/"
                 f"{sum(f.count for f in self.plan.faults)} | restarts {self.max_attempt}")
        if state != self._last_line:
            self._last_line = state
            self.progress(f"{state} | {(time.time_ns() - self.start_ns) / 1e9:.1f} s")


def _set_impairment(network: Network, fault: Fault, node: int, *, on: bool) -> Impairment:
    """Turn `fault`'s part of `node`'s link on or off (kinds compose: a delayed link can also be cut)."""
    if fault.type is FaultType.PARTITION:
        return network.impair(node, cut=on)
    if fault.type is FaultType.NET_DELAY:
        assert fault.ms is not None
        return network.impair(node, delay_s=fault.ms / 1000 if on else 0.0)
    assert fault.type is FaultType.NET_LOSS and fault.pct is not None
    return network.impair(node, loss=fault.pct / 100 if on else 0.0)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def check_plan(job: Job, plan: Plan) -> None:
    """What of the plan depends on the job beyond its world size (`Plan.resolve`): its network
    faults' topology and lengths (`chaos.plan.check_network`). Raises PlanError naming the fault."""
    if any(f.type.network for f in plan.faults):
        check_network(plan, nnodes=job.nnodes, local=job.rdzv_endpoint is None, backend=job.backend,
                      deadline_s=trainer_deadline(job))


def trainer_deadline(job: Job) -> float | None:
    """The collective deadline the reference trainer runs with (its own parser's reading of the
    job's arguments, default included); None for another trainer."""
    if not job.is_reference_trainer:
        return None
    from chaos.workload.train import parse_args

    try:
        return float(parse_args(list(job.trainer_args)).timeout)
    except SystemExit:  # arguments it refuses: the launch will say so
        return None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing
        return False


def _has_flag(args: tuple[str, ...], name: str) -> bool:
    return any(a == name or a.startswith(name + "=") for a in args)


def _flag(args: tuple[str, ...], name: str) -> int | None:
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return int(args[i + 1]) if args[i + 1].isdigit() else None
        if a.startswith(name + "="):
            value = a.split("=", 1)[1]
            return int(value) if value.isdigit() else None
    return None


def _environ(proc: psutil.Process) -> dict[str, str]:
    try:
        return proc.environ()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return {}


def _attempt_of(proc: psutil.Process) -> int:
    return int(_environ(proc).get("TORCHELASTIC_RESTART_COUNT", "0"))


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _signal(proc: psutil.Process, sig: signal.Signals) -> str | None:
    """Send `sig`; the error as text when the process was already gone."""
    try:
        proc.send_signal(sig)
        return None
    except psutil.NoSuchProcess:
        return f"process {proc.pid} already gone"


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a rendezvous endpoint two local agents must share)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_commands(job: Job, max_restarts: int, run_dir: Path,
                      network: Network | None = None) -> list[list[str]]:
    """One torchrun command per agent this machine runs; with `network`, each agent in its
    node's namespace, on a rendezvous at node 0's address."""
    base = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(job.nnodes),
            "--nproc-per-node", str(job.nproc_per_node), "--max-restarts", str(max_restarts),
            "--monitor-interval", "0.1"]
    trainer = job.trainer_argv(run_dir)
    if job.rdzv_endpoint is not None:  # one node of a multi-node job
        node = ["--rdzv-backend", job.rdzv_backend, "--rdzv-endpoint", job.rdzv_endpoint,
                "--rdzv-id", job.rdzv_id or "chaos"]
        if job.node_rank is not None:
            node += ["--node-rank", str(job.node_rank)]
        return [base + node + trainer]
    if job.nnodes == 1:
        return [base + ["--standalone", "--local-addr", "127.0.0.1"] + trainer]
    rdzv_id = job.rdzv_id or uuid.uuid4().hex
    if network is None:
        endpoint, prefixes, addresses = f"127.0.0.1:{free_port()}", [[]] * job.nnodes, ["127.0.0.1"] * job.nnodes
    else:
        endpoint = f"{network.address(0)}:{RDZV_PORT}"
        prefixes = [network.exec_prefix(n) for n in range(job.nnodes)]
        addresses = [network.address(n) for n in range(job.nnodes)]
    # Every agent here would take itself for the store's host: say which one is.
    return [prefixes[n] + base + ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id,
                                  "--rdzv-conf", f"is_host={'true' if n == 0 else 'false'}",
                                  "--local-addr", addresses[n]]
            + trainer for n in range(job.nnodes)]


def run_job(job: Job, plan: Plan, run_dir: str | os.PathLike[str], *, timeout_s: float = 600.0,
            progress: Callable[[str], None] | None = None, inject: bool = True) -> JobOutcome:
    """Run `job` under the resolved `plan` in `run_dir`; see the module docstring.

    `inject=False` runs it without the in-rank injector (the fault-free reference).
    Never returns while a process of the job is alive.
    """
    run_dir = Path(run_dir).absolute()
    check_plan(job, plan)  # before anything starts
    networked = any(f.type.network for f in plan.faults)
    if run_dir.is_dir() and any(run_dir.iterdir()):
        # Logs, checkpoints and the ledger of an earlier run would leak into this one.
        raise ValueError(f"run_job: expected a new or empty run directory; found {run_dir} holding "
                         f"{sorted(p.name for p in run_dir.iterdir())[:5]}")
    for sub in ("logs", "ckpt", "chaos_state"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    plan.save(run_dir / "plan.json")
    (run_dir / "job.json").write_text(json.dumps(job.to_dict(), indent=2) + "\n")
    start_ns = time.time_ns()
    env = {**os.environ, LOG_DIR_ENV: str(run_dir / "logs"), RUN_DIR_ENV: str(run_dir),
           STATE_ENV: str(run_dir / "chaos_state"), START_ENV: str(start_ns), "PYTHONUNBUFFERED": "1"}
    if inject:
        env[PLAN_ENV] = str(run_dir / "plan.json")
    else:
        env.pop(PLAN_ENV, None)
    disk = None
    if any(f.type is FaultType.DISK_FULL for f in plan.faults):
        disk = SmallDisk(run_dir / "ckpt")
        disk.mount()  # raises DiskFullUnavailable, saying why, before anything starts
    network = None
    if networked:
        env["GLOO_SOCKET_IFNAME"] = DEVICE  # else gloo binds what the hostname resolves to: 127.0.0.1
        try:
            # Loss is drawn from the plan's seed (the first net_loss fault's), as `p` triggers are.
            seed = next((f.seed for f in plan.faults if f.type is FaultType.NET_LOSS), 0)
            network = Network(job.nnodes, seed=seed).open()  # raises NetworkUnavailable, saying why
        except BaseException:
            if disk is not None:
                disk.unmount()
            raise
    notes = _Journal(run_dir / "harness.jsonl")
    if network is not None:
        notes.write("harness.network", namespaces=[n.netns for n in network.nodes],
                    addresses=[n.address for n in network.nodes], device=DEVICE)
    agents: list[subprocess.Popen[bytes]] = []
    outcome = JobOutcome(run_dir, start_ns, start_ns, [])
    previous = _on_sigterm()
    watch = None
    try:
        for n, cmd in enumerate(torchrun_commands(job, plan.restarts, run_dir, network)):
            with open(run_dir / f"torchrun{n}.log", "ab") as out:
                agents.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                               start_new_session=True))
            notes.write("harness.launch", node=n, agent_pid=agents[-1].pid, cmd=cmd)
        outcome.pgids = [a.pid for a in agents]
        watch = _Watch(job, plan, run_dir, agents, start_ns, notes, progress, disk, network)
        deadline = time.monotonic() + timeout_s
        while any(a.poll() is None for a in agents):
            if time.monotonic() > deadline:
                outcome.timed_out = True
                notes.write("harness.timeout", timeout_s=timeout_s)
                break
            watch.step()
            time.sleep(POLL_S)
            if network is not None:
                network.check()  # a dead forwarder is a dead network: stop rather than time out
        watch.step()
    except KeyboardInterrupt:
        outcome.interrupted = True
        notes.write("harness.interrupt")
        raise
    finally:
        try:
            if watch is not None:
                watch.release_holds(force=True)
                outcome.pids |= watch.pids
                outcome.first_step_ns = watch.first_step_ns
                outcome.restarts = watch.max_attempt
            outcome.pids |= stop(agents, outcome.pgids)
            outcome.exit_codes = [None if (outcome.timed_out or outcome.interrupted) else a.returncode
                                  for a in agents]
            outcome.end_ns = time.time_ns()
            if network is not None:
                if watch is not None:
                    watch.note_step_times()
                notes.write("harness.network_totals", links=[asdict(network.stats(n)) for n in range(job.nnodes)])
            notes.write("harness.end", exit_codes=outcome.exit_codes, timed_out=outcome.timed_out)
            notes.close()
        finally:
            if network is not None:  # after stop(): no process of the job is left in a namespace
                network.close()
            if disk is not None:
                disk.unmount()
            _restore_sigterm(previous)
    return outcome


def stop(agents: list[subprocess.Popen[bytes]], pgids: list[int]) -> set[int]:
    """Stop every process of the job: SIGCONT + SIGTERM, a grace period, then SIGKILL.

    Covers the agents, all their descendants, and their process groups (a grandchild whose
    parent died is no one's descendant any more, but still in its group). Returns the pids
    it found.
    """
    seen: set[int] = set()
    for sig in (signal.SIGCONT, signal.SIGTERM):
        for proc in _job_processes(agents, pgids):
            seen.add(proc.pid)
            _signal(proc, sig)
    deadline = time.monotonic() + TERM_GRACE_S
    while time.monotonic() < deadline and any(_alive(p) for p in _job_processes(agents, pgids)):
        time.sleep(0.05)
    for _ in range(3):  # an agent may have spawned a worker between two scans
        left = list(_job_processes(agents, pgids))
        if not left:
            break
        for proc in left:
            seen.add(proc.pid)
            _signal(proc, signal.SIGKILL)
        psutil.wait_procs(left, timeout=2)
    for a in agents:
        a.wait()
    return seen


def _job_processes(agents: list[subprocess.Popen[bytes]], pgids: list[int]) -> Iterator[psutil.Process]:
    found: dict[int, psutil.Process] = {}
    for a in agents:
        try:
            root = psutil.Process(a.pid)
            if a.poll() is None:
                found[root.pid] = root
            for child in root.children(recursive=True):
                found[child.pid] = child
        except psutil.NoSuchProcess:
            pass
    groups = set(pgids)
    if groups:
        for proc in psutil.process_iter():
            try:
                if proc.pid not in found and os.getpgid(proc.pid) in groups:
                    found[proc.pid] = proc
            except (ProcessLookupError, psutil.NoSuchProcess):
                continue
    return (p for p in found.values() if _alive(p))


def _on_sigterm() -> Any:
    """Treat SIGTERM like Ctrl-C while the job runs (main thread only), so the job gets cleaned up."""
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: the caller owns signals
        return None


def _restore_sigterm(previous: Any) -> None:
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)
