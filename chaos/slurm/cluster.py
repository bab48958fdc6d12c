"""A local Slurm cluster on this machine, in namespaces: for the tests, and for a user to try
chaos under Slurm on one machine.

    python -m chaos.slurm.cluster up --dir /tmp/slurm --nodes 3     # or scripts/slurm_cluster.sh
    python -m chaos.slurm.cluster run --dir /tmp/slurm -- sinfo
    python -m chaos.slurm.cluster down --dir /tmp/slurm

`Cluster(directory, nodes).up()` brings up, everything root-only (`ClusterUnavailable` says
why not, before anything is left behind):

- one munged for the whole cluster, its key and socket in ``/run/cslurm-<owner>-<hex>``
  (munged wants every directory above its socket searchable by all, which a test's temporary
  directory is not; every namespace shares the file system, so every daemon and client
  reaches it);
- a network namespace for the controller and one per node, ``cslurm-<owner>-<hex>-<machine>``
  (`owner`: the pid whose death makes the cluster stale, 0 for a cluster kept until `down`),
  joined by veth pairs to a bridge inside the controller's namespace, on a private /24 drawn
  for the cluster: nothing is added to this machine's own network namespace, and no address
  is reachable from outside the cluster;
- slurmctld (hostname ``ctl``) and one slurmd per node (``node0``, ``node1``, ...), each the
  child of a `chaos.slurm.init` that is process 1 of fresh UTS, mount and PID namespaces,
  entered with ``nsenter --net`` (``ip netns exec`` would remount /sys and hide the cgroup
  file system, and slurmd dies) and ``unshare --fork --kill-child``: killing a machine's
  ``unshare`` kills its daemons and every job process under them at once;
- a slurm.conf tuned for a cluster that tests wait on (`slurm_conf`): no accounting,
  proctrack/linuxproc, task/none, a credential lifetime of `CRED_EXPIRE_S` (a requeued job
  waits that long before it can start again), a scheduler pass every second, a node declared
  down `SLURMD_TIMEOUT_S` after its last answer, a partition ``batch`` whose jobs are requeued
  when preempted (grace `GRACE_S`, with the job's ``--signal`` sent first) and a partition
  ``urgent`` that preempts it.

Client commands (sbatch, squeue, scontrol, and ``python -m chaos sbatch``) run in the
controller's network namespace with ``SLURM_CONF`` set: `Cluster.run`, or the ``run``
subcommand. `down` (or a crash followed by the next `up`: `sweep`) kills every process that
carries the cluster's mark in its environment (``CHAOS_SLURM_CLUSTER``; the machines'
processes die with their PID namespaces) and deletes its network namespaces, which takes
their veths, bridge and addresses with them; the hosts file's bind mounts lived in the
machines' own mount namespaces and are gone with them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from chaos.options import directory_problem, option
from chaos.processes import alive
from commlib import settings

MARK_ENV = "CHAOS_SLURM_CLUSTER"
NETNS_DIR = Path("/run/netns")
RUN_DIR = Path("/run")
PREFIX = "cslurm"
_NETNS = re.compile(rf"^{PREFIX}-(\d+)-([0-9a-f]+)-(ctl|node\d+)$")
# What the cluster runs; scripts/system_packages.sh installs them (its ``slurm`` set), never this module.
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "nsenter", "unshare", "ip", "mount")
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
CTL = "ctl"
BRIDGE = "br0"
DEVICE = "eth0"  # each node's interface (GLOO_SOCKET_IFNAME in a node)
CTL_HOST = 1  # the controller's address in the cluster's /24
NODE_HOST0 = 10  # node i's is NODE_HOST0 + i
# The tuning (module docstring): a requeued job waits CRED_EXPIRE_S + 1 s (Slurm's minimum is 5).
CRED_EXPIRE_S = 5
SLURMD_TIMEOUT_S = 6
MESSAGE_TIMEOUT_S = 3
KILL_WAIT_S = 15
GRACE_S = 30
START_TIMEOUT_S = 30.0
JOB_PARTITION = "batch"
PREEMPTOR_PARTITION = "urgent"
MOST_NODES = 200  # node addresses from NODE_HOST0 on, inside the cluster's /24


class ClusterUnavailable(RuntimeError):
    """The cluster cannot be brought up here; the message says why."""


@dataclass(frozen=True)
class Machine:
    name: str  # its hostname and Slurm name
    netns: str
    address: str


@dataclass(frozen=True)
class NodeState:
    name: str
    state: str  # sinfo's: idle, alloc, down*, ...


@dataclass
class Status:
    up: bool  # the controller answers and every process of the cluster is alive
    nodes: list[NodeState]
    processes: list[int]  # pids carrying the cluster's mark
    namespaces: list[str]
    problem: str | None = None


def missing_tools() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None]


class Cluster:
    """A local Slurm cluster kept in `directory` (module docstring)."""

    def __init__(
        self, directory: str | os.PathLike[str], nodes: int = 3, *, owner: int = 0, tag: str | None = None
    ) -> None:
        """`owner`: the process whose death makes the cluster stale (`sweep`), 0 for none;
        `tag`: an existing cluster's (`attach`), else a new one is drawn."""
        settings.integer(nodes, "Cluster's nodes", low=1, high=MOST_NODES)
        self.directory = Path(directory).absolute()
        self.nodes = nodes
        self.owner = owner
        self.tag = tag or f"{owner}-{secrets.token_hex(3)}"
        # The subnet only has to be unique inside the cluster (its namespaces are their own
        # network); drawn from the tag, so two clusters' addresses differ in their logs.
        a, b = 16 + int(self.tag[-6:-4], 16) % 224, int(self.tag[-4:-2], 16)
        self.subnet = f"10.{a}.{b}"
        self.ctl = Machine(CTL, f"{PREFIX}-{self.tag}-{CTL}", f"{self.subnet}.{CTL_HOST}")
        self.machines = [
            Machine(f"node{i}", f"{PREFIX}-{self.tag}-node{i}", f"{self.subnet}.{NODE_HOST0 + i}") for i in range(nodes)
        ]
        self._daemons: list[subprocess.Popen[bytes]] = []  # started by `up` in this process

    @property
    def conf(self) -> Path:
        return self.directory / "slurm.conf"

    @property
    def munge_dir(self) -> Path:
        return _munge_dir(self.tag)

    @property
    def node_names(self) -> list[str]:
        return [m.name for m in self.machines]

    # -- life cycle --------------------------------------------------------------------
    def up(self) -> Cluster:
        """Sweep what stale clusters left, then bring this one up (module docstring); on any
        failure, take down what was started and raise ClusterUnavailable saying why."""
        if os.geteuid() != 0:
            raise ClusterUnavailable(
                f"chaos.slurm.cluster: expected root (namespaces, mounts, daemons); found uid {os.geteuid()}"
            )
        missing = missing_tools()
        if missing:
            raise ClusterUnavailable(
                f"chaos.slurm.cluster: expected {missing} on PATH; install them with "
                f"`scripts/system_packages.sh slurm` (Debian's {' '.join(PACKAGES)}; "
                f"scripts/test.sh and `scripts/slurm_cluster.sh up` run it)"
            )
        sweep()
        previous = _read_record(self.directory)
        if previous is not None:
            _take_down(previous["tag"])
        try:
            self._write_files()
            self._start_munge()
            self._make_network()
            self._start(self.ctl, ["slurmctld", "-D", "-c", "-f", str(self.conf)])
            self._wait_for("slurmctld to answer `scontrol ping`", self._controller_answers)
            for machine in self.machines:
                self._start(machine, ["slurmd", "-D", "-N", machine.name, "-f", str(self.conf)])
            self._wait_for(f"{self.nodes} node(s) idle in sinfo", self._all_idle)
        except BaseException as exc:
            self.down()
            if isinstance(exc, ClusterUnavailable):
                raise ClusterUnavailable(f"{exc}{self._log_tails()}") from None
            raise
        return self

    def down(self) -> list[str]:
        """Kill every process of the cluster and delete its namespaces; returns what was removed."""
        return _take_down(self.tag)

    def __enter__(self) -> Cluster:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def status(self) -> Status:
        """Whether the controller answers with every node listed; the cluster's processes and namespaces."""
        procs, spaces = [p.pid for p in _marked(self.tag)], _namespaces(self.tag)
        if self.ctl.netns not in spaces:
            return Status(False, [], procs, spaces, "the controller's network namespace is gone")
        done = self.run(["sinfo", "--noheader", "--Node", "--format=%N %t"], check=False, timeout=10)
        states = _states(done.stdout)
        listed = [NodeState(n, states.get(n, "unknown")) for n in self.node_names]
        problem = None if done.returncode == 0 else f"sinfo exited {done.returncode}: {done.stderr.strip()}"
        return Status(done.returncode == 0 and set(states) == set(self.node_names), listed, procs, spaces, problem)

    def leftovers(self) -> list[str]:
        """What of the cluster still exists (expected: nothing after `down`)."""
        return _leftovers(self.tag, self.directory)

    # -- client commands ---------------------------------------------------------------
    def client_prefix(self) -> list[str]:
        """The prefix of a client command: the controller's network, this cluster's slurm.conf."""
        return ["nsenter", f"--net={NETNS_DIR / self.ctl.netns}", "env", f"SLURM_CONF={self.conf}"]

    def run(
        self, argv: Sequence[str], *, check: bool = True, timeout: float = 60.0, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """A client command (``sbatch``, ``squeue``, ``python -m chaos sbatch``...) against the cluster."""
        done = subprocess.run(
            self.client_prefix() + list(argv), capture_output=True, text=True, timeout=timeout, env=env
        )
        if check and done.returncode != 0:
            raise RuntimeError(
                f"`{' '.join(argv)}` against the cluster in {self.directory} exited "
                f"{done.returncode}: {(done.stderr or done.stdout).strip()[-2000:]}"
            )
        return done

    def node_states(self) -> list[NodeState]:
        return self.status().nodes

    # -- pieces of `up` ----------------------------------------------------------------
    def _write_files(self) -> None:
        if self.directory.exists():
            for name in (CTL, *self.node_names):
                shutil.rmtree(self.directory / name, ignore_errors=True)
        for sub in (f"{CTL}/state", *(f"{n}/spool" for n in self.node_names)):
            (self.directory / sub).mkdir(parents=True, exist_ok=True)
        self.munge_dir.mkdir(mode=0o755, parents=True)
        key = self.munge_dir / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        os.chmod(key, 0o400)
        (self.directory / "plugstack.conf").write_text("")  # not Debian's /etc/slurm/plugstack.conf
        self.conf.write_text(slurm_conf(self))
        hosts = ["127.0.0.1 localhost"] + [f"{m.address} {m.name}" for m in [self.ctl, *self.machines]]
        (self.directory / "hosts").write_text("\n".join(hosts) + "\n")
        _write_record(
            self.directory,
            {
                "tag": self.tag,
                "owner": self.owner,
                "nodes": self.nodes,
                "ctl": asdict(self.ctl),
                "machines": [asdict(m) for m in self.machines],
            },
        )

    def _env(self) -> dict[str, str]:
        return {**os.environ, MARK_ENV: self.tag, "SLURM_CONF": str(self.conf)}

    def _start_munge(self) -> None:
        d = self.munge_dir
        (self.directory / "munge").mkdir(exist_ok=True)
        with open(self.directory / "munge" / "munged.out", "ab") as out:
            self._daemons.append(
                subprocess.Popen(
                    [
                        "munged",
                        "--foreground",
                        f"--socket={d / 'munge.socket'}",
                        f"--key-file={d / 'munge.key'}",
                        f"--pid-file={d / 'munged.pid'}",
                        f"--seed-file={d / 'munged.seed'}",
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=self._env(),
                    start_new_session=True,
                )
            )
        self._wait_for("munged's socket", lambda: (d / "munge.socket").exists(), timeout=10)

    def _make_network(self) -> None:
        ns = self.ctl.netns
        _ip("netns", "add", ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "link", "add", BRIDGE, "type", "bridge")
        _ip("-n", ns, "addr", "add", f"{self.ctl.address}/24", "dev", BRIDGE)
        _ip("-n", ns, "link", "set", BRIDGE, "up")
        for m in self.machines:
            _ip("netns", "add", m.netns)
            _ip("-n", m.netns, "link", "set", "lo", "up")
            port = f"v{m.name}"
            # Both ends made in their namespaces: nothing passes through this machine's own.
            _ip("link", "add", DEVICE, "netns", m.netns, "type", "veth", "peer", "name", port, "netns", ns)
            _ip("-n", ns, "link", "set", port, "master", BRIDGE)
            _ip("-n", ns, "link", "set", port, "up")
            _ip("-n", m.netns, "addr", "add", f"{m.address}/24", "dev", DEVICE)
            _ip("-n", m.netns, "link", "set", DEVICE, "up")

    def _start(self, machine: Machine, daemon: list[str]) -> None:
        cmd = [
            "nsenter",
            f"--net={NETNS_DIR / machine.netns}",
            "unshare",
            "--uts",
            "--mount",
            "--pid",
            "--fork",
            "--kill-child",
            "--mount-proc",
            sys.executable,
            "-m",
            "chaos.slurm.init",
            "--hostname",
            machine.name,
            "--hosts",
            str(self.directory / "hosts"),
            "--",
            *daemon,
        ]
        with open(self.directory / machine.name / "init.out", "ab") as out:
            self._daemons.append(
                subprocess.Popen(
                    cmd,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=self._env(),
                    start_new_session=True,
                    cwd=self.directory,
                )
            )

    def _controller_answers(self) -> bool:
        return self.run(["scontrol", "ping"], check=False, timeout=10).returncode == 0

    def _all_idle(self) -> bool:
        return all(s.state == "idle" for s in self.node_states())

    def _wait_for(self, what: str, ready: Callable[[], bool], timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [p for p in self._daemons if p.poll() is not None]
            if dead:
                raise ClusterUnavailable(
                    # `up` starts every daemon from an argument list.
                    f"chaos.slurm.cluster: expected {what}; found `{' '.join(dead[0].args[:3])}"  # type: ignore[index, arg-type]
                    f" ...` exited {dead[0].returncode}"
                )
            if time.monotonic() > deadline:
                raise ClusterUnavailable(f"chaos.slurm.cluster: expected {what} within {timeout:g} s; found none")
            time.sleep(0.1)

    def _log_tails(self) -> str:
        out = []
        for path in sorted(self.directory.glob("*/*.log")) + sorted(self.directory.glob("*/*.out")):
            lines = path.read_text(errors="replace").splitlines()
            if lines:
                out.append(f"\n  {path.relative_to(self.directory)} ends:\n    " + "\n    ".join(lines[-6:]))
        return "".join(out)


def slurm_conf(cluster: Cluster) -> str:
    d = cluster.directory
    lines = [
        "ClusterName=chaos",
        f"SlurmctldHost={CTL}({cluster.ctl.address})",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={cluster.munge_dir / 'munge.socket'},cred_expire={CRED_EXPIRE_S}",
        f"StateSaveLocation={d / CTL / 'state'}",
        f"SlurmctldPidFile={d / CTL / 'slurmctld.pid'}",
        f"SlurmctldLogFile={d / CTL / 'slurmctld.log'}",
        f"SlurmdSpoolDir={d}/%n/spool",
        f"SlurmdPidFile={d}/%n/slurmd.pid",
        f"SlurmdLogFile={d}/%n/slurmd.log",
        f"PlugStackConfig={d / 'plugstack.conf'}",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/backfill",
        "SchedulerParameters=sched_interval=1,bf_interval=1",
        "ReturnToService=2",
        f"SlurmdTimeout={SLURMD_TIMEOUT_S}",
        f"MessageTimeout={MESSAGE_TIMEOUT_S}",
        f"KillWait={KILL_WAIT_S}",
        "InactiveLimit=0",
        "MinJobAge=600",
        "JobRequeue=1",
        "PreemptType=preempt/partition_prio",
        "PreemptMode=REQUEUE",
        "SlurmctldParameters=preempt_send_user_signal",
        *(
            f"NodeName={m.name} NodeAddr={m.address} CPUs={os.cpu_count() or 1} RealMemory=1000 State=UNKNOWN"
            for m in cluster.machines
        ),
        f"PartitionName={JOB_PARTITION} Nodes=ALL Default=YES PriorityTier=1 PreemptMode=REQUEUE GraceTime={GRACE_S} "
        f"MaxTime=INFINITE State=UP",
        f"PartitionName={PREEMPTOR_PARTITION} Nodes=ALL PriorityTier=2 PreemptMode=OFF MaxTime=INFINITE State=UP",
    ]
    return "\n".join(lines) + "\n"


# -- what exists of a cluster, by its tag ---------------------------------------------------
def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise ClusterUnavailable(
            f"chaos.slurm.cluster: `ip {' '.join(args)}` exited {done.returncode}: "
            f"{done.stderr.strip() or done.stdout.strip()}"
        )
    return done


def _namespaces(tag: str | None = None) -> list[str]:
    try:
        names = sorted(p.name for p in NETNS_DIR.iterdir())
    except FileNotFoundError:
        return []
    return [n for n in names if (m := _NETNS.match(n)) and (tag is None or f"{m.group(1)}-{m.group(2)}" == tag)]


def _marked(tag: str | None = None) -> list[psutil.Process]:
    """The live processes carrying a cluster's mark (`tag`'s, or any cluster's)."""
    found = []
    for proc in psutil.process_iter():
        try:
            mark = proc.environ().get(MARK_ENV)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if mark is not None and (tag is None or mark == tag) and alive(proc):
            found.append(proc)
    return found


def _take_down(tag: str) -> list[str]:
    removed = []
    for _ in range(3):  # an unshare may fork its child between two scans
        procs = _marked(tag)
        if not procs:
            break
        for proc in procs:
            try:
                proc.send_signal(signal.SIGKILL)
                removed.append(f"process {proc.pid} ({proc.name()})")
            except psutil.NoSuchProcess:
                continue
        psutil.wait_procs(procs, timeout=5)
    for name in _namespaces(tag):
        if _ip("netns", "del", name, check=False).returncode == 0:
            removed.append(f"network namespace {name}")
    if _munge_dir(tag).exists():
        shutil.rmtree(_munge_dir(tag))
        removed.append(f"directory {_munge_dir(tag)}")
    return removed


def _munge_dir(tag: str) -> Path:
    return RUN_DIR / f"{PREFIX}-{tag}"


def sweep() -> list[str]:
    """Take down every cluster whose owner process is gone (a test run killed before its
    cleanup); clusters of live owners, and those kept until `down` (owner 0), are left alone."""
    tags = {f"{m.group(1)}-{m.group(2)}" for n in _namespaces() if (m := _NETNS.match(n))}
    tags |= {p.name.removeprefix(f"{PREFIX}-") for p in RUN_DIR.glob(f"{PREFIX}-*-*") if p.is_dir()}
    for proc in _marked():
        try:
            tags.add(proc.environ()[MARK_ENV])
        except (psutil.Error, KeyError):
            continue
    removed = []
    for tag in sorted(tags):
        owner = int(tag.split("-")[0]) if tag.split("-")[0].isdigit() else 0
        if owner != 0 and not psutil.pid_exists(owner):
            removed += _take_down(tag)
    return removed


def _leftovers(tag: str, directory: Path) -> list[str]:
    found = [f"process {p.pid} ({p.name()})" for p in _marked(tag)]
    found += [f"network namespace {n}" for n in _namespaces(tag)]
    found += [f"directory {_munge_dir(tag)}"] if _munge_dir(tag).exists() else []
    mounts = Path("/proc/self/mountinfo").read_text()
    found += [f"mount {line.split()[4]}" for line in mounts.splitlines() if tag in line or str(directory) in line]
    return found


def _states(sinfo: str) -> dict[str, str]:
    """node -> state, from ``sinfo --Node --format='%N %t'`` (a node in two partitions is listed twice)."""
    states = {}
    for line in sinfo.splitlines():
        name, _, state = line.strip().partition(" ")
        states[name] = state.strip()
    return states


_RECORD = "cluster.json"


def _read_record(directory: Path) -> dict | None:
    try:
        return json.loads((directory / _RECORD).read_text())
    except (OSError, ValueError):
        return None


def _write_record(directory: Path, record: dict) -> None:
    tmp = directory / f"{_RECORD}.tmp"
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, directory / _RECORD)


def attach(directory: str | os.PathLike[str]) -> Cluster:
    """The cluster brought up in `directory` (by another process: ``up``)."""
    record = _read_record(Path(directory).absolute())
    if record is None:
        raise ClusterUnavailable(f"chaos.slurm.cluster: expected a cluster in {directory} ({_RECORD}); found none")
    return Cluster(directory, record["nodes"], owner=record["owner"], tag=record["tag"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chaos.slurm.cluster", description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=("up", "down", "status", "run"), help="run: -- then a client command")
    p.add_argument(
        "--dir",
        type=option(settings.text, "--dir", spaces=True),
        required=True,
        help="the cluster's directory (configuration, logs, spool, munge key)",
    )
    p.add_argument(
        "--nodes",
        type=option(settings.integer, "--nodes", low=1, high=MOST_NODES),
        default=3,
        help="up: how many nodes (one of them can be the spare)",
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    try:
        if args.command == "up":
            problem = directory_problem(args.dir, "--dir", empty=False)  # before anything is swept
            if problem is not None:
                raise ValueError(problem)
            cluster = Cluster(args.dir, args.nodes).up()
            print(
                f"up: {cluster.nodes} node(s) {', '.join(cluster.node_names)}; run client commands with\n"
                f"  {' '.join(cluster.client_prefix())} sbatch ..."
            )
            return 0
        cluster = attach(args.dir)
        if args.command == "down":
            removed = cluster.down()
            left = cluster.leftovers()
            print(f"down: removed {len(removed)} thing(s)" + (f"; LEFT: {left}" if left else ""))
            return 1 if left else 0
        if args.command == "status":
            s = cluster.status()
            print(json.dumps(asdict(s), indent=2))
            return 0 if s.up else 1
        return subprocess.run(cluster.client_prefix() + command).returncode
    except (ClusterUnavailable, ValueError) as exc:
        print(f"chaos.slurm.cluster: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
