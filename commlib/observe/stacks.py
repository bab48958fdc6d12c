"""The stacks a rank's `faulthandler` wrote on SIGUSR2 (``stacks_{host}_{pid}.txt``), read back.

`commlib.record.flight` registers faulthandler on SIGUSR2 (`files.STACKS_SIGNAL`), which writes, without needing
the GIL, one block per thread::

    Thread 0x00007f... (most recent call first):
      File "/path/threading.py", line 320 in wait
      ...

    Current thread 0x00007f... (most recent call first):
      File "/path/train.py", line 88 in step
      File "/path/train.py", line 120 in <module>

Each SIGUSR2 appends such a dump, with no marker between dumps: a new one starts where a
thread id already seen in the current one comes again. The main thread is the one that
runs a module's top level (a ``<module>`` frame; under ``python -m``, runpy's frames are
outside it). Files are read line by line, keeping one dump at a time. A file is named by its
process's host and pid (`commlib.record.files.stacks_file_name`). Torch-free (the doctor reads it).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from commlib.record.files import STACKS_FILE, open_regular

_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    def traceback_line(self) -> str:
        """In `traceback.format_stack`'s form, as the flight recorder's stacks are."""
        return f'  File "{self.file}", line {self.line}, in {self.func}\n'


def last_dump(lines: str | Iterable[str]) -> dict[str, list[Frame]]:
    """The last dump in `lines` (a text, or its lines): thread id -> frames, most recent first."""
    dump: dict[str, list[Frame]] = {}
    frames: list[Frame] | None = None
    for line in lines.splitlines() if isinstance(lines, str) else lines:
        thread = _THREAD.match(line)
        if thread is not None:
            tid = thread.group(1)
            if tid in dump:
                dump = {}
            frames = dump.setdefault(tid, [])
            continue
        frame = _FRAME.match(line)
        if frame is not None and frames is not None:
            frames.append(Frame(frame.group(1), int(frame.group(2)), frame.group(3)))
    return dump


def main_thread(dump: dict[str, list[Frame]]) -> list[Frame] | None:
    """The main thread's frames (most recent first), or None when no thread runs a module's top level."""
    return next((frames for frames in dump.values() if any(f.func == "<module>" for f in frames)), None)


def read_main_stacks(
    directory: Path, skipped: list[tuple[str, str]] | None = None
) -> dict[tuple[str | None, int], list[Frame]]:
    """(host as in the file name (`commlib.record.files.safe_host`), pid) -> the main thread's frames of the last
    dump, for every stacks file of `directory` (host None: a file named by its pid alone);
    (path, why) of each that could not be read goes into `skipped`."""
    out: dict[tuple[str | None, int], list[Frame]] = {}
    for path in sorted(directory.glob("stacks_*.txt")):
        match = STACKS_FILE.match(path.name)
        if match is None:
            continue
        try:
            with open(open_regular(path), errors="replace") as f:
                frames = main_thread(last_dump(f))
        except OSError as exc:  # a FIFO among them is named, never waited on
            if skipped is not None:
                skipped.append((str(path), f"{type(exc).__name__}: {exc.strerror or exc}"))
            continue
        if frames:
            out[(match.group(1), int(match.group(2)))] = frames
    return out
