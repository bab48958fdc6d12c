"""The flight recorder: a ring buffer per communicator of its most recent collectives.

Always on and cheap: starting an entry is one dataclass and a deque append. Its dump (JSON,
written atomically to the log dir) answers "what was this rank doing": `Communicator`
dumps it on a CollectiveTimeout, a PeerFailure and `abort()`; an operator can ask a live,
hung process for it with SIGUSR1, which works even while the main thread is blocked inside
a collective (see `install_sigusr1`).

The dump runs on another thread than the one appending, so it works on a copy of the ring
(`FlightRecorder.entries`), never on the live deque.

SIGUSR2 (`STACKS_SIGNAL`) makes `faulthandler` write the Python stack of every thread of
the process to ``stacks_{pid}.txt`` in the log dir (stderr without one). That C-level
handler needs no GIL, so it answers even for a rank wedged in C code that holds the GIL,
where the flight-recorder dump (Python) has to wait. It has a signal of its own: on SIGUSR1
beside the flight dump, a burst of signals made faulthandler's all-thread walk crash the
process now and then (SIGSEGV, seen in the fifty-SIGUSR1 test). Each SIGUSR2 appends one
dump; the doctor reads the last one (`commlib.observe.stacks`). A rank whose collective
timed out sends SIGUSR2 to the peers it names that run on its own host
(`board.ask_for_stacks`).
"""

from __future__ import annotations

import faulthandler
import functools
import itertools
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

from commlib.observe import log as _log
from commlib.ops import PLAIN_NAMES, Collective

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
    peer: int | None = None  # the other rank of a send/recv (then `seq` counts this pair's p2p ops)
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
        self._dumps = itertools.count(1)  # next() is atomic: the SIGUSR1 thread dumps too
        _RECORDERS.add(self)

    def start(self, call: Collective) -> FlightEntry:
        t = call.tensor
        if t is not None:  # the common case: one tensor, no list to build and scan
            shapes, dtype = [t.shape], _dtype_name(t.dtype)
        else:
            tensors = call.tensors()
            shapes = [x.shape for x in tensors]
            dtype = _dtype_name(tensors[0].dtype) if tensors else None
        context = call.context
        step, phase = (context.get("step"), context.get("phase")) if context else (None, None)
        entry = FlightEntry(
            call.seq, PLAIN_NAMES[call.op], self.comm, shapes, dtype, call.nbytes(), call.root, call.async_op,
            call.deadline_s, time.time_ns(), time.monotonic_ns(), step, phase, call.peer, "started", None,
            traceback.format_stack()[:-3] if self.with_stacks else None,
        )
        self._ring.append(entry)
        return entry

    @staticmethod
    def end(entry: FlightEntry, state: str) -> None:
        entry.end_mono_ns = time.monotonic_ns()
        entry.state = state

    def entries(self) -> list[FlightEntry]:
        """A copy of the ring, safe to take from any thread while the owner appends."""
        return _copy(self._ring)

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
            "entries": [asdict(e) for e in self.entries()],
        }

    def dump(self, directory: Path | None, reason: str) -> Path | None:
        """Write the ring as JSON (atomically) into `directory`; stderr when there is none."""
        data = json.dumps(self.snapshot(reason), default=str)
        if directory is None:
            sys.stderr.write(data + "\n")
            return None
        path = directory / f"flight_rank{self.world_rank}_{self.comm}_{os.getpid()}_{next(self._dumps)}_{reason}.json"
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            f.write(data)
        os.replace(tmp, path)
        return path


@functools.cache
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype)


def _copy(items: Any) -> list[Any]:
    """`list(items)` of a deque or WeakSet that another thread may change meanwhile.

    Under the GIL, copying a deque is one C call that no append interleaves with; a
    WeakSet's iteration runs Python code and can see a concurrent add ("changed size during
    iteration"), and so can a deque without a GIL: retry, then give up loudly.
    """
    for _ in range(100):
        try:
            return list(items)
        except RuntimeError:
            continue
    return list(items)


# Every live recorder of the process (the one registry this module owns), for SIGUSR1.
_RECORDERS: "weakref.WeakSet[FlightRecorder]" = weakref.WeakSet()


def dump_all(directory: Path | None, reason: str) -> list[Path | None]:
    return [r.dump(directory, reason) for r in _copy(_RECORDERS)]


def install_sigusr1(directory_fn: Any) -> bool:
    """Dump every recorder on SIGUSR1, even while the main thread is blocked in C++ (and
    register the faulthandler stack dump on SIGUSR2: see the module docstring).

    A Python signal handler runs only when the main thread returns to the interpreter, and a
    hung rank sits inside a collective's wait. So the handler is a no-op whose real effect
    is the interpreter's wakeup fd: the C-level handler writes the signal number to a pipe
    from whichever thread the kernel picked, and a daemon thread reading that pipe does the
    dump. Returns False when not called from the main thread (signals cannot be set there).

    The process has one wakeup fd, and it may be someone else's already (asyncio's loop sets
    one to learn of its signals): every byte read is forwarded to that previous fd, so its
    owner still hears of every signal. A SIGUSR1 handler installed before keeps being called.
    A failed dump is logged and the thread goes on, so the next SIGUSR1 dumps again.
    Whoever sets the wakeup fd later takes it over for good, and asyncio does not forward:
    a loop that adds its first signal handler after `commlib.init`, or closes (removing its
    last handler sets the wakeup fd to -1, and a SIGUSR1 handler of its own back to the
    default action, which kills), ends SIGUSR1 dumps in that process.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    if getattr(install_sigusr1, "installed", False):
        return True
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous_handler = signal.getsignal(signal.SIGUSR1)

    def handler(signum: int, frame: Any) -> None:
        if callable(previous_handler):
            previous_handler(signum, frame)

    signal.signal(signal.SIGUSR1, handler)
    forward_to = [signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)]

    def watch() -> None:
        while True:
            try:
                signals = os.read(read_fd, 64)
                if forward_to[0] >= 0:
                    forward_to[0] = _forward(forward_to[0], signals)
                if signal.SIGUSR1 in signals:
                    directory = directory_fn()
                    for recorder in _copy(_RECORDERS):
                        try:
                            recorder.dump(directory, "sigusr1")
                        except Exception as exc:  # the other recorders still dump
                            _dump_failed(exc, recorder.comm)
            except Exception as exc:  # one failure must not silence every later SIGUSR1
                _dump_failed(exc, None)

    threading.Thread(target=watch, name="commlib-sigusr1", daemon=True).start()
    _register_stack_dump(directory_fn())
    install_sigusr1.installed = True  # type: ignore[attr-defined]
    return True


STACKS_FILE = "stacks_{pid}.txt"
_STACK_FILES: list[Any] = []  # faulthandler writes to the fd: its file must stay open


STACKS_SIGNAL = signal.SIGUSR2


def _register_stack_dump(directory: Path | None) -> None:
    """faulthandler's C handler on STACKS_SIGNAL (no GIL needed), then any handler installed before it."""
    if directory is None:
        out: Any = sys.stderr
    else:
        out = open(Path(directory) / STACKS_FILE.format(pid=os.getpid()), "a")
        _STACK_FILES.append(out)
    # Chained only to a handler someone installed: chaining to the default action would kill.
    previous = signal.getsignal(STACKS_SIGNAL)
    faulthandler.register(STACKS_SIGNAL, file=out, all_threads=True,
                          chain=previous not in (signal.SIG_DFL, signal.SIG_IGN, None))


def _dump_failed(exc: Exception, comm: str | None) -> None:
    try:
        _log.get_logger().error("flight.sigusr1_dump_failed", comm=comm, error=f"{type(exc).__name__}: {exc}")
    except Exception:
        pass  # the log is broken too: nothing left to tell, but the thread lives on


def _forward(fd: int, data: bytes) -> int:
    """Pass wakeup bytes on to the fd that was the wakeup fd before ours (often a socket).

    Returns the fd to forward to next time: -1 once it is closed (its owner is gone).
    """
    try:
        os.write(fd, data)
    except BlockingIOError:
        pass  # its buffer is full: its owner has wakeups pending already, as with its own fd
    except OSError as exc:
        _log.get_logger().warning("flight.wakeup_forward_stopped", fd=fd, error=f"{type(exc).__name__}: {exc}")
        return -1
    return fd
