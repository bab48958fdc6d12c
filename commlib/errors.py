"""commlib's typed errors.

Every failure a collective can meet is one of these, raised by `Communicator` (the only
place that raises them). Each carries structured fields so that callers, logs and the
doctor can act on the failure without parsing its message, and each message says what was
expected, what was found, which op and sequence number, and on which rank.
"""

from __future__ import annotations


class CommError(RuntimeError):
    """Base of every commlib error. Fields are None where they do not apply."""

    def __init__(
        self,
        message: str,
        *,
        op: str | None = None,
        seq: int | None = None,
        comm: str | None = None,
        rank: int | None = None,
    ) -> None:
        super().__init__(message)
        self.op = op
        self.seq = seq
        self.comm = comm
        self.rank = rank

    def fields(self) -> dict[str, object]:
        """The structured fields, for logs and reports."""
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only fields: rebuild from the message and the field dict, so errors cross
        # process boundaries (multiprocessing, commlib.testing) intact.
        return _rebuild, (type(self), str(self), self.fields())


def _rebuild(cls: type[CommError], message: str, fields: dict[str, object]) -> CommError:
    error = cls.__new__(cls)
    RuntimeError.__init__(error, message)
    error.__dict__.update(fields)
    return error


class CollectiveTimeout(CommError):
    """A collective did not complete within its deadline.

    `missing_ranks` lists the communicator ranks that never started the collective (read
    from the progress board); `stale_ranks` those whose heartbeat stopped (possibly dead
    or stopped). Either may be empty when the board could not tell.
    """

    def __init__(
        self,
        message: str,
        *,
        elapsed: float,
        deadline: float,
        missing_ranks: list[int] | None,
        stale_ranks: list[int] | None = None,
        **where: object,
    ) -> None:
        super().__init__(message, **where)  # type: ignore[arg-type]
        self.elapsed = elapsed
        self.deadline = deadline
        self.missing_ranks = missing_ranks
        self.stale_ranks = stale_ranks


class PeerFailure(CommError):
    """A peer of the collective died or closed its connection (process killed, crashed)."""


class CollectiveMismatch(CommError):
    """Ranks issued different collectives (op, shapes, dtypes or root) at one sequence number."""

    def __init__(self, message: str, *, differing_ranks: list[int], **where: object) -> None:
        super().__init__(message, **where)  # type: ignore[arg-type]
        self.differing_ranks = differing_ranks


class CommAborted(CommError):
    """The communicator was aborted, finalized, or broken by an earlier failure."""
