"""The one model of a run's logs, read in one streaming pass: attempts, ranks, communicators,
and what the doctor's verdicts need of their collectives.

Every tool that reads commlib's JSON-lines logs reads them through this module (the
doctor's rules and statistics, the trace, `fsdp_overlap.timeline`, `chaos.verify`):
`load(logdir)` reads every rank's files (`log.rank_segments`: rotated ones too, in order),
then its `flight_rank*.json` dumps (`flight_dumps`) and the faulthandler stacks of
`stacks_{pid}.txt` (each rank's position shows its main thread's innermost frame when no
flight-recorder stack says where it was) into a `RunLogs`; `build(events)` does the same
for events already in memory. `position(att, rank, at_ns)` says where a rank was at the
end of its log, or when a deadline expired. Nothing here talks to a process group or a
store, and nothing imports torch (`python -m commlib.doctor` runs where only the logs are).

Streaming: the ranks' files are read side by side, a window of wall-clock time (`ts_ns`)
at a time (`_Fold.run`), and each event is folded into the model as it comes; nothing keeps
the events themselves.
A collective whose every member finished it ("ok") is settled: its statistics (latency,
who arrived last, whether the ranks issued the same thing) go into the model's
accumulators and its calls are let go. What stays is what verdicts are made of: the
collectives still open or that failed somewhere, the failure events, per rank where it is
(its last event, step and phase, last started and last finished call), and, at the moment
each deadline expired, where every rank was then. Memory is bounded by ranks x open
collectives, not by the size of the logs. Observers (`Observer`: the trace, the timeline)
see each call once it is final, and each notice, as the pass goes.

Everything is kept per torchrun attempt (the `attempt` field of every event), because
sequence numbers start over in each attempt. Within an attempt a collective is identified
by (communicator, seq); a communicator created twice under one name in one process gets a
label `name#2` for its second incarnation. Send/recv are numbered apart, per peer pair
(their events carry `peer`, the other side's communicator rank, and `seq`, the pair's
count of point-to-point ops), so they never enter the collective matching: a point-to-point
op is identified by (communicator, the pair of ranks, its pair seq), and the k-th op of a
pair on one side matches the k-th on the other (a send with a recv). Ranks are global
ranks: communicator ranks are mapped through the `comm_rank` of each rank's events (or the
`comm.split` that made the communicator).

Jobs: each process's `log.open` line names its job (`log.job_id`). A directory holding the
logs of more than one job is refused (`MixedJobsError`, naming each) unless one job is asked for.
"""

from __future__ import annotations

import contextlib
import gc
import json
import operator
import os
import resource
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from commlib.observe.log import HEADER_EVENT, HEADER_ONLY, Inflater, decode, rank_segments, read_run
from commlib.observe.sketch import Quantiles
from commlib.observe.stacks import read_main_stacks

FAILURE_EVENTS = ("collective.timeout", "peer.failure", "collective.error")
MISMATCH_EVENT = "collective.mismatch"
# Handed to observers (the trace): failures, aborts, and anything at warning or above.
NOTICE_EVENTS = (*FAILURE_EVENTS, MISMATCH_EVENT, "comm.abort")
NOTICE_LEVELS = ("warning", "error", "critical")
ERROR_LEVELS = ("error", "critical")  # kept per attempt, by event name and error type (`ErrorGroup`)
P2P_OPS = ("send", "recv")
# Rooted list arguments exist only on the root: per-rank shapes legitimately differ.
ROOT_ONLY_SHAPES = ("gather", "scatter")
FLIGHT_DUMP_KIND = "commlib.flight_recorder"
LISTED = 10  # files an error names one by one
FD_MARGIN = 64  # descriptors left to the rest of the process when every rank's file is open at once
BATCH = 10_000  # lines the pass reads and folds in at a time (`_Fold.run`)
# In a window's lines, what has it folded in wall-clock order (`_Fold.run`): a deadline that
# expired, a send's or a recv's start or end (as `EventWriter` writes them: the op first).
TIMEOUT_MARK = b'"collective.timeout"'
P2P_STARTS = (b'{"op":"send"', b'{"op":"recv"')
HEADER_START = b'{"event":"' + HEADER_EVENT.encode() + b'"'  # how the writer starts a log.open line
LATENCY_BLOCK = 256  # durations a communicator gathers per (op, bytes) before they go into its sketch
_CLOCK_AND_RANK = operator.itemgetter(0, 1)


class LogDirError(ValueError):
    """The log directory cannot be read (missing, or holds no readable event)."""


class MixedJobsError(LogDirError):
    """The directory holds the logs of more than one job (`jobs`: job id -> what was seen of it)."""

    def __init__(self, message: str, jobs: dict[str | None, "JobInfo"]) -> None:
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

    __slots__ = ("rank", "comm", "seq", "op", "start_ns", "peer", "status", "source", "end_ns", "duration_s",
                 "stack", "_start", "_end")

    def __init__(self, rank: int, comm: str, seq: int, op: str, start_ns: int | None, start: dict[str, Any],
                 peer: int | None = None, status: str = "started", source: str = "log") -> None:
        self.rank = rank
        self.comm = comm
        self.seq = seq  # a send/recv's: the count of its pair's point-to-point ops
        self.op = op
        self.start_ns = start_ns  # wall clock (`ts_ns`)
        self.peer = peer  # send/recv: the other side's communicator rank
        self.status = status  # started | ok | timed_out | failed
        self.source = source  # log | flight (found only in a flight-recorder dump)
        self._start = start  # the start event (or what stands for it)
        self._end: dict[str, Any] = _NO_EVENT  # the event that ended it: collective.end, or a failure
        self.end_ns: int | None = None
        self.duration_s: float | None = None
        self.stack: list[str] | None = None

    @classmethod
    def of(cls, rank: int, comm: str, seq: int, op: str, start_ns: int | None, *, peer: int | None = None,
           status: str = "started", source: str = "log", **fields: Any) -> "Call":
        """A call from its fields (`bytes`, `shapes`, `dtype`, `root`, `deadline_s`, `step`, `phase`,
        `label`, `pid`, `start_mono_ns`, `async_op`, `duration_s`, `end_ns`, `end_mono_ns`, `stack`)."""
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
        return (f"Call(rank={self.rank}, comm={self.comm!r}, seq={self.seq}, op={self.op!r}, "
                f"status={self.status!r}, start_ns={self.start_ns}, end_ns={self.end_ns})")

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
    def root(self) -> int | None:
        return None if self.peer is not None else self._start.get("root")

    @property
    def async_op(self) -> bool:
        return bool(self._start.get("async_op"))

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
    last: dict[str, Any]  # its last event (the pass keeps the event, not fields copied out of it)
    host: str | None = None
    pid: int | None = None
    # The main thread's stack from its last SIGUSR2 (faulthandler; traceback lines, outermost first).
    signal_stack: list[str] | None = None
    first_ns: int = 0
    stepped: dict[str, Any] = field(default_factory=dict)  # its last event with a step or a phase
    last_started: Call | None = None  # the call with the latest start
    last_finished: Call | None = None  # the ok call with the latest end
    first_failure_ns: int | None = None  # its first failure or mismatch event
    recovered: dict[str, Any] | None = None  # its last `recovery.in_job` event

    @property
    def last_ns(self) -> int:
        return self.last["ts_ns"]

    @property
    def last_event(self) -> str:
        return self.last.get("event", "")

    def failed_before(self, ts_ns: int) -> bool:
        return self.first_failure_ns is not None and self.first_failure_ns <= ts_ns

    def place(self) -> Place:
        return (self.last_event, self.last_ns, self.stepped.get("step"), self.stepped.get("phase"),
                self.last_started, self.last_finished)


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


@dataclass
class CommLog:
    """One communicator (one incarnation of a name) in one attempt."""

    label: str
    size: int | None = None
    members: dict[int, int] = field(default_factory=dict)  # comm rank -> global rank
    # Collectives not settled (some member has not finished it, or it failed): seq -> rank -> call.
    calls: dict[int, dict[int, Call]] = field(default_factory=dict)
    # Send/recv not settled, as each side logged them: (global rank, peer's comm rank, pair seq) -> call.
    p2p_calls: dict[tuple[int, int, int], Call] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)  # collectives' and send/recv's
    mismatches: dict[int, dict[int, dict[str, Any]]] = field(default_factory=lambda: defaultdict(dict))
    parent: tuple["CommLog", list[int]] | None = None  # the communicator it was split from, and ranks
    # Accumulated from settled calls: latency per (op, bytes), and the first seq whose ranks issued
    # different things, with their calls, and how many such seqs.
    latency: dict[tuple[str, int], list[float]] = field(default_factory=dict)  # folded into sketches by stats
    sketches: dict[tuple[str, int], Quantiles] = field(default_factory=dict)
    differing: tuple[int, dict[int, Call]] | None = None
    differing_count: int = 0
    waited: int = 0  # collectives every member started (`_count_waits`)
    seqs: SeqSet = field(default_factory=SeqSet)  # collective seqs any rank started
    # rank (a send/recv's: (rank, peer)) -> the last seq its log has (sequence numbers only grow in an attempt)
    logged: dict[Any, int] = field(default_factory=dict)
    ok: dict[int, int] = field(default_factory=dict)  # seq -> calls finished ok (unsettled seqs)
    counted: int | None = None  # len(member_ranks()), until members, size or parent change

    def global_rank(self, comm_rank: int) -> int:
        if comm_rank in self.members:
            return self.members[comm_rank]
        if self.parent is not None and comm_rank < len(self.parent[1]):
            return self.parent[0].global_rank(self.parent[1][comm_rank])
        return comm_rank  # no event of that rank on this communicator: assume the world's numbering

    def member_ranks(self) -> list[int]:
        size = self.size if self.size is not None else len(self.members)
        return sorted({self.global_rank(r) for r in range(size)} | set(self.members.values()))

    def member_count(self) -> int:
        if self.counted is None:
            self.counted = len(self.member_ranks())
        return self.counted

    def pair_key(self, rank: int, peer: int, seq: int) -> tuple[int, int, int]:
        """(lower global rank, higher, pair seq) of `rank`'s send/recv with comm rank `peer`."""
        other = self.global_rank(peer)
        return (min(rank, other), max(rank, other), seq)

    def pairs(self) -> dict[tuple[int, int, int], dict[int, Call]]:
        """Unsettled send/recv matched across each pair: (lower global rank, higher, pair seq) -> rank -> call."""
        out: dict[tuple[int, int, int], dict[int, Call]] = defaultdict(dict)
        for (rank, peer, seq), call in self.p2p_calls.items():
            out[self.pair_key(rank, peer, seq)][rank] = call
        return out

    def sketch(self, key: tuple[str, int], durations: list[float]) -> None:
        """Fold a block of durations into the sketch of `key` (`latencies`), and clear it."""
        sketch = self.sketches.get(key)
        if sketch is None:
            sketch = self.sketches[key] = Quantiles()
        for d in durations:
            sketch.add(d)
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
            if _disagree(calls.values()):
                count += 1
                if first is None or seq < first[0]:
                    first = (seq, {r: c for r, c in calls.items() if c.shapes is not None})
        return None if first is None else (first[0], first[1], count)


def _disagree(calls: Iterable[Call]) -> bool:
    """Whether the calls that logged their start issued different things (what `Call.signature`
    says; a collective's calls, whose `root` is their start's)."""
    first = None
    for c in calls:
        start = c._start
        shapes = start.get("shapes")
        if shapes is None:
            continue  # made up from a failure: nothing to compare
        if first is None:
            first, op, dtype, root = shapes, c.op, start.get("dtype"), start.get("root")
        elif (c.op != op or start.get("dtype") != dtype or start.get("root") != root
              or (shapes != first and op not in ROOT_ONLY_SHAPES)):
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
    p2p_ops: int = 0  # distinct (communicator, pair, pair seq) started
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
    rank: int  # global rank when the dump's pid is in the logs; else the communicator rank it names
    comm: str
    attempt: int | None
    reason: str
    dumped_ns: int | None
    entries: int
    # Entries still "started" at dump time: comm, op, seq, and a send/recv's peer (a global
    # rank once the dump's owner is found in the logs, as `rank`; else its communicator rank).
    unfinished: list[dict[str, Any]]


@dataclass(frozen=True)
class Process:
    """A process that logged: its pid, its global rank, and its first event (wall clock)."""

    pid: int
    rank: int
    first_ns: int


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
    pids: set[int] = field(default_factory=set)

    def describe(self) -> str:
        name = repr(self.job) if self.job is not None else "without a job id (an older log format)"
        return (f"job {name}: ranks {_ranges(self.ranks)}, attempt(s) {sorted(self.attempts)}, "
                f"{len(self.pids)} process(es)")


def _ranges(ranks: Iterable[int]) -> str:
    out: list[str] = []
    for r in sorted(ranks):
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return "[" + ", ".join(out) + "]"


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


@dataclass
class RunLogs:
    logdir: str
    attempts: dict[int, AttemptLog]
    dumps: list[DumpInfo]
    files: list[FileReport]
    job: str | None = None
    processes_seen: dict[int, Process] = field(default_factory=dict)
    # How to read the same logs again (`events`, `calls`): the directory, or the events given to `build`.
    _source: list[dict[str, Any]] | None = None
    _job_filter: str | None = None

    @property
    def unreadable(self) -> list[FileReport]:
        """The files nothing could be read from; but a file that holds nothing yet (a rotation
        has just started it) is no loss where its rank's other files were read."""
        read = {f.rank for f in self.files if f.unreadable() is None}
        return [f for f in self.files if f.unreadable() is not None
                and not (f.rank in read and f.problem is None and f.garbled == 0)]

    def events(self) -> list[dict[str, Any]]:
        """Every rank's events of every attempt as one stream, in wall-clock order (read again,
        and kept: for tools that need the events themselves, on logs of a test's size)."""
        if self._source is not None:
            return sorted((e for e in self._source if isinstance(e.get("ts_ns"), int)), key=lambda e: e["ts_ns"])
        return [e for e in read_run(self.logdir) if self._job_filter is None or e.get("job") == self._job_filter]

    def calls(self) -> list[tuple[int, Call]]:
        """(attempt, call) for every call of the run (read again), as the trace sees them."""
        collect = _Collect()
        if self._source is not None:
            build(self._source, observers=[collect])
        else:
            load(self.logdir, job=self._job_filter, observers=[collect])
        return collect.calls

    def processes(self) -> dict[int, Process]:
        """Every process that logged, by pid (hosts reusing a pid share one entry: the earliest)."""
        return dict(self.processes_seen)


class _Collect(Observer):
    def __init__(self) -> None:
        self.calls: list[tuple[int, Call]] = []

    def call(self, att: AttemptLog, call: Call) -> None:
        self.calls.append((att.attempt, call))


# ---------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------
def load(logdir: str | os.PathLike[str], job: str | None = None,
         observers: Iterable[Observer] = ()) -> RunLogs:
    """Read every rank's logs, every flight-recorder dump and every stack dump of `logdir`, in
    one pass (module docstring); with `job`, only that job's events. Raises LogDirError when
    the directory is missing or no file in it holds a readable event, MixedJobsError when it
    holds more than one job's logs and `job` does not pick one."""
    directory = Path(logdir)
    if not directory.is_dir():
        raise LogDirError(f"expected a log directory; found no directory at {directory}")
    segments = rank_segments(directory)
    if not segments:
        nested = directory / "logs"
        hint = (f"they are in {nested}" if nested.is_dir() and rank_segments(nested)
                else "was the job run with log_dir= or COMMLIB_LOG_DIR set?")
        raise LogDirError(f"expected rank*.jsonl logs in {directory}; found none ({hint})")
    fold = _Fold(job, list(observers))
    readers = [_RankReader(rank, paths) for rank, paths in segments.items()]
    keep_open = _enough_descriptors(len(readers))
    for reader in readers:
        reader.keep_open = keep_open
    collecting = gc.isenabled()
    gc.disable()  # the pass makes millions of short-lived dicts and no cycles: a fifth of its time went to gc
    try:
        fold.run(readers)
    except MixedJobsError:
        raise mixed_jobs(directory, fold.jobs) from None
    finally:
        if collecting:
            gc.enable()
        for reader in readers:
            reader.close()
    files = [report for reader in readers for report in reader.reports]
    if all(f.unreadable() is not None for f in files):
        listing = "; ".join(f"{Path(f.path).name}: {f.unreadable()}" for f in files[:LISTED])
        more = f"; and {len(files) - LISTED} more" if len(files) > LISTED else ""
        raise LogDirError(f"expected at least one readable event in {directory}; found none: {listing}{more}")
    if job is not None and not fold.attempts:
        raise LogDirError(f"expected events of job {job!r} in {directory}; found only "
                          + "; ".join(info.describe() for info in fold.jobs.values()))
    dumps = [fold.add_dump(path, data) for path, data in flight_dumps(directory)]
    stacks = read_main_stacks(directory)
    for att in fold.attempts.values():
        for rl in att.ranks.values():
            if rl.pid in stacks:
                rl.signal_stack = [f.traceback_line() for f in reversed(stacks[rl.pid])]
    fold.finish()
    return RunLogs(str(directory), dict(sorted(fold.attempts.items())), dumps, files, fold.job_seen(),
                   fold.processes, None, job)


def build(events: Iterable[dict[str, Any]], logdir: str = "", observers: Iterable[Observer] = ()) -> RunLogs:
    """The model of events already read (each carrying its `rank`; no dumps, no stacks), in their order."""
    source = [e for e in events if isinstance(e.get("rank"), int)]
    fold = _Fold(None, list(observers))
    clocks = [e["ts_ns"] for e in source if isinstance(e.get("ts_ns"), int)]
    for observer in fold.observers if clocks else ():
        observer.begin(min(clocks))
    contexts: dict[int, _Context] = {}
    inflate = Inflater()
    for event in source:
        if isinstance(event.get("ts_ns"), int):
            context = contexts.get(event["rank"])
            if context is None:
                context = contexts[event["rank"]] = _Context(event["rank"])
            fold.add(inflate(dict(event)) or event, context)  # a log.open line: the fold keeps its header
    fold.finish()
    return RunLogs(logdir, dict(sorted(fold.attempts.items())), [], [], fold.job_seen(), fold.processes, source)


def _enough_descriptors(files: int) -> bool:
    """Whether every rank's file can stay open through the pass (raising the soft limit as far
    as the hard one allows); if not, each is opened for each block of lines read."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if files + FD_MARGIN <= soft:
        return True
    with contextlib.suppress(ValueError, OSError):
        wanted = files + FD_MARGIN if hard == resource.RLIM_INFINITY else min(hard, files + FD_MARGIN)
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        return files + FD_MARGIN <= wanted
    return False


class _RankReader:
    """One rank's files, read in order as one stream of lines with their clock (`take`), with
    what was read of each file (`reports`).

    A line waits in the pass's merge as its bytes, its clock read out of them: it is parsed
    only when its turn comes, so the event is fresh in the cache when it is folded in (parsed
    as it is read, the pass took half as long again). A line whose clock cannot be read that
    way is parsed at once, to tell."""

    BLOCK = 1 << 16  # bytes of lines read per opening, when the files cannot all stay open

    def __init__(self, rank: int, paths: list[Path]) -> None:
        self.rank = rank
        self.paths = paths
        self.index = 0
        self.keep_open = True
        self.reports = [FileReport(str(p), rank) for p in paths]
        self.report = self.reports[-1]
        self.head: tuple[int, bytes, FileReport] | None = None  # the next line not taken yet
        self.ordered = False  # a line taken wants its window folded in wall-clock order (`_Fold.run`)
        self._index = -1
        self._file: Any = None
        self._offset = 0
        self._lines: Iterator[bytes] = iter(())

    def take(self, until: int) -> list[tuple[int, bytes, FileReport]]:
        """(ts_ns, line, its file's report) of each line before `until`, from `head` on; `head`
        is then the first line at or after it, or None when the files are read."""
        taken: list[tuple[int, bytes, FileReport]] = []
        head = self.head
        if head is not None:
            if head[0] >= until:
                return taken
            taken.append(head)
            self.ordered = self.ordered or _wants_order(head[1])
        while True:
            report = self.report
            for raw in self._lines:
                if raw[-1] != 10:  # b"\n"
                    break  # a last line cut short by a kill, or still being written
                at = raw.find(b'"ts_ns":')
                end = raw.find(b",", at)
                try:  # the clock read out of the bytes; parsed only when that fails
                    ts = int(raw[at + 8:end if end > 0 else -2]) if at >= 0 else _clock(raw)
                except ValueError:
                    ts = _clock(raw)
                if ts is None:
                    report.garbled += 1
                    continue
                report.events += 1
                if raw.startswith(HEADER_START):  # only the writer writes them (`log._header_line`)
                    report.headers += 1
                if ts >= until:
                    self.head = (ts, raw, report)
                    return taken
                taken.append((ts, raw, report))
                if TIMEOUT_MARK in raw or raw.startswith(P2P_STARTS):  # `_wants_order`, inline: every line
                    self.ordered = True
            if not self._advance():
                self.head = None
                return taken

    def _advance(self) -> bool:
        """On to the next block of lines, of this file or the next; False when there is none."""
        while True:
            if self._file is not None:
                self._file.close()
                self._file = None
            elif self._index >= 0 and not self.keep_open and self._try(self._refill):
                return True
            if self._index + 1 >= len(self.paths):
                return False
            self._index += 1
            self._offset = 0
            self.report = self.reports[self._index]
            if self._try(self._open):
                return True

    def _try(self, step: Callable[[], bool]) -> bool:
        try:
            return step()
        except OSError as exc:  # rotated away meanwhile, or not readable
            self.reports[self._index].problem = f"{type(exc).__name__}: {exc.strerror or exc}"
            return False

    def _open(self) -> bool:
        path = self.paths[self._index]
        self.reports[self._index].bytes = os.path.getsize(path)
        if not self.keep_open:
            return self._refill()
        self._file = open(path, "rb")
        self._lines = iter(self._file)
        return True

    def _refill(self) -> bool:
        """The next block of whole lines of the current file (closed again until the next block)."""
        with open(self.paths[self._index], "rb") as f:
            f.seek(self._offset)
            lines = f.readlines(self.BLOCK)
            self._offset = f.tell()
        self._lines = iter(lines)
        return bool(lines)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class _Context:
    """What the pass knows of the events of one stream: its file's rank, and the process,
    attempt, rank and communicators of the events last seen (they change seldom)."""

    __slots__ = ("file_rank", "rank", "pid", "job", "host", "attempt", "att", "rl", "comms")

    def __init__(self, file_rank: int) -> None:
        self.file_rank = file_rank
        self.rank: Any = ()
        self.pid: Any = ()  # never a pid: the first event sets it
        self.job: str | None = None
        self.host: str | None = None
        self.attempt: Any = ()  # with `rank` of the last event: the attempt and rank of att and rl
        self.att: AttemptLog | None = None
        self.rl: RankLog | None = None
        self.comms: dict[str, CommLog] = {}  # name -> current incarnation, for (attempt, rank)


class _Fold:
    """Folds events, each rank's in its file's order, into attempts, ranks, communicators and calls.

    `add` runs once per line of the logs: the two events every collective writes take its
    inline path, every other event `_other`.
    """

    def __init__(self, job: str | None, observers: list[Observer]) -> None:
        self.attempts: dict[int, AttemptLog] = {}
        self.observers = observers
        self.job_filter = job
        self.jobs: dict[str | None, JobInfo] = {}
        self.headers: dict[Any, dict[str, Any]] = {}  # pid -> its log.open fields
        self.processes: dict[int, Process] = {}
        self._incarnation: dict[tuple[int, int, str], int] = defaultdict(int)  # (attempt, rank, name)
        self._pending_split: dict[tuple[int, int], tuple[str, str, list[int]]] = {}
        # pid -> {(attempt, rank)}: more than one only when hosts reuse a pid
        self._pids: dict[int, set[tuple[int, int]]] = defaultdict(set)
        self._first_timeout: dict[tuple[Any, ...], int] = {}  # a timeout's group -> its first ts_ns
        self._done: dict[int, set[int]] = defaultdict(set)  # attempt -> ranks whose logs of it are over
        self._comms_of: dict[tuple[int, int], set[str]] = defaultdict(set)  # (attempt, rank) -> its communicators
        self._begun = False

    # -- the pass -----------------------------------------------------------------------
    def run(self, readers: list[_RankReader]) -> None:
        """Every rank's lines, window by window of wall-clock time: every line before the
        window's end from every rank, then the next window. The window is sized to hold about
        `BATCH` lines. Within a window, ranks are folded in one after the other (each rank's
        lines in its files' order): no verdict depends on how ranks interleave within a few
        milliseconds, except two. Where every rank was when a deadline expired; and whom a
        send/recv was with, when its communicator ranks are told apart from the other side's
        events (which, in wall-clock order, all come before the op ends). So a window that
        holds a `collective.timeout` or a send/recv (`TIMEOUT_MARK`, `P2P_STARTS`) is folded in
        wall-clock order instead (rank order between equal clocks). Ordering every line so (a heap of
        the ranks' next lines, or a sort of each window) took a quarter of the pass."""
        contexts = [_Context(r.rank) for r in readers]
        for i, reader in enumerate(readers):
            reader.index = i
            reader.take(-1)  # reads its first line into `head`
        live = [r for r in readers if r.head is not None]
        window = 1_000_000  # ns; adapted to the logs' pace
        add = self.add
        while live:
            start = min(r.head[0] for r in live)  # type: ignore[index]
            if not self._begun:
                self._begun = True
                for observer in self.observers:
                    observer.begin(start)
            groups: list[tuple[_Context, Any]] = [(contexts[r.index], r.take(start + window)) for r in live]
            lines = sum(len(t) for _, t in groups)
            if any(r.ordered for r in live):  # each line a group of its own, in order
                for r in live:
                    r.ordered = False
                groups = [(context, ((ts, raw, report),)) for ts, _, raw, report, context in sorted(
                    ((ts, i, raw, report, context) for i, (context, t) in enumerate(groups) for ts, raw, report in t),
                    key=_CLOCK_AND_RANK)]
            for context, taken in groups:
                for _, raw, report in taken:
                    try:
                        event = decode(raw)
                    except ValueError:
                        event = None
                    if type(event) is dict:
                        add(event, context)
                    else:  # a clock in its bytes, but not a JSON event
                        report.events -= 1
                        report.garbled += 1
            for reader in live:
                context = contexts[reader.index]
                if reader.head is None and context.att is not None:
                    self._rank_done(context.att.attempt, context.rl.rank)  # type: ignore[union-attr]
            live = [r for r in live if r.head is not None]
            window = max(1, min(window * 4, int(window * BATCH / max(1, lines))))

    def add(self, e: dict[str, Any], context: _Context) -> None:
        get = e.get
        name = get("event", "")
        if (get("pid") != context.pid or name == HEADER_EVENT) and self._switch(e, context):
            return  # a log.open line, or a process of a job not asked for
        ts = e["ts_ns"]
        attempt, rank = get("attempt"), get("rank", context.file_rank)
        if attempt != context.attempt or rank != context.rank:
            self._enter(e, context, int(attempt or 0), int(rank))
        rl = context.rl
        rl.last = e  # type: ignore[union-attr]
        if get("step") is not None or get("phase") is not None:
            rl.stepped = e  # type: ignore[union-attr]
        # A collective's start and end (never notices: `EventWriter` writes them at info level)
        # on a communicator this stream has seen: the inline path. Everything else: `_other`.
        comm = context.comms.get(get("comm"))
        if comm is None or get("peer") is not None:
            self._other(e, context, name, ts)
        elif name == "collective.start":
            seq = get("seq")
            if type(seq) is not int:
                return
            op = get("op")
            call = Call(rl.rank, comm.label, seq, op if type(op) is str else str(op), ts, e)  # type: ignore[union-attr]
            calls = comm.calls.get(seq)
            if calls is None:
                calls = self._new_collective(context.att, comm, seq)  # type: ignore[arg-type]
            calls[call.rank] = call
            comm.logged[call.rank] = seq
            last = rl.last_started  # type: ignore[union-attr]
            if last is None or (last.start_ns or 0) < ts:
                rl.last_started = call  # type: ignore[union-attr]
        elif name == "collective.end":
            calls = comm.calls.get(get("seq"))
            call = calls.get(rl.rank) if calls is not None else None  # type: ignore[union-attr]
            if call is None:
                call = self._call(context.att, comm, rl, e, ts)  # type: ignore[arg-type]
            self._close(context.att, comm, rl, call, e, "ok", ts, get("bytes"))  # type: ignore[arg-type]
        else:
            self._other(e, context, name, ts)

    def _switch(self, e: dict[str, Any], context: _Context) -> bool:
        """An event of another process than the last one in this stream: its job and host (its
        header's, or its events' own). Whether to leave the event out: a process's log.open line
        (kept as its header), or a process of a job not asked for (left out, each of its events
        coming back here)."""
        pid = e.get("pid")
        if e.get("event") == HEADER_EVENT:
            self.headers[pid] = {k: e[k] for k in HEADER_ONLY if k in e}
            context.pid = ()  # the next event looks its process up again
            return True
        header = self.headers.get(pid, {})
        context.pid = pid
        context.job = e.get("job", header.get("job"))
        context.host = e.get("host", header.get("host"))
        context.attempt = ()
        info = self.jobs.get(context.job)
        if info is None:
            info = self.jobs[context.job] = JobInfo(context.job)
            if len(self.jobs) > 1 and self.job_filter is None:
                raise MixedJobsError("a second job", self.jobs)  # `load` names them all
        if isinstance(pid, int):
            info.pids.add(pid)
        if self.job_filter is not None and context.job != self.job_filter:
            context.pid = ()
            return True
        return False

    def _enter(self, e: dict[str, Any], context: _Context, attempt: int, rank: int) -> None:
        """The events now come from another (attempt, rank) than the last ones of this stream."""
        if context.att is not None and context.att.attempt < attempt:
            self._rank_done(context.att.attempt, context.rl.rank)  # type: ignore[union-attr]
        att = self.attempts.get(attempt)
        if att is None:
            att = self.attempts[attempt] = AttemptLog(attempt)
        ts = e["ts_ns"]
        rl = att.ranks.get(rank)
        if rl is None:
            rl = att.ranks[rank] = RankLog(rank, e, first_ns=ts)
        header = self.headers.get(context.pid, {})
        size = e.get("size", header.get("size"))
        if isinstance(size, int):
            att.world_size = max(att.world_size or 0, size)
        rl.host = context.host or rl.host
        pid = e.get("pid")
        if pid is not None:
            rl.pid = pid
            if isinstance(pid, int):
                self._pids[pid].add((attempt, rank))
                known = self.processes.get(pid)
                if known is None or ts < known.first_ns:
                    self.processes[pid] = Process(pid, rank, ts)
        info = self.jobs[context.job]
        info.ranks.add(rank)
        info.attempts.add(attempt)
        context.attempt, context.rank = e.get("attempt"), e.get("rank", context.file_rank)
        context.att, context.rl = att, rl
        context.comms = {}

    def _other(self, e: dict[str, Any], context: _Context, name: str, ts: int) -> None:
        """Every event but a collective's start and end (and those, the first time their
        communicator shows in this stream, or for a send/recv)."""
        att, rl, comm_name = context.att, context.rl, e.get("comm")
        assert att is not None and rl is not None
        notice = name in NOTICE_EVENTS or e.get("level") in NOTICE_LEVELS
        if name == "recovery.in_job":
            rl.recovered = e
        if not isinstance(comm_name, str):
            if notice:
                self._notice(att, rl, e, None)
            return
        if name == "comm.init":
            self._incarnation[(att.attempt, rl.rank, comm_name)] += 1
        comm = context.comms.get(comm_name) if name != "comm.init" else None
        if comm is None:
            comm = context.comms[comm_name] = self._comm(att, rl.rank, comm_name)
        comm_rank, comm_size = e.get("comm_rank"), e.get("comm_size")
        if comm_rank is not None and comm.members.get(comm_rank) != rl.rank:
            comm.members[comm_rank] = rl.rank
            comm.counted = None
        if comm_size is not None and comm.size != comm_size:
            comm.size, comm.counted = comm_size, None
        if name == "collective.start":
            self._start(att, comm, rl, e, ts)
        elif name == "collective.end":
            self._close(att, comm, rl, self._call(att, comm, rl, e, ts), e, "ok", ts, e.get("bytes"))
        elif name in FAILURE_EVENTS:
            call = self._call(att, comm, rl, e, ts)
            comm.failures.append({**e, "label": comm.label})
            self._failed(rl, ts)
            self._close(att, comm, rl, call, e, e.get("status") or "failed", ts)
            if name == "collective.timeout":
                self._snapshot(att, comm, e, ts)
        elif name == MISMATCH_EVENT and isinstance(e.get("seq"), int):
            comm.mismatches[e["seq"]][rl.rank] = {**e, "label": comm.label}
            self._failed(rl, ts)
        elif name == "comm.split":
            self._pending_split[(att.attempt, rl.rank)] = (comm.label, e.get("new_comm"), list(e.get("ranks") or []))
        elif name == "comm.init":
            pending = self._pending_split.pop((att.attempt, rl.rank), None)
            if pending and pending[1] == comm_name and pending[0] in att.comms and comm.parent is None:
                comm.parent, comm.counted = (att.comms[pending[0]], pending[2]), None
        if notice:  # after its call is handed over: a failure is drawn on the track of its communicator
            self._notice(att, rl, e, comm.label)

    def _comm(self, att: AttemptLog, rank: int, name: str) -> CommLog:
        label = self._label(att.attempt, rank, name)
        comm = att.comms.get(label)
        if comm is None:
            comm = att.comms[label] = CommLog(label)
        self._comms_of[(att.attempt, rank)].add(label)
        return comm

    def _notice(self, att: AttemptLog, rl: RankLog, e: dict[str, Any], label: str | None) -> None:
        for observer in self.observers:
            observer.notice(att, e, label)
        name = e.get("event", "")
        if e.get("level") in ERROR_LEVELS and name not in NOTICE_EVENTS:
            key = (str(name), e.get("error_type"))
            group = att.errors.get(key)
            if group is None:
                group = att.errors[key] = ErrorGroup(key[0], key[1], {**e, "label": label})
            elif e["ts_ns"] < group.first["ts_ns"]:
                group.first = {**e, "label": label}
            group.reporters.add(rl.rank)
            blamed = e.get("ranks")
            if group.blamed is not None and isinstance(blamed, list) and all(isinstance(r, int) for r in blamed):
                group.blamed.update(blamed)
            else:
                group.blamed = None

    @staticmethod
    def _failed(rl: RankLog, ts: int) -> None:
        if rl.first_failure_ns is None or ts < rl.first_failure_ns:
            rl.first_failure_ns = ts

    def _snapshot(self, att: AttemptLog, comm: CommLog, e: dict[str, Any], ts: int) -> None:
        """Where every rank is now, when a deadline expired first for this collective (or send/recv)."""
        peer, mine = peer_of(e), e.get("comm_rank")
        if peer is None or not isinstance(mine, int):
            group: tuple[Any, ...] = (att.attempt, comm.label, e.get("seq"), peer)
        else:
            group = (att.attempt, comm.label, e.get("seq"), min(mine, peer), max(mine, peer))
        first = self._first_timeout.get(group)
        if first is None or ts < first:
            self._first_timeout[group] = ts
            att.snapshots[ts] = {r: rl.place() for r, rl in att.ranks.items()}

    # -- calls --------------------------------------------------------------------------
    def _start(self, att: AttemptLog, comm: CommLog, rl: RankLog, e: dict[str, Any], ts: int) -> None:
        seq = e.get("seq")
        if not isinstance(seq, int):
            return
        call = Call(rl.rank, comm.label, seq, str(e.get("op")), ts, e, peer_of(e))
        self._place(att, comm, call, e.get("comm_rank"))
        last = rl.last_started
        if last is None or (last.start_ns or 0) < ts:
            rl.last_started = call

    @staticmethod
    def _new_collective(att: AttemptLog, comm: CommLog, seq: int) -> dict[int, Call]:
        calls: dict[int, Call] = {}
        comm.calls[seq] = calls
        comm.ok[seq] = 0
        if comm.seqs.add(seq):
            att.collectives += 1
        return calls

    def _place(self, att: AttemptLog, comm: CommLog, call: Call, comm_rank: Any) -> None:
        seq = call.seq
        if call.peer is None:
            calls = comm.calls.get(seq)
            if calls is None:
                calls = self._new_collective(att, comm, seq)
            calls[call.rank] = call
            if seq > comm.logged.get(call.rank, 0):
                comm.logged[call.rank] = seq
            return
        if seq > comm.logged.get((call.rank, call.peer), 0):
            comm.logged[(call.rank, call.peer)] = seq
        comm.p2p_calls[(call.rank, call.peer, seq)] = call
        if seq > comm.logged.get((comm.global_rank(call.peer), comm_rank), 0):
            att.p2p_ops += 1  # the other side has not logged it: a pair op not counted yet

    def _call(self, att: AttemptLog, comm: CommLog, rl: RankLog, e: dict[str, Any], ts: int) -> Call:
        """The call an end/failure event closes; made up when its start was never logged.

        A failure inside the consistency check happens before the start is logged: the rank
        did arrive, so the call starts `duration_s` before the failure.
        """
        seq, peer = e.get("seq"), peer_of(e)
        call = _find(comm, rl.rank, seq, peer)
        if call is None:
            took_ns = int((e.get("duration_s") or 0.0) * 1e9)
            mono = e.get("mono_ns")
            call = Call.of(rl.rank, comm.label, seq if isinstance(seq, int) else -1, str(e.get("op")), ts - took_ns,
                           peer=peer, step=e.get("step"), phase=e.get("phase"), label=e.get("label"), pid=e.get("pid"),
                           start_mono_ns=mono - took_ns if isinstance(mono, int) else None)
            if isinstance(seq, int):
                self._place(att, comm, call, e.get("comm_rank"))
            last = rl.last_started
            if last is None or (last.start_ns or 0) < (call.start_ns or 0):
                rl.last_started = call
        return call

    def _close(self, att: AttemptLog, comm: CommLog, rl: RankLog, call: Call, e: dict[str, Any], status: str,
               ts: int, nbytes: int | None = None) -> None:
        """`call` ended with `e` (`nbytes`: what its collective.end says it moved)."""
        duration = e.get("duration_s")
        call.status = status
        call.end_ns = ts
        call.duration_s = duration
        call._end = e
        if self.observers:
            for observer in self.observers:
                observer.call(att, call)
        if status != "ok":
            return
        last = rl.last_finished
        if last is None or (last.end_ns or 0) < ts:
            rl.last_finished = call
        if duration is not None:
            key = (call.op, (nbytes if nbytes is not None else call._start.get("bytes")) or 0)
            latency = comm.latency.get(key)
            if latency is None:
                latency = comm.latency[key] = []
            latency.append(duration)
            if len(latency) >= LATENCY_BLOCK:
                comm.sketch(key, latency)
        seq = call.seq
        if call.peer is not None:
            self._settle_pair(att, comm, call, e.get("comm_rank"))
            return
        ok = comm.ok.get(seq)
        if ok is None:
            return
        ok = comm.ok[seq] = ok + 1
        size = comm.size
        if size is not None and ok == len(comm.calls[seq]) and (
                ok == size or ok + len(self._done[att.attempt]) >= size):
            self._settle(att, comm, seq)

    def _settle(self, att: AttemptLog, comm: CommLog, seq: int) -> None:
        """Let go of a collective every member finished (or every member that will ever log it):
        what verdicts need of it goes into the accumulators."""
        calls = comm.calls[seq]
        if len(calls) < (comm.size or 0):
            done = self._done[att.attempt]
            if not all(r in calls or r in done for r in comm.member_ranks()):
                return
        del comm.calls[seq]
        del comm.ok[seq]
        if _disagree(calls.values()):
            comm.differing_count += 1
            if comm.differing is None or seq < comm.differing[0]:
                comm.differing = (seq, {r: c for r, c in calls.items() if c._start.get("shapes") is not None})
        _count_waits(att, comm, calls)

    def _settle_pair(self, att: AttemptLog, comm: CommLog, call: Call, mine: Any = None) -> None:
        """Let go of a send/recv both sides finished (or whose other side will never log it)."""
        other = comm.global_rank(call.peer)  # type: ignore[arg-type]
        if not isinstance(mine, int):
            mine = next((cr for cr, g in comm.members.items() if g == call.rank), None)
        theirs = comm.p2p_calls.get((other, mine, call.seq)) if mine is not None else None
        if theirs is None:
            if other in self._done[att.attempt]:
                del comm.p2p_calls[(call.rank, call.peer, call.seq)]  # type: ignore[arg-type]
            return
        if theirs.status != "ok":
            return
        del comm.p2p_calls[(call.rank, call.peer, call.seq)]  # type: ignore[arg-type]
        del comm.p2p_calls[(other, mine, call.seq)]  # type: ignore[arg-type]
        self._observe_pair(att, comm, call.seq, [call, theirs])

    def _observe_pair(self, att: AttemptLog, comm: CommLog, seq: int, calls: list[Call]) -> None:
        sends = [c for c in calls if c.op == "send" and c.start_ns is not None]
        recvs = [c for c in calls if c.op == "recv" and c.start_ns is not None]
        if len(sends) == 1 and len(recvs) == 1:
            for observer in self.observers:
                observer.pair(att, comm, seq, sends[0], recvs[0])

    def _rank_done(self, attempt: int, rank: int) -> None:
        """`rank` logs nothing more in `attempt`: settle what only waited for it."""
        done = self._done[attempt]
        if rank in done:
            return
        done.add(rank)
        att = self.attempts[attempt]
        for label in self._comms_of.get((attempt, rank), ()):
            comm = att.comms[label]
            for seq in [s for s, ok in comm.ok.items() if ok == len(comm.calls[s]) and rank not in comm.calls[s]]:
                self._settle(att, comm, seq)
            for (r, peer, seq), call in list(comm.p2p_calls.items()):
                if call.status == "ok" and comm.global_rank(peer) == rank and (r, peer, seq) in comm.p2p_calls:
                    self._settle_pair(att, comm, call)

    # -- after the pass -------------------------------------------------------------------
    def job_seen(self) -> str | None:
        return self.job_filter if self.job_filter is not None else next(iter(self.jobs), None)

    def finish(self) -> None:
        """The calls still open when the logs end: counted, and handed to observers."""
        for att in self.attempts.values():
            for comm in att.comms.values():
                for calls in comm.calls.values():
                    _count_waits(att, comm, calls)
                    for call in calls.values():
                        if call.status == "started" or call.source == "flight":
                            for observer in self.observers:
                                observer.call(att, call)
                for call in comm.p2p_calls.values():
                    if call.status == "started" or call.source == "flight":
                        for observer in self.observers:
                            observer.call(att, call)
                for (_, _, seq), calls in sorted(comm.pairs().items()):
                    self._observe_pair(att, comm, seq, list(calls.values()))

    def _dump_owner(self, pid: Any, comm_name: str, comm_rank: Any) -> tuple[int, int] | None:
        """(attempt, global rank) of the process that wrote a dump (which names only its pid and comm rank)."""
        candidates = self._pids.get(pid, set()) if isinstance(pid, int) else set()
        if len(candidates) > 1:
            candidates = {(a, r) for a, r in candidates
                          if (c := self.attempts[a].comms.get(self._label(a, r, comm_name))) is not None
                          and c.members.get(comm_rank) == r}
        return next(iter(candidates)) if len(candidates) == 1 else None

    def _label(self, attempt: int, rank: int, name: str) -> str:
        n = self._incarnation[(attempt, rank, name)]
        return name if n <= 1 else f"{name}#{n}"

    def add_dump(self, path: Path, data: dict[str, Any]) -> DumpInfo:
        """Record a dump, and add its entries that the logs lack (a log that was cut short)."""
        comm_name = str(data.get("comm"))
        where = self._dump_owner(data.get("pid"), comm_name, data.get("rank"))
        dumped = dump_calls(data)
        info = DumpInfo(path=str(path), rank=data.get("rank", -1), comm=comm_name,
                        attempt=where[0] if where else None, reason=str(data.get("reason")),
                        dumped_ns=data.get("dumped_ns"),
                        entries=sum(1 for x in data.get("entries") or [] if isinstance(x, dict)),
                        unfinished=[{"comm": comm_name, "op": c.op, "seq": c.seq,
                                     **({"peer": c.peer} if c.peer is not None else {})}
                                    for c in dumped if c.status == "started"])
        if where is None:
            return info
        attempt, rank = where
        info.rank = rank
        att = self.attempts[attempt]
        comm = att.comms.get(self._label(attempt, rank, comm_name))
        if comm is None:
            return info
        for u in info.unfinished:  # the entries name the peer by its rank in the communicator
            if "peer" in u:
                u["peer"] = comm.global_rank(u["peer"])
        rl = att.ranks[rank]
        comm_rank = data.get("rank")
        for d in dumped:
            call = _find(comm, rank, d.seq, d.peer)
            if call is None:
                for known in (rl.last_started, rl.last_finished):
                    if known is not None and (known.comm, known.seq, known.peer) == (comm.label, d.seq, d.peer):
                        call = known
            if call is None and not _logged(comm, rank, d):
                d.rank, d.comm = rank, comm.label
                self._place(att, comm, d, comm_rank)
                rl.last_started, rl.last_finished = _later(rl.last_started, rl.last_finished, d, None)
                for t, snapshot in att.snapshots.items():  # where the rank was then, had its log had it
                    place = snapshot.get(rank)
                    if place is not None:
                        snapshot[rank] = (*place[:4], *_later(place[4], place[5], d, t))
            elif call is not None and d.stack and call.stack is None:
                call.stack = d.stack
        return info


def _later(started: Call | None, finished: Call | None, call: Call, at_ns: int | None
           ) -> tuple[Call | None, Call | None]:
    """(last started, last finished) by `at_ns` (None: ever) once `call` is counted too."""
    start = call.start_ns or 0
    if at_ns is None or start <= at_ns:
        if started is None or (started.start_ns or 0) < start:
            started = call
        end = call.end_ns or 0
        if call.status == "ok" and (at_ns is None or end <= at_ns) and (
                finished is None or (finished.end_ns or 0) < end):
            finished = call
    return started, finished


def _wants_order(raw: bytes) -> bool:
    """Whether a line wants its window folded in wall-clock order (`_Fold.run`)."""
    return TIMEOUT_MARK in raw or raw.startswith(P2P_STARTS)


def _clock(raw: bytes) -> int | None:
    """A line's integer `ts_ns`, parsed; None when the line is not an event."""
    try:
        event = decode(raw)
    except ValueError:
        return None
    ts = event.get("ts_ns") if type(event) is dict else None
    return ts if type(ts) is int else None


def _count_waits(att: AttemptLog, comm: CommLog, calls: dict[int, Call]) -> None:
    """Who arrived last at a collective every member started, and how long the others waited
    for it (`RankWaits`; each member's count of such collectives is its communicators' `waited`)."""
    if len(calls) != comm.member_count() or len(calls) < 2:
        return
    first = last = -1
    last_rank = -1
    for r, c in calls.items():
        ts = c.start_ns
        if ts is None:
            return  # a member that never logged its start
        if first < 0 or ts < first:
            first = ts
        if ts > last:
            last, last_rank = ts, r
    comm.waited += 1
    w = att.waits[last_rank]
    w.last_count += 1
    w.lags.add((last - first) / 1e9)


def _logged(comm: CommLog, rank: int, call: Call) -> bool:
    """Whether `rank`'s log reaches `call` (of a dump): a dump adds to a log only what comes
    after its end (a log cut short), not what a rotation took from its start."""
    return call.seq <= comm.logged.get(rank if call.peer is None else (rank, call.peer), 0)


def _find(comm: CommLog, rank: int, seq: Any, peer: int | None) -> Call | None:
    if not isinstance(seq, int):
        return None
    if peer is not None:
        return comm.p2p_calls.get((rank, peer, seq))
    calls = comm.calls.get(seq)
    return calls.get(rank) if calls is not None else None


def mixed_jobs(directory: Path, jobs: dict[str | None, JobInfo]) -> MixedJobsError:
    """The refusal to read several jobs' logs as one, naming every job of the directory (its
    `log.open` lines read again: the pass stops at the first line of a second job)."""
    seen = {job: JobInfo(job, set(info.ranks), set(info.attempts), set(info.pids)) for job, info in jobs.items()}
    for paths in rank_segments(directory).values():
        for path in paths:
            with contextlib.suppress(OSError), open(path, "rb") as f:
                for raw in f:
                    if b'"' + HEADER_EVENT.encode() + b'"' not in raw:
                        continue
                    with contextlib.suppress(ValueError):
                        header = decode(raw)
                        info = seen.setdefault(header.get("job"), JobInfo(header.get("job")))
                        info.ranks.add(header.get("rank"))
                        info.attempts.add(header.get("attempt") or 0)
                        info.pids.add(header.get("pid"))
    listing = "; ".join(info.describe() for info in seen.values())
    return MixedJobsError(f"expected the logs of one job in {directory}; found {len(seen)}: {listing}. "
                          f"Read one of them with --job ID (or move each job's logs to a directory of its own)",
                          seen)


def flight_dumps(directory: str | os.PathLike[str]) -> list[tuple[Path, dict[str, Any]]]:
    """Every flight-recorder dump (`flight_rank*.json`) of `directory` that reads as one, with its path."""
    out = []
    for path in sorted(Path(directory).glob("flight_rank*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("kind") == FLIGHT_DUMP_KIND:
            out.append((path, data))
    return out


def dump_calls(data: dict[str, Any]) -> list[Call]:
    """The entries of one flight-recorder dump as calls, as the dump names them: `rank` is the
    communicator rank, `comm` its name, `source` "flight"."""
    status = {"completed": "ok", "started": "started"}
    calls = []
    for x in data.get("entries") or []:
        if not isinstance(x, dict) or not isinstance(x.get("seq"), int):
            continue
        peer = peer_of(x)
        end, start_mono = x.get("end_mono_ns"), x.get("start_mono_ns")
        duration = (end - start_mono) / 1e9 if end and start_mono else None
        call = Call.of(data.get("rank", -1), str(data.get("comm")), x["seq"], str(x.get("op")), x.get("start_ns"),
                       peer=peer, status=status.get(x.get("state"), x.get("state") or "started"), source="flight",
                       bytes=x.get("nbytes"), shapes=x.get("shapes"), dtype=x.get("dtype"), root=x.get("root"),
                       step=x.get("step"), phase=x.get("phase"), duration_s=duration, stack=x.get("stack") or None,
                       pid=data.get("pid"), start_mono_ns=start_mono, end_mono_ns=end, async_op=x.get("async_op"))
        if duration is not None and call.start_ns is not None:
            call.end_ns = call.start_ns + int(duration * 1e9)
        calls.append(call)
    return calls


def peer_of(e: dict[str, Any]) -> int | None:
    """The other side's communicator rank of a send/recv event or flight entry; None for a collective.

    Flight dumps written before entries had `peer` kept it in `root`.
    """
    if e.get("op") not in P2P_OPS:
        return None
    peer = e.get("peer", e.get("root"))
    return peer if isinstance(peer, int) else None


def p2p_name(op: str, seq: int, peer: int) -> str:
    return f"{op} #{seq} {'to' if op == 'send' else 'from'} rank {peer}"


# ---------------------------------------------------------------------------------------
# Where a rank was
# ---------------------------------------------------------------------------------------
@dataclass
class CallRef:
    comm: str
    op: str
    seq: int  # a send/recv's: the count of its pair's point-to-point ops
    status: str  # at the time the position is taken: ok, started (in progress), timed_out, failed
    start_ns: int | None
    peer: int | None = None  # a send/recv's other side (global rank)

    def describe(self) -> str:
        if self.peer is None:
            return f"{self.op} #{self.seq} on {self.comm!r}"
        return f"{p2p_name(self.op, self.seq, self.peer)} on {self.comm!r}"


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

    def describe(self) -> str:
        parts = []
        s = self.last_started
        if s is not None:
            state = {"started": "still in it", "ok": "finished"}.get(s.status, s.status)
            parts.append(f"last started {s.describe()} ({state})")
        f = self.last_finished
        if f is not None and (s is None or (f.comm, f.seq, f.peer) != (s.comm, s.seq, s.peer)):
            parts.append(f"last finished {f.describe()}")
        if s is None and f is None:
            parts.append("no collective yet")
        if self.step is not None or self.phase is not None:
            parts.append(f"step {self.step}, phase {self.phase}")
        if self.last_event:
            parts.append(f"last event {self.last_event}")
        if self.stack:
            parts.append(f"called from {self.stack[-1].strip().splitlines()[0]}")
        return "; ".join(parts)


def position(att: AttemptLog, rank: int, at_ns: int | None = None) -> RankPosition:
    """Where `rank` was at `at_ns`: the end of its log in this attempt (None), or a moment a
    deadline expired (the model keeps where every rank was at each)."""
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
        status = c.status if c.end_ns is not None and c.end_ns <= t else "started"  # still in it at t
        comm = att.comms.get(c.comm)
        peer = None if c.peer is None else comm.global_rank(c.peer) if comm is not None else c.peer
        return CallRef(c.comm, c.op, c.seq, status, c.start_ns, peer)

    return RankPosition(rank=rank, host=rl.host, pid=rl.pid, last_event=last_event, last_event_ns=last_event_ns,
                        step=step, phase=phase, last_started=ref(last_started), last_finished=ref(last_finished),
                        log_ends_ns=rl.last_ns,
                        stack=last_started.stack if last_started and last_started.stack else rl.signal_stack)
