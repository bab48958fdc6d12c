"""The log dir's files as a rank names them and as their readers open them.

What a process writes beside its log is named by its host and pid (`stacks_file_name`, and a
flight dump's name: `commlib.record.flight`), since pids repeat across the hosts of a job whose
ranks share one log dir; a host's name is made safe for a file name (`safe_host`). A dump that
an operator asked for (SIGUSR1) says so in its name and its `reason` (`SIGUSR1_REASON`); the
stacks file is what a rank writes on `STACKS_SIGNAL`. (This module imports no torch: chaos's
cleanup process signals ranks with it and starts in a tenth of the time.)


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
import re
import signal
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
# A dump's reason when an operator asked for it (SIGUSR1); any other reason is a failure's or an abort's.
SIGUSR1_REASON = "sigusr1"
STACKS_SIGNAL = signal.SIGUSR2  # a rank writes every thread's stack (`commlib.record.flight`)
STACKS_FILE = re.compile(r"^stacks_(?:(.+)_)?(\d+)\.txt$")  # the host is absent in files written before it was named
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def safe_host(host: str | None) -> str | None:
    """`host` as it shows in a file name (anything but letters, digits, '.', '_' and '-' as '-')."""
    return None if host is None else _UNSAFE.sub("-", host)


def stacks_file_name(host: str, pid: int) -> str:
    """The stacks file of process `pid` on `host`."""
    return f"stacks_{safe_host(host)}_{pid}.txt"


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
