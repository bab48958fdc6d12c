"""Who failed, and how it is said: the typed error for each way a communicator's op can fail.

`FailureReports` (one per `Communicator`) reads what the ranks published (the progress board,
and the abort announcements in the communicator's store) and words the error: a deadline that
passed is a `CollectiveTimeout` naming the ranks that never arrived, a peer's death or abort a
`PeerFailure` naming it. It words; it never records, breaks or raises: the communicator does.

Announcements: a rank that breaks or aborts its communicator says so in the communicator's store
(`ABORT_KEY`: its rank and why; the first one stays). A peer waiting in a collective of the same
communicator reads it between slices of its wait and fails with a `PeerFailure` naming the rank,
instead of waiting out its deadline for a rank that will never come. A peer whose deadline
passed in the same collective, which this rank had started by then, is no culprit: this rank
fails with the same `CollectiveTimeout` naming the ranks that never arrived. The announcement of
a rank that only met a peer's failure names what it found, never itself.

Ranks: the board and the announcements hold the communicator's own ranks; every error names
global ranks (`commlib.members`). The store: every call goes through the communicator's
`StoreThread` and is waited for at most `STORE_ANSWER_S` (`commlib.store_thread`): a store that
stopped answering must not hold a deadline, nor the error that reports it.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch.distributed as dist

from commlib import store_thread
from commlib.backends.base import Backend
from commlib.errors import CollectiveTimeout, CommAborted, CommError, PeerFailure, WaitTimeout
from commlib.failures import Failure
from commlib.members import Members
from commlib.missing_ranks import ask_for_stacks, explain_timeout, find_gone
from commlib.ops import Collective, OpName
from commlib.record.board import HEARTBEAT_S, STALE_AFTER_S, BoardEntry, ProgressBoard, stale_after_s
from commlib.record.flight import FlightEntry
from commlib.store_thread import StoreThread

ABORT_KEY = "commlib/aborted"  # in a communicator's store: the first rank that broke or aborted it
GONE_GRACE_S = 1.0  # how long a broken connection's rank may take to show as exited (`FailureReports._find_gone_peers`)
# How often `FailureReports._find_gone_peers` reads the board again: a heartbeat changes no faster, and every
# survivor of a peer's death looks at once. In between, it asks /proc every `GONE_POLL_S`.
BOARD_REREAD_S = HEARTBEAT_S / 2
GONE_POLL_S = 0.02


class FailureReports:
    """The typed errors of one communicator's failures (module docstring)."""

    def __init__(self, members: Members, rank: int, board: ProgressBoard, log: Any, backend: Backend) -> None:
        self.members = members
        self.comm = members.comm
        self.rank = rank
        self.me = members.name(rank)
        self.board = board
        self._store_thread = StoreThread(board.side_client, members.comm)
        self._log = log
        self._backend = backend  # what a raw engine failure means is the backend's (`Backend.classify`)
        self._abort_read: Future[dict[str, Any] | None] | None = None  # the read under way (`abort_announced`)

    def where(self, call: Collective) -> dict[str, Any]:
        """An error's place: its rank is this process's global rank."""
        return {"op": call.op.value, "seq": call.seq, "comm": self.comm, "rank": self.members.global_ranks[self.rank]}

    # -- announcements -------------------------------------------------------------------
    def announce_abort(self, reason: str, error: BaseException | None = None, call: Collective | None = None) -> None:
        """Say in the store that this rank broke or aborted the communicator, and why.

        A collective's timeout adds its op, seq and the ranks that had not started it. A
        `PeerFailure` marks the announcement as made after a peer's failure, naming whom this
        rank found failed (if anyone): a reader must not take this rank for the culprit.
        """
        # In the communicator's own ranks, as its board: the error's fields are global ranks.
        own = self.members.own_of
        announcement: dict[str, Any] = {"rank": self.rank, "reason": reason}
        if (
            isinstance(error, CollectiveTimeout)
            and call is not None
            and call.peer is None
            and error.missing_ranks is not None
        ):
            announcement.update(timed_out_in=[error.op, error.seq], missing=own(error.missing_ranks))
        elif isinstance(error, PeerFailure):
            failed = error.failed_ranks
            announcement.update(after_peer_failure=True, failed=None if failed is None else own(failed))
        text = json.dumps(announcement)
        try:
            self._store_thread.call(lambda store: store.compare_set(ABORT_KEY, "", text))
        except Exception as exc:  # the store is gone too: peers fall back on their deadlines
            report_side_failure(self._log, "abort announcement", exc)

    def announce_broken(self, why: str) -> None:
        """Mark this rank's board entry broken by it (`BoardEntry.broken`: the error's type), so
        that its exit is not taken for a culprit's; then close the board."""
        try:
            self._store_thread.call(lambda _: self.board.publish_broken(why))  # the board's own client
        except Exception as exc:  # the store may be gone with the failure: nothing to tell it
            report_side_failure(self._log, "board's broken mark", exc)
        finally:
            self.board.close()

    def abort_announced(self, wait_s: float | None = None) -> dict[str, Any] | None:
        """The announcement of the peer that aborted this communicator, if one did. A read the
        store has not answered within `wait_s` (`STORE_ANSWER_S`) tells nothing yet (the deadline
        still holds): the next call takes its answer, or waits for it again."""
        wait_s = store_thread.STORE_ANSWER_S if wait_s is None else wait_s
        read = self._abort_read
        if read is None:
            read = self._abort_read = self._store_thread.submit(self._read_announcement)
        try:
            announced = read.result(timeout=wait_s)
        except FutureTimeout:
            return None
        self._abort_read = None
        return announced

    def _read_announcement(self, store: dist.Store) -> dict[str, Any] | None:
        try:
            if not store.check([ABORT_KEY]):
                return None
            announced = json.loads(store.get(ABORT_KEY))
        except Exception:  # an unreachable store tells nothing: the deadline still holds
            return None
        return announced if announced["rank"] != self.rank else None

    # -- verdicts ------------------------------------------------------------------------
    def engine_failure(self, call: Collective, entry: FlightEntry, exc: BaseException) -> CommError:
        """The error for an op whose engine raised `exc` (`Backend.classify` says what it means)."""
        kind = self._backend.classify(exc)
        if kind is Failure.TIMEOUT:
            return self.timeout(call, entry, exc)
        if kind is Failure.PEER:
            # A peer that aborted on purpose said why before it closed its connections: that,
            # not the broken connection, is what this rank's error has to say.
            announced = self.abort_announced()
            if announced is not None and not announced.get("after_peer_failure"):
                return self.peer_left(call, entry, announced, exc)
            return self.peer_gone(call, entry, exc, announced)
        head = f"{call.op} #{call.seq} on {self.comm!r} failed on {self.me}"
        if kind is Failure.ABORTED:
            error: CommError = CommAborted(
                f"{head}: expected a live communicator; the backend says it is not ({exc})", **self.where(call)
            )
        else:
            error = CommError(f"{head}: {type(exc).__name__}: {exc}", **self.where(call))
        error.__cause__ = exc
        return error

    def timeout(
        self,
        call: Collective,
        entry: FlightEntry,
        cause: BaseException | None,
        expired_first_on: int | None = None,
        stream_ordered: bool = False,
    ) -> CollectiveTimeout:
        """`expired_first_on`: the peer whose deadline for this same collective passed before
        this rank's, which ends this rank's wait early (`peer_left`). `stream_ordered`: the op
        was enqueued on a device and its engine aborted: what it and the ops behind it wrote
        is undefined."""
        elapsed = (time.monotonic_ns() - entry.start_mono_ns) / 1e9
        try:
            board = self._store_thread.call(self.board.read)
            if call.peer is not None:
                message, missing, stale = _explain_p2p_timeout(call, self.members, elapsed, board)
            else:
                diagnosis = explain_timeout(
                    call.op.value, call.seq, self.members, self.rank, elapsed, call.deadline_s, board, time.time_ns()
                )
                message, missing, stale = diagnosis.message, diagnosis.missing_ranks, diagnosis.stale_ranks
            # Where the ranks it waited for are stuck: their stacks, for the doctor.
            asked = ask_for_stacks(board, sorted(set(missing) | set(stale)))
            if asked:
                self._log.info("comm.asked_for_stacks", op=call.op.value, seq=call.seq, ranks=asked)
        except Exception as exc:  # the store itself may be gone with a dead rank 0
            message = (
                f"{call.op} #{call.seq} on {self.comm!r} timed out after {elapsed:.1f} s on {self.me}; "
                f"the progress board could not be read ({exc})"
            )
            missing, stale = None, None
        if stream_ordered:
            message += (
                " (its deadline counts from its issue. Its outputs, and those of the ops queued behind it "
                "on this communicator, are undefined: roll the step back)"
            )
        if expired_first_on is not None:
            message += (
                f" ({self.members.name(expired_first_on)}'s deadline for it expired first: this rank "
                f"stopped waiting before its own {call.deadline_s:g} s)"
            )
        error = CollectiveTimeout(
            message,
            elapsed=elapsed,
            deadline=call.deadline_s,
            missing_ranks=self._global(missing),
            stale_ranks=self._global(stale),
            **self.where(call),
        )
        if cause is not None:
            error.__cause__ = cause
        return error

    def peer_left(
        self, call: Collective, entry: FlightEntry, announced: dict[str, Any], cause: BaseException | None = None
    ) -> CommError:
        """The error for `call` once a peer's abort announcement was read.

        `cause`: the engine's own failure, when the peer's abort reached this rank as a
        broken connection rather than between two wait slices.
        """
        peer, reason = announced["rank"], announced["reason"]
        if announced.get("after_peer_failure"):
            # The peer only met a failure first: name what it found, or find out here.
            return self.peer_gone(call, entry, cause, announced)
        in_this_call = call.peer is None and announced.get("timed_out_in") == [call.op.value, call.seq]
        if in_this_call and self.rank not in announced["missing"]:
            # The peer's deadline expired first in this same collective, which this rank had
            # started by then: its wait is doomed by the same absent ranks. Blaming the peer,
            # which arrived too, would send the operator to the wrong rank; this is the same
            # timeout.
            return self.timeout(call, entry, cause, expired_first_on=peer)
        elapsed = (time.monotonic_ns() - entry.start_mono_ns) / 1e9
        who = self.members.name(peer)
        if in_this_call:  # this rank is one the peer gave up on: the late one, which the operator must hear
            found = (
                f"found {who} had stopped waiting for it at its deadline and aborted the communicator, "
                f"naming {self.members.names(announced['missing'])} (this one among them) as never having "
                f"started it: this rank arrived late"
            )
        else:
            found = f"found {who} had aborted the communicator ({reason})"
        error = PeerFailure(
            f"{call.op} #{call.seq} on {self.comm!r} failed on {self.me} after {elapsed:.1f} s: "
            f"expected every peer to complete it; {found}",
            failed_ranks=self._global([peer]),
            **self.where(call),
        )
        if cause is not None:
            error.__cause__ = cause
        return error

    def peer_gone(
        self, call: Collective, entry: FlightEntry, cause: BaseException | None, announced: dict[str, Any] | None
    ) -> PeerFailure:
        """A `PeerFailure` naming the peers that are gone, as far as anyone can tell (module docstring)."""
        elapsed = (time.monotonic_ns() - entry.start_mono_ns) / 1e9
        if announced is not None and announced.get("failed"):
            gone = list(announced["failed"])
            how = (
                f"as {self.members.name(announced['rank'])}, which met the failure first and aborted the "
                f"communicator, found"
            )
        else:
            gone, how = self._find_gone_peers(None if announced is None else announced["rank"])
            if announced is not None:
                how += f"; {self.members.name(announced['rank'])} met the failure first and aborted the communicator"
        found = f"found {self.members.names(gone)} gone ({how})" if gone else f"found a peer gone ({how})"
        if cause is not None:
            found += f"; the backend said: {first_line(cause)}"
        error = PeerFailure(
            f"{call.op} #{call.seq} on {self.comm!r} failed on {self.me} after {elapsed:.1f} s: "
            f"expected every peer alive; {found}",
            failed_ranks=self._global(gone) or None,
            **self.where(call),
        )
        if cause is not None:
            error.__cause__ = cause
        return error

    def wait_timeout(self, call: Collective, entry: FlightEntry, waited_s: float) -> WaitTimeout:
        """A caller's shorter wait passed: the op and the communicator stay as they are."""
        elapsed = (time.monotonic_ns() - entry.start_mono_ns) / 1e9
        return WaitTimeout(
            f"{call.op} #{call.seq} on {self.comm!r} {self.me}: expected it to complete within "
            f"the wait's {waited_s:g} s; found it still running after {elapsed:.1f} s of its "
            f"{call.deadline_s:g} s deadline (the op goes on; wait again)",
            waited=waited_s,
            deadline=call.deadline_s,
            **self.where(call),
        )

    def _global(self, ranks: list[int] | None) -> list[int] | None:
        return None if ranks is None else self.members.global_of(ranks)

    def _find_gone_peers(self, announcer: int | None) -> tuple[list[int], str]:
        """The peers that are gone (`commlib.missing_ranks.find_gone`) and how that was found; no ranks where
        nobody could tell. The board is read again for a while: a killed process closes its
        sockets before /proc shows it gone (`GONE_GRACE_S`), and another host's heartbeat
        takes up to `STALE_AFTER_S` to go stale. The board is read at most every `BOARD_REREAD_S`,
        /proc asked about the last one read every `GONE_POLL_S`."""
        start = time.monotonic()
        read_at = start - BOARD_REREAD_S  # so the board is read at once
        while True:
            if time.monotonic() - read_at >= BOARD_REREAD_S:
                read_at = time.monotonic()
                try:
                    board = self._store_thread.call(self.board.read)
                except Exception as exc:  # the store went with the dead rank's host
                    return [], f"which one could not be told: the progress board could not be read ({first_line(exc)})"
            gone, how, remote = find_gone(board, self.rank, announcer, time.time_ns())
            gone = self._not_broken_since(gone)
            if gone:
                return gone, how
            if time.monotonic() - start >= (STALE_AFTER_S + HEARTBEAT_S if remote else GONE_GRACE_S):
                return [], f"which one could not be told: {how}"
            time.sleep(GONE_POLL_S)

    def _not_broken_since(self, gone: list[int]) -> list[int]:
        """`gone` but the ranks the board, read again, says broke. A rank marks itself broken on
        the board before it exits: one that met the failure too, said so and exited between the
        board's read and /proc's answer would be named gone. Where the store does not answer
        this second read, what /proc answered stands."""
        if not gone:
            return gone
        try:
            again = self._store_thread.call(self.board.read)
        except Exception:  # the store went meanwhile (with the dead rank's host)
            return gone
        return [r for r in gone if (e := again.get(r)) is None or e.broken is None]


def _explain_p2p_timeout(
    call: Collective, members: Members, elapsed: float, board: dict[int, BoardEntry | None]
) -> tuple[str, list[int], list[int]]:
    """A send/recv waits on its one peer: name it, and say whether it is still beating."""
    peer = call.peer
    assert peer is not None
    direction = "to" if call.op is OpName.SEND else "from"
    entry = board.get(peer)
    age_s = None if entry is None else (time.time_ns() - entry.heartbeat_ns) / 1e9
    stale = [peer] if age_s is None or age_s > stale_after_s(call.deadline_s) else []
    if entry is None:
        where = "never published progress"
    elif entry.finished_seq < 0:
        where = "has finished no collective yet"
    else:
        where = f"last reported finishing collective {entry.finished_op} #{entry.finished_seq}"
    if entry is not None and (entry.step is not None or entry.phase is not None):
        where += f" at step {entry.step}, phase {entry.phase}"
    if stale and age_s is not None:
        where += f"; no heartbeat for {age_s:.1f} s: possibly dead or stopped"
    who = members.name(peer)
    message = (
        f"{call.op} #{call.seq} {direction} {who} on {members.comm!r} timed out after {elapsed:.1f} s on "
        f"{members.name(call.rank)}: expected {who} to post the matching "
        f"{'recv' if call.op is OpName.SEND else 'send'}; it did not complete it ({who} {where})"
    )
    return message, [peer], stale


def first_line(exc: BaseException) -> str:
    """An engine error's first line: c10d appends its whole C++ stack to the message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"


def report_side_failure(log: Any, what: str, exc: BaseException) -> None:
    """Log a failure beside the one being reported (a dump, a hook, an announcement), which
    must not replace it; where the log itself is what failed, say nothing."""
    try:
        log.error("comm.side_failure", what=what, error=f"{type(exc).__name__}: {exc}")
    except Exception:
        pass
