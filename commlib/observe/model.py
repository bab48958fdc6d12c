"""The one model of a run's logs: attempts, ranks, their event streams, and matched collectives.

Every tool that reads commlib's JSON-lines logs reads them through this module (the
doctor's rules and statistics, the trace, `fsdp_overlap.timeline`, `chaos.verify`):
`load(logdir)` reads `rank*.jsonl` (through `log.read_events`, which skips a truncated last
line), `flight_rank*.json` (`flight_dumps`) and the faulthandler stacks of
`stacks_{pid}.txt` (each rank's position shows its main thread's innermost frame when no
flight-recorder stack says where it was) into a `RunLogs`; `build(events)` does the same
for events already in memory. `position(att, rank, at_ns)` says where a rank was at a
moment. Nothing here talks to a process group or a store, and nothing imports torch
(`python -m commlib.doctor` runs where only the logs are).

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
"""

from __future__ import annotations

import bisect
import json
import os
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from commlib.observe.log import read_events
from commlib.observe.stacks import read_main_stacks

FAILURE_EVENTS = ("collective.timeout", "peer.failure", "collective.error")
MISMATCH_EVENT = "collective.mismatch"
# Kept whole in `RankLog.notices` (for the trace): failures, aborts, and anything at warning or above.
NOTICE_EVENTS = (*FAILURE_EVENTS, MISMATCH_EVENT, "comm.abort")
NOTICE_LEVELS = ("warning", "error", "critical")
P2P_OPS = ("send", "recv")
# Rooted list arguments exist only on the root: per-rank shapes legitimately differ.
ROOT_ONLY_SHAPES = ("gather", "scatter")
FLIGHT_DUMP_KIND = "commlib.flight_recorder"
_RANK_FILE = re.compile(r"rank(\d+)\.jsonl$")


class LogDirError(ValueError):
    """The log directory cannot be read (missing, or holds no rank logs)."""


@dataclass
class Call:
    """One rank's view of one collective (or send/recv): its start, its end, and its state."""

    rank: int
    comm: str
    seq: int
    op: str
    start_ns: int | None  # wall clock (`ts_ns`)
    bytes: int | None = None
    shapes: list[list[int]] | None = None
    dtype: str | None = None
    root: int | None = None
    deadline_s: float | None = None
    # The caller's `commlib.context` fields the tools group by (`label`: the A/B bench's mode).
    step: Any = None
    phase: Any = None
    label: Any = None
    end_ns: int | None = None
    duration_s: float | None = None
    status: str = "started"  # started | ok | timed_out | failed
    source: str = "log"  # log | flight (found only in a flight-recorder dump)
    stack: list[str] | None = None
    peer: int | None = None  # send/recv: the other side's communicator rank; seq is the pair's
    pid: int | None = None  # the process that issued it
    start_mono_ns: int | None = None  # the same moments on that host's monotonic clock (`mono_ns`)
    end_mono_ns: int | None = None
    async_op: bool = False
    wait_s: float | None = None  # an async op: how long its wait() blocked the caller
    done_before_wait: bool | None = None  # an async op: it had finished before its wait began

    def signature(self) -> tuple[Any, ...]:
        """What every rank must agree on at one collective seq."""
        shapes = None if self.op in ROOT_ONLY_SHAPES else json.dumps(self.shapes)
        return (self.op, shapes, self.dtype, self.root)


@dataclass
class RankLog:
    """One rank in one attempt: its events (as logged, in its file's order) and its collectives."""

    rank: int
    host: str | None = None
    pid: int | None = None
    # The main thread's stack from its last SIGUSR2 (faulthandler; traceback lines, outermost first).
    signal_stack: list[str] | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)  # in start order
    failures: list[dict[str, Any]] = field(default_factory=list)  # failure and mismatch events
    notices: list[dict[str, Any]] = field(default_factory=list)  # NOTICE_EVENTS / NOTICE_LEVELS, with "label"

    @property
    def first_ns(self) -> int:
        return self.events[0]["ts_ns"]

    @property
    def last_ns(self) -> int:
        return self.events[-1]["ts_ns"]

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


@dataclass(frozen=True)
class Process:
    """A process that logged: its pid, its global rank, and its first event (wall clock)."""

    pid: int
    rank: int
    first_ns: int


@dataclass
class RunLogs:
    logdir: str
    attempts: dict[int, AttemptLog]
    dumps: list[DumpInfo]
    files: list[str]

    def events(self) -> list[dict[str, Any]]:
        """Every rank's events of every attempt as one stream, in wall-clock order."""
        return sorted((e for att in self.attempts.values() for rl in att.ranks.values() for e in rl.events),
                      key=lambda e: e["ts_ns"])

    def processes(self) -> dict[int, Process]:
        """Every process that logged, by pid (hosts reusing a pid share one entry: the earliest)."""
        out: dict[int, Process] = {}
        for att in self.attempts.values():
            for rl in att.ranks.values():
                for e in rl.events:
                    pid = e.get("pid")
                    if isinstance(pid, int) and (pid not in out or e["ts_ns"] < out[pid].first_ns):
                        out[pid] = Process(pid, rl.rank, e["ts_ns"])
        return out


def load(logdir: str | os.PathLike[str]) -> RunLogs:
    """Read every rank's log, every flight-recorder dump and every stack dump of `logdir`."""
    directory = Path(logdir)
    if not directory.is_dir():
        raise LogDirError(f"expected a log directory; found no directory at {directory}")
    files = sorted((p for p in directory.glob("rank*.jsonl") if _RANK_FILE.search(p.name)),
                   key=lambda p: int(_RANK_FILE.search(p.name).group(1)))  # type: ignore[union-attr]
    if not files:
        hint = (f"they are in {directory / 'logs'}" if any((directory / "logs").glob("rank*.jsonl"))
                else "was the job run with log_dir= or COMMLIB_LOG_DIR set?")
        raise LogDirError(f"expected rank*.jsonl logs in {directory}; found none ({hint})")
    builder = _Builder()
    for path in files:
        file_rank = int(_RANK_FILE.search(path.name).group(1))  # type: ignore[union-attr]
        for event in read_events(path):
            builder.add(event, file_rank)
    dumps = [builder.add_dump(path, data) for path, data in flight_dumps(directory)]
    stacks = read_main_stacks(directory)
    for att in builder.attempts.values():
        for rl in att.ranks.values():
            if rl.pid in stacks:
                rl.signal_stack = [f.traceback_line() for f in reversed(stacks[rl.pid])]
    return RunLogs(str(directory), dict(sorted(builder.attempts.items())), dumps, [str(p) for p in files])


def build(events: Iterable[dict[str, Any]], logdir: str = "") -> RunLogs:
    """The model of events already read (each carrying its `rank`; no dumps, no stacks)."""
    builder = _Builder()
    for event in events:
        if isinstance(event.get("rank"), int):
            builder.add(event, event["rank"])
    return RunLogs(logdir, dict(sorted(builder.attempts.items())), [], [])


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
        call = Call(rank=data.get("rank", -1), comm=str(data.get("comm")), seq=x["seq"], op=str(x.get("op")),
                    start_ns=x.get("start_ns"), bytes=x.get("nbytes"), shapes=x.get("shapes"), dtype=x.get("dtype"),
                    root=None if peer is not None else x.get("root"), step=x.get("step"), phase=x.get("phase"),
                    source="flight", status=status.get(x.get("state"), x.get("state") or "started"),
                    duration_s=duration, peer=peer, stack=x.get("stack") or None, pid=data.get("pid"),
                    start_mono_ns=start_mono, end_mono_ns=end, async_op=bool(x.get("async_op")))
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
        rl.events.append(e)
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
            self._close(call, e, "ok", ts)
            call.bytes = e.get("bytes", call.bytes)
            call.wait_s, call.done_before_wait = e.get("wait_s"), e.get("done_before_wait")
        elif name in FAILURE_EVENTS:
            self._close(self._call(comm, rl, e, ts), e, e.get("status") or "failed", ts)
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
        peer = peer_of(e)
        call = Call(rank=rl.rank, comm=comm.label, seq=seq, op=str(e.get("op")), start_ns=ts,
                    bytes=e.get("bytes"), shapes=e.get("shapes"), dtype=e.get("dtype"),
                    root=None if peer is not None else e.get("root"),
                    deadline_s=e.get("deadline_s"), step=e.get("step"), phase=e.get("phase"), label=e.get("label"),
                    peer=peer, pid=e.get("pid"), start_mono_ns=e.get("mono_ns"), async_op=bool(e.get("async_op")))
        self._place(comm, call)
        rl.calls.append(call)

    @staticmethod
    def _close(call: Call, e: dict[str, Any], status: str, ts: int) -> None:
        call.status, call.end_ns, call.end_mono_ns, call.duration_s = status, ts, e.get("mono_ns"), e.get("duration_s")

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
        seq, peer = e.get("seq"), peer_of(e)
        call = self._find(comm, rl.rank, seq, peer)
        if call is None:
            took_ns = int((e.get("duration_s") or 0.0) * 1e9)
            mono = e.get("mono_ns")
            call = Call(rank=rl.rank, comm=comm.label, seq=seq if isinstance(seq, int) else -1, op=str(e.get("op")),
                        start_ns=ts - took_ns, step=e.get("step"), phase=e.get("phase"), label=e.get("label"),
                        peer=peer, pid=e.get("pid"), start_mono_ns=mono - took_ns if isinstance(mono, int) else None)
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
        for d in dumped:
            call = self._find(comm, rank, d.seq, d.peer)
            if call is None:
                call = d
                call.rank, call.comm = rank, comm.label
                self._place(comm, call)
                bisect.insort(rl.calls, call, key=lambda c: c.start_ns or 0)
            elif d.stack and call.stack is None:
                call.stack = d.stack
        return info


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
    """Where `rank` was at `at_ns` (default: the end of its log in this attempt)."""
    rl = att.ranks.get(rank)
    if rl is None:
        return RankPosition(rank, None, None, None, None, None, None, None, None, None)
    t = rl.last_ns if at_ns is None else at_ns
    i = bisect.bisect_right(rl.events, t, key=lambda e: e["ts_ns"])
    last = rl.events[i - 1] if i else None
    step = phase = None
    for e in reversed(rl.events[:i]):
        if e.get("step") is not None or e.get("phase") is not None:
            step, phase = e.get("step"), e.get("phase")
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

    return RankPosition(rank=rank, host=rl.host, pid=rl.pid, last_event=last.get("event", "") if last else None,
                        last_event_ns=last["ts_ns"] if last else None, step=step, phase=phase,
                        last_started=ref(last_started), last_finished=ref(last_finished),
                        log_ends_ns=rl.last_ns,
                        stack=last_started.stack if last_started and last_started.stack else rl.signal_stack)
