"""The log model's data: what the doctor, the trace and the timeline read of a run's logs, as plain types.

Per torchrun attempt (`AttemptLog`): its ranks (`RankLog`: where each log begins and ends,
and where the rank was), its communicators (`CommLog`: members, the collectives and
send/recv not settled yet, failures and mismatches, and what settled calls left in its
accumulators), and its error-level events (`ErrorGroup`); a rank's view of one collective
or send/recv (`Call`); what was read of each file (`FileReport`), each job (`JobInfo`),
and each flight-recorder dump (`DumpInfo`); and what a tool that
needs more than the verdicts sees of the pass (`Observer`). The builder
(`commlib.observe.builder`) fills them in; the reading (`commlib.observe.reading`) feeds it;
`commlib.observe.run_logs` composes the two. Nothing here reads a file.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from commlib.members import rank_ranges
from commlib.observe.sketch import Quantiles
from commlib.observe.typed import UNSET, CollectiveLine, Event

FAILURE_EVENTS = ("collective.timeout", "peer.failure", "collective.error")
MISMATCH_EVENT = "collective.mismatch"
# Handed to observers (the trace): failures, aborts, and anything at warning or above.
NOTICE_EVENTS = (*FAILURE_EVENTS, MISMATCH_EVENT, "comm.abort")
NOTICE_LEVELS = ("warning", "error", "critical")
ERROR_LEVELS = ("error", "critical")  # kept per attempt, by event name and error type (`ErrorGroup`)
P2P_OPS = ("send", "recv")
# Rooted list arguments exist only on the root: per-rank shapes legitimately differ.
ROOT_ONLY_SHAPES = ("gather", "scatter")


class LogDirError(ValueError):
    """The log directory cannot be read (missing, or holds no readable event)."""


class MixedJobsError(LogDirError):
    """The directory holds the logs of more than one job (`jobs`: job id -> what was seen of it)."""

    def __init__(self, message: str, jobs: dict[str | None, JobInfo]) -> None:
        super().__init__(message)
        self.jobs = jobs


class _Field:
    """A field of a `Call` read from one of its events when asked (`event`: the attribute that holds it)."""

    def __init__(self, event: str, key: str, doc: str | None = None) -> None:
        self.event, self.key, self.__doc__ = event, key, doc

    def __get__(self, call: Any, owner: type) -> Any:
        return self if call is None else getattr(call, self.event).get(self.key)


class Call:
    """One rank's view of one collective (or send/recv): its start, its end, and its state.

    What its start and end events say of the call (`shapes`, `dtype`, `step`, `wait_s`, ...) is
    read from those events when asked, not copied out of them: most calls are let go unread
    once settled, and copying every field up front cost a fifth of the doctor's pass. A call
    with no start event (made up from its failure, or found only in a flight dump) gets its
    fields with `Call.of`.
    """

    __slots__ = (
        "rank",
        "comm",
        "seq",
        "op",
        "start_ns",
        "peer",
        "status",
        "source",
        "end_ns",
        "duration_s",
        "stack",
        "_start",
        "_end",
    )

    def __init__(
        self,
        rank: int,
        comm: str,
        seq: int,
        op: str,
        start_ns: int | None,
        start: Event,
        peer: int | None = None,
        status: str = "started",
        source: str = "log",
    ) -> None:
        self.rank = rank
        self.comm = comm
        self.seq = seq  # a send/recv's: the count of its pair's point-to-point ops of its tag
        self.op = op
        self.start_ns = start_ns  # wall clock (`ts_ns`)
        self.peer = peer  # send/recv: the other side's communicator rank
        self.status = status  # started | ok | timed_out | failed
        self.source = source  # log | flight (found only in a flight-recorder dump)
        self._start = start  # the start event (or what stands for it)
        self._end: Event = _NO_EVENT  # the event that ended it: collective.end, or a failure
        self.end_ns: int | None = None
        self.duration_s: float | None = None
        self.stack: list[str] | None = None

    @classmethod
    def of(
        cls,
        rank: int,
        comm: str,
        seq: int,
        op: str,
        start_ns: int | None,
        *,
        peer: int | None = None,
        status: str = "started",
        source: str = "log",
        **fields: Any,
    ) -> Call:
        """A call from its fields (`bytes`, `shapes`, `dtype`, `root`, `deadline_s`, `step`, `phase`,
        `label`, `pid`, `start_mono_ns`, `async_op`, `tag`, `duration_s`, `end_ns`, `end_mono_ns`,
        `stack`)."""
        after = {k: fields.pop(k) for k in ("duration_s", "end_ns", "stack") if k in fields}
        if "start_mono_ns" in fields:
            fields["mono_ns"] = fields.pop("start_mono_ns")
        call = cls(rank, comm, seq, op, start_ns, fields, peer, status, source)
        if "end_mono_ns" in fields:
            call._end = {"mono_ns": fields.pop("end_mono_ns")}
        for k, v in after.items():
            setattr(call, k, v)
        return call

    def __repr__(self) -> str:
        return (
            f"Call(rank={self.rank}, comm={self.comm!r}, seq={self.seq}, op={self.op!r}, "
            f"status={self.status!r}, start_ns={self.start_ns}, end_ns={self.end_ns})"
        )

    @property
    def bytes(self) -> int | None:
        """What this rank contributes, as its collective.end says (else its start)."""
        end = self._end
        return end["bytes"] if end.get("event") == "collective.end" and "bytes" in end else self._start.get("bytes")

    shapes = _Field("_start", "shapes")
    dtype = _Field("_start", "dtype")
    deadline_s = _Field("_start", "deadline_s")
    step = _Field("_start", "step")
    phase = _Field("_start", "phase")
    label = _Field("_start", "label", "The caller's `commlib.context(label=...)`: the A/B bench's mode.")
    pid = _Field("_start", "pid")
    start_mono_ns = _Field("_start", "mono_ns", "The start on that host's monotonic clock (`mono_ns`).")
    end_mono_ns = _Field("_end", "mono_ns")
    wait_s = _Field("_end", "wait_s", "An async op: how long its wait() blocked the caller.")
    done_before_wait = _Field("_end", "done_before_wait", "An async op: it had finished before its wait began.")

    @property
    def start_logged(self) -> bool:
        """Its start was read from its `collective.start` (not made up from its end or failure)."""
        return self._start.get("event") == "collective.start"

    @property
    def tag(self) -> int:
        """A send/recv's tag (0: untagged; a collective's is 0)."""
        return tag_of(self._start)

    @property
    def root(self) -> int | None:
        return None if self.peer is not None else self._start.get("root")

    @property
    def async_op(self) -> bool:
        return bool(self._start.get("async_op"))

    def open_at(self, t: int, aborters: Collection[int] = ()) -> bool:
        """Whether it was still in progress at `t`: not ended by then, or ended by the abort of
        one of `aborters` (a `peer.failure` naming them), the ranks whose deadline expired at `t`.
        Their abort came after their deadline, so such a call was open then, whatever the two
        hosts' clocks say of when it ended."""
        if self.end_ns is None or self.end_ns > t:
            return True
        failed = self._end.get("failed_ranks") if self.status == "failed" else None
        return isinstance(failed, list) and any(r in failed for r in aborters)

    def signature(self) -> tuple[Any, ...]:
        """What every rank must agree on at one collective seq."""
        shapes = None if self.op in ROOT_ONLY_SHAPES else json.dumps(self.shapes)
        return (self.op, shapes, self.dtype, self.root)


_NO_EVENT: dict[str, Any] = {}  # a call not ended yet (never written to)

# Where a rank is, as the pass goes: (last event, its ts_ns, step, phase, last started call, last finished call).
Place = tuple[str | None, int | None, Any, Any, Call | None, Call | None]


@dataclass(slots=True)
class RankLog:
    """One rank in one attempt: where its log begins and ends, and where it was."""

    rank: int
    last: Event  # its last event (the pass keeps the event, not fields copied out of it)
    host: str | None = None
    pid: int | None = None
    # The main thread's stack from its last SIGUSR2 (faulthandler; traceback lines, outermost first).
    signal_stack: list[str] | None = None
    first_ns: int = 0
    stepped: Event = field(default_factory=dict)  # its last event with a step or a phase
    last_started: Call | None = None  # the call with the latest start
    last_finished: Call | None = None  # the ok call with the latest end
    first_failure_ns: int | None = None  # its first failure or mismatch event
    recovered: dict[str, Any] | None = None  # its last `recovery.in_job` event
    aborted: dict[str, Any] | None = None  # its last `comm.abort`: it ended a communicator on purpose, saying why
    cut: bool = False  # its log ends in a line cut short: its process was killed (or is) writing it

    @property
    def last_ns(self) -> int:
        return self.last["ts_ns"]

    @property
    def last_event(self) -> str:
        return self.last.get("event", "")

    def failed_before(self, ts_ns: int) -> bool:
        return self.first_failure_ns is not None and self.first_failure_ns <= ts_ns

    def left_after_abort(self, ts_ns: int) -> bool:
        """Whether its last deed by `ts_ns` was an abort on purpose: it aborted then, and started
        no call after it (a rank that aborts and goes on, an in-job recovery, is not one)."""
        if self.aborted is None or self.aborted["ts_ns"] > ts_ns:
            return False
        started = self.last_started
        return started is None or (started.start_ns or 0) <= self.aborted["ts_ns"]

    def place(self) -> Place:
        return (
            self.last_event,
            self.last_ns,
            self.stepped.get("step"),
            self.stepped.get("phase"),
            self.last_started,
            self.last_finished,
        )


class SeqSet:
    """Sequence numbers seen (from 1), in the memory of the few seen out of order."""

    __slots__ = ("below", "above")

    def __init__(self) -> None:
        self.below = 1  # every seq under it was seen
        self.above: set[int] = set()

    def add(self, seq: int) -> bool:
        """Add `seq`; whether it is new."""
        if seq == self.below:
            self.below += 1
            while self.below in self.above:
                self.above.remove(self.below)
                self.below += 1
            return True
        if seq < self.below or seq in self.above:
            return False
        self.above.add(seq)
        return True

    def __contains__(self, seq: int) -> bool:
        return seq < self.below or seq in self.above

    def __iter__(self) -> Iterator[int]:
        """The seqs seen, in order."""
        yield from range(1, self.below)
        yield from sorted(self.above)


@dataclass
class CommLog:
    """One communicator (one incarnation of a name) in one attempt."""

    label: str
    size: int | None = None
    members: dict[int, int] = field(default_factory=dict)  # comm rank -> global rank
    # Collectives not settled (some member has not finished it, or it failed): seq -> rank -> call.
    calls: dict[int, dict[int, Call]] = field(default_factory=dict)
    # Send/recv not settled, as each side logged them:
    # (global rank, peer's comm rank, tag, pair seq) -> call.
    p2p_calls: dict[tuple[int, int, int, int], Call] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)  # collectives' and send/recv's
    mismatches: dict[int, dict[int, dict[str, Any]]] = field(default_factory=lambda: defaultdict(dict))
    parent: tuple[CommLog, list[int]] | None = None  # the communicator it was split from, and ranks
    # Accumulated from settled calls: latency per (op, bytes), and the first seq whose ranks issued
    # different things, with their calls, and how many such seqs.
    latency: dict[tuple[str, int], list[float]] = field(default_factory=dict)  # merged into sketches by stats
    sketches: dict[tuple[str, int], Quantiles] = field(default_factory=dict)
    differing: tuple[int, dict[int, Call]] | None = None
    differing_count: int = 0
    waited: int = 0  # collectives every member started (`_count_waits`)
    seqs: SeqSet = field(default_factory=SeqSet)  # collective seqs any rank started
    # rank (a send/recv's: (rank, peer, tag)) -> the last seq its log has (sequence numbers
    # only grow in an attempt)
    logged: dict[Any, int] = field(default_factory=dict)
    ok: dict[int, int] = field(default_factory=dict)  # seq -> calls finished ok (unsettled seqs)
    member_cache: frozenset[int] | None = None  # member_ranks() as a set, until members, size or parent change

    def global_rank(self, comm_rank: int) -> int:
        if comm_rank in self.members:
            return self.members[comm_rank]
        if self.parent is not None and comm_rank < len(self.parent[1]):
            return self.parent[0].global_rank(self.parent[1][comm_rank])
        return comm_rank  # no event of that rank on this communicator: assume the world's numbering

    def member_ranks(self) -> list[int]:
        size = self.size if self.size is not None else len(self.members)
        return sorted({self.global_rank(r) for r in range(size)} | set(self.members.values()))

    def member_set(self) -> frozenset[int]:
        if self.member_cache is None:
            self.member_cache = frozenset(self.member_ranks())
        return self.member_cache

    def member_count(self) -> int:
        return len(self.member_set())

    def pair_key(self, rank: int, peer: int, tag: int, seq: int) -> tuple[int, int, int, int]:
        """(lower global rank, higher, tag, pair seq) of `rank`'s op with comm rank `peer`."""
        other = self.global_rank(peer)
        return (min(rank, other), max(rank, other), tag, seq)

    def pairs(self) -> dict[tuple[int, int, int, int], dict[int, Call]]:
        """Unsettled send/recv matched across each pair: (lower global rank, higher, tag, pair seq)
        -> rank -> call."""
        out: dict[tuple[int, int, int, int], dict[int, Call]] = defaultdict(dict)
        for (rank, peer, tag, seq), call in self.p2p_calls.items():
            out[self.pair_key(rank, peer, tag, seq)][rank] = call
        return out

    def sketch(self, key: tuple[str, int], durations: list[float]) -> None:
        """Merge a block of durations into the sketch of `key` (`latencies`), and clear it."""
        sketch = self.sketches.get(key)
        if sketch is None:
            sketch = self.sketches[key] = Quantiles()
        sketch.extend(durations)
        durations.clear()

    def latencies(self) -> dict[tuple[str, int], Quantiles]:
        """Per (op, bytes): the durations of every call of this communicator that finished ok."""
        for key, durations in self.latency.items():
            self.sketch(key, durations)
        return self.sketches

    def first_differing(self) -> tuple[int, dict[int, Call], int] | None:
        """(the first seq whose `collective.start` events disagree, its calls that logged a start,
        how many seqs disagree), settled or not."""
        first, count = self.differing, self.differing_count
        for seq, calls in self.calls.items():
            if disagree(calls.values()):
                count += 1
                if first is None or seq < first[0]:
                    first = (seq, {r: c for r, c in calls.items() if c.shapes is not None})
        return None if first is None else (first[0], first[1], count)


def disagree(calls: Iterable[Call]) -> bool:
    """Whether the calls that logged their start issued different things (what `Call.signature`
    says; a collective's calls, whose `root` is their start's)."""
    first = None
    for c in calls:
        start = c._start
        if type(start) is CollectiveLine:  # most are: read by attribute (every settled collective's calls)
            shapes, its_dtype, its_root = start.shapes, start.dtype, start.root
            if shapes is UNSET:
                continue
            if its_dtype is UNSET:
                its_dtype = None
            if its_root is UNSET:
                its_root = None
        else:
            shapes, its_dtype, its_root = start.get("shapes"), start.get("dtype"), start.get("root")
        if shapes is None:
            continue  # made up from a failure: nothing to compare
        if first is None:
            first, op, dtype, root = shapes, c.op, its_dtype, its_root
        elif c.op != op or its_dtype != dtype or its_root != root or (shapes != first and op not in ROOT_ONLY_SHAPES):
            return True
    return False


@dataclass(slots=True)
class RankWaits:
    """How long the others waited for one rank at the collectives it arrived last at (at the
    others, nobody waited for it: 0)."""

    last_count: int = 0
    lags: Quantiles = field(default_factory=Quantiles)  # its start - the first start


@dataclass
class ErrorGroup:
    """Error-level events of one name and error type in one attempt (an application's `train.error`)."""

    name: str
    error_type: Any
    first: dict[str, Any]  # the earliest
    reporters: set[int] = field(default_factory=set)
    blamed: set[int] | None = field(default_factory=set)  # union of their `ranks`; None once one lacks it


@dataclass
class AttemptLog:
    attempt: int
    world_size: int | None = None
    ranks: dict[int, RankLog] = field(default_factory=dict)
    comms: dict[str, CommLog] = field(default_factory=dict)
    collectives: int = 0  # distinct (communicator, seq) started
    p2p_ops: int = 0  # distinct (communicator, pair, tag, pair seq) started
    waits: dict[int, RankWaits] = field(default_factory=lambda: defaultdict(RankWaits))

    def waited(self) -> dict[int, int]:
        """Per rank, the collectives of this attempt that every member started (the straggler table's count)."""
        out: dict[int, int] = defaultdict(int)
        for comm in self.comms.values():
            if comm.waited:
                for r in comm.member_ranks():
                    out[r] += comm.waited
        return out

    errors: dict[tuple[str, Any], ErrorGroup] = field(default_factory=dict)
    # Where every rank was when each deadline expired: the first timeout's ts_ns -> rank -> place.
    snapshots: dict[int, dict[int, Place]] = field(default_factory=dict)


@dataclass
class DumpInfo:
    """A flight-recorder dump found in the log directory."""

    path: str
    rank: int  # global rank when the dump's process (host, pid) is in the logs; else the communicator rank it names
    comm: str
    attempt: int | None
    reason: str
    dumped_ns: int | None
    entries: int
    # Entries still "started" at dump time: comm, op, seq, and a send/recv's peer (a global
    # rank once the dump's owner is found in the logs, as `rank`; else its communicator rank)
    # and its tag, where it has one.
    unfinished: list[dict[str, Any]]
    host: str | None = None  # the process that wrote it
    pid: int | None = None


@dataclass
class FileReport:
    """What was read of one log file: how much, and what could not be read."""

    path: str
    rank: int
    bytes: int = 0
    events: int = 0  # lines read as events, a process's log.open lines among them
    headers: int = 0  # log.open lines
    garbled: int = 0  # lines that are not a JSON object with an integer ts_ns
    problem: str | None = None  # why nothing could be read from it, when nothing could

    def unreadable(self) -> str | None:
        """Why this file gave no event, or None when it gave some."""
        if self.problem is not None:
            return self.problem
        if self.events > self.headers:
            return None
        if self.bytes == 0:
            return "empty"
        if self.headers:
            return "no event after its process's log.open line"
        return f"no event in {self.bytes} bytes ({self.garbled} line(s) not a JSON event)"


@dataclass
class JobInfo:
    """One job seen in a log directory."""

    job: str | None
    ranks: set[int] = field(default_factory=set)
    attempts: set[int] = field(default_factory=set)
    processes: set[tuple[Any, Any]] = field(default_factory=set)  # (host, pid): pids repeat across hosts

    def describe(self) -> str:
        name = repr(self.job) if self.job is not None else "without a job id (an older log format)"
        return (
            f"job {name}: ranks [{rank_ranges(self.ranks)}], attempt(s) {sorted(self.attempts)}, "
            f"{len(self.processes)} process(es)"
        )


class Observer:
    """What a tool that needs more than the verdicts sees of the pass (the trace, the timeline)."""

    def begin(self, ts_ns: int) -> None:
        """The run's logs begin at `ts_ns` (their first line, in wall-clock order)."""

    def call(self, att: AttemptLog, call: Call) -> None:
        """`call` is final: finished or failed, or still open when the logs end."""

    def notice(self, att: AttemptLog, event: dict[str, Any], label: str | None) -> None:
        """A failure, abort or event at warning level or above (`NOTICE_EVENTS`, `NOTICE_LEVELS`)."""

    def pair(self, att: AttemptLog, comm: CommLog, seq: int, send: Call, recv: Call) -> None:
        """A send and the recv it matched (both logged a start)."""


def peer_of(e: Event) -> int | None:
    """The other side's communicator rank of a send/recv event or flight entry; None for a collective.

    Flight dumps written before entries had `peer` kept it in `root`.
    """
    if e.get("op") not in P2P_OPS:
        return None
    peer = e.get("peer", e.get("root"))
    return peer if isinstance(peer, int) else None


def tag_of(e: Event) -> int:
    """The tag of a send/recv event or flight entry; 0 where it has none (untagged, collective)."""
    tag = e.get("tag")
    return tag if type(tag) is int else 0


def tag_text(tag: int) -> str:
    """What follows a tagged op's name: nothing for an untagged one."""
    return f" (tag {tag})" if tag else ""


def p2p_name(op: str, seq: int, peer: int, tag: int = 0) -> str:
    return f"{op} #{seq} {'to' if op == 'send' else 'from'} rank {peer}{tag_text(tag)}"
