"""Files that several processes or nodes may write in one shared directory.

Every writer's temporary file or directory gets a name no other writer can have: the
standard library's `tempfile` makes it in that very directory (``O_EXCL`` on a random name).
A pid is not such a name: nodes in PID namespaces of their own (containers, the local Slurm
cluster) run harnesses of the same pid on one shared run directory. The temporary then takes
its final name atomically: `write_atomic` replaces (a reader sees the old file or the whole
new one), `publish` links (the first writer's file stays; a peer's is never overwritten).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def _temporary(path: Path, text: str) -> Path:
    """`text` in a new file of a unique name beside `path`, flushed to disk."""
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        os.unlink(name)
        raise
    return Path(name)


def write_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename: whole or not at all,
    even if the writer is killed, and durably (the directory is synced too)."""
    path = Path(path)
    tmp = _temporary(path, text)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_json_atomic(path: str | os.PathLike[str], obj: Any) -> None:
    """`write_atomic` of `obj` as strict JSON (non-finite floats are refused: they are not JSON)."""
    write_atomic(path, json.dumps(obj, indent=1, allow_nan=False))


def publish(path: str | os.PathLike[str], text: str) -> bool:
    """Give `path` the content `text` unless a peer already did: whether this writer's stayed.
    Whole or absent, never over a peer's (a hard link of a complete temporary file)."""
    path = Path(path)
    tmp = _temporary(path, text)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        tmp.unlink()
    return True


def work_directory(parent: str | os.PathLike[str], prefix: str) -> Path:
    """A new empty directory in `parent`, named `prefix` and a suffix no other writer has."""
    return Path(tempfile.mkdtemp(dir=parent, prefix=prefix))


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make the renames inside `directory` survive a machine crash."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
