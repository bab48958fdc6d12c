"""The job's processes: the torchrun agents the harness launches, their workers, and
everything else in the agents' process groups. The harness finds, signals and stops the
job's processes here only. A job the harness gives up on is asked for its stacks and flight
dumps first (`JobProcesses.ask_for_dumps`), so that a hang says where it hung.

Each agent starts in a session of its own (`JobProcesses.launch`), so its process group is
its pid and nothing it spawns can slip out of the job unseen. A worker is an agent's child,
matched to its rank and attempt by its environment (``RANK``, and the attempt its torchrun's
and Slurm's counts estimate: `commlib.attempt.attempt_number`), never by name; the agents'
trees are scanned in one place (`_children`), and a worker's environment is read once.
`JobProcesses.seen` is every pid of the job noticed so far: agents, workers, pids in the
ranks' logs, and whatever `stop` finds.

The job's life is tied to the harness's: every process of the job inherits the run's token
(`JOB_ENV`), which finds it even once it is no one's descendant (torchrun starts each worker
in a session of its own, so a worker whose agent died is in none of the agents' groups), and
each agent gets SIGTERM the moment the harness dies (``PR_SET_PDEATHSIG``), on which torchrun
stops its own workers. `members` and `terminate` are what `chaos.cleanup` stops a dead
harness's job with.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

from commlib.attempt import attempt_number
from commlib.record.files import STACKS_SIGNAL

TERM_GRACE_S = 5.0
# What the harness gives a hung job's ranks to write their stacks and flight dumps before it
# stops them (`JobProcesses.ask_for_dumps`): faulthandler writes at once, the dump thread soon after.
DUMPS_WAIT_S = 2.0
JOB_ENV = "CHAOS_JOB"  # the run's token, in the environment of every process of the job
_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class Worker:
    """A child of an agent, with what its environment says it is."""

    proc: psutil.Process
    node: int  # the index of the local agent it runs under (its node, when the nodes run here)
    rank: int | None  # None while its environment is unreadable (not yet exec'd, or gone)
    attempt: int  # as its environment estimates it (its node's restart count; the ranks agree the exact one)


class JobProcesses:
    """The agents this harness launched, and the processes found under them."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.agents: list[subprocess.Popen[bytes]] = []
        self.seen: set[int] = set()
        # A worker's environment is fixed once it has exec'd: read it once.
        self._identities: dict[psutil.Process, tuple[int, int]] = {}

    def launch(
        self, cmd: list[str], env: Mapping[str, str], output: Path, cwd: Path | None = None
    ) -> subprocess.Popen[bytes]:
        """Start one agent (in `cwd`), its output appended to `output`, carrying the token, stopped
        when the harness dies."""
        with open(output, "ab") as out:
            agent = subprocess.Popen(
                cmd,
                cwd=cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**env, JOB_ENV: self.token},
                start_new_session=True,
                preexec_fn=_terminated_with(os.getpid()),
            )
        self.agents.append(agent)
        self.seen.add(agent.pid)
        return agent

    @property
    def pgids(self) -> list[int]:
        return [a.pid for a in self.agents]  # each agent leads the group of its own session

    def running(self) -> bool:
        return any(a.poll() is None for a in self.agents)

    def note(self, pid: object) -> None:
        """A pid the job was seen to have elsewhere (a rank's log line)."""
        if isinstance(pid, int):
            self.seen.add(pid)

    def workers(self) -> list[Worker]:
        """Every child of the agents, live or not yet reaped, with its rank and attempt."""
        found = []
        for node, proc in self._children(recursive=False):
            self.seen.add(proc.pid)
            identity: tuple[int | None, int] | None = self._identities.get(proc)
            if identity is None:
                env = _environ(proc)
                rank = int(env["RANK"]) if "RANK" in env else None
                attempt = attempt_number(env)
                identity = (rank, attempt)
                if rank is not None:  # before its exec a child shows the agent's environment
                    self._identities[proc] = (rank, attempt)
            found.append(Worker(proc, node, *identity))
        return found

    def worker(self, rank: int, pid: int | None = None) -> Worker | None:
        """The live worker of `rank` (the newest, or the one with `pid`)."""
        found = [w for w in self.workers() if w.rank == rank and (pid is None or w.proc.pid == pid) and alive(w.proc)]
        return max(found, key=lambda w: (w.attempt, w.proc.create_time()), default=None)

    def ask_for_dumps(self) -> list[int]:
        """Ask every live worker for every thread's stack (SIGUSR2) and its flight recorder's
        rings (SIGUSR1), as a timed-out rank asks its peers: what a hung job leaves to say where
        it hung, when the harness gives up on it. Waits `DUMPS_WAIT_S` for them to be written;
        the ranks asked. A worker that has not set its handlers yet dies of it: it was to be
        stopped next anyway."""
        asked = []
        for w in self.workers():
            if w.rank is not None and alive(w.proc) and send(w.proc, STACKS_SIGNAL) is None:
                send(w.proc, signal.SIGUSR1)  # the flight recorder's dump (`commlib.record.flight`)
                asked.append(w.rank)
        if asked:
            time.sleep(DUMPS_WAIT_S)
        return sorted(asked)

    def stop(self) -> None:
        """Stop every process of the job (`terminate`): the agents, all their descendants, their
        process groups (a grandchild whose parent died is no one's descendant any more, but still in
        its group) and whatever carries the token. What it finds is added to `seen`."""
        self.seen |= terminate(self._all)
        for a in self.agents:
            a.wait()

    def _all(self) -> list[psutil.Process]:
        """Every live process of the job: the running agents, their descendants, their groups' members,
        the token's carriers."""
        found: dict[int, psutil.Process] = {}
        for a in self.agents:
            if a.poll() is None:
                try:
                    found[a.pid] = psutil.Process(a.pid)
                except psutil.NoSuchProcess:
                    pass
        for _, child in self._children(recursive=True):
            found[child.pid] = child
        for proc in members(self.token, set(self.pgids)):
            found.setdefault(proc.pid, proc)
        return [p for p in found.values() if alive(p)]

    def _children(self, recursive: bool) -> list[tuple[int, psutil.Process]]:
        """(agent index, process) for each child of each agent, or each descendant with `recursive`."""
        found = []
        for node, agent in enumerate(self.agents):
            try:
                found += [(node, child) for child in psutil.Process(agent.pid).children(recursive=recursive)]
            except psutil.NoSuchProcess:
                continue
        return found


def members(token: str, groups: Collection[int] = ()) -> list[psutil.Process]:
    """The live processes carrying `token` (`JOB_ENV`) in their environment, or in one of `groups`."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and (os.getpgid(proc.pid) in groups or _environ(proc).get(JOB_ENV) == token):
                found.append(proc)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return [p for p in found if alive(p)]


def terminate(find: Callable[[], list[psutil.Process]]) -> set[int]:
    """Stop what `find` returns: SIGCONT + SIGTERM, up to `TERM_GRACE_S` for it to exit, then SIGKILL
    to what is left. `find` is asked again at each turn (a process may spawn another between two
    looks). Returns every pid it signalled."""
    signalled: set[int] = set()
    for sig in (signal.SIGCONT, signal.SIGTERM):  # SIGCONT first: a stopped process acts on SIGTERM only then
        for proc in find():
            signalled.add(proc.pid)
            send(proc, sig)
    deadline = time.monotonic() + TERM_GRACE_S
    while time.monotonic() < deadline and find():
        time.sleep(0.05)
    for _ in range(3):
        left = find()
        if not left:
            break
        for proc in left:
            signalled.add(proc.pid)
            send(proc, signal.SIGKILL)
        psutil.wait_procs(left, timeout=2)
    return signalled


def _terminated_with(harness: int) -> Callable[[], None]:
    """An agent's step between fork and exec: SIGTERM to it when the harness dies."""

    def tie() -> None:
        _libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != harness:  # it died before the line above: no signal will come
            os.kill(os.getpid(), signal.SIGTERM)

    return tie


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def send(proc: psutil.Process, sig: signal.Signals) -> str | None:
    """Send `sig`; the error as text when the process was already gone."""
    try:
        proc.send_signal(sig)
        return None
    except psutil.NoSuchProcess:
        return f"process {proc.pid} already gone"


def _environ(proc: psutil.Process) -> dict[str, str]:
    try:
        return proc.environ()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return {}
