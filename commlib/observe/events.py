"""A run's events read back as dicts, in the logs' documented schema: one file, one rank's files
in order, every rank's in wall-clock order, or a live log dir as it grows.

`rank_segments` lists a rank's files (`RANK_FILE`: rotated ones first, then the live one);
`read_events` (one file), `read_rank` (a rank's files in order), `read_run` (every rank, in
wall-clock order) and `LogTail` (a live log dir, across rotations) are the readers; each skips
a truncated or garbled line instead of failing. The writer (`commlib.record.log`) leaves out of
a line what its process's `log.open` line or its communicator's earlier lines hold
(`HEADER_ONLY`, `COMM_ONLY`) and an `info` line's level: `Inflater` puts them back.
"""

from __future__ import annotations

import contextlib
import heapq
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from commlib.record.codec import decode
from commlib.record.files import NotRegularFile, open_regular
from commlib.record.log import COMM_ONLY, HEADER_ONLY
from commlib.record.logfile import HEADER_EVENT, HEADER_START

RANK_FILE = re.compile(r"^rank(\d+)\.jsonl(?:\.(\d+))?$")


def rank_segments(directory: str | os.PathLike[str]) -> dict[int, list[Path]]:
    """rank -> its log files in the order they were written (rotated ones, oldest first, then the live one)."""
    found: dict[int, list[tuple[float, Path]]] = {}
    for p in Path(directory).iterdir():
        match = RANK_FILE.match(p.name)
        if match is not None:
            order = float(match.group(2)) if match.group(2) else float("inf")
            found.setdefault(int(match.group(1)), []).append((order, p))
    return {rank: [p for _, p in sorted(paths)] for rank, paths in sorted(found.items())}


class Inflater:
    """Puts back into each event of one rank's files what its process's `log.open` line holds
    (`HEADER_ONLY` fields), what its communicator's earlier events said of it (`COMM_ONLY`),
    and the level an `info` line leaves out. The `log.open` lines themselves are not events
    of the process: they give None."""

    __slots__ = ("headers", "comms")

    def __init__(self) -> None:
        self.headers: dict[Any, dict[str, Any]] = {}  # pid -> the header's fields
        self.comms: dict[tuple[Any, Any], dict[str, Any]] = {}  # (pid, comm) -> its COMM_ONLY fields

    def __call__(self, event: dict[str, Any]) -> dict[str, Any] | None:
        pid = event.get("pid")
        if event.get("event") == HEADER_EVENT:
            self.headers[pid] = {k: event[k] for k in HEADER_ONLY if k in event}
            return None
        header = self.headers.get(pid)
        if header:
            for k, v in header.items():
                event.setdefault(k, v)
        comm = event.get("comm")
        if comm is not None:
            if "backend" in event:
                self.comms[(pid, comm)] = {k: event[k] for k in COMM_ONLY if k in event}
            else:
                for k, v in self.comms.get((pid, comm), {}).items():
                    event.setdefault(k, v)
        event.setdefault("level", "info")
        return event


def after_cut(raw: bytes) -> bytes | None:
    """The header a garbled line hides, if any: a process killed mid-write leaves its last line
    without a newline, and the rank's next process appended its `log.open` line to it."""
    at = raw.find(HEADER_START, 1)
    return raw[at:] if at > 0 else None


def scan(path: str | os.PathLike[str], offset: int) -> Iterator[tuple[int, dict[str, Any] | None]]:
    """(offset after the line, its event or None if garbled) for each complete line from `offset`.

    A last line without its newline is being written, or was cut short by a kill: it is
    not read, so its offset is never passed. `NotRegularFile` where `path` is not a regular file.
    """
    with os.fdopen(open_regular(path), "rb") as f:
        f.seek(offset)
        for raw in f:
            if not raw.endswith(b"\n"):
                return
            offset += len(raw)
            try:
                event = decode(raw)
            except ValueError:
                header = after_cut(raw)
                try:
                    event = decode(header) if header is not None else None
                except ValueError:
                    event = None
            yield offset, event if isinstance(event, dict) else None


def read_events(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Events of one JSON-lines file in order; a truncated or garbled line is skipped."""
    inflate = Inflater()
    return (e for e in (inflate(event) for _, event in scan(path, 0) if event is not None) if e is not None)


def read_rank(paths: Iterable[Path]) -> Iterator[dict[str, Any]]:
    """Events of one rank's files (`rank_segments`) in order, as one stream; a file rotated
    away before it could be opened, or that is not a regular file, is skipped."""
    inflate = Inflater()
    for path in paths:
        try:
            for _, event in scan(path, 0):
                if event is not None and (event := inflate(event)) is not None:
                    yield event
        except (FileNotFoundError, NotRegularFile):
            continue


def read_run(directory: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Every rank's events (all files) as one stream in wall-clock order (`ts_ns`); events
    without a clock are left out."""
    streams = [
        ((e["ts_ns"], rank, e) for e in read_rank(paths) if isinstance(e.get("ts_ns"), int))
        for rank, paths in rank_segments(directory).items()
    ]
    return (e for _, _, e in heapq.merge(*streams, key=lambda item: item[:2]))


class LogTail:
    """New events of every rank's log in a log dir since the last poll, each rank's in order.

    For watching a live run: a line still being written is left for the next poll; a file
    rotated since the last poll is read to its end before its successor (files are told
    apart by inode, which a rename keeps).
    """

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._at: dict[int, tuple[int, int]] = {}  # rank -> (inode of the file being read, offset in it)
        self._inflate: dict[int, Inflater] = {}

    def poll(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if not self.log_dir.is_dir():
            return events
        for rank, paths in rank_segments(self.log_dir).items():
            inflate = self._inflate.setdefault(rank, Inflater())
            files = []
            for path in paths:
                with contextlib.suppress(FileNotFoundError):
                    files.append((os.stat(path).st_ino, path))
            inode, offset = self._at.get(rank, (None, 0))
            inodes = [ino for ino, _ in files]
            start = inodes.index(inode) if inode in inodes else 0
            if inode not in inodes:
                offset = 0  # the file read last was rotated away unread to its end: go on from the oldest left
            for ino, path in files[start:]:
                offset = offset if ino == inode else 0
                with contextlib.suppress(FileNotFoundError, NotRegularFile):
                    for end, event in scan(path, offset):
                        offset = end  # where the next read of this rank starts
                        if event is not None and (event := inflate(event)) is not None:
                            events.append(event)
                self._at[rank] = (ino, offset)
        return events
