"""The ``disk_full`` fault's disk: a size-limited tmpfs on the run's checkpoint directory.

`SmallDisk.mount` mounts a tmpfs of `TMPFS_MB` on ``{run_dir}/ckpt`` before the job
starts (root, or CAP_SYS_ADMIN, is needed; without it the run fails before launching,
saying so). `fill` writes a filler file until the filesystem refuses more (ENOSPC), so the
next checkpoint save fails the way a full disk fails it; `drain` removes the filler (the
operator freed space); `unmount` detaches it at the end of the run (lazily: a process of the
job may still hold a file open). The module's `unmount` detaches it knowing only the directory
(it finds the tmpfs by its source name, `SOURCE`): what `chaos.cleanup` does after a harness
that died with the disk mounted.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
from pathlib import Path

TMPFS_MB = 64  # holds the kept checkpoints of the runs the tests and benchmarks make; quick to fill
FILLER = ".chaos-disk-full"
SOURCE = "chaos-disk-full"  # the tmpfs's source in the mount table: how a later process knows it is ours
_CHUNK = 1 << 20


class DiskFullUnavailable(RuntimeError):
    """A tmpfs cannot be mounted here (not root, no CAP_SYS_ADMIN, no mount command)."""


class SmallDisk:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.mounted = False

    @property
    def filler(self) -> Path:
        return self.directory / FILLER

    def mount(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_MB}m", SOURCE, str(self.directory)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise DiskFullUnavailable(
                f"disk_full: expected to mount a {TMPFS_MB} MiB tmpfs on {self.directory} (needs root or "
                f"CAP_SYS_ADMIN); `mount` exited {done.returncode}: {done.stderr.strip() or done.stdout.strip()}"
            )
        self.mounted = True

    def fill(self) -> int:
        """Write the filler until the filesystem is full; returns the bytes written."""
        written = 0
        block = b"\0" * _CHUNK
        with open(self.filler, "ab", buffering=0) as f:
            while True:
                try:
                    written += f.write(block)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    return written

    def drain(self) -> None:
        self.filler.unlink(missing_ok=True)

    def unmount(self) -> None:
        if self.mounted:
            unmount(self.directory)
            self.mounted = False

    def free_bytes(self) -> int:
        st = os.statvfs(self.directory)
        return st.f_bavail * st.f_frsize


def unmount(directory: Path) -> bool:
    """Detach every `SmallDisk` tmpfs mounted on `directory` (lazily); returns whether there was one."""
    found = False
    while _mounted(directory):
        found = True
        done = subprocess.run(["umount", "-l", str(directory)], capture_output=True, text=True)
        if done.returncode != 0:
            raise OSError(
                f"disk_full: expected to unmount the tmpfs on {directory}; `umount` exited "
                f"{done.returncode}: {done.stderr.strip()}"
            )
    return found


def _mounted(directory: Path) -> bool:
    """Whether a tmpfs of ours is mounted on `directory` (/proc/self/mountinfo: the mount point is
    the 5th field, octal-escaped; the source follows the fs type after the ``-``)."""
    target = os.path.realpath(directory)
    with open("/proc/self/mountinfo") as table:
        for line in table:
            head, _, tail = line.partition(" - ")
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), head.split()[4])
            if point == target and tail.split()[:2] == ["tmpfs", SOURCE]:
                return True
    return False
