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


def find_comm_error(exc: BaseException) -> CommError | None:
    """The commlib error behind `exc`: itself, its cause or context, or one of the per-rank
    failures of an error that gathers them (DCP's `CheckpointException.failures`: rank ->
    (exception, traceback)). None when a commlib error is nowhere in it.

    torch's layers wrap what a collective raised (DCP re-raises every rank's failure as one
    CheckpointException); a trainer deciding how to exit must still see the typed error.
    """
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, CommError):
            return e
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for value in failures.values():
                inner = value[0] if isinstance(value, tuple) and value else value
                if isinstance(inner, BaseException):
                    todo.append(inner)
    return None


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


class WaitTimeout(CommError):
    """A caller's `Work.wait(timeout)` ended before the op did, with the op's deadline still ahead.

    Unlike `CollectiveTimeout`, nothing is broken: the op goes on, the communicator stays
    usable, and a later `wait()` picks the op up again (as a raw gloo wait does). Only the
    op's own deadline breaks the communicator. `waited` is the caller's timeout; `deadline`
    the op's, both in seconds.
    """

    def __init__(self, message: str, *, waited: float, deadline: float, **where: object) -> None:
        super().__init__(message, **where)  # type: ignore[arg-type]
        self.waited = waited
        self.deadline = deadline


class PeerFailure(CommError):
    """A peer of the collective died, closed its connection (process killed, crashed), or
    aborted the communicator. `failed_ranks` names the peers known to have failed: the one
    that announced its abort, or the ones found gone (their process exited, their heartbeat
    stopped, or the peer that noticed first named them); None when nobody could tell which.
    A peer that only noticed the failure first is never named.
    """

    def __init__(self, message: str, *, failed_ranks: list[int] | None = None, **where: object) -> None:
        super().__init__(message, **where)  # type: ignore[arg-type]
        self.failed_ranks = failed_ranks


class CollectiveMismatch(CommError):
    """Ranks issued different collectives (op, shapes, dtypes or root) at one sequence number."""

    def __init__(self, message: str, *, differing_ranks: list[int], **where: object) -> None:
        super().__init__(message, **where)  # type: ignore[arg-type]
        self.differing_ranks = differing_ranks


class CommAborted(CommError):
    """The communicator was aborted, finalized, or broken by an earlier failure."""
