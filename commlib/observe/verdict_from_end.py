"""The doctor's verdict read from the end of each rank's logs: who is stuck where, who is dead, who
waits for whom, in seconds whatever the size of the logs.

`verdict(logdir)` reads each rank's files backwards from their end (across rotations), only as
far back as the verdict needs, builds the log model of what it read (`commlib.observe.builder`,
in the same wall-clock order as the full read) and applies the doctor's rules to it
(`commlib.observe.blame`, `whole=False`). A collective that hung at the end of a ten-million
line log is in its last lines, as c10d's flight recorder keeps only its last entries.

How far back: each rank's window starts with its last `INITIAL_BYTES` and grows `GROWTH`-fold,
rank by rank, until the verdict holds everything it stands on:
- where a problem is found, each rank's last started and last finished call (their starts too:
  a call whose start lies before the window is made up from its end) and its last step or
  phase (its position), and the same as of each moment a deadline expired;
- at a collective a problem names, every member's part in it: each member's window holds a
  start on that communicator at or before it (so every later call of that rank there is whole),
  and the communicator's size (in every line) and members (each by its own lines) are known;
  the same for the collectives ranks were held up in when a deadline expired, and for both
  sides of a send/recv;
- a call that a rank's window shows it waiting in (`collective.wait_timeout`: an application
  polling an op with short waits) has its start in that window, however far back: the window
  goes straight to when the wait says it began (a binary search on the lines' clocks), with a
  first window's worth of lines before it (where the rank was then: its last finished call);
- every window starts in the process whose `log.open` line is read for it.
A collective that the windows hold only in part, every part of it finished, is their edge, not
a problem. A rank's window that reaches the start of its attempt holds all of it; where every
window does, the verdict is the full read's. Attempts are told apart by a binary search on the
attempt number of the lines (it only grows within a rank's files), so that each attempt's
window ends where the next one begins; its process's `log.open` line, which its events leave
their host, size and job to, is read wherever the window starts.

Where the tail cannot decide, the whole directory is read (`commlib.observe.run_logs.load`) and
the verdict says why (`ReadInfo.full_read_because`): an in-job recovery in a window (whether
the attempt recovered depends on its whole history), the logs of more than one job, a job
asked for (--job), attempt numbers that go back within a rank's files, a rank's file that
cannot be read, more files than the process may hold open; and windows that would hold more
than half of the logs (a hang near their start): the full read streams them in less memory.
`from_the_end` says so before reading what the full read would read again: the jobs of the
`log.open` lines where the windows start are told before any window is read, and a wait that
began before its window, from the window's lines, before the model of them is built.

What the verdict leaves to the full report (`commlib.observe.diagnosis.diagnose`): the statistics
(stragglers, latency, bandwidth) and the counts of collectives and of time; and what lies wholly
before every window and left no trace in them: an error the application logged and went on
from, a mismatch that completed, an in-job recovery that every window begins after and whose
flight dumps are gone (with a dump of its failure or abort, the windows reach back to it; without
one the attempt reads as ok, not recovered, and a rebuilt communicator as `name`, not `name#2`),
a collective left open by a rank whose later lines are all on other communicators without a
wait on it, or a second job appended to the same files by processes with the same pids and
attempt numbers as the first's, whose `log.open` lines no window holds.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from commlib.observe.blame import attempt_finding
from commlib.observe.builder import ModelBuilder
from commlib.observe.diagnosis import Diagnosis, analyze
from commlib.observe.dumps import add_dump, add_stacks, flight_dumps
from commlib.observe.events import after_cut, rank_segments
from commlib.observe.findings import AttemptFinding, Kind
from commlib.observe.reading import WindowReader, enough_descriptors, stream
from commlib.observe.records import AttemptLog, Call, MixedJobsError, Observer, tag_of
from commlib.observe.run_logs import load
from commlib.record.codec import decode
from commlib.record.files import SIGUSR1_REASON, open_regular
from commlib.record.logfile import HEADER_START

INITIAL_BYTES = 6 * 1024  # of each rank's attempt: a few steps (less costs growth rounds: docs/measurements.md)
LINE_PROBE = 4096  # bytes read at a time to find a whole line (the binary search, a header)
_ATTEMPT = re.compile(rb'"attempt":(\d+)')
_PID = re.compile(rb'"pid":(\d+)')
_CLOCK = re.compile(rb'"ts_ns":(\d+)')
GROWTH = 4  # a window that must reach further back grows this many times over
MOST = 0.5  # windows that would hold more than this share of the logs: the (streaming) full read instead
# A rank polling a call: the call's start is looked for this long before its wait says it began
# (the wait says it on the monotonic clock, the start's line on the wall clock).
WAIT_MARGIN_NS = 10_000_000
_MIXED_JOBS = "the directory holds the logs of more than one job: read in full"
_RECOVERED = "and whether it did depends on all of it: read in full"
_WAITING = b'"collective.wait_timeout"'


@dataclass
class ReadInfo:
    """How the verdict read the logs."""

    bytes_read: int  # of the rank logs, in the windows the verdict stood on
    bytes_total: int
    ranks_whole: list[int]  # ranks whose every attempt was read whole (their window reached its start)
    rounds: int  # windows grown this many times before the verdict held
    full_read_because: str | None = None  # the tail could not decide: the whole directory was read


@dataclass
class _Segment:
    """One attempt's part of one rank's files (offsets into its files read as one sequence)."""

    attempt: int
    start: int
    end: int
    header: bytes | None  # its process's log.open line, at `start`
    glued: bool  # the line at `start` is a line cut short with this log.open line appended
    lo: int = 0  # the window is [lo, end)
    lines: list[bytes] = field(default_factory=list)
    cut: bool = False  # it ends in a line cut short

    @property
    def whole(self) -> bool:
        return self.lo <= self.start


class _Files:
    """One rank's files (rotated ones first) read as one sequence of bytes."""

    def __init__(self, paths: list[Path]) -> None:
        self.fds: list[int] = []
        self.spans: list[tuple[int, int]] = []  # each file's [start, end) in the sequence
        self.size = 0
        try:
            for path in paths:
                fd = open_regular(path)
                self.fds.append(fd)
                size = os.fstat(fd).st_size
                self.spans.append((self.size, self.size + size))
                self.size += size
        except BaseException:
            self.close()
            raise

    def read(self, lo: int, hi: int) -> bytes:
        parts = [
            os.pread(fd, min(hi, end) - max(lo, start), max(lo, start) - start)
            for fd, (start, end) in zip(self.fds, self.spans, strict=False)  # close() empties fds only
            if start < hi and end > lo
        ]
        return b"".join(parts)

    def line_at(self, offset: int) -> tuple[int, bytes] | None:
        """(its start, the line) of the first line that starts at or after `offset`; None past the last."""
        at = offset
        while at > 0:  # a line starts right after a newline
            chunk = self.read(at - 1, min(self.size, at - 1 + LINE_PROBE))
            i = chunk.find(b"\n")
            if i >= 0:
                at += i
                break
            if at - 1 + len(chunk) >= self.size:
                return None
            at += len(chunk)
        data = b""
        while at + len(data) < self.size:
            data += self.read(at + len(data), min(self.size, at + len(data) + LINE_PROBE))
            i = data.find(b"\n")
            if i >= 0:
                return at, data[: i + 1]
        return (at, data) if data else None

    def close(self) -> None:
        while self.fds:
            os.close(self.fds.pop())


# Each rank's files and its attempts' parts of them; a call a window shows its rank waiting in
# (`_waiting`: rank, attempt, communicator, seq, peer, tag, when the wait began).
_Ranks = dict[int, tuple[_Files, list[_Segment]]]
_Wait = tuple[int, int, str, int, int | None, int, float]


def _attempt(line: bytes) -> int | None:
    """A line's attempt: its process's, which ends the line (the last one, where a cut line had one too)."""
    found = _ATTEMPT.findall(line)
    return int(found[-1]) if found else None


def _last_attempt(files: _Files, before: int) -> int | None:
    """The attempt of the last line before offset `before` that says one."""
    hi = before
    while hi > 0:
        lo = max(0, hi - LINE_PROBE)
        for line in reversed(files.read(lo, hi).split(b"\n")[1 if lo else 0 :]):
            attempt = _attempt(line)
            if attempt is not None:
                return attempt
        hi = lo
    return None


def _first_line(files: _Files, key: Callable[[bytes], int | None], least: float, lo: int, end: int) -> int:
    """The offset of the first line in [lo, end) whose `key` is `least` or more, lines without one
    passed over (a binary search: the key only grows along the files); `end` where there is none."""

    def later(offset: int) -> bool:
        found = files.line_at(offset)
        while found is not None and found[0] < end and key(found[1]) is None:
            found = files.line_at(found[0] + len(found[1]))
        return found is None or found[0] >= end or key(found[1]) >= least  # type: ignore[operator]

    hi = end
    while lo < hi:
        mid = (lo + hi) // 2
        if later(mid):
            hi = mid
        else:
            lo = mid + 1
    found = files.line_at(lo)
    return end if found is None else min(found[0], end)


def _reach_back(files: _Files, segment: _Segment, since_ns: float, window: int) -> int:
    """The size that, grown once (`GROWTH`, rounded up), begins `segment`'s window `window` bytes
    before its first line at `since_ns` (less `WAIT_MARGIN_NS`): that line and where the rank was
    then. One line short, the windows grew past their need (at a hang mid-log, into a full read)."""
    reach = segment.end - _first_line(files, _clock, since_ns - WAIT_MARGIN_NS, segment.start, segment.end) + window
    return -(-reach // GROWTH)


def _clock(line: bytes) -> int | None:
    found = _CLOCK.search(line)
    return int(found.group(1)) if found else None


def _segments(files: _Files) -> list[_Segment] | str:
    """Each attempt's part of one rank's files, oldest first; or why they cannot be told apart."""
    segments: list[_Segment] = []
    end = files.size
    attempt = _last_attempt(files, end)
    if attempt is None:  # lines without an attempt number (written by hand, or before it was logged): all one
        found = files.line_at(0)
        header = found[1] if found is not None and found[1].startswith(HEADER_START) else None
        return [_Segment(0, 0, end, header, glued=False)]
    found = files.line_at(0)
    first = _attempt(found[1]) if found is not None else None  # one attempt in the files: no search
    while attempt is not None:
        start = 0 if attempt == first else _first_line(files, _attempt, attempt, 0, end)
        found = files.line_at(start)
        line = found[1] if found is not None and found[0] == start else b""
        header = line if line.startswith(HEADER_START) else after_cut(line)
        segments.append(_Segment(attempt, start, end, header, glued=header is not None and header is not line))
        if start == 0:
            return segments[::-1]
        before = _last_attempt(files, start)
        if before is None or before >= attempt:
            return f"its attempt numbers do not grow (attempt {before} before attempt {attempt})"
        end, attempt = start, before
    return segments[::-1]


def _read_window(files: _Files, segment: _Segment, size: int) -> None:
    """The last `size` bytes of `segment` as whole lines (from a line start, or the segment's)."""
    lo = max(segment.start, segment.end - size)
    if lo > segment.start:  # from the byte before: a window that begins at a line's start keeps that line
        data = files.read(lo - 1, segment.end)
        first = data.find(b"\n")
        data, lo = (data[first + 1 :], lo + first) if first >= 0 else (b"", segment.end)
    else:
        data = files.read(lo, segment.end)
    lines = data.split(b"\n")
    rest = lines.pop()  # b"" after a last newline; else a line cut short (or being written)
    segment.lo, segment.cut = lo, bool(rest)
    segment.lines = [line + b"\n" for line in lines]


def _jobs(ranks: _Ranks) -> set[Any]:
    """The jobs the `log.open` lines read so far name (a header's, and any in a window)."""
    jobs = set()
    for _, segments in ranks.values():
        for s in segments:
            for line in ([s.header] if s.header is not None else []) + [
                x for x in s.lines if x.startswith(HEADER_START)
            ]:
                try:
                    header = decode(line)
                except ValueError:
                    continue
                if isinstance(header, dict):
                    jobs.add(header.get("job"))
    return jobs


def _waiting(ranks: _Ranks) -> list[_Wait]:
    """Each call a window shows its rank waiting in (`collective.wait_timeout`: a caller's shorter
    wait, polling an op that goes on): rank, attempt, communicator, seq, peer, tag, its start."""
    out: dict[tuple[int, int, str, int, int | None, int], float] = {}  # the earliest wait of a call
    for rank, (_, segments) in ranks.items():
        for s in segments:
            for line in s.lines if not s.whole else ():
                if _WAITING not in line:
                    continue
                try:
                    e = decode(line)
                except ValueError:
                    continue
                if isinstance(e, dict) and isinstance(e.get("seq"), int) and isinstance(e.get("comm"), str):
                    peer, elapsed = e.get("peer"), e.get("elapsed_s")
                    began = e.get("ts_ns", 0) - (elapsed * 1e9 if isinstance(elapsed, (int, float)) else 0)
                    peer = peer if isinstance(peer, int) else None
                    key = (rank, s.attempt, e["comm"], e["seq"], peer, tag_of(e))
                    out[key] = min(out.get(key, began), began)
    return [(*key, began) for key, began in out.items()]


def _pid(line: bytes) -> bytes | None:
    found = _PID.search(line)
    return found.group(1) if found else None


def _edge(segment: _Segment) -> int | None:
    """The clock of the first line of a window that does not hold its whole attempt (None where it does)."""
    if segment.whole:
        return None
    for line in segment.lines:
        at = line.find(b'"ts_ns":')
        if at >= 0:
            digits = re.match(rb"\d+", line[at + 8 :])
            if digits:
                return int(digits.group())
    return math.inf  # type: ignore[return-value]


class _Coverage(Observer):
    """What each rank's window holds of its calls: the least collective seq (per communicator) and
    send/recv pair seq (per peer and tag) whose start it holds: every call of that rank from there
    on is whole in it (calls start in seq order)."""

    def __init__(self, edges: dict[tuple[int, int], int | None]) -> None:
        self.edges = edges  # (attempt, rank) -> `_edge` of its window
        self.first_seq: dict[tuple[int, int, str], int] = {}
        self.first_pair: dict[tuple[int, int, str, int, int], int] = {}

    def call(self, att: AttemptLog, call: Call) -> None:
        if call.source != "log" or not call.start_logged:  # a dump's, or made up from its end or failure
            return
        if call.peer is None:
            at = (att.attempt, call.rank, call.comm)
            self.first_seq[at] = min(self.first_seq.get(at, call.seq), call.seq)
        else:
            pair = (att.attempt, call.rank, call.comm, call.peer, call.tag)
            self.first_pair[pair] = min(self.first_pair.get(pair, call.seq), call.seq)

    def pair_seq(self, attempt: int, rank: int, label: str, peer: int | None, tag: int) -> float:
        """The least seq of `rank`'s send/recv with `peer` (its comm rank) under `tag` whose start
        its window holds; infinity where it holds none, or the peer is not known."""
        if peer is None:
            return math.inf
        return self.first_pair.get((attempt, rank, label, peer, tag), math.inf)


def _placed(place: tuple[Any, ...] | None) -> bool:
    """Whether a rank's place (`RankLog.place`) was read whole: its last started and last finished
    calls, their starts too, and a step or phase."""
    if place is None:
        return False
    _, _, step, phase, started, finished = place
    return (
        started is not None
        and started.start_logged
        and finished is not None
        and finished.start_logged
        and (step is not None or phase is not None)
    )


def _needs(att: AttemptLog, finding: AttemptFinding, open_ranks: set[int], coverage: _Coverage) -> set[int]:
    """The ranks of `att` whose windows must reach further back for `finding` to be the full read's.

    Only what the problems stand on is checked: a collective that the windows hold only in part,
    every part of it finished, is the windows' edge, not a problem."""
    a = att.attempt
    if not finding.problems:
        return set()
    need = {r for r in open_ranks if not _placed(att.ranks[r].place())}
    by_comm: dict[str, set[int]] = defaultdict(set)  # communicator -> the collective seqs the problems stand on
    pairs: dict[str, set[tuple[int, int, int, int]]] = defaultdict(set)
    for p in finding.problems:
        if p.kind is Kind.TIMEOUT and p.ts_ns in att.snapshots:
            snapshot = att.snapshots[p.ts_ns]
            need |= {r for r in open_ranks if (coverage.edges[(a, r)] or 0) > p.ts_ns or not _placed(snapshot.get(r))}
        if p.comm not in att.comms or not isinstance(p.seq, int):
            continue
        if p.details.get("p2p"):
            lo, hi = p.details["pair"]
            pairs[p.comm].add((lo, hi, p.details["tag"], p.seq))
            continue
        by_comm[p.comm].add(p.seq)
        if p.kind is Kind.TIMEOUT and p.ts_ns is not None:  # the collectives ranks were held up in then
            by_comm[p.comm] |= {
                k
                for k, calls in att.comms[p.comm].calls.items()
                if k < p.seq and any(c.open_at(p.ts_ns, p.reporters) for c in calls.values())
            }
    for label, seqs in by_comm.items():
        comm, first = att.comms[label], min(seqs)
        if comm.size is None or (comm.parent is None and any(k not in comm.members for k in range(comm.size))):
            need |= open_ranks - set(comm.members.values())  # who the members are is not known yet
        need |= {
            q
            for q in comm.member_ranks()
            if q in open_ranks and coverage.first_seq.get((a, q, label), math.inf) > first
        }
    for label, keys in pairs.items():
        comm_rank_of = {g: c for c, g in att.comms[label].members.items()}
        for lo, hi, tag, seq in keys:
            for q, other in ((lo, hi), (hi, lo)):
                held = coverage.pair_seq(a, q, label, comm_rank_of.get(other), tag)
                if q in open_ranks and held > seq:
                    need.add(q)
    return need


@dataclass(frozen=True)
class InFull:
    """The tail cannot decide: the full read must, for this reason (None: the directory holds no
    rank log or no event, and the full read's refusal says so)."""

    why: str | None


def verdict(logdir: str | os.PathLike[str], job: str | None = None, window: int = INITIAL_BYTES) -> Diagnosis:
    """The doctor's verdict on `logdir`, read from the end of each rank's logs (module docstring):
    a `Diagnosis` without statistics, whose `read` (a `ReadInfo`) says how much was read and,
    where the tail could not decide, why the whole directory was."""
    found = from_the_end(logdir, job, window)
    if isinstance(found, Diagnosis):
        return found
    diagnosis = analyze(load(logdir, job=job))
    diagnosis.read = read_in_full(logdir, diagnosis, found.why)
    return diagnosis


def from_the_end(
    logdir: str | os.PathLike[str], job: str | None = None, window: int = INITIAL_BYTES
) -> Diagnosis | InFull:
    """The verdict read from the end (`verdict`), or, where the tail cannot decide, why the full
    read must: decided before anything is read that the full read would read again."""
    directory = Path(logdir)
    if job is not None:
        return InFull("a job was asked for (--job): read in full")
    if not os.fspath(logdir) or not directory.is_dir() or not rank_segments(directory):
        return InFull(None)  # the refusal of the full read, or its verdict
    paths = rank_segments(directory)
    ranks: _Ranks = {}
    try:
        if not enough_descriptors(sum(len(p) for p in paths.values())):
            return InFull("more rank files than this process may hold open")
        for rank, files_of_rank in paths.items():
            try:
                files = _Files(files_of_rank)
            except OSError as exc:
                return InFull(f"rank {rank}'s files cannot all be read ({exc.strerror or exc})")
            segments = _segments(files)
            ranks[rank] = (files, segments if isinstance(segments, list) else [])
            if isinstance(segments, str):
                return InFull(f"rank {rank}'s log: {segments}")
        if len(_jobs(ranks)) > 1:  # told by the `log.open` lines where the windows start
            return InFull(_MIXED_JOBS)
        return _from_the_end(directory, paths, ranks, window)
    finally:
        for files, _ in ranks.values():
            files.close()


def _planned(ranks: _Ranks, sizes: dict[tuple[int, int], int]) -> int:
    """The bytes windows of `sizes` hold."""
    planned = 0
    for rank, (_, segments) in ranks.items():
        planned += sum(min(sizes[(rank, s.attempt)], s.end - s.start) for s in segments)
    return planned


def _too_large(planned: int, total: int) -> InFull | None:
    """Why windows of `planned` bytes are left to the full read; None where they are not."""
    if planned <= total * MOST:  # streamed, the full read holds less and takes no longer
        return None
    return InFull(
        f"the windows would hold {min(1, planned / max(1, total)):.0%} of the logs "
        f"(small logs, or a problem far back): read in full"
    )


def _reaches(ranks: _Ranks, waits: list[_Wait], window: int) -> dict[_Wait, int]:
    """The size each window must grow to (`_reach_back`) for the waits that began before it starts
    (their call's start cannot be in it), read from the lines alone, before any builder."""
    out = {}
    for wait in waits:
        rank, attempt, *_, began = wait
        files, segments = ranks[rank]
        s = next(s for s in segments if s.attempt == attempt)
        first = _clock(s.lines[0]) if s.lines else None
        if first is not None and began + WAIT_MARGIN_NS < first:
            out[wait] = _reach_back(files, s, began, window)
    return out


def _from_the_end(
    directory: Path,
    paths: dict[int, list[Path]],
    ranks: _Ranks,
    window: int,
) -> Diagnosis | InFull:
    sizes = {(rank, s.attempt): window for rank, (_, segments) in ranks.items() for s in segments}
    skipped: list[tuple[str, str]] = []
    dumps_read: list[tuple[Path, dict[str, Any]]] | None = None  # read at the first builder
    grow = set(sizes)
    rounds = 0
    total = sum(files.size for files, _ in ranks.values())
    while grow:
        rounds += 1
        too_large = _too_large(_planned(ranks, sizes), total)
        if too_large is not None:
            return too_large
        for rank, (files, segments) in ranks.items():
            for s in segments:
                if (rank, s.attempt) in grow:
                    _read_window(files, s, sizes[(rank, s.attempt)])
        grow = {
            (rank, s.attempt)
            for rank, (_, segments) in ranks.items()
            for s in segments
            if not s.whole
            and s.header is not None
            and s.lines
            and not s.lines[0].startswith(HEADER_START)
            and _pid(s.lines[0]) != _pid(s.header)
        }  # the window starts in another process than its header's
        if grow:
            for key in grow:
                sizes[key] *= GROWTH
            continue
        if len(_jobs(ranks)) > 1:
            return InFull(_MIXED_JOBS)
        waits = _waiting(ranks)
        reaches = _reaches(ranks, waits, window)
        ahead = dict(sizes)  # where those waits alone take the windows, the builder aside
        for (rank, a, *_), reach in reaches.items():
            ahead[(rank, a)] = max(ahead[(rank, a)], reach) * GROWTH
        too_large = _too_large(_planned(ranks, ahead), total)
        if too_large is not None:
            return too_large
        if dumps_read is None:
            dumps_read = flight_dumps(directory, skipped)
        stacks_skipped: list[tuple[str, str]] = []
        try:
            builder, coverage, dumps = _build(directory, paths, ranks, dumps_read, stacks_skipped)
        except MixedJobsError:
            return InFull(_MIXED_JOBS)
        if not builder.attempts and all(s.whole for _, segments in ranks.values() for s in segments):
            return InFull(None)  # no event anywhere: the full read's refusal
        whole = {
            a: all(s.whole for _, segments in ranks.values() for s in segments if s.attempt == a)
            for a in builder.attempts
        }
        last = max(builder.attempts, default=None)
        findings = {
            a: attempt_finding(att, [d for d in dumps if d.attempt == a], final=a == last, whole=whole[a])
            for a, att in sorted(builder.attempts.items())
        }
        # A window that holds no event of its attempt yet: the rank is in it, further back.
        grow = {
            (rank, s.attempt)
            for rank, (_, segments) in ranks.items()
            for s in segments
            if not s.whole and rank not in (builder.attempts[s.attempt].ranks if s.attempt in builder.attempts else ())
        }
        for wait in waits:  # a call a rank waits in has its start in its window
            rank, a, name, seq, peer, tag, began = wait
            label = builder.label(a, rank, name)
            held = (
                coverage.first_seq.get((a, rank, label), math.inf)
                if peer is None
                else coverage.pair_seq(a, rank, label, peer, tag)
            )
            if held > seq:
                grow.add((rank, a))
                files, segments = ranks[rank]
                s = next(s for s in segments if s.attempt == a)  # straight back to when it began
                reach = reaches[wait] if wait in reaches else _reach_back(files, s, began, window)
                sizes[(rank, a)] = max(sizes[(rank, a)], reach)
        # A failure or an abort of an attempt that its flight dumps date before a rank's window:
        # an in-job recovery, say, that every window began after (whether the attempt recovered
        # depends on it). That window reaches back to the attempt's first such dump.
        first_failure: dict[int, int] = {}
        for d in dumps:
            if d.reason != SIGUSR1_REASON and d.attempt is not None and d.dumped_ns is not None:
                first_failure[d.attempt] = min(d.dumped_ns, first_failure.get(d.attempt, d.dumped_ns))
        for rank, (files, segments) in ranks.items():
            for seg in segments:
                since = first_failure.get(seg.attempt)
                window_from = _clock(seg.lines[0]) if since is not None and seg.lines and not seg.whole else None
                if since is None or window_from is None or window_from <= since:
                    continue
                grow.add((rank, seg.attempt))
                sizes[(rank, seg.attempt)] = max(sizes[(rank, seg.attempt)], _reach_back(files, seg, since, window))
        for a, att in builder.attempts.items():
            open_ranks = {
                r
                for r, (_, segments) in ranks.items()
                for s in segments
                if s.attempt == a and not s.whole and r in att.ranks
            }
            if open_ranks and any(rl.recovered is not None for rl in att.ranks.values()):
                return InFull(f"attempt {a} recovered in-job, {_RECOVERED}")
            grow |= {(r, a) for r in _needs(att, findings[a], open_ranks, coverage)}
        for key in grow:
            sizes[key] *= GROWTH
    read = sum(len(line) for _, segments in ranks.values() for s in segments for line in s.lines)
    info = ReadInfo(
        read, total, sorted(r for r, (_, segments) in ranks.items() if all(s.whole for s in segments)), rounds
    )
    atts = builder.attempts
    return Diagnosis(
        logdir=str(directory),
        world_size=max((a.world_size or 0 for a in atts.values()), default=0) or None,
        hosts=sorted({rl.host for a in atts.values() for rl in a.ranks.values() if rl.host}),
        attempts=list(findings.values()),
        stragglers=[],
        ops=[],
        dumps=dumps,
        job=builder.job_seen(),
        unreadable=[{"path": path, "why": why} for path, why in skipped + stacks_skipped],
        read=info,
    )


def _build(
    directory: Path,
    paths: dict[int, list[Path]],
    ranks: _Ranks,
    dumps_read: list[tuple[Path, dict[str, Any]]],
    skipped: list[tuple[str, str]],
) -> tuple[ModelBuilder, _Coverage, list[Any]]:
    """The model of the windows, in the full read's wall-clock order, with the dumps and stacks."""
    coverage = _Coverage({(s.attempt, rank): _edge(s) for rank, (_, segments) in ranks.items() for s in segments})
    builder = ModelBuilder(None, [coverage])
    readers = []
    for rank, (_, segments) in ranks.items():
        lines: list[bytes] = []
        for s in segments:
            if not s.whole and s.header is not None:
                lines.append(s.header)  # what its process's events leave to it: host, size, job
            lines += s.lines
        readers.append(WindowReader(rank, paths[rank][-1], lines, segments[-1].cut if segments else False))
    stream(builder, readers)
    for rank, (_, segments) in ranks.items():
        for before, s in itertools.pairwise(segments):
            rl = builder.attempts[before.attempt].ranks.get(rank) if before.attempt in builder.attempts else None
            if s.glued and not s.whole and rl is not None:
                rl.cut = True  # the line its process was killed writing is the one the next appended to
    dumps = [add_dump(builder, path, data) for path, data in dumps_read]
    add_stacks(builder, directory, skipped)
    builder.finish()
    return builder, coverage, dumps


def read_in_full(logdir: str | os.PathLike[str], diagnosis: Diagnosis, why: str | None) -> ReadInfo:
    """How the full read's `diagnosis` read `logdir`, saying why the tail did not decide."""
    files = [p for paths in rank_segments(logdir).values() for p in paths]
    total = sum(os.path.getsize(p) for p in files if os.path.isfile(p))
    ranks = sorted({r for a in diagnosis.attempts for r in a.ranks})
    return ReadInfo(total, total, ranks, 0, why or "read in full")


def verdict_fields(finding: AttemptFinding) -> dict[str, Any]:
    """What of an attempt's finding the verdict stands for: the tail's and the full read's are
    equal here (not in the statistics: no straggler, no counts, not when the logs begin)."""
    problems = [p for p in finding.problems if p.kind is not Kind.STRAGGLER]
    out = asdict(finding)
    for dropped in ("collectives", "p2p_ops", "start_ns"):
        del out[dropped]
    out["problems"] = [asdict(p) for p in problems]
    out["culprits"] = next((sorted(p.ranks) for p in problems if p.ranks), [])
    return out
