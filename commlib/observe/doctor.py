"""The doctor's analyzer: what went wrong in a run, read from every rank's log and flight dumps.

Pure functions over files that already exist: `load(logdir)` reads `rank*.jsonl` (through
`log.read_events`, which skips a truncated last line), `flight_rank*.json` and the
faulthandler stacks of `stacks_{pid}.txt` (each rank's position shows its main thread's
innermost frame when no flight-recorder stack says where it was) into a `RunLogs`
model, `analyze(run)` turns it into a `Diagnosis`, and `diagnose(logdir)` does both. Nothing
here talks to a process group or a store.

Everything is analyzed per torchrun attempt (the `attempt` field of every event), because
sequence numbers start over in each attempt. Within an attempt a collective is identified
by (communicator, seq); a communicator created twice under one name in one process gets a
label `name#2` for its second incarnation. Send/recv are numbered apart, per peer pair
(their events carry `peer`, the other side's communicator rank, and `seq`, the pair's
count of point-to-point ops), so they never enter the collective matching: a point-to-point
op is identified by (communicator, the pair of ranks, its pair seq), and the k-th op of a
pair on one side matches the k-th on the other (a send with a recv). Ranks in results are always global ranks: the
communicator ranks that `collective.timeout` and `collective.mismatch` carry are mapped
through the `comm_rank` of each rank's events (or the `comm.split` that made the
communicator).

Culprits: for a timeout, the ranks that had not arrived when the deadline expired (the
progress board's `missing_ranks`, plus ranks with no `collective.start` before the timeout,
plus ranks that started it only after); for a peer failure, the members that stopped
logging before it without logging a failure of their own; for a mismatch, the minority
(every differing rank when there is no majority); for a hang (no deadline expired yet),
the ranks that never started the oldest unfinished collective; for a send/recv that timed
out or hangs, the peer that never posted the matching op; for a straggler (a finding, not a
failure), the rank that arrived last at most of an attempt's collectives (at least
`STRAGGLER_MIN_COLLECTIVES` of them) with a median lag of at least `STRAGGLER_MIN_LAG_S`.

Nothing here imports torch (`python -m commlib.doctor` runs where only the logs are).
"""

from __future__ import annotations

import bisect
import enum
import json
import math
import os
import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from commlib.failures import Failure, classify
from commlib.observe.log import read_events
from commlib.observe.stacks import read_main_stacks

FAILURE_EVENTS = ("collective.timeout", "peer.failure", "collective.error")
MISMATCH_EVENT = "collective.mismatch"
# Kept whole in `RankLog.notices` (for the trace): failures, aborts, and anything at warning or above.
NOTICE_EVENTS = (*FAILURE_EVENTS, MISMATCH_EVENT, "comm.abort")
NOTICE_LEVELS = ("warning", "error", "critical")
APP_ERROR_LEVELS = ("error", "critical")
COMMLIB_ERRORS = ("CommError", "CollectiveTimeout", "PeerFailure", "CollectiveMismatch", "CommAborted")
P2P_OPS = ("send", "recv")
_MATCHING_P2P = {"send": "recv", "recv": "send"}
# Rooted list arguments exist only on the root: per-rank shapes legitimately differ.
ROOT_ONLY_SHAPES = ("gather", "scatter")
# op -> (S is n * bytes rather than bytes, bus bandwidth factor for n ranks), after
# NCCL-tests' PERFORMANCE.md. `bytes` in the log is what one rank contributes (its input),
# so for the gathers the whole array S is n times that.
BANDWIDTH: dict[str, tuple[bool, Callable[[int], float]]] = {
    "all_reduce": (False, lambda n: 2 * (n - 1) / n),
    "all_gather": (True, lambda n: (n - 1) / n),
    "all_gather_single": (True, lambda n: (n - 1) / n),
    "reduce_scatter": (False, lambda n: (n - 1) / n),
    "reduce_scatter_single": (False, lambda n: (n - 1) / n),
    "all_to_all_single": (False, lambda n: (n - 1) / n),
    "broadcast": (False, lambda n: 1.0),
    "reduce": (False, lambda n: 1.0),
    "gather": (True, lambda n: (n - 1) / n),
    "scatter": (False, lambda n: (n - 1) / n),
    "send": (False, lambda n: 1.0),
}
# A rank inside a collective that fails elsewhere logs its own outcome by its own deadline;
# one that has not, this long after, was stopped or dead (SIGSTOP, a kill mid-collective).
FROZEN_GRACE_S = 1.0
# A straggler: last to arrive at this share of an attempt's collectives, with this median lag
# (gloo on loopback: ranks of a healthy job start a collective well under a millisecond apart).
STRAGGLER_LAST_SHARE = 0.6
STRAGGLER_MIN_LAG_S = 0.02
STRAGGLER_MIN_COLLECTIVES = 10  # fewer: one late arrival (a rank that hung, then timed out) is no pattern
_RANK_FILE = re.compile(r"rank(\d+)\.jsonl$")


class DoctorInputError(ValueError):
    """The log directory cannot be analyzed (missing, or holds no rank logs)."""


class Kind(enum.StrEnum):
    TIMEOUT = "timeout"
    HANG = "hang"
    MISMATCH = "mismatch"
    DEAD_RANK = "dead_rank"
    PEER_FAILURE = "peer_failure"
    ERROR = "error"
    STRAGGLER = "straggler"  # not a failure: the attempt may still be ok


# ---------------------------------------------------------------------------------------
# The model of the logs
# ---------------------------------------------------------------------------------------
@dataclass
class Call:
    """One rank's view of one collective."""

    rank: int
    comm: str
    seq: int
    op: str
    start_ns: int | None
    bytes: int | None = None
    shapes: list[list[int]] | None = None
    dtype: str | None = None
    root: int | None = None
    deadline_s: float | None = None
    step: Any = None
    phase: Any = None
    end_ns: int | None = None
    duration_s: float | None = None
    status: str = "started"  # started | ok | timed_out | failed
    source: str = "log"  # log | flight (found only in a flight-recorder dump)
    stack: list[str] | None = None
    peer: int | None = None  # send/recv: the other side's communicator rank; seq is the pair's

    def signature(self) -> tuple[Any, ...]:
        """What every rank must agree on at one collective seq."""
        shapes = None if self.op in ROOT_ONLY_SHAPES else json.dumps(self.shapes)
        return (self.op, shapes, self.dtype, self.root)


@dataclass
class RankLog:
    """One rank in one attempt: its events (time, name, step, phase) and its collectives."""

    rank: int
    host: str | None = None
    pid: int | None = None
    # The main thread's stack from its last SIGUSR1 (faulthandler; traceback lines, outermost first).
    signal_stack: list[str] | None = None
    events: list[tuple[int, str, Any, Any]] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)  # in start order
    failures: list[dict[str, Any]] = field(default_factory=list)  # failure and mismatch events
    notices: list[dict[str, Any]] = field(default_factory=list)  # NOTICE_EVENTS / NOTICE_LEVELS, with "label"

    @property
    def first_ns(self) -> int:
        return self.events[0][0]

    @property
    def last_ns(self) -> int:
        return self.events[-1][0]

    def failed_before(self, ts_ns: int) -> bool:
        return any(f["ts_ns"] <= ts_ns for f in self.failures)


@dataclass
class CommLog:
    """One communicator (one incarnation of a name) in one attempt."""

    label: str
    size: int | None = None
    members: dict[int, int] = field(default_factory=dict)  # comm rank -> global rank
    # Collectives only: seq -> rank -> call.
    calls: dict[int, dict[int, Call]] = field(default_factory=lambda: defaultdict(dict))
    # Send/recv as each side logged them: (global rank, peer's comm rank, pair seq) -> call.
    p2p_calls: dict[tuple[int, int, int], Call] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)  # collectives' and send/recv's
    mismatches: dict[int, dict[int, dict[str, Any]]] = field(default_factory=lambda: defaultdict(dict))
    parent: tuple["CommLog", list[int]] | None = None  # the communicator it was split from, and ranks

    def global_rank(self, comm_rank: int) -> int:
        if comm_rank in self.members:
            return self.members[comm_rank]
        if self.parent is not None and comm_rank < len(self.parent[1]):
            return self.parent[0].global_rank(self.parent[1][comm_rank])
        return comm_rank  # no event of that rank on this communicator: assume the world's numbering

    def member_ranks(self) -> list[int]:
        size = self.size if self.size is not None else len(self.members)
        return sorted({self.global_rank(r) for r in range(size)} | set(self.members.values()))

    def pair_key(self, rank: int, peer: int, seq: int) -> tuple[int, int, int]:
        """(lower global rank, higher, pair seq) of `rank`'s send/recv with comm rank `peer`."""
        other = self.global_rank(peer)
        return (min(rank, other), max(rank, other), seq)

    def pairs(self) -> dict[tuple[int, int, int], dict[int, Call]]:
        """Send/recv matched across each pair: (lower global rank, higher, pair seq) -> rank -> call.

        Resolved when asked, not while loading: a peer's global rank is known only once
        every rank's log has been read.
        """
        out: dict[tuple[int, int, int], dict[int, Call]] = defaultdict(dict)
        for (rank, peer, seq), call in self.p2p_calls.items():
            out[self.pair_key(rank, peer, seq)][rank] = call
        return out


@dataclass
class AttemptLog:
    attempt: int
    world_size: int | None = None
    ranks: dict[int, RankLog] = field(default_factory=dict)
    comms: dict[str, CommLog] = field(default_factory=dict)


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


@dataclass
class RunLogs:
    logdir: str
    attempts: dict[int, AttemptLog]
    dumps: list[DumpInfo]
    files: list[str]


def load(logdir: str | os.PathLike[str]) -> RunLogs:
    """Read every rank's log and every flight-recorder dump of `logdir`."""
    directory = Path(logdir)
    if not directory.is_dir():
        raise DoctorInputError(f"expected a log directory; found no directory at {directory}")
    files = sorted((p for p in directory.glob("rank*.jsonl") if _RANK_FILE.search(p.name)),
                   key=lambda p: int(_RANK_FILE.search(p.name).group(1)))  # type: ignore[union-attr]
    if not files:
        hint = (f"they are in {directory / 'logs'}" if any((directory / "logs").glob("rank*.jsonl"))
                else "was the job run with log_dir= or COMMLIB_LOG_DIR set?")
        raise DoctorInputError(f"expected rank*.jsonl logs in {directory}; found none ({hint})")
    builder = _Builder()
    for path in files:
        file_rank = int(_RANK_FILE.search(path.name).group(1))  # type: ignore[union-attr]
        for event in read_events(path):
            builder.add(event, file_rank)
    dumps = [builder.add_dump(p) for p in sorted(directory.glob("flight_rank*.json"))]
    stacks = read_main_stacks(directory)
    for att in builder.attempts.values():
        for rl in att.ranks.values():
            if rl.pid in stacks:
                rl.signal_stack = [f.traceback_line() for f in reversed(stacks[rl.pid])]
    return RunLogs(str(directory), dict(sorted(builder.attempts.items())), [d for d in dumps if d],
                   [str(p) for p in files])


def _peer(e: dict[str, Any]) -> int | None:
    """The other side's communicator rank of a send/recv event or flight entry; None for a collective.

    Flight dumps written before entries had `peer` kept it in `root`.
    """
    if e.get("op") not in P2P_OPS:
        return None
    peer = e.get("peer", e.get("root"))
    return peer if isinstance(peer, int) else None


class _Builder:
    """Folds events, in each file's order, into attempts, ranks, communicators and calls."""

    def __init__(self) -> None:
        self.attempts: dict[int, AttemptLog] = {}
        self._incarnation: dict[tuple[int, int, str], int] = defaultdict(int)  # (attempt, rank, name)
        self._pending_split: dict[tuple[int, int], tuple[str, str, list[int]]] = {}
        # pid -> {(attempt, rank)}: more than one only when hosts reuse a pid
        self._pids: dict[int, set[tuple[int, int]]] = defaultdict(set)

    def _label(self, attempt: int, rank: int, name: str) -> str:
        n = self._incarnation[(attempt, rank, name)]
        return name if n <= 1 else f"{name}#{n}"

    def add(self, e: dict[str, Any], file_rank: int) -> None:
        ts = e.get("ts_ns")
        if not isinstance(ts, int):
            return
        attempt = int(e.get("attempt") or 0)
        rank = int(e.get("rank", file_rank))
        att = self.attempts.get(attempt)
        if att is None:
            att = self.attempts[attempt] = AttemptLog(attempt)
        if isinstance(e.get("size"), int):
            att.world_size = max(att.world_size or 0, e["size"])
        rl = att.ranks.get(rank)
        if rl is None:
            rl = att.ranks[rank] = RankLog(rank)
        rl.host, rl.pid = e.get("host", rl.host), e.get("pid", rl.pid)
        if rl.pid is not None:
            self._pids[rl.pid].add((attempt, rank))
        name = e.get("event", "")
        rl.events.append((ts, name, e.get("step"), e.get("phase")))
        comm_name = e.get("comm")
        if isinstance(comm_name, str) and name == "comm.init":
            self._incarnation[(attempt, rank, comm_name)] += 1
        label = self._label(attempt, rank, comm_name) if isinstance(comm_name, str) else None
        if name in NOTICE_EVENTS or e.get("level") in NOTICE_LEVELS:
            rl.notices.append({**e, "label": label})
        if label is None:
            return
        comm = att.comms.get(label)
        if comm is None:
            comm = att.comms[label] = CommLog(label)
        if isinstance(e.get("comm_rank"), int):
            comm.members[e["comm_rank"]] = rank
        if isinstance(e.get("comm_size"), int):
            comm.size = e["comm_size"]
        if name == "comm.split":
            self._pending_split[(attempt, rank)] = (label, e.get("new_comm"), list(e.get("ranks") or []))
        elif name == "comm.init":
            pending = self._pending_split.pop((attempt, rank), None)
            if pending and pending[1] == comm_name and pending[0] in att.comms and comm.parent is None:
                comm.parent = (att.comms[pending[0]], pending[2])
        elif name == "collective.start":
            self._start(comm, rl, e, ts)
        elif name == "collective.end":
            call = self._call(comm, rl, e, ts)
            call.status, call.end_ns, call.duration_s = "ok", ts, e.get("duration_s")
            call.bytes = e.get("bytes", call.bytes)
        elif name in FAILURE_EVENTS:
            call = self._call(comm, rl, e, ts)
            call.status, call.end_ns, call.duration_s = e.get("status") or "failed", ts, e.get("duration_s")
            failure = {**e, "label": label}
            comm.failures.append(failure)
            rl.failures.append(failure)
        elif name == MISMATCH_EVENT and isinstance(e.get("seq"), int):
            failure = {**e, "label": label}
            comm.mismatches[e["seq"]][rank] = failure
            rl.failures.append(failure)

    def _start(self, comm: CommLog, rl: RankLog, e: dict[str, Any], ts: int) -> None:
        seq = e.get("seq")
        if not isinstance(seq, int):
            return
        peer = _peer(e)
        call = Call(rank=rl.rank, comm=comm.label, seq=seq, op=str(e.get("op")), start_ns=ts,
                    bytes=e.get("bytes"), shapes=e.get("shapes"), dtype=e.get("dtype"),
                    root=None if peer is not None else e.get("root"),
                    deadline_s=e.get("deadline_s"), step=e.get("step"), phase=e.get("phase"), peer=peer)
        self._place(comm, call)
        rl.calls.append(call)

    @staticmethod
    def _place(comm: CommLog, call: Call) -> None:
        if call.peer is not None:
            comm.p2p_calls[(call.rank, call.peer, call.seq)] = call
        else:
            comm.calls[call.seq][call.rank] = call

    @staticmethod
    def _find(comm: CommLog, rank: int, seq: Any, peer: int | None) -> Call | None:
        if not isinstance(seq, int):
            return None
        if peer is not None:
            return comm.p2p_calls.get((rank, peer, seq))
        return comm.calls.get(seq, {}).get(rank)

    def _call(self, comm: CommLog, rl: RankLog, e: dict[str, Any], ts: int) -> Call:
        """The call an end/failure event closes; made up when its start was never logged.

        A failure inside the consistency check happens before the start is logged: the rank
        did arrive, so the call starts `duration_s` before the failure.
        """
        seq, peer = e.get("seq"), _peer(e)
        call = self._find(comm, rl.rank, seq, peer)
        if call is None:
            duration = e.get("duration_s") or 0.0
            call = Call(rank=rl.rank, comm=comm.label, seq=seq if isinstance(seq, int) else -1, op=str(e.get("op")),
                        start_ns=ts - int(duration * 1e9), step=e.get("step"), phase=e.get("phase"), peer=peer)
            if isinstance(seq, int):
                self._place(comm, call)
            rl.calls.append(call)
        return call

    def _dump_owner(self, pid: Any, comm_name: str, comm_rank: Any) -> tuple[int, int] | None:
        """(attempt, global rank) of the process that wrote a dump (which names only its pid and comm rank)."""
        candidates = self._pids.get(pid, set()) if isinstance(pid, int) else set()
        if len(candidates) > 1:
            candidates = {(a, r) for a, r in candidates
                          if (c := self.attempts[a].comms.get(self._label(a, r, comm_name))) is not None
                          and c.members.get(comm_rank) == r}
        return next(iter(candidates)) if len(candidates) == 1 else None

    def add_dump(self, path: Path) -> DumpInfo | None:
        """Record a dump, and add its entries that the logs lack (a log that was cut short)."""
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("kind") != "commlib.flight_recorder":
            return None
        comm_name = str(data.get("comm"))
        where = self._dump_owner(data.get("pid"), comm_name, data.get("rank"))
        entries = [x for x in data.get("entries") or [] if isinstance(x, dict)]
        info = DumpInfo(path=str(path), rank=data.get("rank", -1), comm=comm_name,
                        attempt=where[0] if where else None, reason=str(data.get("reason")),
                        dumped_ns=data.get("dumped_ns"), entries=len(entries),
                        unfinished=[{"comm": comm_name, "op": x.get("op"), "seq": x.get("seq"),
                                     **({"peer": _peer(x)} if _peer(x) is not None else {})}
                                    for x in entries if x.get("state") == "started"])
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
        status = {"completed": "ok", "started": "started"}
        for x in entries:
            seq, peer = x.get("seq"), _peer(x)
            if not isinstance(seq, int):
                continue
            call = self._find(comm, rank, seq, peer)
            if call is None:
                end, start_mono = x.get("end_mono_ns"), x.get("start_mono_ns")
                duration = (end - start_mono) / 1e9 if end and start_mono else None
                call = Call(rank=rank, comm=comm.label, seq=seq, op=str(x.get("op")), start_ns=x.get("start_ns"),
                            bytes=x.get("nbytes"), shapes=x.get("shapes"), dtype=x.get("dtype"),
                            root=None if peer is not None else x.get("root"),
                            step=x.get("step"), phase=x.get("phase"), source="flight",
                            status=status.get(x.get("state"), x.get("state") or "started"),
                            duration_s=duration, peer=peer)
                if duration is not None and call.start_ns is not None:
                    call.end_ns = call.start_ns + int(duration * 1e9)
                self._place(comm, call)
                bisect.insort(rl.calls, call, key=lambda c: c.start_ns or 0)
            if x.get("stack") and call.stack is None:
                call.stack = x["stack"]
        return info


# ---------------------------------------------------------------------------------------
# Results
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
        return f"{_p2p_name(self.op, self.seq, self.peer)} on {self.comm!r}"


def _p2p_name(op: str, seq: int, peer: int) -> str:
    return f"{op} #{seq} {'to' if op == 'send' else 'from'} rank {peer}"


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


@dataclass
class Problem:
    kind: Kind
    ranks: list[int]  # culprits (global ranks)
    comm: str | None
    op: str | None
    seq: int | None
    message: str
    reporters: list[int] = field(default_factory=list)  # ranks whose logs show it
    ts_ns: int | None = None  # when it first showed
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class AttemptFinding:
    attempt: int
    status: str  # ok | failed | incomplete
    ranks: list[int]
    world_size: int | None
    collectives: int  # distinct (communicator, seq) started
    start_ns: int
    end_ns: int
    problems: list[Problem]
    culprits: list[int]  # the culprits of the earliest problem that names any
    positions: list[RankPosition]  # every rank at the end of its log (failed/incomplete attempts)
    p2p_ops: int = 0  # distinct (communicator, pair, pair seq) started


@dataclass
class StragglerStat:
    """How long the other ranks waited for this rank to arrive (wall clocks: see README)."""

    rank: int
    collectives: int
    last_count: int  # collectives this rank arrived last at
    waited_total_s: float
    waited_p50_s: float
    waited_p99_s: float


@dataclass
class OpStat:
    op: str
    comm_size: int
    bytes: int  # per-rank input bytes as logged
    samples: int  # (rank, collective) pairs that completed
    p50_s: float
    p99_s: float
    algbw_gbps: float | None  # S / p50, GB/s (1e9 bytes)
    busbw_gbps: float | None


@dataclass
class Diagnosis:
    logdir: str
    world_size: int | None
    hosts: list[str]
    attempts: list[AttemptFinding]
    stragglers: list[StragglerStat]
    ops: list[OpStat]
    dumps: list[DumpInfo]

    @property
    def final(self) -> AttemptFinding | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def ok(self) -> bool:
        return all(a.status == "ok" for a in self.attempts)

    @property
    def exit_code(self) -> int:
        """0: no problem; 1: the final attempt has a problem; 3: earlier attempts failed, the last is ok."""
        if self.ok:
            return 0
        return 1 if self.final is None or self.final.status != "ok" else 3

    def to_dict(self) -> dict[str, Any]:
        return {**_plain(asdict(self)), "ok": self.ok, "exit_code": self.exit_code}


def _plain(obj: Any) -> Any:
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


# ---------------------------------------------------------------------------------------
# Analysis
# ---------------------------------------------------------------------------------------
def diagnose(logdir: str | os.PathLike[str]) -> Diagnosis:
    """Read `logdir` and say what went wrong in every attempt (see the module docstring)."""
    return analyze(load(logdir))


def analyze(run: RunLogs) -> Diagnosis:
    last = max(run.attempts, default=None)
    attempts = [_analyze_attempt(att, [d for d in run.dumps if d.attempt == n], final=n == last)
                for n, att in run.attempts.items()]
    hosts = sorted({rl.host for att in run.attempts.values() for rl in att.ranks.values() if rl.host})
    world = max((att.world_size or 0 for att in run.attempts.values()), default=0) or None
    return Diagnosis(logdir=run.logdir, world_size=world, hosts=hosts, attempts=attempts,
                     stragglers=stragglers(run), ops=op_stats(run), dumps=run.dumps)


def _analyze_attempt(att: AttemptLog, dumps: list[DumpInfo], final: bool) -> AttemptFinding:
    problems: list[Problem] = []
    for comm in att.comms.values():
        mismatches = _mismatches(comm)
        problems += mismatches.values()
        problems += _failures(att, comm, mismatches, dumps)
    problems += _app_errors(att)  # before dead ranks: a backend failure outside commlib is evidence too
    problems += _dead_ranks(att, problems)
    problems.sort(key=lambda p: (p.ts_ns or 0, p.kind.value))
    slow = _straggler(att)
    if all(p.kind is Kind.HANG for p in problems):
        # Nobody reported a failure: a live hang, a job killed from outside, or (an attempt
        # torchrun followed with another) a rank that died between collectives.
        status = "incomplete" if problems or not final else "ok"
    else:
        status = "failed"
    if slow is not None:
        problems.append(slow)  # after the failures: they, when any, name the culprits
    culprits = next((sorted(p.ranks) for p in problems if p.ranks), [])
    return AttemptFinding(
        attempt=att.attempt, status=status, ranks=sorted(att.ranks), world_size=att.world_size,
        collectives=sum(1 for c in att.comms.values() for calls in c.calls.values() if calls),
        start_ns=min(rl.first_ns for rl in att.ranks.values()), end_ns=max(rl.last_ns for rl in att.ranks.values()),
        problems=problems, culprits=culprits,
        positions=[position(att, r) for r in sorted(att.ranks)] if status != "ok" else [],
        p2p_ops=sum(len(c.pairs()) for c in att.comms.values()))


def _app_errors(att: AttemptLog) -> list[Problem]:
    """Error-level events of the application (a trainer's own `train.error`, say), per event name.

    Culprits are the union of the events' `ranks` field when every event has one (the
    convention for an application that knows whom to blame), else the ranks that logged
    it. An error that merely carries a commlib failure up is left out: the failure itself
    is reported from commlib's own events.
    """
    by_name: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rl in att.ranks.values():
        for e in rl.notices:
            if (e.get("level") in APP_ERROR_LEVELS and e.get("event") not in NOTICE_EVENTS
                    and e.get("error_type") not in COMMLIB_ERRORS):
                by_name[str(e.get("event"))].append(e)
    problems = []
    for name, events in sorted(by_name.items()):
        reporters = sorted({e["rank"] for e in events})
        blamed = [e.get("ranks") for e in events]
        if all(isinstance(b, list) and all(isinstance(r, int) for r in b) for b in blamed):
            culprits = sorted({r for b in blamed for r in b})  # type: ignore[union-attr]
        else:
            culprits = reporters
        first = min(events, key=lambda e: e["ts_ns"])
        what = first.get("error") or first.get("message") or ""
        message = f"{name} logged at error level by rank(s) {reporters}: {first.get('error_type') or ''} {what}"
        details: dict[str, Any] = {"event": name}
        if classify(first.get("error_type"), str(what)) in (Failure.TIMEOUT, Failure.PEER):
            # A torch.distributed call commlib did not issue (DCP's collectives, say) timed out
            # or lost a peer: its reporters are victims, and the suspects are the ranks that
            # had gone quiet before it without an error of their own.
            others = sorted(set(att.ranks) - set(reporters))
            quiet = [r for r in _gone_before(att, others, first["ts_ns"]) if not att.ranks[r].failed_before(first["ts_ns"])]
            culprits, details["quiet"] = quiet, quiet
            message += (f" (a backend failure in a torch.distributed call outside commlib; rank(s) {quiet} had "
                        f"stopped logging before it)" if quiet else
                        " (a backend failure in a torch.distributed call outside commlib)")
        problems.append(Problem(Kind.ERROR, culprits, first.get("label"), first.get("op"), first.get("seq"),
                                message.strip(), reporters, first["ts_ns"], details))
    return problems


def position(att: AttemptLog, rank: int, at_ns: int | None = None) -> RankPosition:
    """Where `rank` was at `at_ns` (default: the end of its log in this attempt)."""
    rl = att.ranks.get(rank)
    if rl is None:
        return RankPosition(rank, None, None, None, None, None, None, None, None, None)
    t = rl.last_ns if at_ns is None else at_ns
    i = bisect.bisect_right(rl.events, t, key=lambda ev: ev[0])
    last = rl.events[i - 1] if i else None
    step = phase = None
    for ev in reversed(rl.events[:i]):
        if ev[2] is not None or ev[3] is not None:
            step, phase = ev[2], ev[3]
            break
    started = [c for c in rl.calls if c.start_ns is not None and c.start_ns <= t]
    finished = [c for c in started if c.status == "ok" and c.end_ns is not None and c.end_ns <= t]
    last_started = max(started, key=lambda c: c.start_ns or 0, default=None)
    last_finished = max(finished, key=lambda c: c.end_ns or 0, default=None)

    def ref(c: Call | None) -> CallRef | None:
        if c is None:
            return None
        status = c.status if c.end_ns is not None and c.end_ns <= t else "started"  # still in it at t
        comm = att.comms.get(c.comm)
        peer = None if c.peer is None else comm.global_rank(c.peer) if comm is not None else c.peer
        return CallRef(c.comm, c.op, c.seq, status, c.start_ns, peer)

    return RankPosition(rank=rank, host=rl.host, pid=rl.pid, last_event=last[1] if last else None,
                        last_event_ns=last[0] if last else None, step=step, phase=phase,
                        last_started=ref(last_started), last_finished=ref(last_finished),
                        log_ends_ns=rl.last_ns,
                        stack=last_started.stack if last_started and last_started.stack else rl.signal_stack)


def _ops_text(calls: dict[int, Call]) -> str:
    return "/".join(sorted({c.op for c in calls.values()})) or "?"


def _mismatches(comm: CommLog) -> dict[int, Problem]:
    """The first seq of `comm` at which ranks disagree (later ones are its consequences)."""
    found = [p for p in (_checked_mismatch(comm), _seen_mismatch(comm)) if p is not None]
    first = min(found, key=lambda p: p.seq or 0) if found else None
    return {first.seq: first} if first is not None and first.seq is not None else {}


def _checked_mismatch(comm: CommLog) -> Problem | None:
    """The first mismatch the consistency check raised (`collective.mismatch` events)."""
    if not comm.mismatches:
        return None
    seq = min(comm.mismatches)
    by_rank = comm.mismatches[seq]
    ops = {r: ev.get("op") for r, ev in by_rank.items()}
    return _mismatch_problem(comm, seq, _agreement_groups(comm, by_rank), ops,
                             reporters=sorted(by_rank), ts=min(ev["ts_ns"] for ev in by_rank.values()),
                             detail=next(iter(by_rank.values())).get("error"), checked=True)


def _seen_mismatch(comm: CommLog) -> Problem | None:
    """The first seq whose `collective.start` events disagree (the check was off).

    Only calls whose start was logged count: a call made up from its failure event (a rank
    whose pre-hook raised, or that failed before its start was written) has no shapes to compare.
    """
    started = {seq: {r: c for r, c in calls.items() if c.shapes is not None} for seq, calls in comm.calls.items()}
    differing = [seq for seq, calls in sorted(started.items()) if len({c.signature() for c in calls.values()}) > 1]
    if not differing:
        return None
    seq = differing[0]
    calls = started[seq]
    by_sig: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    for r, c in sorted(calls.items()):
        by_sig[c.signature()].append(r)
    detail = "; ".join(f"rank {r}: {c.op}(shapes={c.shapes}, dtype={c.dtype}, root={c.root})"
                       for r, c in sorted(calls.items()))
    problem = _mismatch_problem(comm, seq, list(by_sig.values()), {r: c.op for r, c in calls.items()},
                                reporters=sorted(calls), ts=min(c.start_ns or 0 for c in calls.values()),
                                detail=detail, checked=False)
    problem.details["later_differing_seqs"] = len(differing) - 1
    return problem


def _agreement_groups(comm: CommLog, by_rank: dict[int, dict[str, Any]]) -> list[list[int]]:
    """Ranks that agreed with each other, from each rank's `differing_ranks` (comm ranks)."""
    differ = {r: {comm.global_rank(d) for d in ev.get("differing_ranks") or []} for r, ev in by_rank.items()}
    groups: list[list[int]] = []
    for r in sorted(by_rank):
        for g in groups:
            s = g[0]
            if r not in differ.get(s, set()) and s not in differ.get(r, set()):
                g.append(r)
                break
        else:
            groups.append([r])
    return groups


def _mismatch_problem(comm: CommLog, seq: int, groups: list[list[int]], ops: dict[int, Any], *,
                      reporters: list[int], ts: int, detail: str | None, checked: bool) -> Problem:
    groups = sorted(groups, key=lambda g: (-len(g), g))
    majority = groups[0] if len(groups) > 1 and len(groups[0]) > len(groups[1]) else None
    culprits = sorted(r for g in groups if g is not majority for r in g)
    parts = []
    for g in groups:
        g_ops = sorted({str(ops[r]) for r in g if r in ops})
        parts.append(f"ranks {g} issued {'/'.join(g_ops) or '?'}")
    how = "the consistency check caught it" if checked else "seen in the collective.start events"
    who = f"the minority {culprits}" if majority else f"no majority: all of {culprits}"
    message = (f"ordering mismatch at #{seq} on {comm.label!r}: {'; '.join(parts)} ({how}); culprits: {who}")
    op_names = sorted({str(o) for o in ops.values()})
    return Problem(Kind.MISMATCH, culprits, comm.label, "/".join(op_names), seq, message, reporters, ts,
                   {"groups": groups, "ops": {str(r): o for r, o in sorted(ops.items())}, "detail": detail,
                    "checked": checked})


def _failures(att: AttemptLog, comm: CommLog, mismatches: dict[int, Problem],
              dumps: list[DumpInfo]) -> list[Problem]:
    """Timeouts, peer failures and errors logged on `comm` (collectives' and send/recv's), or
    else the oldest unfinished collective and, per pair of ranks, the oldest unfinished send/recv."""
    problems: list[Problem] = []
    by_key: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    by_pair: dict[tuple[tuple[int, int, int], str], list[dict[str, Any]]] = defaultdict(list)
    for f in comm.failures:
        peer = _peer(f)
        if peer is not None and isinstance(f.get("seq"), int):
            by_pair[(comm.pair_key(f["rank"], peer, f["seq"]), f["event"])].append(f)
        else:
            by_key[(f.get("seq", -1), f["event"])].append(f)
    for (seq, event), events in sorted(by_key.items(), key=lambda kv: min(e["ts_ns"] for e in kv[1])):
        mismatch = mismatches.get(seq)
        if event == "collective.timeout":
            problems.append(_timeout(att, comm, seq, events, mismatch))
        elif event == "peer.failure":
            problems.append(_peer_failure(att, comm, seq, events))
        else:
            problems.append(_error(comm, seq, events, mismatch))
    for (key, event), events in sorted(by_pair.items(), key=lambda kv: min(e["ts_ns"] for e in kv[1])):
        problems.append(_p2p_failure(att, comm, key, event, events))
    if not comm.failures:
        hang = _hang(att, comm, mismatches, dumps)
        if hang is not None:
            problems.append(hang)
        problems += _p2p_hangs(att, comm, dumps)
    return problems


def _arrivals(comm: CommLog, seq: int) -> dict[int, int | None]:
    return {r: c.start_ns for r, c in comm.calls.get(seq, {}).items()}


def _where(att: AttemptLog, ranks: list[int], at_ns: int | None) -> dict[str, Any]:
    return {str(r): asdict(position(att, r, at_ns)) for r in ranks}


def _where_text(att: AttemptLog, ranks: list[int], at_ns: int | None) -> str:
    return "; ".join(f"rank {r}: {position(att, r, at_ns).describe()}" for r in ranks)


def _timeout(att: AttemptLog, comm: CommLog, seq: int, events: list[dict[str, Any]],
             mismatch: Problem | None) -> Problem:
    t = min(e["ts_ns"] for e in events)
    reporters = sorted({e["rank"] for e in events})
    op = events[0].get("op")
    board_missing = {comm.global_rank(r) for e in events for r in (e.get("missing_ranks") or [])}
    board_known = any(e.get("missing_ranks") is not None for e in events)
    stale = sorted({comm.global_rank(r) for e in events for r in (e.get("stale_ranks") or [])})
    arrivals = _arrivals(comm, seq)
    members = comm.member_ranks()
    late = sorted(r for r, ts in arrivals.items() if r not in reporters and ts is not None and ts > t)
    never = sorted(r for r in members if r not in arrivals and r not in reporters)
    missing = sorted(board_missing | set(late) | set(never))
    arrived = sorted(r for r in members if r not in missing)
    deadline = events[0].get("deadline")
    frozen = _frozen(comm.calls.get(seq, {}), t)
    head = (f"{op} #{seq} on {comm.label!r} timed out"
            + (f" after {deadline:g} s" if isinstance(deadline, (int, float)) else "")
            + f" on rank(s) {reporters}")
    if missing:
        culprits = missing
        body = f"rank(s) {missing} had not arrived"
        if late:
            body += "; " + ", ".join(f"rank {r} started it {(arrivals[r] - t) / 1e9:.2f} s after the deadline"
                                     for r in late)
    elif mismatch is not None:
        culprits = mismatch.ranks
        body = f"every rank arrived, but rank(s) {mismatch.ranks} issued a different collective (see the mismatch)"
    else:
        culprits = sorted(set(stale) | set(frozen))
        body = "every rank arrived and the backend did not complete it"
        if frozen:
            body += f"; rank(s) {frozen} never left it, not even at their own deadline (stopped or dead)"
        if stale:
            body += f"; rank(s) {stale} had stopped sending heartbeats"
    message = f"{head}: {body}. Arrived: {arrived}."
    if culprits:
        message += f" Where they were at the deadline: {_where_text(att, culprits, t)}."
    return Problem(Kind.TIMEOUT, culprits, comm.label, op, seq, message, reporters, t,
                   {"arrived": arrived, "missing": missing,
                    "board_missing": sorted(board_missing) if board_known else None, "late": late,
                    "stale": stale, "frozen": frozen, "deadline_s": deadline, "where": _where(att, culprits, t)})


def _frozen(calls: dict[int, Call], t: int) -> list[int]:
    """Ranks in the collective at `t` that logged no outcome of it by their own deadline (plus grace).

    Reporters count too: a rank stopped past its deadline reports its own timeout once resumed.
    """
    out = []
    for r, c in sorted(calls.items()):
        if c.start_ns is None or c.start_ns > t or c.deadline_s is None:
            continue
        due = c.start_ns + int((c.deadline_s + FROZEN_GRACE_S) * 1e9)
        if c.end_ns is None or c.end_ns > due:
            out.append(r)
    return out


def _gone_before(att: AttemptLog, ranks: list[int], t: int) -> list[int]:
    return [r for r in ranks if r not in att.ranks or att.ranks[r].last_ns <= t]


def _peer_failure(att: AttemptLog, comm: CommLog, seq: int, events: list[dict[str, Any]],
                  others: list[int] | None = None, what: str | None = None) -> Problem:
    """`others`: the ranks that could have failed (default every other member); `what`: the op, in words."""
    t = min(e["ts_ns"] for e in events)
    reporters = sorted({e["rank"] for e in events})
    op = events[0].get("op")
    if others is None:
        others = [r for r in comm.member_ranks() if r not in reporters]
    gone = _gone_before(att, others, t)
    silent = [r for r in gone if r not in att.ranks or not att.ranks[r].failed_before(t)]
    head = f"rank(s) {reporters} saw a peer fail during {what or f'{op} #{seq}'} on {comm.label!r}"
    if silent:
        message = (f"{head}: rank(s) {silent} had stopped logging before, without reporting an error "
                   f"(killed or crashed). {_where_text(att, silent, None)}.")
    elif gone:
        message = (f"{head}: rank(s) {gone} had already failed and left: a consequence of their failure "
                   f"(see the earlier problem).")
    elif announced := sorted({comm.global_rank(r) for e in events for r in e.get("failed_ranks") or []}):
        message = (f"{head}: rank(s) {announced} had aborted the communicator and said so (their own "
                   f"failure, or an in-job recovery: see the earlier problem).")
    else:
        message = (f"{head}: every other member kept logging after it, so a peer most likely aborted "
                   f"its side after an earlier failure (see the earlier problem).")
    return Problem(Kind.PEER_FAILURE, silent, comm.label, op, seq, message, reporters, t,
                   {"gone": gone, "errors": sorted({str(e.get("error"))[:300] for e in events}),
                    "where": _where(att, gone, None)})


def _error(comm: CommLog, seq: int, events: list[dict[str, Any]], mismatch: Problem | None,
           what: str | None = None) -> Problem:
    t = min(e["ts_ns"] for e in events)
    reporters = sorted({e["rank"] for e in events})
    op = events[0].get("op")
    errors = sorted({f"{e.get('error_type')}: {e.get('error')}" for e in events})
    culprits = mismatch.ranks if mismatch is not None else reporters
    message = f"{what or f'{op} #{seq}'} on {comm.label!r} failed on rank(s) {reporters}: {errors[0]}"
    if mismatch is not None:
        message += f" (ranks disagree on this collective: {mismatch.message})"
    return Problem(Kind.ERROR, culprits, comm.label, op, seq, message, reporters, t, {"errors": errors})


def _hang(att: AttemptLog, comm: CommLog, mismatches: dict[int, Problem], dumps: list[DumpInfo]) -> Problem | None:
    """The oldest collective of `comm` that some rank started and never left (no deadline expired).

    Flight-recorder dumps (SIGUSR1 on a live job) that still show it started confirm the
    rank was alive and in it when dumped.
    """
    unfinished = [seq for seq, calls in comm.calls.items()
                  if any(c.status == "started" for c in calls.values())]
    if not unfinished:
        return None
    seq = min(unfinished)
    calls = comm.calls[seq]
    members = comm.member_ranks()
    stuck = sorted(r for r, c in calls.items() if c.status == "started")
    missing = sorted(r for r in members if r not in calls)
    mismatch = mismatches.get(seq)
    culprits = missing or (mismatch.ranks if mismatch else [])
    t = min(c.start_ns or 0 for c in calls.values())
    op = _ops_text(calls)
    message = (f"{op} #{seq} on {comm.label!r} never finished and no deadline expired: rank(s) {stuck} are in it "
               f"at the end of their logs (hung, or killed while in it)")
    if missing:
        message += (f"; rank(s) {missing} never started it. Where they were: "
                    f"{_where_text(att, missing, None)}")
    elif mismatch is not None:
        message += f"; every rank started it, but: {mismatch.message}"
    else:
        message += "; every rank started it (the backend did not complete it)"
    seen = [d for d in dumps if {"comm": comm.label, "op": op, "seq": seq} in d.unfinished]
    if seen:
        message += (f". Flight-recorder dumps ({', '.join(sorted({d.reason for d in seen}))}) show rank(s) "
                    f"{sorted({d.rank for d in seen})} alive and still in it")
    return Problem(Kind.HANG, culprits, comm.label, op, seq, message + ".", stuck, t,
                   {"stuck": stuck, "missing": missing, "where": _where(att, missing or stuck, None),
                    "dumps": [d.path for d in seen]})


def _p2p_failure(att: AttemptLog, comm: CommLog, key: tuple[int, int, int], event: str,
                 events: list[dict[str, Any]]) -> Problem:
    """A send/recv that timed out, lost its peer or failed: about the pair, never the whole communicator."""
    lo, hi, seq = key
    first = min(events, key=lambda e: e["ts_ns"])
    rank, op = first["rank"], str(first.get("op"))
    peer = hi if rank == lo else lo
    what = _p2p_name(op, seq, peer)
    calls = comm.pairs().get(key, {})
    details: dict[str, Any] = {"p2p": True, "pair": [lo, hi], "peer": peer}
    if event == "peer.failure":
        problem = _peer_failure(att, comm, seq, events, others=[peer], what=what)
    elif event != "collective.timeout":
        problem = _error(comm, seq, events, None, what=what)
    else:
        problem = _p2p_timeout(att, comm, seq, events, rank, op, peer, calls.get(rank), calls.get(peer))
    problem.details.update(details)
    return problem


def _p2p_timeout(att: AttemptLog, comm: CommLog, seq: int, events: list[dict[str, Any]], rank: int, op: str,
                 peer: int, mine: Call | None, theirs: Call | None) -> Problem:
    t = min(e["ts_ns"] for e in events)
    reporters = sorted({e["rank"] for e in events})
    want = _MATCHING_P2P.get(op, "?")
    deadline = events[0].get("deadline")
    head = (f"{_p2p_name(op, seq, peer)} on {comm.label!r} timed out"
            + (f" after {deadline:g} s" if isinstance(deadline, (int, float)) else "") + f" on rank(s) {reporters}")
    late: list[int] = []
    frozen: list[int] = []
    if theirs is None or (theirs.start_ns is not None and theirs.start_ns > t and peer not in reporters):
        culprits = [peer]
        body = f"rank {peer} never posted the matching {_p2p_name(want, seq, rank)}"
        if theirs is not None and theirs.start_ns is not None:
            late = [peer]
            body += f" before the deadline (it posted {theirs.op} #{seq} {(theirs.start_ns - t) / 1e9:.2f} s after it)"
    elif theirs.op == op:
        culprits = sorted({rank, peer})
        body = (f"rank {peer} posted {_p2p_name(theirs.op, seq, rank)} instead of the matching {want}: "
                f"both sides issued {op} as their point-to-point op #{seq} with each other")
    else:
        frozen = _frozen({r: c for r, c in ((rank, mine), (peer, theirs)) if c is not None}, t)
        culprits = frozen
        body = f"rank {peer} posted the matching {want} and the backend did not complete it"
        if frozen:
            body += f"; rank(s) {frozen} never left it, not even at their own deadline (stopped or dead)"
    message = f"{head}: {body}."
    if culprits:
        message += f" Where they were at the deadline: {_where_text(att, culprits, t)}."
    return Problem(Kind.TIMEOUT, culprits, comm.label, op, seq, message, reporters, t,
                   {"arrived": sorted(r for r in (rank, peer) if r not in culprits or r in frozen),
                    "missing": [r for r in culprits if r not in frozen], "late": late, "stale": [],
                    "frozen": frozen, "deadline_s": deadline, "where": _where(att, culprits, t)})


def _p2p_hangs(att: AttemptLog, comm: CommLog, dumps: list[DumpInfo]) -> list[Problem]:
    """Per pair of ranks, the oldest send/recv that a side started and never left (no deadline expired)."""
    by_pair: dict[tuple[int, int], dict[int, dict[int, Call]]] = defaultdict(dict)
    for (lo, hi, seq), calls in comm.pairs().items():
        by_pair[(lo, hi)][seq] = calls
    problems = []
    for (lo, hi), by_seq in sorted(by_pair.items()):
        unfinished = [seq for seq, calls in by_seq.items() if any(c.status == "started" for c in calls.values())]
        if not unfinished:
            continue
        seq = min(unfinished)
        calls = by_seq[seq]
        stuck = sorted(r for r, c in calls.items() if c.status == "started")
        rank = stuck[0]
        peer = hi if rank == lo else lo
        op = calls[rank].op
        theirs = calls.get(peer)
        head = (f"{_p2p_name(op, seq, peer)} on {comm.label!r} never finished and no deadline expired: rank(s) "
                f"{stuck} in it at the end of their logs (hung, or killed while in it)")
        if theirs is None:
            culprits = [peer]
            body = (f"rank {peer} never posted the matching {_p2p_name(_MATCHING_P2P.get(op, '?'), seq, rank)}. "
                    f"Where it was: {_where_text(att, [peer], None)}")
        elif theirs.op == op:
            culprits = [lo, hi]
            body = f"both sides issued {op} as their point-to-point op #{seq} with each other"
        else:
            culprits = []
            body = "both sides posted it (the backend did not complete it)"
        seen = [d for d in dumps if d.rank in stuck and any(
            u.get("comm") == comm.label and u.get("op") == calls[d.rank].op and u.get("seq") == seq
            and u.get("peer") == (hi if d.rank == lo else lo) for u in d.unfinished)]
        message = f"{head}; {body}"
        if seen:
            message += (f". Flight-recorder dumps ({', '.join(sorted({d.reason for d in seen}))}) show rank(s) "
                        f"{sorted({d.rank for d in seen})} alive and still in it")
        t = min(c.start_ns or 0 for c in calls.values())
        problems.append(Problem(Kind.HANG, culprits, comm.label, op, seq, message + ".", stuck, t,
                                {"p2p": True, "pair": [lo, hi], "peer": peer, "stuck": stuck,
                                 "missing": [r for r in (lo, hi) if r not in calls],
                                 "where": _where(att, culprits or stuck, None), "dumps": [d.path for d in seen]}))
    return problems


def _dead_ranks(att: AttemptLog, problems: list[Problem]) -> list[Problem]:
    """Ranks that stopped logging silently while peers saw them fail or go quiet on the board."""
    evidence: dict[int, list[str]] = defaultdict(list)
    for p in problems:
        if p.kind is Kind.PEER_FAILURE:
            for r in p.ranks:
                evidence[r].append(f"rank(s) {p.reporters} saw a peer failure in {p.op} #{p.seq} on {p.comm!r}")
        elif p.kind is Kind.TIMEOUT and p.ts_ns is not None:
            quiet = sorted(set(p.details["stale"]) | set(p.details["frozen"]))
            for r in _gone_before(att, quiet, p.ts_ns):
                if r not in att.ranks or not att.ranks[r].failed_before(p.ts_ns):
                    evidence[r].append(f"it had gone quiet (no heartbeat, or no outcome by its deadline) when "
                                       f"{p.op} #{p.seq} on {p.comm!r} timed out")
        elif p.kind is Kind.ERROR and p.details.get("quiet"):
            for r in p.details["quiet"]:
                evidence[r].append(f"it had stopped logging before rank(s) {p.reporters} hit a backend failure "
                                   f"outside commlib ({p.details['event']})")
    dead = []
    for r, why in sorted(evidence.items()):
        pos = position(att, r)
        when = pos.log_ends_ns
        message = (f"rank {r} ({pos.host}, pid {pos.pid}) stopped logging without reporting an error "
                   f"(dead, killed or stopped): {pos.describe()}. Evidence: {'; '.join(sorted(set(why)))}.")
        last = pos.last_started or pos.last_finished
        dead.append(Problem(Kind.DEAD_RANK, [r], last.comm if last else None, last.op if last else None,
                            last.seq if last else None, message, [], when, {"where": asdict(pos)}))
    return dead


# ---------------------------------------------------------------------------------------
# Stragglers and performance
# ---------------------------------------------------------------------------------------
def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted, non-empty list."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def stragglers(run: RunLogs) -> list[StragglerStat]:
    """Per rank, the time others waited for it: (last start - first start) when it arrived last, else 0.

    Over every collective all of whose members logged a start (all attempts). Starts are
    wall clocks (`ts_ns`) of different processes, so across hosts the figures include the
    hosts' clock offset.
    """
    return _straggler_stats(run.attempts.values())


def _straggler(att: AttemptLog) -> Problem | None:
    """The attempt's straggler finding (see STRAGGLER_LAST_SHARE), or None."""
    stats = _straggler_stats([att])
    top = max(stats, key=lambda s: s.waited_total_s, default=None)
    if top is None or top.collectives < STRAGGLER_MIN_COLLECTIVES:
        return None
    if top.last_count < STRAGGLER_LAST_SHARE * top.collectives or top.waited_p50_s < STRAGGLER_MIN_LAG_S:
        return None
    return Problem(Kind.STRAGGLER, [top.rank], None, None, None,
                   f"rank {top.rank} is a straggler: it arrived last at {top.last_count} of {top.collectives} "
                   f"collectives; the others waited p50 {top.waited_p50_s * 1e3:.0f} ms, p99 "
                   f"{top.waited_p99_s * 1e3:.0f} ms for it ({top.waited_total_s:.1f} s in all)",
                   details=asdict(top))


def _straggler_stats(attempts: Iterable[AttemptLog]) -> list[StragglerStat]:
    waits: dict[int, list[float]] = defaultdict(list)
    last_count: dict[int, int] = defaultdict(int)
    for att in attempts:
        for comm in att.comms.values():
            members = comm.member_ranks()
            if len(members) < 2:
                continue
            for calls in comm.calls.values():
                starts = {r: c.start_ns for r, c in calls.items() if c.start_ns is not None}
                if len(starts) != len(members):
                    continue
                first = min(starts.values())
                last_rank = max(starts, key=lambda r: starts[r])
                last_count[last_rank] += 1
                for r, ts in starts.items():
                    waits[r].append((ts - first) / 1e9 if r == last_rank else 0.0)
    out = []
    for r, values in sorted(waits.items()):
        values.sort()
        out.append(StragglerStat(rank=r, collectives=len(values), last_count=last_count[r],
                                 waited_total_s=sum(values), waited_p50_s=_percentile(values, 0.5),
                                 waited_p99_s=_percentile(values, 0.99)))
    return out


def bandwidth(op: str, nbytes: int, n: int, seconds: float) -> tuple[float | None, float | None]:
    """(algbw, busbw) in GB/s for `op` on `n` ranks, each contributing `nbytes`, taking `seconds`.

    algbw = S / t, busbw = algbw * factor(n), with NCCL-tests' S and factors (see README).
    """
    if op not in BANDWIDTH or nbytes <= 0 or seconds <= 0 or n < 1:
        return None, None
    times_n, factor = BANDWIDTH[op]
    size = nbytes * n if times_n else nbytes
    algbw = size / seconds / 1e9
    return algbw, algbw * factor(n)


def op_stats(run: RunLogs) -> list[OpStat]:
    """Latency and bandwidth per (op, communicator size, bytes) over completed collectives."""
    samples: dict[tuple[str, int, int], list[float]] = defaultdict(list)
    for att in run.attempts.values():
        for comm in att.comms.values():
            n = comm.size or len(comm.members)
            every = [c for calls in comm.calls.values() for c in calls.values()] + list(comm.p2p_calls.values())
            for c in every:
                if c.status == "ok" and c.duration_s is not None and c.source == "log":
                    samples[(c.op, n, int(c.bytes or 0))].append(c.duration_s)
    out = []
    for (op, n, nbytes), values in sorted(samples.items()):
        values.sort()
        p50 = _percentile(values, 0.5)
        algbw, busbw = bandwidth(op, nbytes, n, p50)
        out.append(OpStat(op=op, comm_size=n, bytes=nbytes, samples=len(values), p50_s=p50,
                          p99_s=_percentile(values, 0.99), algbw_gbps=algbw, busbw_gbps=busbw))
    return out
