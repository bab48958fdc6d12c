"""commlib as torchft's process group: the group between replica groups, rebuilt at each quorum.

torchft owns replica-level fault tolerance: its Lighthouse decides which replica groups take
part in each step (a quorum), its Manager commits or discards each step and heals a replica
that joins from a live peer's state. At every quorum change the Manager reconfigures the one
process group that spans the replicas. `replica_group(timeout_s)` makes that group: torchft's
`ProcessGroupWrapper`, whose inner group, at each reconfiguration, is a commlib process group
(`commlib.process_group.group_over_store`) over the store torchft hands it, with `timeout_s`
as every collective's deadline. Nothing of quorum, lighthouse or healing is done here.

What torchft's Manager reads of it, through the interfaces it already has:

- a failed collective: the Work's `wait()` raises commlib's typed error (`PeerFailure`
  naming the dead peer within milliseconds of its connection breaking, `CollectiveTimeout`
  naming who never arrived), which the Manager catches and keeps (`Manager.errored()`), so
  the step is not committed;
- `errored()`: the first typed error a collective of the current quorum raised (a failure
  hook on its communicator), which `Manager.should_commit` reads.

What the logs say (the rank's commlib log): ``replicas.quorum`` at each reconfiguration (the
quorum id, this rank, the members as global ranks and replica groups, the communicator's name
``replicas.q{id}``, or ``replicas.q{id}.shard{k}`` where each replica group has more than one
rank (`Quorum.comm_name`), which every collective of that quorum carries as its ``comm``), and
``replicas.failure`` when a collective fails, naming the failed peers' replica groups.

A member's global rank is read from torchft's reconfigure handles: the Manager puts each
rank's there, ``replica index x ranks per group + group rank`` when its replica id ends in the
index (``replica_id="replica3"``). The quorum's communicator is given them, so its errors and
logs name ranks of the whole job (the communicator's own beside them), and a failed rank's
replica group is its global rank // ranks per group; without them, members are unnamed.

torchft is imported when a group is made, never when this module is: without it,
`replica_group` raises `TorchftMissing` saying how to install it.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from commlib.errors import CollectiveTimeout, CommError, PeerFailure
from commlib.members import quorum_comm
from commlib.record import log as _log
from commlib.settings import number

INSTALL_HINT = "install it with the project's extra: pip install -e '.[replicas]' (torchft-nightly==2026.10.26)"
BACKEND_NAME = "torchft-commlib"
MAX_TIMEOUT_S = 86400.0


class TorchftMissing(ImportError):
    """torchft cannot be imported, and a replica group was asked for."""


@dataclass(frozen=True)
class Quorum:
    """One reconfiguration of the group: who is in it, and where this rank stands."""

    quorum_id: int
    rank: int  # this rank's place in the quorum's communicator
    size: int
    global_ranks: tuple[int, ...] | None  # of each member, by communicator rank; None where torchft had none
    group_size: int  # ranks per replica group

    @property
    def comm_name(self) -> str:
        """`commlib.members.quorum_comm`: with the members' common rank within their
        replica group where a group has more than one rank (every member of a quorum communicator
        is rank k of its group, for one k; the members' global ranks say which)."""
        if self.global_ranks is None or self.group_size == 1:
            return quorum_comm(self.quorum_id)
        return quorum_comm(self.quorum_id, self.global_ranks[0] % self.group_size)

    @property
    def replicas(self) -> tuple[int, ...] | None:
        """Each member's replica group, by communicator rank."""
        if self.global_ranks is None:
            return None
        return tuple(g // self.group_size for g in self.global_ranks)

    def replicas_of(self, ranks: list[int] | None) -> list[int] | None:
        """The replica groups of global `ranks`, as commlib's errors name them (None where unknown)."""
        if ranks is None or self.global_ranks is None:
            return None
        return sorted({g // self.group_size for g in ranks})

    def fields(self) -> dict[str, Any]:
        return {**asdict(self), "replicas": self.replicas, "comm_name": self.comm_name}


def failed_ranks(error: CommError) -> list[int] | None:
    """The global ranks a typed error blames: the failed peers, or those that never arrived."""
    if isinstance(error, PeerFailure):
        return error.failed_ranks
    if isinstance(error, CollectiveTimeout):
        return sorted(set(error.missing_ranks or []) | set(error.stale_ranks or [])) or None
    return None


def replica_group(timeout_s: float, options: Any = None) -> Any:
    """A torchft process group (pass it to `torchft.Manager(pg=...)`) whose every quorum is a
    commlib group with deadline `timeout_s`; `options`: `commlib.EngineOptions` of its engines."""
    timeout_s = number(timeout_s, "replica_group timeout_s", above=0, high=MAX_TIMEOUT_S, unit="seconds")
    return _group_class()(timeout_s, options)


@functools.cache
def _group_class() -> type:
    try:
        from torchft.process_group import ProcessGroupWrapper
    except ImportError as exc:
        raise TorchftMissing(
            f"commlib.replicas: expected torchft to be importable; found {exc}. {INSTALL_HINT}"
        ) from exc
    from commlib.process_group import group_over_store

    class ReplicaGroup(ProcessGroupWrapper):
        """torchft's reconfigurable group, a commlib group inside (module docstring)."""

        _pg: Any  # ProcessGroupWrapper's wrapped group (torchft has no types); None once aborted

        def __init__(self, timeout_s: float, options: Any) -> None:
            super().__init__(timeout=timedelta(seconds=timeout_s))
            self._options = options
            self.quorum: Quorum | None = None
            self._error: CommError | None = None

        def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
            global_ranks = getattr(self, "_global_ranks", None)
            quorum = Quorum(
                int(getattr(self, "_uuid", None) or 0),
                rank,
                world_size,
                tuple(global_ranks) if global_ranks else None,
                getattr(self, "_group_world_size", None) or 1,
            )
            _log.get_logger().info("replicas.quorum", **quorum.fields())
            group = group_over_store(
                store,
                rank,
                world_size,
                self._timeout.total_seconds(),
                quorum.comm_name,
                self._options,
                quorum.global_ranks,
            )
            group.communicator().hooks.register_failure_hook(functools.partial(self._failed, quorum))
            self.quorum, self._error = quorum, None
            return group

        def _failed(self, quorum: Quorum, call: Any, error: CommError) -> None:
            if quorum is not self.quorum:
                return  # an earlier quorum's communicator, aborted by a reconfiguration
            if self._error is None:
                self._error = error
            ranks = failed_ranks(error)
            _log.get_logger().warning(
                "replicas.failure",
                quorum_id=quorum.quorum_id,
                comm=quorum.comm_name,
                error_type=type(error).__name__,
                op=call.op,
                seq=call.seq,
                failed_ranks=ranks,
                failed_replicas=quorum.replicas_of(ranks),
                replicas=quorum.replicas,
            )

        def errored(self) -> Exception | None:
            return self._error

        def abort(self, errored: bool = True) -> None:
            group = self._pg
            if group is not None:
                why = "torchft aborted the quorum" if errored else "torchft reconfigures"
                _log.get_logger().info(
                    "replicas.abort", quorum_id=self.quorum.quorum_id if self.quorum else None, errored=errored
                )
                group.abort_quietly(why)  # the quorum's store may be gone with its host
            self._pg = None

        def shutdown(self) -> None:
            group = self._pg
            if group is not None:
                group.shutdown()
            self._pg = None

        def set_timeout(self, timeout: timedelta) -> None:
            super().set_timeout(timeout)
            if self._pg is not None:
                self._pg.set_timeout(timeout)

        def getBackendName(self) -> str:  # noqa: N802 - torch's name
            return BACKEND_NAME

    return ReplicaGroup
