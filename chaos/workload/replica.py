"""The reference trainer in replica mode: replica groups under torchft's Manager, and its replay.

    TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 torchrun --nproc-per-node G -m chaos.workload.replica \\
        --replica R --replicas N --steps 20 --timeout 5 --log-dir runs/logs/replica{R}

One torchrun per replica group. A group of one rank trains the whole model (data parallel
across groups); a group of G > 1 ranks shards it with FSDP2 through `fsdp_overlap` over its
own commlib world (HSDP: sharded within a group, replicated across groups). Across groups,
torchft decides each step's members and heals a group that joins behind from a live peer;
the process group between the groups is commlib's (`commlib.replicas`), or torchft's own
gloo group with ``--replica-pg torchft-gloo`` (the baseline the benchmark compares against).
A heal goes over torchft's HTTPTransport, or its PGTransport over that process group
(``--heal-transport pg``).

With ``--ckpt-dir``, every group also keeps durable checkpoints (`GroupCheckpoints`: every
``--ckpt-every`` committed steps and at the last, in a directory of its own): after a quorum
that leaves a group behind the newest of any group's (the groups that held a newer state are
gone), it loads that one and the groups go on from it (a rollback, logged ``replica.resume``).
Without them, a restarted group alone at step 0 stops (``replica.orphaned``).

Each step: the quorum (torchft, synchronous: a replica that is behind heals before the step,
so every member of a quorum trains it), this rank's batch (a pure function of the step, the
replica and the rank: `chaos.workload.data.batch_for(step, replica x G + rank)`), forward,
backward (the group's reduce-scatter, G > 1), then the gradient average across the members,
then the commit (`Manager.should_commit`) and the optimizer step.

The average across replicas has a fixed order, so a replay can be exact: each rank gathers
from every member (`all_gather` on the replicas' group) a row ``[replica, taking part,
gradient shard...]`` and sums the members' shards in ascending replica order, one addition
at a time, then divides by their number (`ordered_mean`). An all-reduce would leave the
order of a sum of three or more shards to the engine.

The replay (``--replay MEMBERSHIP``, a torchrun of one group of G ranks, no torchft): for
each committed step, in order, the gradient of every member replica, computed from the one
model in turn on that replica's batches (the same shards, the same reduce-scatter inside the
group), averaged by `ordered_mean`, then the same optimizer step; at a rollback, back to its
own state after the checkpoint's step. A run whose replicas stayed in step is bitwise equal
to it at every step.

Logged per step (the rank's commlib log): ``train.step`` for a committed step (its loss and
its exact ``loss_hex``, the members ``replicas``, the quorum, the ``digest`` of this rank's
model and optimizer state after the step), ``train.failed_in_step`` for a step torchft did not
commit (the error that stopped it; the harness's holds are released on it, as on the single-job
trainer's in-job recovery), ``replica.heal`` when this rank took a peer's state (its size in
bytes), ``replica.join`` at a process's first quorum, ``replica.resume`` (`GroupCheckpoints`); the
replay logs ``replay.step`` (each member's loss, the digest). `chaos.replicas` verifies
from these. The in-rank fault injector (`chaos.inject`) runs with the rank's place in the
whole job (replica x G + rank); a heal calls its ``on_checkpoint_staged``, so
``kill_during_checkpoint`` kills a replica between taking a peer's state and committing a step.

Exit codes as `chaos.workload.train`'s (3: a commlib error inside the group, 1: any other).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import shutil
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

import commlib
import fsdp_overlap
from chaos.files import fsync_dir
from chaos.inject import Injector, install_from_env
from chaos.options import LONGEST_S, option
from chaos.workload import train
from chaos.workload.arguments import RefusingParser
from chaos.workload.checkpoint import (
    Checkpointer,
    Snapshot,
    TrainState,
    checkpoint_steps,
    find_latest,
    staging_dir_name,
    step_dir_name,
    verify,
)
from chaos.workload.data import DataConfig, batch_for
from chaos.workload.model import (
    ModelConfig,
    Transformer,
    build_block_mask,
    require_supported_torch,
    set_deterministic,
    warm_up_attention,
)
from commlib import settings
from commlib.attempt import attempt_number

PGS = ("commlib", "torchft-gloo")
TRANSPORTS = ("http", "pg")
MAX_REPLICAS = 1024
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own
_HEADER = 2  # a gathered row: [replica, taking part, gradient...]
HOLD_S = 0.5  # between two quorums of a group holding for lost ones


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """This mode's options, then the reference trainer's (`chaos.workload.train`) for the rest; a bad
    command line exits 2 naming the argument (argparse's way)."""
    return _parsed(argv, argparse.ArgumentParser, train.parse_args)


def check_args(argv: list[str]) -> argparse.Namespace:
    """The same reading as `parse_args`, or `chaos.workload.arguments.ArgumentsRefused` saying what it
    refuses: for a launcher (`chaos.replicas`) to check a job before it starts one."""
    return _parsed(argv, RefusingParser, train.check_args)


def _parsed(argv: list[str] | None, kind: type[argparse.ArgumentParser], trainer: Any) -> argparse.Namespace:
    seconds = functools.partial(option, settings.number, unit="seconds")
    p = kind(prog="python -m chaos.workload.replica", add_help=False, description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--replica",
        type=option(settings.integer, "--replica", low=0, high=MAX_REPLICAS - 1),
        default=0,
        help="this replica group's index",
    )
    p.add_argument(
        "--replicas",
        type=option(settings.integer, "--replicas", low=1, high=MAX_REPLICAS),
        default=2,
        help="replica groups in the job",
    )
    p.add_argument("--replica-pg", choices=PGS, default="commlib", help="the process group between replica groups")
    p.add_argument(
        "--heal-transport",
        choices=TRANSPORTS,
        default="http",
        help="how a group behind takes a peer's state: torchft's HTTPTransport, or its PGTransport over "
        "the process group between the groups",
    )
    p.add_argument("--replay", default=None, help="replay the membership in this JSON file instead of training")
    p.add_argument(
        "--quorum-timeout",
        type=seconds("--quorum-timeout", above=0, high=LONGEST_S),
        default=60.0,
        help="seconds to wait for a quorum",
    )
    p.add_argument(
        "--manager-timeout",
        type=seconds("--manager-timeout", above=0, high=LONGEST_S),
        default=30.0,
        help="torchft's own operations (commit vote, healing transfer), seconds",
    )
    p.add_argument(
        "--ready-dir",
        default=None,
        help="the first launch of every group waits here for all --replicas groups before its first "
        "quorum, so that they start in one quorum",
    )
    p.add_argument(
        "--finish-together-s",
        type=seconds("--finish-together-s", low=0, high=LONGEST_S),
        default=0.0,
        help="before the last step, wait up to this long for lost groups to come back and heal, so "
        "that every group ends with the final model (0: do not wait)",
    )
    p.add_argument(
        "--min-step-s",
        type=seconds("--min-step-s", low=0, high=60),
        default=0.0,
        help="pad every step to at least this long (a tiny model's steps take milliseconds; a real "
        "one's take seconds, long enough for a lost group to come back while the others train)",
    )
    if {"-h", "--help"} & set(sys.argv[1:] if argv is None else argv):
        print(p.format_help() + "\nand the reference trainer's options:\n")
        train.parse_args(["--help"])  # exits
    own, rest = p.parse_known_args(argv)
    if own.replica >= own.replicas:
        p.error(f"expected --replica below --replicas {own.replicas}; found --replica {own.replica}")
    return argparse.Namespace(**vars(trainer(rest)), **vars(own))


# -- state: digests, heal transfers, gradients ---------------------------------------------
def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """This rank's model and optimizer state (its shards), in a fixed order."""
    out = []
    for name, p in model.named_parameters():
        out.append((name, _local(p.detach())))
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            if isinstance(value, torch.Tensor):
                out.append((f"{name}.{key}", _local(value)))
    return out


def digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """sha256 of this rank's state: equal digests are bitwise-equal shards."""
    h = hashlib.sha256()
    for name, t in local_state(model, optimizer):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def heal_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a healing peer takes from this rank: its shards as plain tensors (torchft ships them)."""
    return {
        "params": [_local(p.detach()).clone() for p in model.parameters()],
        "optim": [
            {
                k: (_local(v).clone() if isinstance(v, torch.Tensor) else v)
                for k, v in optimizer.state.get(p, {}).items()
            }
            for p in model.parameters()
        ],
    }


@torch.no_grad()
def load_heal_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """A peer's `heal_state` into this rank's shards, bit for bit (optimizer state made where it is missing)."""
    params = list(model.parameters())
    if len(state["params"]) != len(params):
        raise ValueError(f"replica heal: expected {len(params)} parameter shards; found {len(state['params'])}")
    for p, saved, saved_optim in zip(params, state["params"], state["optim"], strict=True):
        _local(p).copy_(saved)
        current = optimizer.state.setdefault(p, {})
        for key, value in saved_optim.items():
            if not isinstance(value, torch.Tensor):
                current[key] = value
            elif key in current:
                _local(current[key]).copy_(value)
            else:
                current[key] = _like(p, value)


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` shaped as `param` is: a DTensor over the same mesh where the parameter is one."""
    if hasattr(param, "device_mesh") and local.shape == _local(param).shape:
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            local.clone(),
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    return local.clone()


def grad_shards(model: torch.nn.Module) -> list[torch.Tensor]:
    return [_local(p.grad) for p in model.parameters() if p.grad is not None]


def ordered_mean(rows: dict[int, torch.Tensor]) -> torch.Tensor:
    """The mean of the members' rows, summed in ascending replica order, one addition at a time."""
    replicas = sorted(rows)
    total = rows[replicas[0]].clone()
    for r in replicas[1:]:
        total += rows[r]
    return total / len(replicas)


def _write_back(grads: list[torch.Tensor], flat: torch.Tensor) -> None:
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


# -- one training process --------------------------------------------------------------
class ReplicaTrainer:
    """One rank of one replica group: its model, optimizer, Manager and step loop."""

    def __init__(
        self,
        args: argparse.Namespace,
        comm: commlib.Communicator,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        injector: Injector | None,
        checkpoints: GroupCheckpoints | None,
    ) -> None:
        self.args, self.comm, self.model, self.optimizer, self.injector = args, comm, model, optimizer, injector
        self.checkpoints = checkpoints
        self.log = commlib.get_logger()
        self.healed_to: int | None = None
        self.pg = _replica_pg(args)
        host, port, self._store = _attempt_store(comm)
        self.manager = _manager(args, comm, self.pg, host, port, self._load, lambda: heal_state(model, optimizer))

    def _load(self, state: dict[str, Any]) -> None:
        load_heal_state(self.model, self.optimizer, state)
        self.healed_to = self.manager.current_step()
        self.log.warning(
            "replica.heal",
            to_step=self.healed_to,
            bytes=sum(t.nbytes for _, t in local_state(self.model, self.optimizer)),
            digest=digest(self.model, self.optimizer),
        )

    def run(self, data_cfg: DataConfig, model_cfg: ModelConfig) -> None:
        args, manager = self.args, self.manager
        global_rank = args.replica * self.comm.size + self.comm.rank
        if args.ready_dir:
            _start_together(args, self.comm)
        holds = 0  # quorums held before the last step, waiting for lost groups (`_hold_for_lost_groups`)
        quorums = 0
        settled: int | None = None  # the size of the last quorum whose step this group committed
        while manager.current_step() < args.steps:
            start = time.perf_counter()
            self.healed_to = None
            if quorums == 0:
                self.log.info("replica.join", step=manager.current_step())
            self._quorum()
            quorums += 1
            # After a change (this process's first quorum, a step not committed, other members), the groups
            # that held a newer state than the durable checkpoints may be gone.
            participants = manager.num_participants()
            if participants != settled and self._caught_up(first=quorums == 1):
                continue
            step = manager.current_step() + 1
            if self._orphaned(step):
                return
            if self._hold_for_lost_groups(step, holds):
                holds += 1
                time.sleep(HOLD_S)
                continue
            with commlib.context(step=step):
                if self.injector is not None:
                    self.injector.on_step_start(step)
                    if self.healed_to is not None:  # a peer's state in place, no step of it committed yet
                        self.injector.on_checkpoint_staged(self.healed_to)
                batch = batch_for(data_cfg, step, global_rank)
                with commlib.context(phase="forward"):
                    loss = self.model(
                        batch.tokens, batch.targets, build_block_mask(model_cfg, batch.doc_ids, torch.device("cpu"))
                    )
                with commlib.context(phase="backward"):
                    loss.backward()
                with commlib.context(phase="replicas"):
                    members = self._average()
                committed = manager.should_commit()
                settled = participants if committed else None
                if committed:
                    self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                self._note(step, committed, members, loss.detach().item(), time.perf_counter() - start)
                if committed and self.checkpoints is not None and self.checkpoints.due(step):
                    with commlib.context(phase="checkpoint"):
                        self.checkpoints.save(self.model, self.optimizer, manager.state_dict())
            time.sleep(max(0.0, args.min_step_s - (time.perf_counter() - start)))

    def _quorum(self) -> None:
        """The next quorum; where none comes (torchft raises: the lighthouse gone or out of reach past
        --quorum-timeout), the group first saves its committed state durably, then the error goes on
        (torchft cannot ask again in this process): the restarted group resumes from that state, not
        from an older checkpoint."""
        try:
            self.manager.start_quorum()
        except Exception as exc:
            step, checkpoints = self.manager.current_step(), self.checkpoints
            save = checkpoints is not None and step > 0 and not checkpoints.holds(step)
            self.log.error("replica.no_quorum", step=step, error=str(exc)[:300], checkpointed=save)
            if checkpoints is not None and save:
                with commlib.context(phase="checkpoint"):
                    checkpoints.save(self.model, self.optimizer, self.manager.state_dict())
            raise

    def _caught_up(self, first: bool) -> bool:
        """Whether the group, behind the newest durable checkpoint (the groups that held a newer state
        are gone), loaded it (`GroupCheckpoints.catch_up`), so must ask for a quorum again at its step."""
        if self.checkpoints is None:
            return False
        with commlib.context(phase="checkpoint"):
            return self.checkpoints.catch_up(self.model, self.optimizer, self.manager, first)

    def _orphaned(self, step: int) -> bool:
        """A restarted group alone at step 0 without durable checkpoints: the others have finished or
        are gone, and no peer can heal it. It stops (logged) rather than start the training over as a
        lineage of its own. (With checkpoints it resumed from the newest before its first quorum.)"""
        alone = self.manager.num_participants() == 1 < self.args.replicas
        if step == 1 and attempt_number() > 0 and alone and self.checkpoints is None:
            self.log.error(
                "replica.orphaned",
                replica=self.args.replica,
                attempt=attempt_number(),
                why="restarted and alone at step 0: no live peer to heal from (the others finished or "
                "are gone); not starting the training over",
            )
            return True
        return False

    def _hold_for_lost_groups(self, step: int, holds: int) -> bool:
        """Before the last step, while fewer than --replicas groups are in the quorum, quorum again
        instead of training (at most --finish-together-s): so a restarted group can heal and finish
        with the others. Counted in quorums, not seconds, so every rank of a group holds alike."""
        limit = round(self.args.finish_together_s / HOLD_S)
        if step != self.args.steps or holds >= limit or self.manager.num_participants() >= self.args.replicas:
            return False
        if holds == 0:
            self.log.info(
                "replica.holding",
                step=step,
                members=self.manager.num_participants(),
                replicas=self.args.replicas,
                at_most_s=self.args.finish_together_s,
            )
        return True

    def _average(self) -> list[int]:
        """The members' ordered mean into this rank's gradient shards; the members (none on an error)."""
        manager = self.manager
        grads = grad_shards(self.model)
        flat = torch.cat([g.reshape(-1) for g in grads])
        header = torch.tensor([float(self.args.replica), 1.0 if manager.is_participating() else 0.0])
        row = torch.cat([header, flat])
        rows = [torch.empty_like(row) for _ in range(self.pg.size())]
        if manager.errored() is not None:
            return []
        try:
            self.pg.allgather([rows], [row], AllgatherOptions()).wait()
        except Exception as exc:  # a peer gone or late: torchft discards the step (should_commit says no)
            manager.report_error(exc)
            return []
        members = {int(r[0]): r[_HEADER:] for r in rows if r[1] == 1.0}
        _write_back(grads, ordered_mean(members))
        return sorted(members)

    def _note(self, step: int, committed: bool, members: list[int], loss: float, took: float) -> None:
        quorum = getattr(self.pg, "quorum", None)
        where = {
            "step": step,
            "replica": self.args.replica,
            "replicas": members,
            "quorum_id": quorum.quorum_id if quorum is not None else None,
            "step_time_s": took,
            "healed_to": self.healed_to,
        }
        if committed:
            self.log.info(
                "train.step", loss=loss, loss_hex=loss.hex(), digest=digest(self.model, self.optimizer), **where
            )
            return
        error = self.manager.errored()
        cause = getattr(error, "original_exception", error)
        self.log.warning(
            "train.failed_in_step",
            error_type=type(cause).__name__ if cause is not None else None,
            error=str(cause)[:300] if cause is not None else None,
            **where,
        )


def _replica_pg(args: argparse.Namespace) -> Any:
    if args.replica_pg == "commlib":
        from commlib.replicas import replica_group

        return replica_group(args.timeout)
    from torchft import ProcessGroupGloo

    return ProcessGroupGloo(timeout=timedelta(seconds=args.timeout))


def _manager(
    args: argparse.Namespace, comm: commlib.Communicator, pg: Any, host: str, port: int, load: Any, save: Any
) -> Any:
    """torchft's Manager for this rank, over the store at `host`:`port` (`_attempt_store`)."""
    from torchft import Manager

    if not os.environ.get(LIGHTHOUSE_ENV):
        raise ValueError(
            f"replica {args.replica} rank {comm.rank}: expected {LIGHTHOUSE_ENV}=http://HOST:PORT "
            f"(the lighthouse the job's starter runs); found it unset"
        )
    return Manager(
        pg=pg,
        load_state_dict=load,
        state_dict=save,
        checkpoint_transport=_heal_transport(args, pg),
        min_replica_size=1,
        use_async_quorum=False,
        timeout=timedelta(seconds=args.manager_timeout),
        quorum_timeout=timedelta(seconds=args.quorum_timeout),
        connect_timeout=timedelta(seconds=args.manager_timeout),
        rank=comm.rank,
        world_size=comm.size,
        store_addr=host,
        store_port=port,
        replica_id=f"replica{args.replica}",
        init_sync=False,
    )


def _heal_transport(args: argparse.Namespace, pg: Any) -> Any:
    """torchft's checkpoint transport for a heal (``--heal-transport``): None for its default, the
    HTTPTransport (a server in every rank, its state fetched in chunks), or its PGTransport over the
    process group between the groups (sent and received in order with tags 1, 2, 3 + tensor index)."""
    if args.heal_transport == "http":
        return None
    from torchft.checkpointing.pg_transport import PGTransport

    return PGTransport(pg, timeout=timedelta(seconds=args.manager_timeout), device=torch.device("cpu"))


def _attempt_store(comm: commlib.Communicator) -> tuple[str, int, dist.TCPStore | None]:
    """A store of this attempt for the Manager, whose keys (its server's address) carry no attempt:
    torchrun's store keeps a dead attempt's, which a restarted rank would read before its new rank 0
    wrote them. Rank 0 hosts it (returned, to be kept alive); the group learns where from torchrun's
    store, under this attempt."""
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    agent = dist.TCPStore(
        host,
        settings.integer(os.environ.get("MASTER_PORT", ""), "MASTER_PORT", low=1, high=65535),
        is_master=False,
        wait_for_workers=False,
    )
    key = f"replica/attempt{attempt_number()}/manager_store"
    own = None
    if comm.rank == 0:
        own = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        agent.set(key, str(own.port))
    return host, int(agent.get(key).decode()), own


def _start_together(args: argparse.Namespace, comm: commlib.Communicator) -> None:
    """Hold the first launch, its Manager up (heartbeating to the lighthouse, which then waits for it to
    join the first quorum), until every group's is (`--ready-dir`); else the first group up would train
    alone and the others join it late, healing. Every attempt marks its group ready, a restarted one
    too (it never waits): a group whose first launch died before its mark would otherwise hold the
    others' first launch, heartbeating, and with it every quorum its own restart asks for."""
    ready = Path(args.ready_dir)
    if comm.rank == 0:
        ready.mkdir(parents=True, exist_ok=True)
        (ready / f"replica{args.replica}").touch()
        give_up = time.monotonic() + args.startup_timeout
        while attempt_number() == 0 and len(list(ready.glob("replica*"))) < args.replicas:
            if time.monotonic() > give_up:
                raise TimeoutError(
                    f"replica {args.replica}: expected all {args.replicas} replica groups ready in "
                    f"{ready} within --startup-timeout {args.startup_timeout:g} s; found "
                    f"{sorted(p.name for p in ready.glob('replica*'))}"
                )
            time.sleep(0.05)
    comm.barrier(timeout=max(args.timeout, args.startup_timeout))


# -- durable checkpoints -------------------------------------------------------------------
class GroupCheckpoints:
    """This group's durable checkpoints, ``{ckpt_dir}/replica{R}`` (`chaos.workload.checkpoint`: staged,
    hashed, renamed, so a kill never leaves a torn one behind), written every ``--ckpt-every`` committed
    steps and at the last; and the catch-up to the newest complete one of any group's.

    Every group keeps its own directory (a save or a restart of one never touches another's files);
    the groups of a quorum commit bitwise the same state, so any group's checkpoint of a step is
    every group's. After a quorum that healed this group from a live peer, it holds the newest state
    there is; after one that left it behind the newest checkpoint (every group that held a newer state
    is gone), it loads that checkpoint and asks for a quorum again: the groups go on from it. Each
    such resume is logged (``replica.resume``: the step, the digest of the state loaded, the group
    whose checkpoint it was), and so is a process's first quorum that leaves it at step 0 unhealed
    (step 0, no checkpoint: it goes on from the initial state).
    """

    def __init__(
        self,
        args: argparse.Namespace,
        comm: commlib.Communicator,
        lineage: dict[str, Any],
        injector: Injector | None,
    ) -> None:
        self.root = Path(args.ckpt_dir)
        self.every, self.last, self.replica, self.comm = args.ckpt_every, args.steps, args.replica, comm
        self.checkpointer = Checkpointer(
            self.root / f"replica{args.replica}",
            comm,
            attempt=attempt_number(),
            lineage=lineage,
            on_committed=injector.on_checkpoint_committed if injector else None,
        )
        self._unusable = -1  # rank 0: the newest step listed that held no complete checkpoint newer than ours

    def due(self, step: int) -> bool:
        return step == self.last or step % self.every == 0

    def holds(self, step: int) -> bool:
        """Whether this group's directory lists a checkpoint of `step` (every rank of the group asks at
        the same point, after the same saves, so all answer alike)."""
        return step in checkpoint_steps(self.checkpointer.directory)

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, manager_state: dict[str, int]) -> None:
        """The state after a committed step, with the Manager's (torchft's step count: a resume needs it)."""
        self.checkpointer.save(model, optimizer, TrainState(step=manager_state["step"], manager=manager_state))

    def catch_up(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, manager: Any, first: bool) -> bool:
        """After a quorum (collective over the group): load the newest complete checkpoint of any group
        where it is ahead of the Manager's step (rank 0 decides); whether it did."""
        step = manager.current_step()
        newest, source = self._newer_than(step) if self.comm.rank == 0 else (-1, None)
        choice = torch.tensor([newest], dtype=torch.int64)
        self.comm.broadcast(choice, root=0)
        log = commlib.get_logger()
        if int(choice.item()) > step:
            state = self.checkpointer.resume(model, optimizer)
            manager.load_state_dict(state.manager)
            log.warning("replica.resume", step=state.step, from_replica=source, digest=digest(model, optimizer))
            return True
        if first and step == 0:
            log.info("replica.resume", step=0, from_replica=None, digest=digest(model, optimizer))
        return False

    def _newer_than(self, step: int) -> tuple[int, int | None]:
        """Rank 0: the newest complete checkpoint's step and group where it is ahead of `step` (else -1);
        a directory listing first, so that no file is read while nothing newer is there."""
        listed = max((s for d in self._group_dirs() for s in checkpoint_steps(d)), default=-1)
        if listed <= max(step, self._unusable):
            return -1, None
        found = self._take_newest()
        if found is None or found[0] <= step:
            self._unusable = listed
            return -1, None
        return found

    def _take_newest(self) -> tuple[int, int] | None:
        """Rank 0: the newest complete checkpoint's step and the group whose directory holds it (None:
        none does), copied into this group's directory when it is another's, so `Checkpointer.resume`
        finds it there. A copy is checked against its marker before it counts; one that fails (its
        source pruned under it) is removed and the choice made again."""
        for _ in range(3):
            staging = None
            try:
                found = [(s, int(d.name[7:])) for d in self._group_dirs() if (s := find_latest(d)[0]) is not None]
                if not found:
                    return None
                step, replica = max(found, key=lambda f: (f[0], f[1] == self.replica))
                own = self.checkpointer.directory / step_dir_name(step)
                if replica == self.replica or verify(own) is None:
                    return step, replica
                staging = self.checkpointer.directory / staging_dir_name(step, attempt_number())
                shutil.copytree(self.root / f"replica{replica}" / step_dir_name(step), staging, dirs_exist_ok=True)
                shutil.rmtree(own, ignore_errors=True)
                os.rename(staging, own)
                fsync_dir(own.parent)
                if verify(own) is None:
                    return step, replica
                shutil.rmtree(own, ignore_errors=True)
            except OSError:  # a directory pruned or renamed by its group while this one read it
                if staging is not None:
                    shutil.rmtree(staging, ignore_errors=True)
        return None

    def _group_dirs(self) -> list[Path]:
        return sorted(d for d in self.root.glob("replica*") if d.is_dir() and d.name[7:].isdigit())


# -- the replay --------------------------------------------------------------------------
def replay(
    args: argparse.Namespace,
    comm: commlib.Communicator,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data_cfg: DataConfig,
    model_cfg: ModelConfig,
) -> None:
    """Every committed step of the membership file, every member's gradient in turn (module docstring).

    The file is the run's segments in order, ``[{"from": STEP, "steps": {step: members}}, ...]``: the
    first from step 0, each later one from a rollback to the state after step ``from`` (the durable
    checkpoint the groups resumed from), which is the state the replay had after that step last."""
    segments = json.loads(Path(args.replay).read_text())
    starts = {int(segment["from"]) for segment in segments[1:]}
    kept = {0: Snapshot.take(model, optimizer, TrainState())} if 0 in starts else {}
    log = commlib.get_logger()
    for index, segment in enumerate(segments):
        if index:
            kept[int(segment["from"])].restore(model, optimizer)
        membership = {int(step): members for step, members in segment["steps"].items()}
        for step in sorted(membership):
            members = membership[step]
            rows: dict[int, torch.Tensor] = {}
            losses: dict[str, str] = {}
            with commlib.context(step=step):
                for r in members:
                    batch = batch_for(data_cfg, step, r * comm.size + comm.rank)
                    loss = model(
                        batch.tokens, batch.targets, build_block_mask(model_cfg, batch.doc_ids, torch.device("cpu"))
                    )
                    loss.backward()
                    rows[r] = torch.cat([g.reshape(-1) for g in grad_shards(model)])
                    losses[str(r)] = loss.detach().item().hex()
                    if r != members[-1]:
                        optimizer.zero_grad(set_to_none=True)
                _write_back(grad_shards(model), ordered_mean(rows))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                log.info(
                    "replay.step",
                    segment=index,
                    step=step,
                    replicas=members,
                    losses_hex=losses,
                    digest=digest(model, optimizer),
                )
            if step in starts:
                kept[step] = Snapshot.take(model, optimizer, TrainState(step=step))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    require_supported_torch()
    comm = commlib.init(backend="gloo", timeout=args.timeout, log_dir=args.log_dir, device="cpu")
    log = commlib.get_logger()
    try:
        model_cfg, data_cfg = train.configs(args)
        injector = None if args.replay else install_from_env(comm, rank=args.replica * comm.size + comm.rank)
        set_deterministic()
        with commlib.context(phase="startup"):
            first = batch_for(data_cfg, 1, comm.rank)
            warm_up_attention(
                model_cfg,
                build_block_mask(model_cfg, first.doc_ids, torch.device("cpu")),
                args.batch_size,
                torch.device("cpu"),
            )
            comm.barrier(timeout=max(args.timeout, args.startup_timeout))
        model = Transformer(model_cfg, seed=args.seed)
        if comm.size > 1:
            fsdp_overlap.shard(model, comm, blocks=model.layers, mode=fsdp_overlap.Mode.PLAIN)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        log.info(
            "replica.start",
            replica=args.replica,
            replicas=args.replicas,
            group_size=comm.size,
            replica_pg=args.replica_pg,
            heal_transport=args.heal_transport,
            ckpt_dir=args.ckpt_dir,
            replay=args.replay,
            threads=torch.get_num_threads(),
            steps=args.steps,
        )
        if args.replay:
            replay(args, comm, model, optimizer, data_cfg, model_cfg)
        else:
            checkpoints = None
            if args.ckpt_dir is not None and args.ckpt_every:
                lineage = {
                    "model": dataclasses.asdict(model_cfg),
                    "data": dataclasses.asdict(data_cfg),
                    "lr": args.lr,
                    "world_size": comm.size,
                }
                checkpoints = GroupCheckpoints(args, comm, lineage, injector)
            trainer = ReplicaTrainer(args, comm, model, optimizer, injector, checkpoints)
            trainer.run(data_cfg, model_cfg)
            trainer.manager.shutdown(wait=False)
            trainer.pg.shutdown()  # the last quorum's communicators, finalized
        log.info("train.done", steps=args.steps, digest=digest(model, optimizer))
    except Exception as exc:
        traceback.print_exc()
        comm_error = commlib.find_comm_error(exc)
        code = train.EXIT_COMM_ERROR if comm_error is not None else train.EXIT_ERROR
        log.error(
            "train.error",
            error=str(comm_error or exc)[:500],
            error_type=type(comm_error or exc).__name__,
            exit_code=code,
        )
        return code
    comm.finalize()
    return train.EXIT_OK


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as chaos.workload.train: no interpreter teardown (torchft's threads and servers too)
