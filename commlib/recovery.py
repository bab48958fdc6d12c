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

`Recovery.recover` (collective over the world, every rank calls it after its own failure)
runs four phases, each bounded:

1. abort: the engine communicators of every commlib process group of the process
   (`commlib.process_group.commlib_groups`, read from torch.distributed's own group
   registry); each abort is announced in the communicator's store, so a peer still blocked
   in an old collective fails within a fraction of a second (a `PeerFailure` naming this
   rank) instead of waiting out its deadline;
2. join: the epoch comes from the job's store (the default group's store, under
   ``commlib-recovery/``), not from this object, so a new `Recovery` made after each failure
   never reuses an epoch and its keys: ``epoch`` holds the last epoch opened; a rank joins it
   while its join is undecided, else opens the next one (``compare_set``, so ranks that race
   open one epoch, not two). Each rank writes ``epoch{N}/joined/{rank}`` and waits for every
   rank's key until the join deadline; the first rank to decide the join writes the verdict
   (``epoch{N}/join``: every rank joined, or who gave up on whom) with ``compare_set``, so
   every rank reads the same one. A rank that arrives after a peer gave up is refused at
   once, saying who gave up and why, instead of passing on the peer's stale key;
3. rebuild: new engine communicators for every group under ``epoch{N}/`` of that group's
   store, under the SAME group objects (`CommlibProcessGroup.rebuild_communicators`), so
   FSDP2, DCP and DeviceMesh keep their group handles; each group's rebuild is bounded by its
   own collective deadline. Every rank writes its outcome (``epoch{N}/rebuilt/{rank}``), so a
   rank whose rebuild failed waiting for peers names the ones that raised (with their error)
   or never finished (gone or stuck), after at most `OUTCOME_GRACE_S` more;
4. meet: a barrier on the new world communicator (deadline: the join deadline).

It logs ``recovery.start`` (once the epoch is known), then ``recovery.in_job`` (epoch, trigger
error, timings of each phase) or ``recovery.failed`` (why, and which ranks). After
`max_recoveries` recoveries by one `Recovery` object the next one fails at once.

What it does not restore is the trainer's state (model, optimizer, RNG, data position):
that is the caller's, from its last checkpoint or an in-memory snapshot.

Engines: gloo (and the torchcomms engine, which is rebuilt through the same creator with a
fresh store prefix rather than torchcomms' own `reconfigure`). Communicators made by
`Communicator.split` outside a process group are not rebuilt: their holders must split
again from the new world communicator. Stream-ordered engines (nccl, torchcomms on CUDA):
the abort is `ncclCommAbort` through the backend's `abort`, in a thread of its own that the
abort phase waits on for at most `communicator.ENGINE_ABORT_BOUND_S` (a wedged device can hold
it); the rebuild is a fresh nonblocking `ncclCommInitRank` under the new prefix, bounded by the
group's deadline (`commlib.backends.nccl.build_engine`); the closing barrier waits on the CPU.
On CPU this path runs over the tests' emulated stream-ordered engine
(tests/commlib/test_stream_ordered.py); scripts/bench_gpu.py checks it on one GPU; several GPUs
are designed for and untested.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

from commlib.errors import CommError, find_comm_error
from commlib.failures import Failure, classify
from commlib.members import rank_list, ranks_text
from commlib.record import log as _log
from commlib.store_reads import absent, present

if TYPE_CHECKING:
    from commlib.process_group import CommlibProcessGroup

STORE_PREFIX = "commlib-recovery/"
EPOCH_KEY = "epoch"  # under STORE_PREFIX: the last epoch any rank opened
JOINED = "joined"  # the verdict of a join where every rank joined; otherwise the giver's record
# How long a rank whose rebuild failed waiting for its peers waits for their outcomes, to name
# the culprits: every rank starts its rebuild within milliseconds of the others (they leave the
# join together), so the peers that also waited fail within this of it.
OUTCOME_GRACE_S = 1.0


@dataclass(frozen=True)
class RecoveryPolicy:
    """Bounds of in-job recovery."""

    # How long every rank has to join a new epoch (and to meet after the rebuild). It must
    # cover the longest a live peer can take to notice the failure: a collective deadline.
    join_timeout_s: float = 30.0
    max_recoveries: int = 3  # in-job recoveries per Recovery object; the next failure falls back

    def __post_init__(self) -> None:
        if not self.join_timeout_s > 0:
            raise ValueError(f"RecoveryPolicy: expected join_timeout_s > 0; found {self.join_timeout_s!r}")
        if not isinstance(self.max_recoveries, int) or self.max_recoveries < 0:
            raise ValueError(
                f"RecoveryPolicy: expected max_recoveries to be an int >= 0; found {self.max_recoveries!r}"
            )


class RecoveryFailed(CommError):
    """In-job recovery could not complete on this rank; the caller falls back to a restart.

    `reason` is one of "limit" (max_recoveries spent), "join_timeout" (ranks in
    `missing_ranks` did not join the epoch in time), "refused" (this rank came to an epoch
    that the rank in `failed_ranks` had given up on, missing the ranks in `missing_ranks`),
    "store" (the job's store could not be reached), "rebuild" (a group's new communicators
    could not be built: `failed_ranks` raised building theirs, `missing_ranks` never finished
    it), "barrier", or "unsupported" (the default group is not a commlib group). `epoch` is
    None where the recovery failed before an epoch was chosen.
    """

    def __init__(
        self,
        message: str,
        *,
        reason: str,
        epoch: int | None,
        missing_ranks: list[int] | None = None,
        failed_ranks: list[int] | None = None,
        rank: int | None = None,
    ) -> None:
        super().__init__(message, op="recover", rank=rank)
        self.reason = reason
        self.epoch = epoch
        self.missing_ranks = missing_ranks
        self.failed_ranks = failed_ranks


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


@dataclass(frozen=True)
class _Attempt:
    """One call of `Recovery.recover`: where it runs, for the phases and their errors."""

    store: dist.Store  # the job's store under STORE_PREFIX
    rank: int
    size: int
    trigger: str
    began: float = field(default_factory=time.monotonic)
    # How long each phase took that came to its end (a failed rebuild: until it raised, before
    # the peers' outcomes were read), for `recovery.failed`: where the time of a failure went.
    phases: dict[str, float] = field(default_factory=dict)

    def epoch_store(self, epoch: int) -> dist.Store:
        return dist.PrefixStore(f"epoch{epoch}/", self.store)

    def phase_ended(self, name: str, since: float) -> float:
        """Record that phase `name`, begun at `since` (monotonic), ended now; returns now."""
        now = time.monotonic()
        self.phases[name] = now - since
        return now


class Recovery:
    """This process's in-job recoveries: the epoch it last completed and how many are spent."""

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
        from commlib.process_group import commlib_groups

        world = _world_group()
        attempt = _Attempt(
            dist.PrefixStore(STORE_PREFIX, _world_store(world)), world.rank(), world.size(), _describe(error)
        )
        if self.recoveries >= self.policy.max_recoveries:
            raise self._failed(
                attempt,
                f"expected at most {self.policy.max_recoveries} in-job recoveries per "
                f"Recovery object; this failure would be number {self.recoveries + 1} "
                f"({attempt.trigger})",
                "limit",
                None,
            )
        epoch = self._open_epoch(attempt)
        _log.get_logger().warning(
            "recovery.start",
            epoch=epoch,
            trigger=attempt.trigger,
            trigger_type=_type(error),
            recoveries=self.recoveries,
            max_recoveries=self.policy.max_recoveries,
        )
        t0 = time.monotonic()
        groups = commlib_groups()
        self._abort(attempt, epoch, groups)
        t1 = attempt.phase_ended("abort_s", t0)
        self._join(attempt, epoch)
        t2 = attempt.phase_ended("join_s", t1)
        self._rebuild(attempt, epoch, groups)
        t3 = attempt.phase_ended("rebuild_s", t2)
        self._meet(attempt, epoch, world)
        t4 = time.monotonic()

        self.epoch = epoch
        done = Recovered(
            epoch=epoch,
            trigger=attempt.trigger,
            abort_s=t1 - t0,
            join_s=t2 - t1,
            rebuild_s=t3 - t2,
            barrier_s=t4 - t3,
            groups=len(groups),
        )
        self.history.append(done)
        _log.get_logger().warning(
            "recovery.in_job",
            epoch=epoch,
            trigger=attempt.trigger,
            trigger_type=_type(error),
            groups=len(groups),
            abort_s=done.abort_s,
            join_s=done.join_s,
            rebuild_s=done.rebuild_s,
            barrier_s=done.barrier_s,
            recovery_s=done.total_s,
        )
        return done

    # -- the phases ----------------------------------------------------------------------
    def _open_epoch(self, attempt: _Attempt) -> int:
        """The epoch this recovery joins: the last one opened while its join is undecided, else the next.

        A last epoch whose join a peer gave up on refuses this rank: that peer is falling back
        to a restart, and the job with it.
        """
        try:
            while True:
                last = int(attempt.store.add(EPOCH_KEY, 0))
                if last:
                    verdict = _verdict(attempt.epoch_store(last))
                    if verdict is None:
                        return last
                    if verdict != JOINED:
                        raise self._refused(attempt, last, verdict)
                opened = attempt.store.compare_set(EPOCH_KEY, str(last), str(last + 1))
                if int(opened) == last + 1:
                    return last + 1
        except RecoveryFailed:
            raise
        except Exception as exc:
            raise self._failed(
                attempt,
                f"expected to reach the job's store to choose an epoch; found {type(exc).__name__}: {exc}",
                "store",
                None,
            ) from exc

    def _abort(self, attempt: _Attempt, epoch: int, groups: list[CommlibProcessGroup]) -> None:
        for group in groups:
            group.abort_quietly(f"in-job recovery to epoch {epoch} after {attempt.trigger}")

    def _join(self, attempt: _Attempt, epoch: int) -> None:
        store = attempt.epoch_store(epoch)
        keys = [f"joined/{r}" for r in range(attempt.size)]
        try:
            store.set(keys[attempt.rank], json.dumps({"pid": os.getpid(), "trigger": attempt.trigger}))
        except Exception as exc:
            raise self._failed(
                attempt,
                f"expected to reach the job's store to join epoch {epoch}; found {type(exc).__name__}: {exc}",
                "store",
                epoch,
            ) from exc
        try:
            store.wait(keys, timedelta(seconds=self.policy.join_timeout_s))
            missing: list[int] | None = []
        except Exception:
            missing = _absent(store, keys)
        # The join's verdict is whichever rank's comes first, so every rank acts on the same one.
        proposal = (
            JOINED
            if missing == []
            else json.dumps(
                {
                    "rank": attempt.rank,
                    "reason": "join_timeout",
                    "missing": missing,
                    "waited_s": self.policy.join_timeout_s,
                }
            )
        )
        try:
            verdict = store.compare_set("join", "", proposal).decode()
        except Exception as exc:
            raise self._failed(
                attempt,
                f"expected to reach the job's store to decide epoch {epoch}'s join; found {type(exc).__name__}: {exc}",
                "store",
                epoch,
                missing,
            ) from exc
        if verdict == JOINED:
            return
        if verdict != proposal:
            raise self._refused(attempt, epoch, verdict)
        raise self._failed(
            attempt,
            f"expected all {attempt.size} ranks to join epoch {epoch} within "
            f"{self.policy.join_timeout_s:g} s; ranks {_said(missing)} did not",
            "join_timeout",
            epoch,
            missing,
        )

    def _rebuild(self, attempt: _Attempt, epoch: int, groups: list[CommlibProcessGroup]) -> None:
        store = attempt.epoch_store(epoch)
        began = time.monotonic()
        try:
            for group in groups:
                group.rebuild_communicators(epoch)
        except Exception as exc:
            attempt.phase_ended("rebuild_s", began)
            found = f"{type(exc).__name__}: {exc}"
            waited_for_peers = _waited_for_peers(exc)
            _try_set(store, f"rebuilt/{attempt.rank}", json.dumps({"error": found, "own": not waited_for_peers}))
            if not waited_for_peers:
                raise self._failed(
                    attempt,
                    f"expected to build epoch {epoch}'s communicators; found {found}",
                    "rebuild",
                    epoch,
                    failed=[attempt.rank],
                ) from exc
            raised, missing = _rebuild_culprits(store, attempt.size)
            raise self._failed(
                attempt,
                f"expected every rank to build epoch {epoch}'s communicators; "
                f"{_describe_culprits(raised, missing)} (this rank: {found})",
                "rebuild",
                epoch,
                missing,
                sorted(raised),
            ) from exc
        _try_set(store, f"rebuilt/{attempt.rank}", json.dumps({"error": None}))

    def _meet(self, attempt: _Attempt, epoch: int, world: CommlibProcessGroup) -> None:
        try:
            with _log.context(phase="recovery"):
                world.communicator().barrier(timeout=self.policy.join_timeout_s)
        except Exception as exc:
            raise self._failed(
                attempt,
                f"expected every rank at epoch {epoch}'s first barrier within "
                f"{self.policy.join_timeout_s:g} s; found {type(exc).__name__}: {exc}",
                "barrier",
                epoch,
            ) from exc

    # -- failures ------------------------------------------------------------------------
    def _refused(self, attempt: _Attempt, epoch: int, verdict: str) -> RecoveryFailed:
        gave_up = json.loads(verdict)
        return self._failed(
            attempt,
            f"expected to join epoch {epoch} with every rank; found rank {gave_up['rank']} "
            f"had given up on it ({gave_up['reason']}: ranks {_said(gave_up['missing'])} did not "
            f"join within {gave_up['waited_s']:g} s), so this rank came too late and the "
            f"job falls back to a restart",
            "refused",
            epoch,
            gave_up["missing"],
            [gave_up["rank"]],
        )

    def _failed(
        self,
        attempt: _Attempt,
        found: str,
        reason: str,
        epoch: int | None,
        missing: list[int] | None = None,
        failed: list[int] | None = None,
    ) -> RecoveryFailed:
        message = f"in-job recovery on rank {attempt.rank}: {found}"
        _log.get_logger().error(
            "recovery.failed",
            epoch=epoch,
            reason=reason,
            missing_ranks=missing,
            failed_ranks=failed,
            error=message,
            elapsed_s=round(time.monotonic() - attempt.began, 3),
            **{name: round(took, 3) for name, took in attempt.phases.items()},
        )
        return RecoveryFailed(
            message, reason=reason, epoch=epoch, missing_ranks=missing, failed_ranks=failed, rank=attempt.rank
        )


def _world_group() -> CommlibProcessGroup:
    """The default group, which in-job recovery can rebuild only when commlib made it."""
    from commlib.process_group import CommlibProcessGroup

    world = dist.group.WORLD if dist.is_initialized() else None
    if not isinstance(world, CommlibProcessGroup):
        message = (
            f"in-job recovery on pid {os.getpid()}: expected torch.distributed's default group to be a "
            f"commlib group (init_process_group(backend='commlib') or commlib.init); found "
            f"{type(world).__name__ if world is not None else 'none'}"
        )
        _log.get_logger().error("recovery.failed", epoch=None, reason="unsupported", error=message)
        raise RecoveryFailed(message, reason="unsupported", epoch=None)
    return world


def _world_store(world: dist.ProcessGroup) -> dist.Store:
    """The store torch.distributed made the default group with (the job's store)."""
    recipe = getattr(world, "_recipe", None)
    if recipe is not None:
        return recipe.store
    return dist.distributed_c10d._world.pg_map[world][1]


def _verdict(store: dist.Store) -> str | None:
    """An epoch's join verdict (`Recovery._join`), None while undecided."""
    return store.get("join").decode() if store.check(["join"]) else None


def _absent(store: dist.Store, keys: list[str]) -> list[int] | None:
    try:
        return absent(store, keys)
    except Exception:  # the store itself is gone (its host died): nobody can be named
        return None


def _try_set(store: dist.Store, key: str, value: str) -> None:
    try:
        store.set(key, value)
    except Exception as exc:  # the store is gone: peers then cannot read this rank's outcome, nor anything else
        _log.get_logger().warning("recovery.outcome_unrecorded", key=key, error=f"{type(exc).__name__}: {exc}")


def _waited_for_peers(exc: BaseException) -> bool:
    """Whether a rebuild failed waiting for peers (a store wait or a connection that timed out or broke,
    anywhere in its chain: commlib wraps some), rather than on this rank's own account."""
    seen: BaseException | None = exc
    while seen is not None:
        if classify(type(seen).__name__, str(seen)) in (Failure.TIMEOUT, Failure.PEER):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _rebuild_culprits(store: dist.Store, size: int) -> tuple[dict[int, str], list[int] | None]:
    """({rank whose own rebuild raised: its error}, ranks with no outcome: gone or stuck), read
    from the peers' outcomes, waiting up to `OUTCOME_GRACE_S` for those still out."""
    keys = [f"rebuilt/{r}" for r in range(size)]
    try:
        store.wait(keys, timedelta(seconds=OUTCOME_GRACE_S))
    except Exception:
        pass  # a rank without an outcome by now is one of the culprits
    try:
        outcomes = {r: json.loads(value) for r, value in present(store, keys).items()}
    except Exception:
        return {}, None
    raised = {r: o["error"] for r, o in outcomes.items() if o["error"] is not None and o["own"]}
    return raised, [r for r in range(size) if r not in outcomes]


def _said(ranks: list[int] | None) -> str:
    """Ranks as a message says them (`rank_list`); None: the store could not say which."""
    return rank_list(ranks) if ranks is not None else "(which, the job's store could not say)"


def _describe_culprits(raised: dict[int, str], missing: list[int] | None) -> str:
    parts = []
    if raised:
        by_error: dict[str, list[int]] = {}
        for r, error in sorted(raised.items()):
            by_error.setdefault(error, []).append(r)
        parts.append(
            f"ranks {rank_list(raised)} raised building theirs ("
            + "; ".join(f"{ranks_text(ranks)}: {error}" for error, ranks in by_error.items())
            + ")"
        )
    if missing:
        parts.append(f"ranks {rank_list(missing)} never finished theirs (gone, or stuck)")
    if missing is None:
        parts.append("the job's store could not be read to say which ranks did not")
    return "; ".join(parts) or "found no rank that raised or stopped: each waited for the others"


def _type(error: BaseException | None) -> str | None:
    if error is None:
        return None
    comm_error = find_comm_error(error)
    return type(comm_error if comm_error is not None else error).__name__


def _describe(error: BaseException | None) -> str:
    if error is None:
        return "requested"
    return f"{type(error).__name__}: {str(error)[:300]}"
