"""The reading of a run's log directory: each rank's files across rotations, streamed side by side.

`stream(builder, readers)` hands every line of every rank (`RankReader`: one rank's files,
rotated ones first, read as one stream of lines with their clock) to the builder
(`commlib.observe.builder`), a window of wall-clock time (`ts_ns`) at a time, each event
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
import gc
import operator
import os
import resource
from bisect import bisect_left
from collections.abc import Callable, Sequence
from itertools import islice
from pathlib import Path
from typing import Any

from commlib.observe.builder import Context, ModelBuilder, Unplaceable
from commlib.observe.events import after_cut, rank_segments
from commlib.observe.records import FileReport, JobInfo, MixedJobsError, Observer
from commlib.observe.typed import CollectiveLine, decode_collective, decode_collectives
from commlib.record.codec import decode
from commlib.record.files import open_regular
from commlib.record.logfile import HEADER_EVENT, HEADER_START

FD_MARGIN = 64  # descriptors left to the rest of the process when every rank's file is open at once
BATCH = 40_000  # lines the pass reads and adds at a time (`stream`)
# In a window's lines, what has it added in wall-clock order (`stream`): a deadline that
# expired, a send's or a recv's start or end (as `EventWriter` writes them: the op first).
TIMEOUT_MARK = b'"collective.timeout"'
P2P_STARTS = (b'{"op":"send"', b'{"op":"recv"')
_CLOCK_AND_RANK = operator.itemgetter(0, 1)
# A line as `RankReader.take` hands it over: a collective's start or end, decoded; or any
# other line's (ts_ns, its bytes, whether it wants its window added in order).
Item = CollectiveLine | tuple[int, bytes, bool]
# Lines a take hands over from one chunk: (its file's report, the lines, whether every one is a
# `CollectiveLine`).
Run = tuple[FileReport, list[Item], bool]


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

    Lines are read a chunk at a time (`CHUNK` bytes of whole lines) and decoded as they are
    read: a chunk of collectives' starts and ends (`CollectiveLine`, almost every chunk) in one
    call of the typed decoder over the chunk as one JSON array; a chunk holding any other line,
    line by line, each other line kept as its bytes with its clock read out of them (parsed
    only when its turn comes, as a dict; a line whose clock cannot be read that way is parsed
    at once, to tell). A small chunk keeps a line's event in the cache until it is added."""

    CHUNK = 1 << 13  # bytes of lines read and decoded at a time (about 25 lines)

    def __init__(self, rank: int, paths: list[Path]) -> None:
        self.rank = rank
        self.paths = paths
        self.index = 0
        self.keep_open = True
        self.reports = [FileReport(str(p), rank) for p in paths]
        self.report = self.reports[-1]
        self.head: int | None = None  # the clock of the next line not taken yet; None: the files are read
        self.ordered = False  # a line taken wants its window added in wall-clock order (`stream`)
        self.cut = False  # the files end in a line cut short (a kill mid-write), or being written
        self._index = -1
        self._file: Any = None
        self._offset = 0
        self._items: list[Item] = []  # the chunk read last, decoded
        self._at = 0  # its first item not taken yet
        # The chunk's clocks, where every line of it is a `CollectiveLine` and they never go back
        # (almost every chunk): a take finds its end by bisection. None otherwise.
        self._clocks: list[int] | None = None

    def take(self, until: int) -> list[Run]:
        """The lines before `until`, from `head` on, as runs of one chunk each (`Run`); `head`
        is then the clock of the first line at or after it, or None when the files are read."""
        taken: list[Run] = []
        while True:
            items, at, clocks = self._items, self._at, self._clocks
            first = at
            if clocks is not None:
                at = bisect_left(clocks, until, at)
            else:
                for item in islice(items, at, None):
                    if type(item) is CollectiveLine:
                        if item.ts_ns >= until:
                            break
                    elif item[0] >= until:  # type: ignore[index]
                        break
                    elif item[2]:  # type: ignore[index]
                        self.ordered = True
                    at += 1
            if at > first:
                taken.append((self.report, items[first:at], clocks is not None))
            self._at = at
            if at < len(items):
                item = items[at]
                self.head = item.ts_ns if type(item) is CollectiveLine else item[0]  # type: ignore[index]
                return taken
            if not self._next_chunk():
                self.head = None
                return taken

    def _next_chunk(self) -> bool:
        """The next chunk of lines decoded into `_items`, of this file or the next; False when there is none."""
        while True:
            lines = self._read() if self._index >= 0 else None
            if lines:
                self._clocks = None
                self._items, self._at = self._decode(lines), 0
                if self._items:
                    return True
                continue
            if not self._advance():
                return False

    def _decode(self, lines: list[bytes]) -> list[Item]:
        """A chunk's lines as items (`take`), counted in their file's report; a last line cut short
        (a kill mid-write, or still being written) ends the file's reading, unread."""
        report = self.report
        if lines[-1][-1] != 10:  # b"\n": only ever the last line of a file
            self.cut = True
            lines.pop()
            self._offset = -1  # nothing more of this file
        if not lines:
            return []
        chunk = decode_collectives(lines)
        if chunk is not None:
            report.events += len(chunk)
            clocks = [line.ts_ns for line in chunk]
            if clocks == sorted(clocks):
                self._clocks = clocks
            return chunk  # type: ignore[return-value]
        items: list[Item] = []
        for raw in lines:
            line = decode_collective(raw)
            if line is not None:
                report.events += 1
                items.append(line)
                continue
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
            items.append((ts, raw, _wants_order(raw)))
        return items

    def _read(self) -> list[bytes] | None:
        """The next chunk of whole lines of the current file (the last one perhaps cut short);
        None at its end."""
        if self._offset < 0:
            return None
        try:
            if self._file is not None:
                return self._file.readlines(self.CHUNK) or None
            with os.fdopen(open_regular(self.paths[self._index]), "rb") as f:  # reopened for each chunk
                f.seek(self._offset)
                lines = f.readlines(self.CHUNK)
                self._offset = f.tell()
            return lines or None
        except OSError as exc:  # rotated away meanwhile, or not readable
            self.reports[self._index].problem = f"{type(exc).__name__}: {exc.strerror or exc}"
            return None

    def _advance(self) -> bool:
        """On to the next file; False when there is none."""
        self.close()
        if self._index + 1 >= len(self.paths):
            return False
        self._index += 1
        self._offset = 0
        self.report = self.reports[self._index]
        try:
            fd = open_regular(self.paths[self._index])
            self.report.bytes = os.fstat(fd).st_size
        except OSError as exc:
            self.report.problem = f"{type(exc).__name__}: {exc.strerror or exc}"
            self._offset = -1
            return True
        if self.keep_open:
            self._file = os.fdopen(fd, "rb")
        else:
            os.close(fd)
        return True

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class WindowReader(RankReader):
    """One rank's lines already read into memory (the end of its files:
    `commlib.observe.verdict_from_end`), taken as a `RankReader` takes those of its files; `cut`:
    they end in a line cut short."""

    def __init__(self, rank: int, path: Path, lines: list[bytes], cut: bool) -> None:
        super().__init__(rank, [path])
        self._index = 0
        self._lines = lines
        self.report.bytes = sum(len(line) for line in lines)
        self.cut = cut

    def _read(self) -> list[bytes] | None:
        lines, self._lines = self._lines, []
        return lines or None

    def _advance(self) -> bool:
        return False


def read(
    directory: Path,
    segments: dict[int, list[Path]],
    job: str | None,
    observers: list[Observer],
) -> tuple[ModelBuilder, list[FileReport]]:
    """The pass over every rank's files (`segments`: `events.rank_segments(directory)`): the log
    model's builder, and what was read of each file."""
    builder = ModelBuilder(job, observers)
    readers = [RankReader(rank, paths) for rank, paths in segments.items()]
    keep_open = enough_descriptors(len(readers))
    for reader in readers:
        reader.keep_open = keep_open
    try:
        stream(builder, readers)
    except MixedJobsError:
        raise mixed_jobs(directory, builder.jobs) from None
    finally:
        for reader in readers:
            reader.close()
    return builder, [report for reader in readers for report in reader.reports]


def stream(builder: ModelBuilder, readers: Sequence[RankReader]) -> None:
    """Every rank's lines, window by window of wall-clock time: every line before the
    window's end from every rank, then the next window. The window is sized to hold about
    `BATCH` lines. Within a window, ranks are added one after the other (each rank's
    lines in its files' order): no verdict depends on how ranks interleave within a few
    milliseconds, except two. Where every rank was when a deadline expired; and whom a
    send/recv was with, when its communicator ranks are told apart from the other side's
    events (which, in wall-clock order, all come before the op ends). So a window that
    holds a `collective.timeout` or a send/recv (`TIMEOUT_MARK`, `P2P_STARTS`) is added in
    wall-clock order instead (rank order between equal clocks). Ordering every line so (a heap of
    the ranks' next lines, or a sort of each window) took a quarter of the pass. The garbage
    collector is paused meanwhile: the pass makes millions of short-lived objects and no cycles,
    and a fifth of its time went to collecting."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        _stream(builder, readers)
    finally:
        if collecting:
            gc.enable()


def _stream(builder: ModelBuilder, readers: Sequence[RankReader]) -> None:
    contexts = [Context(r.rank) for r in readers]
    for i, reader in enumerate(readers):
        reader.index = i
        reader.take(-1)  # reads its first line into `head`
    live = [r for r in readers if r.head is not None]
    window = 1_000_000  # ns; adapted to the logs' pace
    add, add_collective = builder.add, builder.add_collective
    if live:
        for observer in builder.observers:
            observer.begin(min(r.head for r in live if r.head is not None))
    while live:
        until = min(r.head for r in live if r.head is not None) + window
        groups: list[tuple[Context, list[Run]]] = []
        lines = 0
        ordered = False
        for r in live:  # one loop over the ranks a window: there are thousands
            runs = r.take(until)
            if runs:
                groups.append((contexts[r.index], runs))
                for run in runs:
                    lines += len(run[1])
                if r.ordered:
                    ordered, r.ordered = True, False
        if ordered:  # each line a run of its own, in order
            groups = [
                (context, [(report, [item], type(item) is CollectiveLine)])
                for _, _, item, report, context in sorted(
                    (
                        (_clock_of(item), i, item, report, context)
                        for i, (context, runs) in enumerate(groups)
                        for report, items, _ in runs
                        for item in items
                    ),
                    key=_CLOCK_AND_RANK,
                )
            ]
        for context, runs in groups:
            for report, items, typed in runs:
                if typed:
                    _fold_collectives(add_collective, items, context, report)
                    continue
                for item in items:
                    try:
                        if type(item) is CollectiveLine:
                            add_collective(item, context)
                            continue
                        _, raw, _ = item  # type: ignore[misc]
                        try:
                            event = decode(raw)
                        except ValueError:
                            event = _after_cut(raw, context, report)
                        if type(event) is dict:
                            add(event, context)
                            continue
                    except MixedJobsError:
                        raise
                    except (Unplaceable, TypeError, ValueError, AttributeError, KeyError):
                        pass  # fields of a type commlib never writes: the line is not read
                    report.events -= 1  # a clock in its bytes, but not an event of a rank
                    report.garbled += 1
        still = []
        for reader in live:
            if reader.head is not None:
                still.append(reader)
                continue
            context = contexts[reader.index]
            if context.att is not None:
                context.rl.cut = reader.cut  # type: ignore[union-attr]
                builder.rank_done(context.att.attempt, context.rl.rank)  # type: ignore[union-attr]
        live = still
        window = max(1, min(window * 4, int(window * BATCH / max(1, lines))))


def _fold_collectives(
    add_collective: Callable[[CollectiveLine, Context], None], lines: list[Item], context: Context, report: FileReport
) -> None:
    """A run of `CollectiveLine`s added, each one a line not read where the builder refuses it
    (`stream`'s loop without its questions of each line: most runs are these)."""
    remaining = iter(lines)
    while True:
        try:
            for line in remaining:
                add_collective(line, context)  # type: ignore[arg-type]
            return
        except MixedJobsError:
            raise
        except (Unplaceable, TypeError, ValueError, AttributeError, KeyError):
            report.events -= 1  # the line is not read; the rest are, from the next one on
            report.garbled += 1


def _after_cut(raw: bytes, context: Context, report: FileReport) -> dict[str, Any] | None:
    """The header a garbled line hides (`events.after_cut`), its process's line cut short before
    it counted as garbled in `report` and its rank as cut at that point; None where the line hides
    none."""
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
    """Whether a line wants its window added in wall-clock order (`stream`; a `CollectiveLine`
    never does: no send/recv, no timeout)."""
    return TIMEOUT_MARK in raw or raw.startswith(P2P_STARTS)


def _clock_of(item: Item) -> int:
    return item.ts_ns if type(item) is CollectiveLine else item[0]  # type: ignore[index]


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
