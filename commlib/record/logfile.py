"""A log file as its process writes it: one descriptor every logger of the process shares, and its rotation.

Each line is written with a single `os.write` on an `O_APPEND` descriptor (`commlib.record.log`
says why). A file that a rank's log starts begins with its process's `log.open` line
(`header_line`); so does each file a rotation starts. The budget itself (how large a file
grows, how many rotated files are kept) is read by `commlib.record.log.budget`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from commlib.record.codec import encode
from commlib.record.files import open_regular

HEADER_EVENT = "log.open"
HEADER_START = b'{"event":"' + HEADER_EVENT.encode() + b'"'  # how `header_line` starts every header
LOG_FORMAT = 2  # 1: every field on every line (no header); 2: per-process fields in the header


class LogFile:
    """A log file as this process writes it: one descriptor that every logger of the process
    pointed at it shares, its size, and, for a rank's log, its rotation (`commlib.record.log`'s docstring).

    A rotation swaps the descriptor; the one it replaces is closed only at the next
    rotation, because another thread may have read it just before the swap and be about
    to write to it (the line then lands, whole, at the end of the renamed file). Once the
    file is closed (`close`), lines still logged through it are dropped.
    """

    def __init__(self, path: Path, max_bytes: int, keep: int, header: dict[str, Any] | None) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep
        self.header = header
        self.fd = open_regular(path, os.O_RDWR | os.O_CREAT | os.O_APPEND)
        self.size = os.fstat(self.fd).st_size
        self._fds = [self.fd]  # every descriptor not yet closed: the current one, and the one retired last
        self._rotating = threading.Lock()
        self._closed = weakref.finalize(self, _close_fds, self._fds)  # once no logger uses the file
        if self.size and os.pread(self.fd, 1, self.size - 1) != b"\n":
            self.write(b"\n")  # a process killed mid-write left its line unended: this one's first line stands alone
        if header is not None:
            self.write(header_line(header))

    def write(self, line: bytes) -> None:
        os.write(self.fd, line)
        self.size += len(line)
        if self.size >= self.max_bytes:
            self._rotate()

    def close(self) -> None:
        self.write = _drop  # type: ignore[method-assign]
        self._closed()

    def _rotate(self) -> None:
        if not self._rotating.acquire(blocking=False):
            return  # another thread is rotating: this line went to the old file, whole
        try:
            if self.size < self.max_bytes:
                return
            self.size = 0  # also when the rename fails: try again one budget later, not every line
            numbers = sorted(rotated_numbers(self.path))
            numbers.append(numbers[-1] + 1 if numbers else 1)
            os.rename(self.path, self.path.with_name(f"{self.path.name}.{numbers[-1]}"))
            fd = open_regular(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            self._fds.append(fd)
            self.fd = fd
            while len(self._fds) > 2:
                os.close(self._fds.pop(0))
            for n in numbers[: max(0, len(numbers) - self.keep)]:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path.with_name(f"{self.path.name}.{n}"))
            if self.header is not None:
                self.write(header_line(self.header))
        except OSError:
            pass  # a log that cannot rotate keeps logging into its file
        finally:
            self._rotating.release()


def _close_fds(fds: list[int]) -> None:
    while fds:
        with contextlib.suppress(OSError):
            os.close(fds.pop())


def _drop(line: bytes) -> None:
    pass


def header_line(fields: dict[str, Any]) -> bytes:
    return (
        encode(
            {
                "event": HEADER_EVENT,
                "format": LOG_FORMAT,
                **fields,
                "ts_ns": time.time_ns(),
                "mono_ns": time.monotonic_ns(),
            }
        )
        + b"\n"
    )


def rotated_numbers(live: Path) -> list[int]:
    """The numbers n of `live`'s rotated files (`{live}.{n}`), in no order."""
    out = []
    for p in live.parent.glob(f"{live.name}.*"):
        suffix = p.name[len(live.name) + 1 :]
        if suffix.isdigit():
            out.append(int(suffix))
    return out
