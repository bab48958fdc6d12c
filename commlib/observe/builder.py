"""The log model built from a run's events as they come, each rank's in its files' order.

`ModelBuilder.add` takes one event at a time (the reading, `commlib.observe.reading`, hands them
over in wall-clock windows) and keeps nothing of the events themselves but what verdicts
are made of. A collective whose every member finished it ("ok") is settled: its statistics
(latency, who arrived last, whether the ranks issued the same thing) go into its
communicator's accumulators and its calls are let go. What stays: the collectives still
open or that failed somewhere, the failure events, per rank where it is (its last event,
step and phase, last started and last finished call), and, at the moment each deadline
expired, where every rank was then. Memory is bounded by ranks x open collectives, not by
the size of the logs. Observers (`Observer`: the trace, the timeline) see each call once it
is final, and each notice, as the builder goes.

Everything is kept per torchrun attempt (the `attempt` field of every event), because
sequence numbers start over in each attempt. Within an attempt a collective is identified
by (communicator, seq); a communicator created twice under one name in one process gets a
label `name#2` for its second incarnation. Send/recv are numbered apart, per peer pair and tag
(their events carry `peer`, the other side's communicator rank, `tag` where it is not 0, and
`seq`, the pair's count of point-to-point ops of that tag), so they never enter the collective
matching: a point-to-point op is identified by (communicator, the pair of ranks, its tag, its
pair seq), and the k-th op of a pair and tag on one side matches the k-th on the other (a send
with the recv of its tag, whatever the order the tags were posted in). Ranks are global
ranks: communicator ranks are mapped through the `comm_rank` of each rank's events (or the
`comm.split` that made the communicator).

Jobs: each process's `log.open` line names its job (`log.job_id`); a second job, where no
job was asked for, stops the builder (`MixedJobsError`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

from commlib.observe.records import (
    ERROR_LEVELS,
    FAILURE_EVENTS,
    MISMATCH_EVENT,
    NOTICE_EVENTS,
    NOTICE_LEVELS,
    AttemptLog,
    Call,
    CommLog,
    ErrorGroup,
    JobInfo,
    MixedJobsError,
    Observer,
    RankLog,
    SeqSet,
    disagree,
    peer_of,
    tag_of,
)
from commlib.observe.typed import UNSET, CollectiveLine, Event
from commlib.record.log import HEADER_ONLY
from commlib.record.logfile import HEADER_EVENT


class Unplaceable(ValueError):
    """An event that names no rank or attempt the model can be kept by (a line to count as garbled)."""


LATENCY_BLOCK = 256
RANK_LISTS = (
    "missing_ranks",
    "stale_ranks",
    "failed_ranks",
    "differing_ranks",
)  # a failure's ranks  # durations a communicator gathers per (op, bytes) before they go into its sketch


class Context:
    """What the pass knows of the events of one stream: its file's rank, and the process,
    attempt, rank and communicators of the events last seen (they change seldom)."""

    __slots__ = ("file_rank", "rank", "pid", "job", "host", "attempt", "att", "rl", "comms", "headers")

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
        # pid -> the fields of its latest log.open line in this stream: a process's events follow
        # its header in its file, and pids repeat across hosts, so headers are never shared between files.
        self.headers: dict[Any, dict[str, Any]] = {}


class ModelBuilder:
    """Adds events, each rank's in its file's order, to attempts, ranks, communicators and calls.

    One of its two entries runs once per line of the logs: `add_collective` for the two
    events every collective writes, decoded typed (`CollectiveLine`, read by attribute);
    `add` for every other event, and for those two where they are dicts, each going to `_other`.
    """

    def __init__(self, job: str | None, observers: list[Observer]) -> None:
        self.attempts: dict[int, AttemptLog] = {}
        self.observers = observers
        self.job_filter = job
        self.jobs: dict[str | None, JobInfo] = {}
        self._incarnation: dict[tuple[int, int, str], int] = defaultdict(int)  # (attempt, rank, name)
        self._pending_split: dict[tuple[int, int], tuple[str, str | None, list[int]]] = {}
        # (host, pid) -> {(attempt, rank)}: more than one only where a host reuses a pid
        self.pids: dict[tuple[str | None, int], set[tuple[int, int]]] = defaultdict(set)
        self._first_timeout: dict[tuple[Any, ...], int] = {}  # a timeout's group -> its first ts_ns
        self._done: dict[int, set[int]] = defaultdict(set)  # attempt -> ranks whose logs of it are over
        self._comms_of: dict[tuple[int, int], set[str]] = defaultdict(set)  # (attempt, rank) -> its communicators

    # -- the events ---------------------------------------------------------------------
    def add(self, e: dict[str, Any], context: Context) -> None:
        """One event, as a dict (the general path)."""
        get: Callable[..., Any] = e.get  # untyped JSON: every value is Any
        name = get("event", "")
        if (get("pid") != context.pid or name == HEADER_EVENT) and self._switch(e, context):
            return  # a log.open line, or a process of a job not asked for
        ts = e["ts_ns"]
        attempt, rank = get("attempt"), get("rank", context.file_rank)
        if attempt != context.attempt or rank != context.rank:
            if type(rank) is not int or (attempt is not None and type(attempt) is not int):
                raise Unplaceable(f"expected an integer rank and attempt; found {rank!r}, {attempt!r}")
            self._enter(e, context, attempt or 0, rank)
        rl = context.rl
        rl.last = e  # type: ignore[union-attr]
        if get("step") is not None or get("phase") is not None:
            rl.stepped = e  # type: ignore[union-attr]
        self._other(e, context, name, ts)

    def add_collective(self, e: CollectiveLine, context: Context) -> None:
        """A collective's start or end, typed (`CollectiveLine`: almost every line), read by
        attribute; the first on its communicator in this stream takes the general path (`_other`)."""
        if e.pid != context.pid and self._switch(e, context):
            return  # a process of a job not asked for
        ts = e.ts_ns
        if e.attempt != context.attempt or e.rank != context.rank:
            self._enter(e, context, e.attempt, e.rank)
        att, rl = context.att, context.rl
        assert att is not None and rl is not None  # `_enter` set them
        rl.last = e
        step, phase = e.step, e.phase
        if (step is not None and step is not UNSET) or (phase is not None and phase is not UNSET):
            rl.stepped = e
        comm = context.comms.get(e.comm)
        if comm is None:
            self._other(e.to_dict(), context, e.event, ts)
        elif e.event == "collective.start":
            seq = e.seq
            call = Call(rl.rank, comm.label, seq, e.op, ts, e)
            calls = comm.calls.get(seq)
            if calls is None:
                calls = self._new_collective(att, comm, seq)
            calls[call.rank] = call
            comm.logged[call.rank] = seq
            last = rl.last_started
            if last is None or (last.start_ns or 0) < ts:
                rl.last_started = call
        else:
            calls = comm.calls.get(e.seq)
            ended = calls.get(rl.rank) if calls is not None else None
            if ended is None:
                ended = self._call(att, comm, rl, e, ts)
            nbytes = e.bytes
            self._close(att, comm, rl, ended, e, "ok", ts, e.duration_s, None if nbytes is UNSET else nbytes)

    def _switch(self, e: Event, context: Context) -> bool:
        """An event of another process than the last one in this stream: its job and host (its
        header's, or its events' own). Whether to leave the event out: a process's log.open line
        (kept as its header), or a process of a job not asked for (left out, each of its events
        coming back here)."""
        pid = e.get("pid")
        if e.get("event") == HEADER_EVENT:
            context.headers[pid] = {k: e[k] for k in HEADER_ONLY if k in e}
            context.pid = ()  # the next event looks its process up again
            return True
        header = context.headers.get(pid, {})
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
            info.processes.add((context.host, pid))
        if self.job_filter is not None and context.job != self.job_filter:
            context.pid = ()
            return True
        return False

    def _enter(self, e: Event, context: Context, attempt: int, rank: int) -> None:
        """The events now come from another (attempt, rank) than the last ones of this stream."""
        if context.att is not None and context.att.attempt < attempt:
            self.rank_done(context.att.attempt, context.rl.rank)  # type: ignore[union-attr]
        att = self.attempts.get(attempt)
        if att is None:
            att = self.attempts[attempt] = AttemptLog(attempt)
        ts = e["ts_ns"]
        rl = att.ranks.get(rank)
        if rl is None:
            rl = att.ranks[rank] = RankLog(rank, e, first_ns=ts)
        header = context.headers.get(context.pid, {})
        size = e.get("size", header.get("size"))
        if isinstance(size, int):
            att.world_size = max(att.world_size or 0, size)
        rl.host = context.host or rl.host
        pid = e.get("pid")
        if pid is not None:
            rl.pid = pid
            if isinstance(pid, int):
                self.pids[(context.host, pid)].add((attempt, rank))
        info = self.jobs[context.job]
        info.ranks.add(rank)
        info.attempts.add(attempt)
        context.attempt, context.rank = e.get("attempt"), e.get("rank", context.file_rank)
        context.att, context.rl = att, rl
        context.comms = {}

    def _other(self, e: dict[str, Any], context: Context, name: str, ts: int) -> None:
        """Every event but a collective's start and end (and those, the first time their
        communicator shows in this stream, or for a send/recv)."""
        att, rl, comm_name = context.att, context.rl, e.get("comm")
        assert att is not None and rl is not None
        notice = name in NOTICE_EVENTS or e.get("level") in NOTICE_LEVELS
        if name == "recovery.in_job" and type(e.get("epoch")) is int:
            rl.recovered = e
        elif name == "comm.abort":
            rl.aborted = e
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
            comm.member_cache = None
        if comm_size is not None and comm.size != comm_size:
            comm.size, comm.member_cache = comm_size, None
        if name == "collective.start":
            self._start(att, comm, rl, e, ts)
        elif name == "collective.end":
            self._close(
                att, comm, rl, self._call(att, comm, rl, e, ts), e, "ok", ts, e.get("duration_s"), e.get("bytes")
            )
        elif name in FAILURE_EVENTS:
            call = self._call(att, comm, rl, e, ts)
            comm.failures.append({**e, **_rank_lists(e), "label": comm.label})
            self._failed(rl, ts)
            self._close(att, comm, rl, call, e, e.get("status") or "failed", ts, e.get("duration_s"))
            if name == "collective.timeout":
                self._snapshot(att, comm, e, ts)
        elif name == MISMATCH_EVENT and isinstance(e.get("seq"), int):
            comm.mismatches[e["seq"]][rl.rank] = {**e, **_rank_lists(e), "label": comm.label}
            self._failed(rl, ts)
        elif name == "comm.split":
            self._pending_split[(att.attempt, rl.rank)] = (comm.label, e.get("new_comm"), list(e.get("ranks") or []))
        elif name == "comm.init":
            pending = self._pending_split.pop((att.attempt, rl.rank), None)
            if pending and pending[1] == comm_name and pending[0] in att.comms and comm.parent is None:
                comm.parent, comm.member_cache = (att.comms[pending[0]], pending[2]), None
        if notice:  # after its call is handed over: a failure is drawn on the track of its communicator
            self._notice(att, rl, e, comm.label)

    def _comm(self, att: AttemptLog, rank: int, name: str) -> CommLog:
        label = self.label(att.attempt, rank, name)
        comm = att.comms.get(label)
        if comm is None:
            comm = att.comms[label] = CommLog(label, seqs=SeqSet())
        self._comms_of[(att.attempt, rank)].add(label)
        return comm

    def _notice(self, att: AttemptLog, rl: RankLog, e: dict[str, Any], label: str | None) -> None:
        for observer in self.observers:
            observer.notice(att, e, label)
        name = e.get("event", "")
        if e.get("level") in ERROR_LEVELS and name not in NOTICE_EVENTS:
            error_type = e.get("error_type")
            key = (str(name), error_type if error_type is None or isinstance(error_type, str) else str(error_type))
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
            low, high = min(mine, peer), max(mine, peer)
            group = (att.attempt, comm.label, e.get("seq"), low, high, tag_of(e))
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
        self.place(att, comm, call, e.get("comm_rank"))
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

    def place(self, att: AttemptLog, comm: CommLog, call: Call, comm_rank: Any) -> None:
        seq = call.seq
        if call.peer is None:
            calls = comm.calls.get(seq)
            if calls is None:
                calls = self._new_collective(att, comm, seq)
            calls[call.rank] = call
            if seq > comm.logged.get(call.rank, 0):
                comm.logged[call.rank] = seq
            return
        tag = call.tag
        if seq > comm.logged.get((call.rank, call.peer, tag), 0):
            comm.logged[(call.rank, call.peer, tag)] = seq
        comm.p2p_calls[(call.rank, call.peer, tag, seq)] = call
        if seq > comm.logged.get((comm.global_rank(call.peer), comm_rank, tag), 0):
            att.p2p_ops += 1  # the other side has not logged it: a pair op not counted yet

    def _call(self, att: AttemptLog, comm: CommLog, rl: RankLog, e: Event, ts: int) -> Call:
        """The call an end/failure event closes; made up when its start was never logged.

        A failure inside the consistency check happens before the start is logged: the rank
        did arrive, so the call starts `duration_s` before the failure.
        """
        seq, peer, tag = e.get("seq"), peer_of(e), tag_of(e)
        call = find_call(comm, rl.rank, seq, peer, tag)
        if call is None:
            took_ns = int((e.get("duration_s") or 0.0) * 1e9)
            mono = e.get("mono_ns")
            call = Call.of(
                rl.rank,
                comm.label,
                seq if isinstance(seq, int) else -1,
                str(e.get("op")),
                ts - took_ns,
                peer=peer,
                step=e.get("step"),
                phase=e.get("phase"),
                label=e.get("label"),
                pid=e.get("pid"),
                start_mono_ns=mono - took_ns if isinstance(mono, int) else None,
                tag=tag,
            )
            if isinstance(seq, int):
                self.place(att, comm, call, e.get("comm_rank"))
            last = rl.last_started
            if last is None or (last.start_ns or 0) < (call.start_ns or 0):
                rl.last_started = call
        return call

    def _close(
        self,
        att: AttemptLog,
        comm: CommLog,
        rl: RankLog,
        call: Call,
        e: Event,
        status: str,
        ts: int,
        duration: Any,
        nbytes: int | None = None,
    ) -> None:
        """`call` ended with `e` (`duration`: its `duration_s`; `nbytes`: what its
        collective.end says it moved)."""
        if type(duration) is not float and not isinstance(duration, int):
            duration = None  # not a number: an event not of commlib's writing
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
        if (
            size is not None
            and ok == len(comm.calls[seq])
            and (ok == size or ok + len(self._done[att.attempt]) >= size)
        ):
            self._settle(att, comm, seq)

    def _settle(self, att: AttemptLog, comm: CommLog, seq: int) -> None:
        """Let go of a collective every member finished (or every member that will ever log it):
        what verdicts need of it goes into the accumulators."""
        calls = comm.calls[seq]
        if len(calls) < (comm.size or 0):
            done = self._done[att.attempt]
            if len(done) < comm.member_count() - len(calls) or not comm.member_set().difference(calls) <= done:
                return  # a member may still log it
        del comm.calls[seq]
        del comm.ok[seq]
        if disagree(calls.values()):
            comm.differing_count += 1
            if comm.differing is None or seq < comm.differing[0]:
                comm.differing = (seq, {r: c for r, c in calls.items() if c._start.get("shapes") is not None})
        _count_waits(att, comm, calls)

    def _settle_pair(self, att: AttemptLog, comm: CommLog, call: Call, mine: Any = None) -> None:
        """Let go of a send/recv both sides finished (or whose other side will never log it)."""
        other, tag = comm.global_rank(call.peer), call.tag  # type: ignore[arg-type]
        if not isinstance(mine, int):
            mine = next((cr for cr, g in comm.members.items() if g == call.rank), None)
        theirs = comm.p2p_calls.get((other, mine, tag, call.seq)) if mine is not None else None
        if theirs is None:
            if other in self._done[att.attempt]:
                del comm.p2p_calls[(call.rank, call.peer, tag, call.seq)]  # type: ignore[arg-type]
            return
        if theirs.status != "ok":
            return
        del comm.p2p_calls[(call.rank, call.peer, tag, call.seq)]  # type: ignore[arg-type]
        del comm.p2p_calls[(other, mine, tag, call.seq)]
        self._observe_pair(att, comm, call.seq, [call, theirs])

    def _observe_pair(self, att: AttemptLog, comm: CommLog, seq: int, calls: list[Call]) -> None:
        sends = [c for c in calls if c.op == "send" and c.start_ns is not None]
        recvs = [c for c in calls if c.op == "recv" and c.start_ns is not None]
        if len(sends) == 1 and len(recvs) == 1:
            for observer in self.observers:
                observer.pair(att, comm, seq, sends[0], recvs[0])

    def rank_done(self, attempt: int, rank: int) -> None:
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
            for key, call in list(comm.p2p_calls.items()):
                settled = key not in comm.p2p_calls  # with its other side, earlier in this loop
                if call.status == "ok" and comm.global_rank(key[1]) == rank and not settled:
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
                for (_, _, _, seq), calls in sorted(comm.pairs().items()):
                    self._observe_pair(att, comm, seq, list(calls.values()))

    def label(self, attempt: int, rank: int, name: str) -> str:
        n = self._incarnation[(attempt, rank, name)]
        return name if n <= 1 else f"{name}#{n}"


def _rank_lists(e: dict[str, Any]) -> dict[str, list[int]]:
    """A failure's lists of ranks, each a list of integers (an event not of commlib's writing may hold anything)."""
    return {
        k: [r for r in v if type(r) is int] if isinstance(v, list) else []
        for k in RANK_LISTS
        if (v := e.get(k)) is not None
    }


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


def find_call(comm: CommLog, rank: int, seq: Any, peer: int | None, tag: int = 0) -> Call | None:
    if not isinstance(seq, int):
        return None
    if peer is not None:
        return comm.p2p_calls.get((rank, peer, tag, seq))
    calls = comm.calls.get(seq)
    return calls.get(rank) if calls is not None else None
