"""In-job recovery: new engine communicators under the same process groups, same process.

    recovery = commlib.Recovery(commlib.RecoveryPolicy(join_timeout_s=30, max_recoveries=3))
    try:
        train_step(...)
    except Exception as exc:
        try:
            recovery.recover(exc)          # every rank calls it; bounded by join_timeout_s
        except commlib.RecoveryFailed:
            raise                          # fall back: exit, the launcher restarts the job
        restore_last_good_state()          # the trainer's part: model, optimizer, RNG, data position

`Recovery.recover` (collective over the world, every rank calls it after its own failure):

1. aborts the engine communicators of every commlib process group of the process
   (`commlib.process_group.commlib_groups`, read from torch.distributed's own group
   registry); each abort is announced in the communicator's store, so a peer still blocked
   in an old collective fails within a fraction of a second (a `PeerFailure` naming this
   rank) instead of waiting out its deadline;
2. joins recovery epoch N+1 through the job's store (the default group's store, under
   ``commlib-recovery/``): each rank writes ``epoch{N}/joined/{rank}`` and waits for every
   rank's key until the join deadline; a rank that is gone or does not join in time makes
   it raise `RecoveryFailed` naming the missing ranks;
3. builds new engine communicators for every group under ``epoch{N}/`` of that group's
   store and puts them under the SAME group objects (`CommlibProcessGroup.rebuild_communicators`),
   so FSDP2, DCP and DeviceMesh keep their group handles;
4. meets at a barrier on the new world communicator (deadline: the join deadline).

It logs ``recovery.start``, then ``recovery.in_job`` (epoch, trigger error, timings of each
phase) or ``recovery.failed`` (why, and which ranks were missing). Everything is bounded:
the join and the barrier by the join deadline, each group's rebuild by its own collective
deadline; after `max_recoveries` recoveries in one process the next one fails at once.

What it does not restore is the trainer's state (model, optimizer, RNG, data position):
that is the caller's, from its last checkpoint or an in-memory snapshot.

Engines: gloo (and the torchcomms engine, which is rebuilt through the same creator with a
fresh store prefix rather than torchcomms' own `reconfigure`). Communicators made by
`Communicator.split` outside a process group are not rebuilt: their holders must split
again from the new world communicator. nccl is designed for (abort is `ncclCommAbort`
through the backend's `abort`; the rebuild is a fresh `ncclCommInitRank` under the new
prefix) but untested without a GPU.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from commlib.errors import CommError, find_comm_error
from commlib.observe import log as _log

STORE_PREFIX = "commlib-recovery/"


@dataclass(frozen=True)
class RecoveryPolicy:
    """Bounds of in-job recovery."""

    # How long every rank has to join a new epoch (and to meet after the rebuild). It must
    # cover the longest a live peer can take to notice the failure: a collective deadline.
    join_timeout_s: float = 30.0
    max_recoveries: int = 3  # in-job recoveries per process; the next failure falls back

    def __post_init__(self) -> None:
        if not self.join_timeout_s > 0:
            raise ValueError(f"RecoveryPolicy: expected join_timeout_s > 0; found {self.join_timeout_s!r}")
        if not isinstance(self.max_recoveries, int) or self.max_recoveries < 0:
            raise ValueError(f"RecoveryPolicy: expected max_recoveries to be an int >= 0; "
                             f"found {self.max_recoveries!r}")


class RecoveryFailed(CommError):
    """In-job recovery could not complete on this rank; the caller falls back to a restart.

    `reason` is one of "limit" (max_recoveries spent), "join_timeout" (ranks in
    `missing_ranks` did not join the epoch in time), "store" (the job's store could not be
    reached), "rebuild" (a group's new communicators could not be built), "barrier", or
    "unsupported" (the default group is not a commlib group).
    """

    def __init__(self, message: str, *, reason: str, epoch: int, missing_ranks: list[int] | None = None,
                 rank: int | None = None) -> None:
        super().__init__(message, op="recover", rank=rank)
        self.reason = reason
        self.epoch = epoch
        self.missing_ranks = missing_ranks


@dataclass
class Recovered:
    """One in-job recovery that completed. Times in seconds."""

    epoch: int
    trigger: str  # type and message of the error that started it
    abort_s: float
    join_s: float
    rebuild_s: float
    barrier_s: float
    groups: int

    @property
    def total_s(self) -> float:
        return self.abort_s + self.join_s + self.rebuild_s + self.barrier_s


class Recovery:
    """This process's in-job recoveries: the current epoch and how many are spent."""

    def __init__(self, policy: RecoveryPolicy | None = None) -> None:
        self.policy = policy or RecoveryPolicy()
        self.epoch = 0
        self.history: list[Recovered] = []

    @property
    def recoveries(self) -> int:
        return len(self.history)

    def recover(self, error: BaseException | None = None) -> Recovered:
        """Rebuild every commlib group's communicators in place, with every rank; see the module docstring.

        Raises `RecoveryFailed` when this cannot be done in bounds: then nothing is usable and
        the caller exits so that the launcher restarts the job.
        """
        from commlib.process_group import CommlibProcessGroup, commlib_groups

        log = _log.get_logger()
        epoch = self.epoch + 1
        trigger = _describe(error)
        world = dist.group.WORLD if dist.is_initialized() else None
        if not isinstance(world, CommlibProcessGroup):
            raise RecoveryFailed(f"in-job recovery on pid {os.getpid()}: expected torch.distributed's default group "
                                 f"to be a commlib group (init_process_group(backend='commlib') or commlib.init); "
                                 f"found {type(world).__name__ if world is not None else 'none'}",
                                 reason="unsupported", epoch=epoch)
        rank, size = world.rank(), world.size()
        log.warning("recovery.start", epoch=epoch, trigger=trigger, trigger_type=_type(error),
                    recoveries=self.recoveries, max_recoveries=self.policy.max_recoveries)
        if self.recoveries >= self.policy.max_recoveries:
            raise self._failed(f"in-job recovery on rank {rank}: expected at most {self.policy.max_recoveries} "
                               f"in-job recoveries per process; this failure would be number "
                               f"{self.recoveries + 1} ({trigger})", "limit", epoch, rank)

        t0 = time.monotonic()
        groups = commlib_groups()
        for group in groups:
            group.abort_quietly(f"in-job recovery to epoch {epoch} after {trigger}")
        t1 = time.monotonic()

        store = dist.PrefixStore(f"{STORE_PREFIX}epoch{epoch}/", _world_store(world))
        deadline = timedelta(seconds=self.policy.join_timeout_s)
        keys = [f"joined/{r}" for r in range(size)]
        try:
            store.set(keys[rank], json.dumps({"pid": os.getpid(), "trigger": trigger}))
        except Exception as exc:
            raise self._failed(f"in-job recovery on rank {rank}: expected to reach the job's store to join epoch "
                               f"{epoch}; found {type(exc).__name__}: {exc}", "store", epoch, rank) from exc
        try:
            store.wait(keys, deadline)
        except Exception as exc:
            missing = _missing(store, keys)
            raise self._failed(f"in-job recovery on rank {rank}: expected all {size} ranks to join epoch {epoch} "
                               f"within {self.policy.join_timeout_s:g} s; ranks {missing} did not "
                               f"({type(exc).__name__})", "join_timeout", epoch, rank, missing) from exc
        t2 = time.monotonic()

        try:
            for group in groups:
                group.rebuild_communicators(epoch)
        except Exception as exc:
            raise self._failed(f"in-job recovery on rank {rank}: expected to build epoch {epoch}'s communicators; "
                               f"found {type(exc).__name__}: {exc}", "rebuild", epoch, rank) from exc
        t3 = time.monotonic()
        try:
            with _log.context(phase="recovery"):
                world.communicator().barrier(timeout=self.policy.join_timeout_s)
        except Exception as exc:
            raise self._failed(f"in-job recovery on rank {rank}: expected every rank at epoch {epoch}'s first "
                               f"barrier within {self.policy.join_timeout_s:g} s; found {type(exc).__name__}: {exc}",
                               "barrier", epoch, rank) from exc
        t4 = time.monotonic()

        self.epoch = epoch
        done = Recovered(epoch=epoch, trigger=trigger, abort_s=t1 - t0, join_s=t2 - t1, rebuild_s=t3 - t2,
                         barrier_s=t4 - t3, groups=len(groups))
        self.history.append(done)
        log.warning("recovery.in_job", epoch=epoch, trigger=trigger, trigger_type=_type(error), groups=len(groups),
                    abort_s=done.abort_s, join_s=done.join_s, rebuild_s=done.rebuild_s, barrier_s=done.barrier_s,
                    recovery_s=done.total_s)
        return done

    def _failed(self, message: str, reason: str, epoch: int, rank: int,
                missing: list[int] | None = None) -> RecoveryFailed:
        _log.get_logger().error("recovery.failed", epoch=epoch, reason=reason, missing_ranks=missing, error=message)
        return RecoveryFailed(message, reason=reason, epoch=epoch, missing_ranks=missing, rank=rank)


def _world_store(world: dist.ProcessGroup) -> dist.Store:
    """The store torch.distributed made the default group with (the job's store)."""
    recipe = getattr(world, "_recipe", None)
    if recipe is not None:
        return recipe.store
    return dist.distributed_c10d._world.pg_map[world][1]


def _missing(store: dist.Store, keys: list[str]) -> list[int] | None:
    try:
        return [r for r, k in enumerate(keys) if not store.check([k])]
    except Exception:  # the store itself is gone (its host died): nobody can be named
        return None


def _type(error: BaseException | None) -> str | None:
    if error is None:
        return None
    comm_error = find_comm_error(error)
    return type(comm_error if comm_error is not None else error).__name__


def _describe(error: BaseException | None) -> str:
    if error is None:
        return "requested"
    return f"{type(error).__name__}: {str(error)[:300]}"

