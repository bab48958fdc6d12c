"""What a chaos run launches: the `Job` (its trainer and the trainer's arguments, its nodes and
ranks per node, its rendezvous), and the torchrun command line of each agent this machine runs.

`chaos.harness` launches these commands and watches the job; a job is plain data, checked
when it is made (`Job.__post_init__`), so a bad one is refused before anything starts. Every
worker runs the trainer through `chaos.entry`, in the run's working directory (`WORK_DIR`):
the trainer's relative paths (its checkpoints, its logs) are that run's own.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from chaos.net import Network
from chaos.options import LARGEST_INDEX, MOST_NODES, MOST_PER_NODE
from commlib import settings

REFERENCE_TRAINER = "chaos.workload.train"
ENTRY = "chaos.entry"
WORK_DIR = "work"  # under the run directory: the trainer's working directory
RDZV_PORT = 29400  # in node 0's own namespace nothing else listens


@dataclass(frozen=True)
class Job:
    """What to launch. `trainer` is a module name (run with ``-m``) or a script path.

    `trainer_args` may contain ``{run_dir}``, replaced by the run directory. For the
    reference trainer the harness adds ``--log-dir`` and ``--ckpt-dir`` in the run directory,
    and ``--backend`` (and ``--device cuda`` for nccl) unless the arguments already name them.
    `digest_every`: every how many steps each rank digests its state (`chaos.probe`).
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
    digest_every: int = 1

    def __post_init__(self) -> None:
        for name, most in (("nproc_per_node", MOST_PER_NODE), ("nnodes", MOST_NODES)):
            settings.integer(getattr(self, name), f"Job.{name}", low=1, high=most)
        settings.integer(self.digest_every, "Job.digest_every", low=1, high=LARGEST_INDEX)
        if self.local_nodes * self.nproc_per_node > MOST_PER_NODE:
            raise ValueError(
                f"Job: expected at most {MOST_PER_NODE} ranks on this machine; found {self.local_nodes} "
                f"local node(s) of {self.nproc_per_node} (--nnodes without --rdzv-endpoint runs every "
                f"node here)"
            )
        if not (Path(self.trainer).is_file() if self.is_script else _importable(self.trainer)):
            raise ValueError(
                f"Job.trainer: expected a script file or an importable module; found neither: {self.trainer!r}"
            )
        if self.node_rank is not None and self.rdzv_endpoint is None:
            raise ValueError(
                f"Job.node_rank: expected only with rdzv_endpoint (a multi-node job); "
                f"found node_rank={self.node_rank} and no endpoint"
            )
        if self.rdzv_endpoint is not None:  # one node's harness among several (chaos.multinode)
            if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
                raise ValueError(
                    f"Job.node_rank: expected this machine's node in [0, {self.nnodes}) with "
                    f"rdzv_endpoint; found {self.node_rank!r}"
                )
            if not self.rdzv_id:
                raise ValueError(
                    f"Job.rdzv_id: expected the job's rendezvous id with rdzv_endpoint (every node's "
                    f"harness gives the same one); found {self.rdzv_id!r}"
                )

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
        """The trainer and its arguments as `chaos.entry` takes them (``-m MODULE``, a script)."""
        argv = [os.path.abspath(self.trainer)] if self.is_script else ["-m", self.trainer]
        argv += [a.replace("{run_dir}", str(run_dir)) for a in self.trainer_args]
        if self.is_reference_trainer:
            argv += ["--log-dir", str(run_dir / "logs"), "--ckpt-dir", str(self.checkpoint_dir(run_dir))]
            if not _has_flag(self.trainer_args, "--backend"):
                argv += ["--backend", self.backend]
            if self.backend == "nccl" and not _has_flag(self.trainer_args, "--device"):
                argv += ["--device", "cuda"]
        return argv

    def worker_argv(self, run_dir: Path) -> list[str]:
        """What each torchrun worker runs: the trainer through `chaos.entry`."""
        return ["-m", ENTRY, *self.trainer_argv(run_dir)]

    def checkpoint_dir(self, run_dir: Path) -> Path:
        """Where the trainer's checkpoints go: the reference trainer's ``--ckpt-dir``; another
        trainer's, wherever it puts them in its working directory."""
        return run_dir / "ckpt" if self.is_reference_trainer else run_dir / WORK_DIR

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "trainer_args": list(self.trainer_args), "world_size": self.world_size}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing
        return False


def _has_flag(args: tuple[str, ...], name: str) -> bool:
    return any(a == name or a.startswith(name + "=") for a in args)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a rendezvous endpoint two local agents must share)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_errors_dir(run_dir: Path, node: int) -> Path:
    """Where node `node`'s torchrun keeps its workers' error files (`--log-dir`): in the run
    directory, beside the logs. Without it, every torchrun makes a directory of its own in /tmp
    (torch.distributed.elastic's `mkdtemp`) and never removes it: one per launch, left behind."""
    return run_dir / "torchrun" / f"node{node}"


def torchrun_commands(job: Job, max_restarts: int, run_dir: Path, network: Network | None = None) -> list[list[str]]:
    """One torchrun command per agent this machine runs; with `network`, each agent in its
    node's namespace, on a rendezvous at node 0's address."""

    def base(node: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(job.nnodes),
            "--nproc-per-node",
            str(job.nproc_per_node),
            "--max-restarts",
            str(max_restarts),
            "--monitor-interval",
            "0.1",
            "--log-dir",
            str(torchrun_errors_dir(run_dir, node)),
        ]

    trainer = job.worker_argv(run_dir)
    if job.rdzv_endpoint is not None:  # one node of a multi-node job
        # Node 0 hosts the rendezvous store: said outright, as nodes sharing a machine (or a
        # loopback endpoint) would each take themselves for its host.
        node = [
            "--rdzv-backend",
            job.rdzv_backend,
            "--rdzv-endpoint",
            job.rdzv_endpoint,
            "--rdzv-id",
            str(job.rdzv_id),
            "--rdzv-conf",
            f"is_host={'true' if job.node_rank == 0 else 'false'}",
        ]
        return [base(job.node_rank or 0) + node + trainer]
    if job.nnodes == 1:
        return [base(0) + ["--standalone", "--local-addr", "127.0.0.1"] + trainer]
    rdzv_id = job.rdzv_id or uuid.uuid4().hex
    if network is None:
        prefixes: list[list[str]]
        endpoint, prefixes, addresses = f"127.0.0.1:{free_port()}", [[]] * job.nnodes, ["127.0.0.1"] * job.nnodes
    else:
        endpoint = f"{network.address(0)}:{RDZV_PORT}"
        prefixes = [network.exec_prefix(n) for n in range(job.nnodes)]
        addresses = [network.address(n) for n in range(job.nnodes)]
    # Every agent here would take itself for the store's host: say which one is.
    return [
        prefixes[n]
        + base(n)
        + [
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            rdzv_id,
            "--rdzv-conf",
            f"is_host={'true' if n == 0 else 'false'}",
            "--local-addr",
            addresses[n],
        ]
        + trainer
        for n in range(job.nnodes)
    ]
