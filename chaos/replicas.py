"""The harness of replica groups under torchft: launch them, break one, restart it alone, prove it.

    outcome = run_replicas(ReplicaJob(replicas=2, trainer_args=("--steps", "20", "--timeout", "5")),
                           Plan.from_dict({"faults": [{"type": "kill", "rank": 1, "step": 6}]}), run_dir)
    proof = chaos.replica_proof.prove(run_dir)      # bitwise, against a replay of the membership

`run_replicas` starts torchft's lighthouse (its own binary, on loopback, a process of the job:
it is stopped when the run ends and dies with the harness, so nothing is left running; its
log is ``{run_dir}/lighthouse.log``), then one torchrun per replica
group (`chaos.workload.replica`, ``--standalone``, ``--max-restarts`` from the plan): when a
group's rank dies, only that group's own torchrun restarts it, and the other groups'
processes live on. The groups' log dirs are ``{run_dir}/logs/replica{R}``, their durable
checkpoints ``{run_dir}/ckpt/replica{R}`` (the trainer's ``--ckpt-every``; 0: none).

Faults are a `chaos.plan.Plan` over the job's ranks, ``replica x group size + group rank``
(`global_rank`), applied with what the single-job harness uses: external faults (``kill``,
``hang``: signals to that rank's worker) by `chaos.external.ExternalFaults`, in-rank ones by
`chaos.inject` inside the trainer; `ReplicaProcesses` lets them find a replica's workers by
their rank in the job. Replica faults in plan terms:

- a kill at a step boundary: ``kill:rank=R,step=S``; a kill inside the step's exchange
  between replicas: ``exit:rank=R,step=S,phase=replicas``;
- a hang past the deadline: ``hang:rank=R,step=S`` (SIGSTOP; SIGKILL once a survivor has
  reported the failure, after which torchrun restarts the group) or, with the process left
  running, ``delay:rank=R,step=S,phase=replicas``;
- a kill during healing: ``kill_during_checkpoint:rank=R,after_s=0``: the trainer calls the
  injector's ``on_checkpoint_staged`` when a peer's state is in place and no step of it is
  committed yet, so the group dies in the middle of its first heal;
- a partition of a group's node: ``partition:rank=R,step=S,duration_s=D``. A plan with a
  network fault runs every group in a network namespace of its own, and the lighthouse in
  one more (`chaos.net`'s nodes and link emulator), each under a host name that is its
  node's address: torchft advertises host names (its stores, its checkpoint server).

Processes go as in the single-job harness: `chaos.processes` finds and stops them (the
agents die with this process, ``PR_SET_PDEATHSIG``), `chaos.cleanup.Guard` removes what a
killed harness left. The harness's journal is ``{run_dir}/harness.jsonl``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from chaos.cleanup import Guard
from chaos.external import ExternalFaults
from chaos.fault import FaultType
from chaos.harness import JOURNAL, POLL_S, RUN_DIR_ENV
from chaos.harness import _poll as poll_job  # one look at a job: its logs, workers, faults, progress
from chaos.inject import PLAN_ENV, START_ENV, STATE_ENV
from chaos.ledger import Ledger
from chaos.net import DEVICE, Network
from chaos.plan import Plan, check_network, check_run
from chaos.processes import JobProcesses, Worker
from chaos.progress import Progress
from commlib.observe.events import LogTail
from commlib.record.log import LOG_DIR_ENV, event_log
from commlib.settings import choice, integer

REPLICA_TRAINER = "chaos.workload.replica"
PGS = ("commlib", "torchft-gloo")
TRANSPORTS = ("http", "pg")
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
LIGHTHOUSE_PORT = 29510  # torchft's default; in the lighthouse's own namespace nothing else listens
LIGHTHOUSE_START_S = 60.0  # for the lighthouse to say it listens (a loaded machine starts processes slowly)


@dataclass(frozen=True)
class ReplicaJob:
    """What to launch: `replicas` groups of `group_size` ranks, and the lighthouse's settings.

    `heartbeat_timeout_ms` is how long the lighthouse waits for a silent group before a
    quorum goes on without it: what a group that died before its next quorum costs the
    others (torchft's default, 5000 ms, is the 5 s measured in MEASURED.md).
    """

    replicas: int = 2
    group_size: int = 1
    trainer: str = REPLICA_TRAINER  # a module (run with -m) or a script (.py) with chaos.workload.replica's options
    trainer_args: tuple[str, ...] = ()
    replica_pg: str = "commlib"
    heal_transport: str = "http"
    heartbeat_timeout_ms: int = 500
    join_timeout_ms: int = 1000
    quorum_tick_ms: int = 50

    def __post_init__(self) -> None:
        integer(self.replicas, "ReplicaJob.replicas", low=1, high=64)
        integer(self.group_size, "ReplicaJob.group_size", low=1, high=64)
        choice(self.replica_pg, "ReplicaJob.replica_pg", PGS)
        choice(self.heal_transport, "ReplicaJob.heal_transport", TRANSPORTS)
        for name in ("heartbeat_timeout_ms", "join_timeout_ms", "quorum_tick_ms"):
            integer(getattr(self, name), f"ReplicaJob.{name}", low=1, high=600_000)

    @property
    def world_size(self) -> int:
        return self.replicas * self.group_size

    def trainer_args_of(self) -> Any:
        """The trainer's own reading of `trainer_args` (defaults included); `chaos.workload.train.ArgumentsRefused`
        (a ValueError) saying what it refuses."""
        from chaos.workload.replica import check_args

        return check_args(["--replicas", str(self.replicas), *self.trainer_args])

    def command(self, replica: int, run_dir: Path, max_restarts: int) -> list[str]:
        """Replica group `replica`'s torchrun."""
        return self._torchrun(max_restarts, run_dir / "torchrun" / f"replica{replica}") + [
            "--replica",
            str(replica),
            "--replicas",
            str(self.replicas),
            "--replica-pg",
            self.replica_pg,
            "--heal-transport",
            self.heal_transport,
            "--log-dir",
            str(log_dir(run_dir, replica)),
            "--ready-dir",
            str(run_dir / "ready"),
            "--ckpt-dir",
            str(run_dir / "ckpt"),
            *self.trainer_args,
        ]

    def replay_command(self, membership: Path, logs: Path) -> list[str]:
        """The replay's torchrun: one group, no restarts, no checkpoints (`chaos.workload.replica`'s
        ``--replay``)."""
        return self._torchrun(0, logs.parent / "torchrun") + [
            "--replicas",
            str(self.replicas),
            "--replay",
            str(membership),
            "--log-dir",
            str(logs),
            *self.trainer_args,
        ]

    def _torchrun(self, max_restarts: int, errors: Path) -> list[str]:
        """torchrun's command line; `errors`: where it keeps its workers' error files (as
        `chaos.job.torchrun_errors_dir` says why)."""
        trainer = [self.trainer] if self.trainer.endswith(".py") else ["-m", self.trainer]
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--local-addr",
            "127.0.0.1",
            "--nproc-per-node",
            str(self.group_size),
            "--max-restarts",
            str(max_restarts),
            "--monitor-interval",
            "0.1",
            "--log-dir",
            str(errors),
            *trainer,
        ]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "trainer_args": list(self.trainer_args), "world_size": self.world_size}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReplicaJob:
        data = {k: v for k, v in data.items() if k != "world_size"}
        return cls(**{**data, "trainer_args": tuple(data.get("trainer_args", ()))})


def log_dir(run_dir: Path, replica: int) -> Path:
    return run_dir / "logs" / f"replica{replica}"


def global_rank(replica: int, rank: int, group_size: int) -> int:
    """A rank's place in the whole job, as plans name it."""
    return replica * group_size + rank


@dataclass
class ReplicaOutcome:
    run_dir: Path
    start_ns: int
    end_ns: int
    exit_codes: list[int | None]  # one per replica group's torchrun; None: stopped by the harness
    timed_out: bool = False
    lighthouse: str = ""
    pids: set[int] = field(default_factory=set)

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(c == 0 for c in self.exit_codes)


class ReplicaProcesses(JobProcesses):
    """The job's processes, each worker known by its rank in the whole job (its agent is its replica)."""

    def __init__(self, token: str, group_size: int) -> None:
        super().__init__(token)
        self.group_size = group_size

    def workers(self) -> list[Worker]:
        return [
            w if w.rank is None else replace(w, rank=global_rank(w.node, w.rank, self.group_size))
            for w in super().workers()
        ]


@contextlib.contextmanager
def _lighthouse(job: ReplicaJob, network: Network | None, token: str, run_dir: Path) -> Iterator[str]:
    """torchft's lighthouse (its own binary) for the length of the run, logging to
    ``{run_dir}/lighthouse.log``; yields its address once it listens.

    It is a process of the job (`chaos.processes`: it dies with the harness, and `chaos.cleanup`
    finds it by the run's token). On loopback it takes a free port; with a network of namespaces
    it runs in a node of its own (the last), so that a partition of a group's node cuts that
    group off from it too, as a lost switch port would.
    """
    binary = Path(sys.executable).with_name("torchft_lighthouse")
    if not binary.is_file():
        raise FileNotFoundError(
            f"run_replicas: expected torchft's lighthouse at {binary} (torchft-nightly's); found none"
        )
    host, port = ("127.0.0.1", 0) if network is None else (network.address(job.replicas), LIGHTHOUSE_PORT)
    settings = {
        "min_replicas": 1,
        "join_timeout_ms": job.join_timeout_ms,
        "quorum_tick_ms": job.quorum_tick_ms,
        "heartbeat_timeout_ms": job.heartbeat_timeout_ms,
    }
    cmd = [str(binary), "--bind", f"{host}:{port}", *(f"--{k}={v}" for k, v in settings.items())]
    log = run_dir / "lighthouse.log"
    own = JobProcesses(token)
    own.launch(cmd if network is None else [*network.exec_prefix(job.replicas), *cmd], _environment(run_dir), log)
    try:
        yield f"http://{host}:{_listening_port(log, own)}"
    finally:
        own.stop()


def _listening_port(log: Path, lighthouse: JobProcesses) -> int:
    """The port the lighthouse says it listens on (it names itself by host name: the port is what counts)."""
    give_up = time.monotonic() + LIGHTHOUSE_START_S
    while time.monotonic() < give_up:
        said = re.search(r"Lighthouse listening on: \S+:(\d+)", log.read_text(errors="replace"))
        if said:
            return int(said.group(1))
        if not lighthouse.running():
            break
        time.sleep(POLL_S)
    raise RuntimeError(
        f"run_replicas: expected torchft's lighthouse to listen within {LIGHTHOUSE_START_S:g} s; "
        f"found {'it exited' if not lighthouse.running() else 'no word of it'} (see {log})"
    )


@contextlib.contextmanager
def _network(job: ReplicaJob, plan: Plan, guard: Guard) -> Iterator[Network | None]:
    """A plan with a network fault: one namespace per group (its node, named by its address: torchft
    advertises host names) and one for the lighthouse, joined by `chaos.net`'s link emulator."""
    if not any(f.type.network for f in plan.faults):
        yield None
        return
    seed = next((f.seed for f in plan.faults if f.type is FaultType.NET_LOSS), 0)
    network = Network(job.replicas + 1, seed=seed)
    guard.note_namespaces([n.netns for n in network.nodes])
    network.open()  # raises NetworkUnavailable, saying why
    try:
        yield network
    finally:
        network.close()


def _in_node(network: Network | None, node: int, cmd: list[str]) -> list[str]:
    """`cmd` in `node`'s namespace, under a host name that is the node's address (so the names torchft
    advertises, its stores' and its checkpoint server's, resolve from every other node)."""
    if network is None:
        return cmd
    return [
        *network.exec_prefix(node),
        "unshare",
        "--uts",
        "sh",
        "-c",
        'hostname "$0" && exec "$@"',
        network.address(node),
        *cmd,
    ]


def run_replicas(
    job: ReplicaJob,
    plan: Plan,
    run_dir: str | os.PathLike[str],
    *,
    timeout_s: float = 600.0,
    progress: Callable[[str], None] | None = None,
) -> ReplicaOutcome:
    """Run `job` under `plan` (resolved here over the job's ranks) in a new `run_dir`; see the module docstring.

    Never returns while a process of the job is alive or the lighthouse runs.
    """
    run_dir = Path(run_dir).absolute()
    args = job.trainer_args_of()
    plan = plan.resolve(job.world_size)
    check_plan(job, plan, timeout_s)
    _prepare(job, plan, run_dir)
    start_ns = time.time_ns()
    env = {
        **_environment(run_dir),
        STATE_ENV: str(run_dir / "chaos_state"),
        START_ENV: str(start_ns),
        PLAN_ENV: str(run_dir / "plan.json"),
    }
    with (
        Guard(run_dir) as guard,
        _network(job, plan, guard) as network,
        _lighthouse(job, network, guard.token, run_dir) as lighthouse,
    ):
        notes = event_log(run_dir / JOURNAL, pid=os.getpid())
        notes.info(
            "replicas.lighthouse",
            address=lighthouse,
            heartbeat_timeout_ms=job.heartbeat_timeout_ms,
            join_timeout_ms=job.join_timeout_ms,
        )
        if network is not None:
            notes.info(
                "harness.network",
                namespaces=[n.netns for n in network.nodes],
                addresses=[n.address for n in network.nodes],
                device=DEVICE,
            )
            env["GLOO_SOCKET_IFNAME"] = DEVICE  # else gloo binds what the host name resolves to
        processes = ReplicaProcesses(guard.token, job.group_size)
        ledger = Ledger(run_dir / "chaos_state")
        faults = ExternalFaults(plan, ledger, notes, processes, start_ns, network=network)
        status = Progress(plan, ledger, processes, start_ns, args.steps, progress)
        tails = _GroupTails(run_dir, job)
        outcome = ReplicaOutcome(run_dir, start_ns, start_ns, [], lighthouse=lighthouse)
        try:
            for r in range(job.replicas):
                cmd = _in_node(network, r, job.command(r, run_dir, plan.restarts))
                agent = processes.launch(cmd, {**env, LIGHTHOUSE_ENV: lighthouse}, run_dir / f"torchrun{r}.log")
                notes.info("harness.launch", replica=r, agent_pid=agent.pid, cmd=cmd)
            deadline = time.monotonic() + timeout_s
            while processes.running():
                if time.monotonic() > deadline:
                    outcome.timed_out = True
                    notes.info("harness.timeout", timeout_s=timeout_s, asked_for_dumps=processes.ask_for_dumps())
                    break
                poll_job(tails, processes, faults, status, start_ns)  # type: ignore[arg-type]
                time.sleep(POLL_S)
                if network is not None:
                    network.check()  # a dead forwarder is a dead network: stop rather than time out
            poll_job(tails, processes, faults, status, start_ns)  # type: ignore[arg-type]
        finally:
            faults.release_holds(force=True)
            processes.stop()
            outcome.pids = set(processes.seen)
            outcome.exit_codes = [None if outcome.timed_out else a.returncode for a in processes.agents]
            outcome.end_ns = time.time_ns()
            notes.info("harness.end", exit_codes=outcome.exit_codes, timed_out=outcome.timed_out)
    return outcome


def run_replay(run_dir: Path, segments: list[dict[str, Any]], *, timeout_s: float = 300.0) -> Path:
    """Replay a finished run's `segments` (each ``{"from": step, "steps": {step: members}}``, the
    first from step 0, each later one from a rollback to a durable checkpoint) in ``{run_dir}/replay``;
    returns that directory.

    Raises RuntimeError when the replay does not finish (its torchrun log says why)."""
    job = ReplicaJob.from_dict(json.loads((run_dir / "job.json").read_text()))
    replay_dir = run_dir / "replay"
    (replay_dir / "logs").mkdir(parents=True)
    steps = replay_dir / "membership.json"
    steps.write_text(json.dumps(segments) + "\n")
    with Guard(replay_dir) as guard:
        processes = JobProcesses(guard.token)
        agent = processes.launch(
            job.replay_command(steps, replay_dir / "logs"), _environment(run_dir), replay_dir / "torchrun.log"
        )
        deadline = time.monotonic() + timeout_s
        while processes.running() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        processes.stop()
    if agent.returncode != 0:
        raise RuntimeError(
            f"run_replay: expected the replay of {run_dir} to finish within {timeout_s:g} s; found "
            f"exit code {agent.returncode} (see {replay_dir / 'torchrun.log'})"
        )
    return replay_dir


def _environment(run_dir: Path) -> dict[str, str]:
    env = {
        **os.environ,
        RUN_DIR_ENV: str(run_dir),
        "PYTHONUNBUFFERED": "1",
        # Every process computes with the same intra-op thread count: CPU reductions split by it.
        "OMP_NUM_THREADS": "1",
    }
    for name in (LOG_DIR_ENV, PLAN_ENV):
        env.pop(name, None)
    return env


def check_plan(job: ReplicaJob, plan: Plan, timeout_s: float) -> None:
    """The plan (resolved) against the job, before anything starts: its triggers against the steps and
    the deadline (`chaos.plan.check_run`), its network faults against the groups' nodes. Raises PlanError."""
    args = job.trainer_args_of()
    check_run(plan, steps=args.steps, deadline_s=float(args.timeout), timeout_s=timeout_s)
    if any(f.type.network for f in plan.faults):
        check_network(plan, nnodes=job.replicas, local=True, backend="gloo", deadline_s=float(args.timeout))


def _prepare(job: ReplicaJob, plan: Plan, run_dir: Path) -> None:
    if run_dir.is_dir() and any(run_dir.iterdir()):
        raise ValueError(
            f"run_replicas: expected a new or empty run directory; found {run_dir} holding "
            f"{sorted(p.name for p in run_dir.iterdir())[:5]}"
        )
    for r in range(job.replicas):
        log_dir(run_dir, r).mkdir(parents=True, exist_ok=True)
    (run_dir / "chaos_state").mkdir(parents=True, exist_ok=True)
    plan.save(run_dir / "plan.json")
    (run_dir / "job.json").write_text(json.dumps(job.to_dict(), indent=2) + "\n")


class _GroupTails:
    """Every group's log tail as one, each event's rank renamed to its rank in the job (what plans name)."""

    def __init__(self, run_dir: Path, job: ReplicaJob) -> None:
        self.tails = [LogTail(log_dir(run_dir, r)) for r in range(job.replicas)]
        self.group_size = job.group_size

    def poll(self) -> list[dict[str, Any]]:
        events = []
        for replica, tail in enumerate(self.tails):
            for event in tail.poll():
                if isinstance(event.get("rank"), int):
                    event["rank"] = global_rank(replica, event["rank"], self.group_size)
                events.append(event)
        return events


# -- `python -m chaos replicas` (registered by chaos/__main__.py) ---------------------------
