"""Who a failed collective waited for, read from the progress board, and how the error says it.

When a deadline expires, the rank that timed out reads every peer's board entry
(`commlib.record.board`): `explain_timeout` names who never started the collective and where
every other rank last was, `find_gone` which peers have exited or stopped beating, and
`ask_for_stacks` signals the named peers on this host to write their stacks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from commlib.members import Members
from commlib.record.board import HOST, STALE_AFTER_S, BoardEntry, process_gone, process_start_time, stale_after_s
from commlib.record.files import STACKS_SIGNAL

NAMED_ONE_BY_ONE = 8  # ranks a timeout's message names one by one; beyond, it says them in groups


@dataclass
class TimeoutExplanation:
    """What the board says about one expired deadline: the message, and whom it names."""

    message: str
    missing_ranks: list[int]
    stale_ranks: list[int]


def find_gone(
    entries: dict[int, BoardEntry | None], me: int, announcer: int | None, now_ns: int
) -> tuple[list[int], str, bool]:
    """Which peers of `me` are gone, as the board tells: (ranks, how that was found, whether
    some live on other hosts, where only a heartbeat can tell, in up to `STALE_AFTER_S`).

    A process on this host that has exited, or a heartbeat older than `STALE_AFTER_S`. Never
    a rank that broke the communicator itself after meeting the failure (`BoardEntry.broken`)
    or the one that announced it (`announcer`): those are alive, or exited after the fact.
    """
    suspects = {r: e for r, e in entries.items() if r not in (me, announcer) and e is not None and e.broken is None}
    exited = [r for r, e in suspects.items() if e.host == HOST and process_gone(e.pid, e.started)]
    if exited:
        return exited, "their process on this host has exited", False
    silent = [r for r, e in suspects.items() if (now_ns - e.heartbeat_ns) / 1e9 > STALE_AFTER_S]
    if silent:
        return silent, f"no heartbeat for over {STALE_AFTER_S:g} s", False
    return [], "every peer's process is alive and beating", any(e.host != HOST for e in suspects.values())


def ask_for_stacks(entries: dict[int, BoardEntry | None], ranks: list[int]) -> list[int]:
    """STACKS_SIGNAL (SIGUSR2) to those of `ranks` that run on this host and dump on it; returns whom it reached.

    Their stacks land in the log dir (`commlib.record.flight`), written even by a rank
    wedged in C code with the GIL held; the doctor shows them. Ranks on other hosts cannot
    be signalled from here: an operator sends them SIGUSR2 (the doctor prints their pids).
    """
    reached = []
    for r in ranks:
        e = entries.get(r)
        if e is None or not e.dumps_stacks or e.host != HOST or e.pid in (0, os.getpid()):
            continue
        # A dead rank's pid may have been given to another process since: signal only the
        # process that published the entry (where /proc tells start times apart).
        if e.started and process_start_time(e.pid) != e.started:
            continue
        try:
            os.kill(e.pid, STACKS_SIGNAL)
        except OSError:  # gone meanwhile
            continue
        reached.append(r)
    return reached


def explain_timeout(
    op: str,
    seq: int,
    members: Members,
    rank: int,
    elapsed: float,
    deadline_s: float,
    entries: dict[int, BoardEntry | None],
    now_ns: int,
) -> TimeoutExplanation:
    """Say who kept collective `seq` from completing, and where each other rank last was.

    Missing is a rank that has not started it (issued it, on a stream-ordered engine) and
    is not held up inside an earlier collective of this communicator by other ranks: a rank
    waiting in collective k for ranks that have not started k is named as waiting, and those
    ranks are the missing ones; it is missing itself only where every other rank has left k
    (it is stuck in k on its own). So a gather's root, waiting for a late rank, is not blamed
    by a peer that finished the gather and timed out in the next op: the late rank is. Board
    entries lag by up to `publish_interval_s` (50 ms up to 1,000 ranks), so a rank's last op
    is "last reported". A rank whose heartbeat is older than `stale_after_s(deadline_s)` is
    stopped or dead. Ranks are the communicator's own in what is returned, and named as
    `members` says in the message: one by one up to `NAMED_ONE_BY_ONE` of them, else in groups
    named for the same reason, as ranges (a thousand ranks behind in a line, not a thousand notes).
    """
    missing: list[int] = []
    stale: list[int] = []
    reasons: dict[int, _Reason] = {}  # every rank the message says something of
    ages: dict[int, float] = {}
    peers = _PeersByCollective(entries, rank)
    stale_s = stale_after_s(deadline_s)
    for r, e in sorted(entries.items()):
        if r == rank:
            continue
        if e is None:
            missing.append(r)
            stale.append(r)
            reasons[r] = _Reason("never_published")
            continue
        ages[r] = (now_ns - e.heartbeat_ns) / 1e9
        if ages[r] > stale_s:
            stale.append(r)
        if e.started_seq >= seq:
            if ages[r] > stale_s:
                reasons[r] = _Reason("started_stale")
            continue
        reasons[r] = reason = _reason_not_started(seq, e, peers)
        if reason.missing:
            missing.append(r)
    # One by one up to NAMED_ONE_BY_ONE ranks; beyond, the ranks named for the same reason together.
    groups: dict[Any, list[int]] = {}
    for r, reason in reasons.items():
        groups.setdefault(reason if len(reasons) > NAMED_ONE_BY_ONE else r, []).append(r)
    timed_out = _TimedOut(op, seq, members, entries, peers, stale_s)
    notes = [_note(timed_out, reasons[ranks[0]], ranks, ages, set(stale)) for ranks in groups.values()] or [
        "every rank started it; the backend did not complete it"
    ]
    message = f"{op} #{seq} on {members.comm!r} timed out after {elapsed:.1f} s on {members.name(rank)}: " + "; ".join(
        notes
    )
    return TimeoutExplanation(message, missing, stale)


@dataclass(frozen=True)
class _Reason:
    """Why a rank is named in a timeout's message (`explain_timeout`). `kind`: never_published;
    started_stale (it started the op, then stopped beating); not_started; waiting (in an earlier
    collective k, for ranks that have not started k); with_others (in k, with others that have
    not left it either); alone (in k, which every other rank has left)."""

    kind: str
    k: int = -1
    k_op: str | None = None
    missing: bool = False


class _PeersByCollective:
    """Which peers have not started, and which have not left, each earlier collective k, as the
    board says, worked out once per k: a thousand ranks held in the same k cost one pass over the
    board, not one each."""

    def __init__(self, entries: dict[int, BoardEntry | None], me: int) -> None:
        self.entries, self.me = entries, me
        self._not_started: dict[int, list[int]] = {}
        self._not_left: dict[int, list[int]] = {}

    def not_started(self, k: int) -> list[int]:
        """The ranks (but the one that timed out) that have not started k."""
        if k not in self._not_started:
            self._not_started[k] = [
                q for q, e in sorted(self.entries.items()) if q != self.me and (e is None or e.started_seq < k)
            ]
        return self._not_started[k]

    def not_left(self, k: int) -> list[int]:
        """The ranks that have not left k (but the one that timed out: it left every earlier collective)."""
        if k not in self._not_left:
            self._not_left[k] = [
                q for q, e in sorted(self.entries.items()) if q != self.me and e is not None and e.finished_seq < k
            ]
        return self._not_left[k]


def _reason_not_started(seq: int, e: BoardEntry, peers: _PeersByCollective) -> _Reason:
    """Why a rank (entry `e`) that has not started collective `seq` is named."""
    if not e.inside():
        return _Reason("not_started", missing=True)
    k, k_op = e.started_seq, e.started_op
    if peers.not_started(k):
        return _Reason("waiting", k, k_op)
    if len(peers.not_left(k)) > 1:  # the rank itself is one of them
        return _Reason("with_others", k, k_op)
    return _Reason("alone", k, k_op, missing=True)


@dataclass
class _TimedOut:
    """The collective whose deadline expired, as `_note` words what each rank was doing then."""

    op: str
    seq: int
    members: Members
    entries: dict[int, BoardEntry | None]
    peers: _PeersByCollective
    stale_s: float


def _note(at: _TimedOut, reason: _Reason, ranks: list[int], ages: dict[int, float], stale: set[int]) -> str:
    """What the message says of `ranks`, named for `reason`: of one rank with its own figures, of
    several as ranges with the first one's whereabouts as the example."""
    many = len(ranks) > 1
    who = at.members.names(ranks) if many else at.members.name(ranks[0])
    if reason.kind == "never_published":
        return f"{who} never published progress (possibly dead)"
    if reason.kind == "started_stale":
        silence = f"for over {at.stale_s:g} s" if many else f"for {ages[ranks[0]]:.1f} s"
        return f"{who} started it but {'' if many else 'has '}sent no heartbeat {silence}: possibly dead or stopped"
    it_is, has = ("they are", "have") if many else ("it is", "has")
    if reason.kind == "not_started":
        note = f"{who} never started it"
    else:
        still = f"{who} {has} not started it: {it_is} still in {reason.k_op} #{reason.k}"
        if reason.kind == "waiting":
            waited = at.members.names(at.peers.not_started(reason.k))
            note = f"{still}, waiting for {waited}, which have not started that"
        elif reason.kind == "with_others":
            others = [q for q in at.peers.not_left(reason.k) if q not in ranks]
            note = f"{still}, with {at.members.names(others)}" if others else f"{still}, together"
        else:
            note = f"{still}, which every other rank has left"
    first = ranks[0]
    last = _last_reported(at.entries[first])
    note += f" ({at.members.name(first)}, for one: {last})" if many else f" ({last})"
    silent = [r for r in ranks if r in stale]
    if silent and many:
        note += f"; of them, {at.members.names(silent)} sent no heartbeat for over {at.stale_s:g} s"
    elif silent:
        note += f"; no heartbeat for {ages[first]:.1f} s"
    return note + (": possibly dead or stopped" if silent else "")


def _last_reported(e: BoardEntry | None) -> str:
    """The last collective a rank reported finishing, and its step and phase."""
    assert e is not None
    if e.finished_seq >= 0:
        last = f"last reported finishing {e.finished_op} #{e.finished_seq}"
    else:
        last = "no collective finished yet"
    if e.step is not None or e.phase is not None:
        last += f", at step {e.step}, phase {e.phase}"
    return last
