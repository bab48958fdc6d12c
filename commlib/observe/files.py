"""Files the observability layer opens by a name that someone else may have given to something else.

A log dir is shared and its names are predictable (`rank{R}.jsonl`, `flight_rank*.json`,
`stacks_*.txt`, a `--trace` path), so a name may hold a FIFO (opening it blocks until a
writer or reader comes: forever, in a dead job's directory), a device (/dev/zero never
ends; /dev/null swallows what is written) or a symlink to either. `open_regular` opens
without blocking and refuses anything but a regular file with `NotRegularFile`, an OSError
saying what it found: every reader counts such a file as one it could not read, naming it,
and every writer refuses it by name.
"""

from __future__ import annotations

import errno
import os
import stat

_KINDS = (
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symlink"),
)


class NotRegularFile(OSError):
    """A name that holds something else than a regular file."""


def kind(mode: int) -> str:
    """What a file of `mode` (its `st_mode`) is, in words."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def refusal(path: str | os.PathLike[str], mode: int) -> NotRegularFile:
    return NotRegularFile(errno.EINVAL, f"expected a regular file; found {kind(mode)}", os.fspath(path))


def open_regular(path: str | os.PathLike[str], flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """A descriptor of `path` opened with `flags` (and blocking once open); `NotRegularFile`
    where `path` (followed through symlinks) is not a regular file."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:  # a FIFO without a reader refuses a writer (ENXIO); a directory, a writer (EISDIR)
        try:
            found = os.stat(path).st_mode
        except OSError:
            raise exc from None
        if stat.S_ISREG(found):
            raise
        raise refusal(path, found) from None
    try:
        found = os.fstat(fd).st_mode
        if not stat.S_ISREG(found):
            raise refusal(path, found)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd
