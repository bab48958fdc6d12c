"""Where a rank was: at the end of its log in an attempt, or when a deadline expired.

`position(att, rank, at_ns)` reads it from the log model (`commlib.observe.records`): the
builder keeps, per rank, its last event, step and phase and its last started and finished
calls, and, at the moment each deadline expired, the same of every rank then. `where` and
`where_text` say it of several ranks, as the doctor's findings carry and print it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from dataclasses import asdict, dataclass
from typing import Any

from commlib.members import ranks_text
from commlib.observe.records import AttemptLog, Call, p2p_name


@dataclass
class CallRef:
    comm: str
    op: str
    seq: int  # a send/recv's: the count of its pair's point-to-point ops of its tag
    status: str  # at the time the position is taken: ok, started (in progress), timed_out, failed
    start_ns: int | None
    peer: int | None = None  # a send/recv's other side (global rank)
    tag: int = 0  # a send/recv's tag

    def identity(self) -> tuple[str, int, int | None, int]:
        """What tells it from its rank's other calls of its op: communicator, seq, peer, tag."""
        return (self.comm, self.seq, self.peer, self.tag)

    def describe(self) -> str:
        if self.peer is None:
            return f"{self.op} #{self.seq} on {self.comm!r}"
        return f"{p2p_name(self.op, self.seq, self.peer, self.tag)} on {self.comm!r}"


@dataclass
class RankPosition:
    """Where a rank was at a moment (a deadline, or the end of its log)."""

    rank: int
    host: str | None
    pid: int | None
    last_event: str | None
    last_event_ns: int | None
    step: Any
    phase: Any
    last_started: CallRef | None
    last_finished: CallRef | None
    log_ends_ns: int | None  # when this rank's log for the attempt ends
    stack: list[str] | None = None  # call site of last_started, when a dump recorded it
    cut: bool = False  # its log ends in a line cut short (killed while writing it, or still writing)

    def describe(self) -> str:
        parts = []
        s = self.last_started
        if s is not None:
            state = {"started": "still in it", "ok": "finished"}.get(s.status, s.status)
            parts.append(f"last started {s.describe()} ({state})")
        f = self.last_finished
        if f is not None and (s is None or f.identity() != s.identity()):
            parts.append(f"last finished {f.describe()}")
        if s is None and f is None:
            parts.append("no collective yet")
        if self.step is not None or self.phase is not None:
            parts.append(f"step {self.step}, phase {self.phase}")
        if self.last_event:
            parts.append(f"last event {self.last_event}")
        if self.stack:
            parts.append(f"called from {self.stack[-1].strip().splitlines()[0]}")
        if self.cut:
            parts.append("then a line cut short (killed while writing it)")
        return "; ".join(parts)


def position(att: AttemptLog, rank: int, at_ns: int | None = None, aborters: Collection[int] = ()) -> RankPosition:
    """Where `rank` was at `at_ns`: the end of its log in this attempt (None), or a moment a
    deadline expired (the model keeps where every rank was at each); `aborters`: the ranks whose
    deadline it was (a call their abort ended was still open then: `Call.open_at`)."""
    rl = att.ranks.get(rank)
    if rl is None:
        return RankPosition(rank, None, None, None, None, None, None, None, None, None)
    if at_ns is None:
        place, t = rl.place(), rl.last_ns
    else:
        snapshot = att.snapshots.get(at_ns)
        if snapshot is None:
            raise KeyError(f"no position of the ranks kept at {at_ns} (only where a deadline expired)")
        place, t = snapshot.get(rank, (None, None, None, None, None, None)), at_ns
    last_event, last_event_ns, step, phase, last_started, last_finished = place

    def ref(c: Call | None) -> CallRef | None:
        if c is None:
            return None
        status = "started" if c.open_at(t, aborters) else c.status  # "started": still in it at t
        comm = att.comms.get(c.comm)
        peer = None if c.peer is None else comm.global_rank(c.peer) if comm is not None else c.peer
        return CallRef(c.comm, c.op, c.seq, status, c.start_ns, peer, c.tag)

    return RankPosition(
        rank=rank,
        host=rl.host,
        pid=rl.pid,
        last_event=last_event,
        last_event_ns=last_event_ns,
        step=step,
        phase=phase,
        last_started=ref(last_started),
        last_finished=ref(last_finished),
        log_ends_ns=rl.last_ns,
        stack=last_started.stack if last_started and last_started.stack else rl.signal_stack,
        cut=rl.cut and at_ns is None,
    )


def where(att: AttemptLog, ranks: list[int], at_ns: int | None, aborters: Collection[int] = ()) -> dict[str, Any]:
    """Each rank's position, as a finding's details hold it (by rank, as text)."""
    return {str(r): asdict(position(att, r, at_ns, aborters)) for r in ranks}


def where_text(att: AttemptLog, ranks: list[int], at_ns: int | None, aborters: Collection[int] = ()) -> str:
    """Where `ranks` were, ranks in the same place said once: "ranks 0-5, 7: last started ..."."""
    places: dict[str, list[int]] = defaultdict(list)
    for r in ranks:
        places[position(att, r, at_ns, aborters).describe()].append(r)
    return "; ".join(f"{ranks_text(rs)}: {text}" for text, rs in places.items())
