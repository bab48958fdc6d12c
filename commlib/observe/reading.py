"""The reading of a run's log directory: each rank's files across rotations, streamed side by side.

`stream(fold, readers)` hands every line of every rank (`RankReader`: one rank's files,
rotated ones first, read as one stream of lines with their clock) to the fold
(`commlib.observe.fold`), a window of wall-clock time (`ts_ns`) at a time, each event
parsed only when its turn comes; nothing keeps the events themselves. Every rank's file
stays open through the pass where the process may hold that many descriptors
(`enough_descriptors`, raising the soft limit as far as the hard one allows); else each is
opened again for each block of lines. A last line cut short (a kill mid-write, or a line
still being written) is not read; a line that is not a JSON event with an integer clock is
counted in its file's `FileReport`. `mixed_jobs` reads the `log.open` lines again to name
every job of a directory that holds more than one.
"""

from __future__ import annotations

import contextlib
import operator
import os
import resource
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from commlib.observe.codec import decode
from commlib.observe.files import open_regular
from commlib.observe.fold import Context, Fold, Unplaceable
from commlib.observe.log import after_cut, rank_segments
from commlib.observe.logfile import HEADER_EVENT, HEADER_START
from commlib.observe.records import FileReport, JobInfo, MixedJobsError

FD_MARGIN = 64  # descriptors left to the rest of the process when every rank's file is open at once
BATCH = 10_000  # lines the pass reads and folds in at a time (`stream`)
# In a window's lines, what has it folded in wall-clock order (`stream`): a deadline that
# expired, a send's or a recv's start or end (as `EventWriter` writes them: the op first).
TIMEOUT_MARK = b'"collective.timeout"'
P2P_STARTS = (b'{"op":"send"', b'{"op":"recv"')
_CLOCK_AND_RANK = operator.itemgetter(0, 1)


def enough_descriptors(files: int) -> bool:
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


class RankReader:
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
        self.ordered = False  # a line taken wants its window folded in wall-clock order (`stream`)
        self.cut = False  # the files end in a line cut short (a kill mid-write), or being written
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
                    self.cut = True  # a last line cut short by a kill, or still being written
                    break
                at = raw.find(b'"ts_ns":')
                end = raw.find(b",", at)
                try:  # the clock read out of the bytes; parsed only when that fails
                    ts = int(raw[at + 8 : end if end > 0 else -2]) if at >= 0 else _clock(raw)
                except ValueError:
                    ts = _clock(raw)
                if ts is None:
                    report.garbled += 1
                    continue
                report.events += 1
                if raw.startswith(HEADER_START):  # only the writer writes them (`logfile.header_line`)
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
        fd = open_regular(self.paths[self._index])
        self.reports[self._index].bytes = os.fstat(fd).st_size
        if not self.keep_open:
            os.close(fd)
            return self._refill()
        self._file = os.fdopen(fd, "rb")
        self._lines = iter(self._file)
        return True

    def _refill(self) -> bool:
        """The next block of whole lines of the current file (closed again until the next block)."""
        with os.fdopen(open_regular(self.paths[self._index]), "rb") as f:
            f.seek(self._offset)
            lines = f.readlines(self.BLOCK)
            self._offset = f.tell()
        self._lines = iter(lines)
        return bool(lines)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class WindowReader(RankReader):
    """One rank's lines already read into memory (the end of its files: `commlib.observe.tail`),
    taken as a `RankReader` takes those of its files; `cut`: they end in a line cut short."""

    def __init__(self, rank: int, path: Path, lines: list[bytes], cut: bool) -> None:
        super().__init__(rank, [path])
        self._index = 0
        self._lines = iter(lines)
        self.report.bytes = sum(len(line) for line in lines)
        self.cut = cut

    def _advance(self) -> bool:
        return False


def stream(fold: Fold, readers: Sequence[RankReader]) -> None:
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
    contexts = [Context(r.rank) for r in readers]
    for i, reader in enumerate(readers):
        reader.index = i
        reader.take(-1)  # reads its first line into `head`
    live = [r for r in readers if r.head is not None]
    window = 1_000_000  # ns; adapted to the logs' pace
    add = fold.add
    begun = False
    while live:
        start = min(r.head[0] for r in live)  # type: ignore[index]
        if not begun:
            begun = True
            for observer in fold.observers:
                observer.begin(start)
        groups: list[tuple[Context, Any]] = [(contexts[r.index], r.take(start + window)) for r in live]
        lines = sum(len(t) for _, t in groups)
        if any(r.ordered for r in live):  # each line a group of its own, in order
            for r in live:
                r.ordered = False
            groups = [
                (context, ((ts, raw, report),))
                for ts, _, raw, report, context in sorted(
                    ((ts, i, raw, report, context) for i, (context, t) in enumerate(groups) for ts, raw, report in t),
                    key=_CLOCK_AND_RANK,
                )
            ]
        for context, taken in groups:
            for _, raw, report in taken:
                try:
                    event = decode(raw)
                except ValueError:
                    event = _after_cut(raw, context, report)
                if type(event) is dict:
                    try:
                        add(event, context)
                        continue
                    except MixedJobsError:
                        raise
                    except (Unplaceable, TypeError, ValueError, AttributeError, KeyError):
                        pass  # fields of a type commlib never writes: the line is not read
                report.events -= 1  # a clock in its bytes, but not an event of a rank
                report.garbled += 1
        for reader in live:
            context = contexts[reader.index]
            if reader.head is None and context.att is not None:
                context.rl.cut = reader.cut  # type: ignore[union-attr]
                fold.rank_done(context.att.attempt, context.rl.rank)  # type: ignore[union-attr]
        live = [r for r in live if r.head is not None]
        window = max(1, min(window * 4, int(window * BATCH / max(1, lines))))


def _after_cut(raw: bytes, context: Context, report: FileReport) -> dict[str, Any] | None:
    """The header a garbled line hides (`log.after_cut`), its process's line cut short before it
    counted as garbled and its rank as cut at that point; None where the line hides none."""
    header = after_cut(raw)
    try:
        event = decode(header) if header is not None else None
    except ValueError:
        return None
    if type(event) is not dict:
        return None
    report.garbled += 1
    report.headers += 1
    if context.rl is not None:
        context.rl.cut = True
    return event


def _wants_order(raw: bytes) -> bool:
    """Whether a line wants its window folded in wall-clock order (`stream`)."""
    return TIMEOUT_MARK in raw or raw.startswith(P2P_STARTS)


def _clock(raw: bytes) -> int | None:
    """A line's integer `ts_ns`, parsed; None when the line is not an event."""
    try:
        event = decode(raw)
    except ValueError:
        return None
    ts = event.get("ts_ns") if type(event) is dict else None
    return ts if type(ts) is int else None


def mixed_jobs(directory: Path, jobs: dict[str | None, JobInfo]) -> MixedJobsError:
    """The refusal to read several jobs' logs as one, naming every job of the directory (its
    `log.open` lines read again: the pass stops at the first line of a second job)."""
    seen = {job: JobInfo(job, set(info.ranks), set(info.attempts), set(info.processes)) for job, info in jobs.items()}
    for paths in rank_segments(directory).values():
        for path in paths:
            with contextlib.suppress(OSError), os.fdopen(open_regular(path), "rb") as f:
                for raw in f:
                    if b'"' + HEADER_EVENT.encode() + b'"' not in raw:
                        continue
                    with contextlib.suppress(ValueError, AttributeError):
                        header = decode(raw if raw.startswith(HEADER_START) else after_cut(raw) or raw)
                        info = seen.setdefault(header.get("job"), JobInfo(header.get("job")))
                        info.ranks.add(header.get("rank"))
                        info.attempts.add(header.get("attempt") or 0)
                        info.processes.add((header.get("host"), header.get("pid")))
    listing = "; ".join(info.describe() for info in seen.values())
    return MixedJobsError(
        f"expected the logs of one job in {directory}; found {len(seen)}: {listing}. "
        f"Read one of them with --job ID (or move each job's logs to a directory of its own)",
        seen,
    )
