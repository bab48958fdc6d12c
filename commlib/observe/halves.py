"""The full read on two cores: the pass split in two halves by sequence number, and merged.

A collective's seq (a send/recv's, its pair's count) decides which half folds it: this
process the even ones, a forked child the odd ones (`Fold.parity`). Each half reads every
line of every rank; it folds the collectives of its parity (their starts, ends, failures and
mismatches) and every other event (headers, communicators, notices, recoveries), which both
need. A collective's calls are all in one half, so each half settles its own exactly as one
pass would. What is left to merge is small and has one rule each (`merge`):

- counts add up (collectives, send/recv ops, waits), sketches merge, sets join;
- the calls still open, their failures and mismatches come from the half that owns them;
- where a rank was (its last event, its last one with a step or phase, its last started and
  last finished call, its first failure) is the later (or first) of the two halves' answers,
  at the end and in each snapshot taken when a deadline expired (both halves take every one);
- the jobs, their ranks and processes, and which ranks each pid was, join (a process whose
  every event but its header is a collective of the other half's is seen by that half only);
- everything else (ranks' hosts, communicators' members, errors) both halves read alike from
  the same events: this process's is kept.

The child sends its fold back pickled through a pipe; a child that fails or dies leaves the
read to one process again, from the start; a parent that dies takes the child with it. The
model is the one pass's, but for sums of durations added in another order (their last bits)
and for ties between two events of one rank at the same nanosecond. Each half still decodes
every line (telling the other half's apart from their bytes costs more than decoding them:
`scripts/bench_doctor.py decode`), so two cores give a little under twice the speed; on small
logs (`worth_halves`) the fork, the pickle and the merge cost more than they save.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import signal
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from commlib.observe.fold import Fold
from commlib.observe.reading import read
from commlib.observe.records import AttemptLog, Call, CommLog, FileReport, JobInfo, Place, RankLog, SeqSet

V = TypeVar("V")
HALVES_FROM_BYTES = 64 << 20  # logs smaller than this are read in one process
_PR_SET_PDEATHSIG = 1


def worth_halves(segments: dict[int, list[Path]]) -> bool:
    """Whether logs this large are read faster on two processes: this machine has two cores,
    and this process no other thread (a fork copies only the calling one: a lock another holds
    would stay held in the child)."""
    if (os.cpu_count() or 1) < 2 or not hasattr(os, "fork") or threading.active_count() > 1:
        return False
    total = 0
    for paths in segments.values():
        for path in paths:
            try:
                total += path.stat().st_size
            except OSError:
                continue
            if total >= HALVES_FROM_BYTES:
                return True
    return False


def read_in_halves(directory: Path, segments: dict[int, list[Path]], job: str | None) -> tuple[Fold, list[FileReport]]:
    """`reading.read` on two processes (module docstring): the merged fold, and what was read of each file."""
    rfd, wfd = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: the odd half, sent back whole
        os.close(rfd)
        code = 1
        try:
            _die_with(parent)
            fold, files = read(directory, segments, job, [], parity=1)
            counts = [(f.events, f.garbled, f.headers) for f in files]
            payload = pickle.dumps((fold, counts), protocol=pickle.HIGHEST_PROTOCOL)
            with os.fdopen(wfd, "wb") as out:
                out.write(payload)
            code = 0
        finally:
            os._exit(code)  # never the parent's exit handlers, nor its buffers flushed twice
    os.close(wfd)
    other: tuple[Fold, list[tuple[int, int, int]]] | None = None
    status = 0
    try:
        fold, files = read(directory, segments, job, [], parity=0)
        with os.fdopen(rfd, "rb") as inp:
            rfd = -1
            data = inp.read()
        _, status = os.waitpid(pid, 0)
        pid = 0
        if status == 0 and data:
            other = pickle.loads(data)
    finally:
        if rfd >= 0:
            os.close(rfd)
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    if other is None:  # the child failed: the whole read in this process, said (a bug shows as a slower doctor)
        warnings.warn(
            f"the second half of the read on two processes failed ({_ended(status)}); read again in one process",
            RuntimeWarning,
            stacklevel=2,
        )
        return read(directory, segments, job, [])
    merge(fold, other[0])
    for report, (events, garbled, headers) in zip(files, other[1], strict=True):
        report.events += events  # the first half counts every line; the second, what only it folds
        report.garbled += garbled
        report.headers += headers
    return fold, files


def _ended(status: int) -> str:
    """How a child ended, from its `waitpid` status."""
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit status {os.WEXITSTATUS(status)}" if os.WEXITSTATUS(status) else "nothing sent back"


def _die_with(parent: int) -> None:
    """This child killed when `parent` dies (Linux's `PR_SET_PDEATHSIG`), not left reading for
    nobody; elsewhere it notices at its end, when the pipe has no reader."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:  # it died before the line above: no signal will come
        os._exit(1)


def merge(fold: Fold, other: Fold) -> None:
    """Fold the odd half (`other`) into the even one (`fold`), which becomes the whole (module docstring)."""
    fold.parity = None
    _merge_each(
        fold.attempts,
        other.attempts,
        lambda mine, theirs: _merge_attempt(mine, theirs, fold.snapshot_clocks, other.snapshot_clocks),
    )
    for key, labels in other._comms_of.items():
        fold._comms_of[key] |= labels
    for process, ranks in other.pids.items():
        fold.pids[process] |= ranks
    for job, info in other.jobs.items():  # a process whose events were all of one half's collectives
        own = fold.jobs.setdefault(job, JobInfo(job))
        own.ranks |= info.ranks
        own.attempts |= info.attempts
        own.processes |= info.processes
    for attempt, done in other._done.items():
        fold._done[attempt] |= done
    for att in fold.attempts.values():
        for comm in att.comms.values():
            if comm.seqs.step != 1:  # a communicator of one half only: its seqs, as a set of every seq
                comm.seqs = SeqSet.union(comm.seqs)


def _merge_attempt(
    mine: AttemptLog,
    theirs: AttemptLog,
    my_clocks: dict[tuple[int, int], dict[int, tuple[int, int | None]]],
    their_clocks: dict[tuple[int, int], dict[int, tuple[int, int | None]]],
) -> None:
    mine.collectives += theirs.collectives
    mine.p2p_ops += theirs.p2p_ops
    if theirs.world_size is not None:
        mine.world_size = max(mine.world_size or 0, theirs.world_size)
    _merge_each(mine.ranks, theirs.ranks, _merge_rank)
    _merge_each(mine.comms, theirs.comms, _merge_comm)
    for rank, waits in theirs.waits.items():
        own_waits = mine.waits[rank]
        own_waits.last_count += waits.last_count
        own_waits.lags.merge(waits.lags)
    for ts, places in mine.snapshots.items():
        other_places = theirs.snapshots.get(ts, {})
        clocks = my_clocks.get((mine.attempt, ts), {})
        other_clocks = their_clocks.get((mine.attempt, ts), {})
        for rank, place in other_places.items():
            if rank not in places:
                places[rank] = place
            else:
                places[rank] = _later_place(places[rank], clocks[rank], place, other_clocks[rank])


def _merge_each(mine: dict[Any, V], theirs: dict[Any, V], merge: Callable[[V, V], None]) -> None:
    """Each of `theirs` merged into `mine`'s of the same key, or added where `mine` has none."""
    for key, value in theirs.items():
        own = mine.get(key)
        if own is None:
            mine[key] = value
        else:
            merge(own, value)


def _merge_rank(mine: RankLog, theirs: RankLog) -> None:
    """Where a rank was: the later of the two halves' answers (this half's where they tie)."""
    if theirs.last_ns > mine.last_ns:
        mine.last = theirs.last
    if _clock(theirs.stepped) > _clock(mine.stepped):
        mine.stepped = theirs.stepped
    mine.last_started = _later(mine.last_started, theirs.last_started, "start_ns")
    mine.last_finished = _later(mine.last_finished, theirs.last_finished, "end_ns")
    if theirs.first_failure_ns is not None and (
        mine.first_failure_ns is None or theirs.first_failure_ns < mine.first_failure_ns
    ):
        mine.first_failure_ns = theirs.first_failure_ns
    mine.first_ns = min(mine.first_ns, theirs.first_ns)


def _later_place(
    mine: Place, my_clocks: tuple[int, int | None], theirs: Place, their_clocks: tuple[int, int | None]
) -> Place:
    """A rank's place in one snapshot, from the two halves' (`RankLog.place`, with the clocks of
    the events its first four fields were read from)."""
    event, ts, step, phase, started, finished = mine
    if their_clocks[0] > my_clocks[0]:
        event, ts = theirs[0], theirs[1]
    if (their_clocks[1] or -1) > (my_clocks[1] or -1):
        step, phase = theirs[2], theirs[3]
    return (
        event,
        ts,
        step,
        phase,
        _later(started, theirs[4], "start_ns"),
        _later(finished, theirs[5], "end_ns"),
    )


def _later(mine: Call | None, theirs: Call | None, clock: str) -> Call | None:
    """The call with the later `clock` (`RankLog.last_started`'s rule: the first of equals, here this half's)."""
    if theirs is None:
        return mine
    if mine is None or (getattr(mine, clock) or 0) < (getattr(theirs, clock) or 0):
        return theirs
    return mine


def _clock(event: Any) -> int:
    ts = event.get("ts_ns")
    return ts if isinstance(ts, int) else -1


def _merge_comm(mine: CommLog, theirs: CommLog) -> None:
    """One communicator's two halves: each collective (and send/recv) is in exactly one of them."""
    if theirs.calls:
        mine.calls = dict(sorted({**mine.calls, **theirs.calls}.items()))  # one pass opens them in seq order
    mine.ok.update(theirs.ok)
    mine.p2p_calls.update(theirs.p2p_calls)
    mine.failures += theirs.failures  # the doctor orders them by their clocks
    for seq, events in theirs.mismatches.items():
        mine.mismatches[seq].update(events)
    for key, seq in theirs.logged.items():
        if seq > mine.logged.get(key, 0):
            mine.logged[key] = seq
    mine.seqs = SeqSet.union(mine.seqs, theirs.seqs)
    for key in [*theirs.latency, *theirs.sketches]:
        if key not in mine.latency:
            mine.latency[key] = []
    for key, durations in theirs.latency.items():
        mine.latency[key] += durations
    for key, sketch in theirs.sketches.items():
        own = mine.sketches.get(key)
        if own is None:
            mine.sketches[key] = sketch
        else:
            own.merge(sketch)
    mine.waited += theirs.waited
    mine.differing_count += theirs.differing_count
    if theirs.differing is not None and (mine.differing is None or theirs.differing[0] < mine.differing[0]):
        mine.differing = theirs.differing
    for comm_rank, rank in theirs.members.items():
        mine.members.setdefault(comm_rank, rank)
    mine.member_cache = None
