"""The flight recorder: a ring buffer per communicator of its most recent collectives.

Always on and cheap: starting an entry is one dataclass and a deque append. Its dump (JSON,
written atomically to the log dir) answers "what was this rank doing": `Communicator`
dumps it on a CollectiveTimeout, a PeerFailure and `abort()`; an operator can ask a live,
hung process for it with SIGUSR1, which works even while the main thread is blocked inside
a collective (see `install_sigusr1`).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from commlib.ops import Collective

SIZE_ENV = "COMMLIB_FLIGHT_RECORDER_SIZE"
STACKS_ENV = "COMMLIB_FLIGHT_RECORDER_STACKS"
DEFAULT_SIZE = 2000


@dataclass(slots=True)
class FlightEntry:
    seq: int
    op: str
    comm: str
    shapes: list[torch.Size]  # tuples: JSON writes them as lists
    dtype: str | None
    nbytes: int
    root: int | None
    async_op: bool
    deadline_s: float
    start_ns: int  # wall clock
    start_mono_ns: int
    step: Any = None
    phase: Any = None
    state: str = "started"  # started | completed | timed_out | failed
    end_mono_ns: int | None = None
    stack: list[str] | None = None

    @property
    def duration_s(self) -> float | None:
        if self.end_mono_ns is None:
            return None
        return (self.end_mono_ns - self.start_mono_ns) / 1e9


class FlightRecorder:
    """The last `capacity` collectives of one communicator."""

    def __init__(self, comm: str, rank: int, capacity: int | None = None, world_rank: int | None = None) -> None:
        if capacity is None:
            capacity = int(os.environ.get(SIZE_ENV, DEFAULT_SIZE))
        if capacity <= 0:
            raise ValueError(f"{SIZE_ENV} must be positive; found {capacity}")
        self.comm = comm
        self.rank = rank
        self.world_rank = rank if world_rank is None else world_rank
        self.capacity = capacity
        self.with_stacks = os.environ.get(STACKS_ENV, "0") == "1"
        self._ring: deque[FlightEntry] = deque(maxlen=capacity)
        self._dumps = 0
        _RECORDERS.add(self)

    def start(self, call: Collective) -> FlightEntry:
        tensors = call.tensors()
        context = call.context
        entry = FlightEntry(
            call.seq, call.op.value, self.comm, [t.shape for t in tensors],
            _dtype_name(tensors[0].dtype) if tensors else None, call.nbytes(),
            call.root if call.root is not None else call.peer, call.async_op, call.deadline_s,
            time.time_ns(), time.monotonic_ns(), context.get("step"), context.get("phase"),
            stack=traceback.format_stack()[:-3] if self.with_stacks else None,
        )
        self._ring.append(entry)
        return entry

    @staticmethod
    def end(entry: FlightEntry, state: str) -> None:
        entry.end_mono_ns = time.monotonic_ns()
        entry.state = state

    def entries(self) -> list[FlightEntry]:
        return list(self._ring)

    def snapshot(self, reason: str) -> dict[str, Any]:
        return {
            "kind": "commlib.flight_recorder",
            "comm": self.comm,
            "rank": self.rank,  # in the communicator
            "world_rank": self.world_rank,
            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "reason": reason,
            "dumped_ns": time.time_ns(),
            "dumped_mono_ns": time.monotonic_ns(),
            "capacity": self.capacity,
            "entries": [asdict(e) for e in self._ring],
        }

    def dump(self, directory: Path | None, reason: str) -> Path | None:
        """Write the ring as JSON (atomically) into `directory`; stderr when there is none."""
        data = json.dumps(self.snapshot(reason), default=str)
        if directory is None:
            sys.stderr.write(data + "\n")
            return None
        self._dumps += 1
        path = directory / f"flight_rank{self.world_rank}_{self.comm}_{os.getpid()}_{self._dumps}_{reason}.json"
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            f.write(data)
        os.replace(tmp, path)
        return path


@functools.cache
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype)


# Every live recorder of the process (the one registry this module owns), for SIGUSR1.
_RECORDERS: "weakref.WeakSet[FlightRecorder]" = weakref.WeakSet()


def dump_all(directory: Path | None, reason: str) -> list[Path | None]:
    return [r.dump(directory, reason) for r in list(_RECORDERS)]


def install_sigusr1(directory_fn: Any) -> bool:
    """Dump every recorder on SIGUSR1, even while the main thread is blocked in C++.

    A Python signal handler runs only when the main thread returns to the interpreter, and a
    hung rank sits inside a collective's wait. So the handler is a no-op whose real effect
    is the interpreter's wakeup fd: the C-level handler writes the signal number to a pipe
    from whichever thread the kernel picked, and a daemon thread reading that pipe does the
    dump. Returns False when not called from the main thread (signals cannot be set there).
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    if getattr(install_sigusr1, "installed", False):
        return True
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.signal(signal.SIGUSR1, lambda *_: None)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    def watch() -> None:
        while True:
            signals = os.read(read_fd, 64)
            if signal.SIGUSR1 in signals:
                dump_all(directory_fn(), "sigusr1")

    threading.Thread(target=watch, name="commlib-sigusr1", daemon=True).start()
    install_sigusr1.installed = True  # type: ignore[attr-defined]
    return True
