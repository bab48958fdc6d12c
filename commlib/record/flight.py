"""The flight recorder: a ring buffer per communicator of its most recent collectives, and
the process's signal-driven dumps (SIGUSR1: the rings; SIGUSR2: every thread's stack).

Always on and cheap: starting an entry is one dataclass and a deque append. Its dump (JSON,
written atomically to the log dir) answers "what was this rank doing": `Communicator`
dumps it on a CollectiveTimeout, a PeerFailure and `abort()`; an operator can ask a live,
hung process for it with SIGUSR1, which works even while the main thread is blocked inside
a collective (see `install_sigusr1`).

The dump runs on another thread than the one appending, so it works on a copy of the ring
(`FlightRecorder.entries`), never on the live deque.

Dumps have a budget: a process keeps its newest `COMMLIB_FLIGHT_DUMPS` dump files (default
32; writing one more removes its oldest), and beside them the dump of its first failure or
abort, whatever came after (the first error is the one an operator looks for, and the
doctor's verdict from the end reaches back to it: `commlib.observe.verdict_from_end`); it answers
SIGUSR1 at most once per `COMMLIB_FLIGHT_DUMP_INTERVAL_S` seconds (default 1): signals that
come faster are answered by one dump taken when the interval is over, so the newest state is
always dumped and a storm of signals writes a few files, not one per signal.

SIGUSR2 (`STACKS_SIGNAL`) makes `faulthandler` write the Python stack of every thread of
the process to ``stacks_{host}_{pid}.txt`` in the log dir (stderr without one). That C-level
handler needs no GIL, so it answers even for a rank wedged in C code that holds the GIL,
where the flight-recorder dump (Python) has to wait. Its file must be open before the signal
comes, yet it should exist only once a dump is in it: it is opened unnamed (`O_TMPFILE`) and
given its name by the SIGUSR1 thread as soon as a dump is in it (faulthandler chains to a
Python-level handler that wakes that thread), or when the process lets go of commlib or
exits. A rank wedged with the GIL held gets its dump written but named only once the GIL is
free: killed before that, its dump is lost (the flight recorder has no dump of it either).
Where the file system has no `O_TMPFILE`, the file is named from the start, as it was
before. SIGUSR2 is a signal of its own: on SIGUSR1 beside the flight dump, a burst of
signals made faulthandler's all-thread walk crash the process now and then (SIGSEGV, seen
under fifty SIGUSR1s in a row). Each SIGUSR2 appends one dump; the doctor reads the last one
(`commlib.observe.stacks`). A rank whose collective timed out sends SIGUSR2 to the peers it
names that run on its own host (`commlib.missing_ranks.ask_for_stacks`).

The process's part ends with its last communicator: `FlightRecorder.close` (a communicator
finalized; `destroy_process_group` finalizes every group's) releases, once no recorder is
left open, what `install_sigusr1` and the log set up (`release`): the SIGUSR1 thread and its
wakeup pipe, the SIGUSR1 and SIGUSR2 handlers and the process's wakeup fd as they were
before, the stacks file and the log file. An aborted communicator's recorder (`aborted`)
no longer counts as open but releases nothing: in-job recovery aborts every communicator
and builds new ones in the same process.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import faulthandler
import itertools
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from commlib import settings
from commlib.attempt import attempt_number
from commlib.ops import PLAIN_NAMES, Collective, OpName
from commlib.record import log as _log
from commlib.record.files import SIGUSR1_REASON, STACKS_SIGNAL, safe_host, stacks_file_name

SIZE_ENV = "COMMLIB_FLIGHT_RECORDER_SIZE"
STACKS_ENV = "COMMLIB_FLIGHT_RECORDER_STACKS"
DUMPS_ENV = "COMMLIB_FLIGHT_DUMPS"
INTERVAL_ENV = "COMMLIB_FLIGHT_DUMP_INTERVAL_S"
DEFAULT_SIZE = 2000
_RECV = OpName.RECV  # read on every collective: a module global reads faster than the enum member
# Every torch dtype's name, read on every collective: `str(dtype)` builds it anew each time.
_DTYPE_NAMES = {d: str(d) for d in vars(torch).values() if isinstance(d, torch.dtype)}
MAX_SIZE = 100_000  # entries a communicator's ring may hold
DEFAULT_DUMPS = 32
MAX_DUMPS = 10_000
DEFAULT_INTERVAL_S = 1.0
MAX_INTERVAL_S = 3600.0
FAILED_PAUSE_S = 1.0  # how long the SIGUSR1 thread rests after a turn that failed
JOIN_S = 5.0  # how long releasing waits for the SIGUSR1 thread to finish a dump under way


class State(enum.Enum):
    """A recorder's part in the process's lifecycle (module docstring)."""

    OPEN = "open"
    ABORTED = "aborted"
    CLOSED = "closed"


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
    peer: int | None = None  # a send/recv's other rank (`seq` counts the pair's p2p ops of its tag)
    tag: int = 0  # a send/recv's tag
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
            capacity = settings.env_integer(SIZE_ENV, DEFAULT_SIZE, low=1, high=MAX_SIZE)
        else:
            capacity = settings.integer(capacity, "a flight recorder's capacity", low=1, high=MAX_SIZE)
        self.comm = comm
        self.rank = rank
        self.world_rank = rank if world_rank is None else world_rank
        self.capacity = capacity
        self.with_stacks = settings.env_flag(STACKS_ENV)
        self._ring: deque[FlightEntry] = deque(maxlen=capacity)
        self._dumps = itertools.count(1)  # next() is atomic: the SIGUSR1 thread dumps too
        self.state = State.OPEN
        _RECORDERS.add(self)

    def close(self) -> None:
        """Its communicator is finalized: once no recorder is left open, release the process's part."""
        self.state = State.CLOSED
        if not any(r.state is State.OPEN for r in _copy(_RECORDERS)):
            release()

    def aborted(self) -> None:
        """Its communicator is aborted (in-job recovery may build a new one): it no longer keeps
        the process's part alive, and releases nothing."""
        if self.state is State.OPEN:
            self.state = State.ABORTED

    def start(self, call: Collective) -> FlightEntry:
        t = call.tensor
        dtype: str | None
        if t is not None:  # the common case: one tensor, no list to build and scan
            shapes, dtype = [t.shape], _DTYPE_NAMES.get(t.dtype) or str(t.dtype)
            nbytes = t.nbytes if call.op is not _RECV else 0  # `Collective.nbytes`, without its call
        else:
            tensors = call.tensors()
            shapes = [x.shape for x in tensors]
            dtype = str(tensors[0].dtype) if tensors else None
            nbytes = call.nbytes()
        context = call.context
        step, phase = (context.get("step"), context.get("phase")) if context else (None, None)
        entry = FlightEntry(
            call.seq,
            PLAIN_NAMES[call.op],
            self.comm,
            shapes,
            dtype,
            nbytes,
            call.root,
            call.async_op,
            call.deadline_s,
            time.time_ns(),
            time.monotonic_ns(),
            step,
            phase,
            call.peer,
            call.tag,
            "started",
            None,
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
            "attempt": attempt_number(),
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
        # Named by the process's host and pid: pids repeat across the hosts sharing a log dir.
        process = f"{safe_host(socket.gethostname())}_{os.getpid()}"
        path = directory / f"flight_rank{self.world_rank}_{self.comm}_{process}_{next(self._dumps)}_{reason}.json"
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            f.write(data)
        os.replace(tmp, path)
        _DUMPS.wrote(path, reason)
        return path


class _DumpFiles:
    """The dump files this process wrote, oldest first: past the budget, the oldest goes. The
    first failure's or abort's dump is kept apart, outside the budget (module docstring): a
    torchft replica that failed once and then went through quorum after quorum, each ending in
    an abort and its dump, lost it to the budget."""

    def __init__(self) -> None:
        self._paths: deque[Path] = deque()
        self._first_failure: Path | None = None
        self._lock = threading.Lock()  # the SIGUSR1 thread and a failing caller both dump

    def wrote(self, path: Path, reason: str) -> None:
        keep = dump_budget()[0]
        with self._lock:
            if self._first_failure is None and reason != SIGUSR1_REASON:
                self._first_failure = path
                return
            self._paths.append(path)
            while len(self._paths) > keep:
                with contextlib.suppress(FileNotFoundError):
                    self._paths.popleft().unlink()


def dump_budget() -> tuple[int, float]:
    """(dump files a process keeps, seconds between two SIGUSR1 dumps), from the environment."""
    keep = settings.env_integer(DUMPS_ENV, DEFAULT_DUMPS, low=1, high=MAX_DUMPS)
    interval = settings.env_number(INTERVAL_ENV, DEFAULT_INTERVAL_S, low=0, high=MAX_INTERVAL_S, unit="seconds")
    return keep, interval


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


# The registries this module owns: every live recorder of the process (for SIGUSR1 and the
# process's lifecycle), the dump files it wrote, and what install_sigusr1 set up.
_RECORDERS: weakref.WeakSet[FlightRecorder] = weakref.WeakSet()
_DUMPS = _DumpFiles()


def install_sigusr1(directory_fn: Callable[[], Path | None]) -> bool:
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
    A failed dump is logged and the thread goes on, so the next SIGUSR1 dumps again; a turn of
    the thread that fails (a setting changed to a bad value since) is logged once, however
    often it repeats, and the thread rests `FAILED_PAUSE_S` before the next: no failure makes
    it spin.
    Whoever sets the wakeup fd later takes it over for good, and asyncio does not forward:
    a loop that adds its first signal handler after `commlib.init`, or closes (removing its
    last handler sets the wakeup fd to -1, and a SIGUSR1 handler of its own back to the
    default action, which kills), ends SIGUSR1 dumps in that process.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    if _INSTALLED:
        return True
    dump_budget()  # bad settings fail here, not in the thread at the first signal
    _INSTALLED.append(_Installed(directory_fn))
    install_sigusr1.installed = True  # type: ignore[attr-defined]
    return True


class _Installed:
    """What `install_sigusr1` set up in this process, and how `release` undoes it."""

    def __init__(self, directory_fn: Callable[[], Path | None]) -> None:
        self.directory_fn = directory_fn
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)
        self.handlers: dict[int, Any] = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, STACKS_SIGNAL)}
        for sig in self.handlers:
            signal.signal(sig, self._chain)
        self.forward_to = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        self.stacks = _StackFile(directory_fn())
        self.thread = threading.Thread(target=self._watch, name="commlib-sigusr1", daemon=True)
        self.thread.start()

    def _chain(self, signum: int, frame: Any) -> None:
        # The wakeup byte is the real work (install_sigusr1); a handler installed before ours is still called.
        previous = self.handlers.get(signum)
        if callable(previous):
            previous(signum, frame)

    def _watch(self) -> None:
        last_round = -float("inf")
        pending = False  # a SIGUSR1 came within the interval: its dump is due when the interval is over
        # The last failure logged, wherever it was met (a recorder's dump, or the turn itself: a
        # setting read in both fails in both): one that repeats is logged once.
        said = None
        while True:
            failed = None  # what a recorder's dump met this turn
            try:
                interval = dump_budget()[1]
                wait = max(0.0, last_round + interval - time.monotonic()) if pending else None
                if select.select([self.read_fd], [], [], wait)[0]:
                    signals = os.read(self.read_fd, 64)
                    if not signals:
                        return  # the write end is closed: released
                    if self.forward_to >= 0:
                        self.forward_to = _forward(self.forward_to, signals)
                    if STACKS_SIGNAL in signals:
                        self.stacks.publish()
                    pending = pending or signal.SIGUSR1 in signals
                if pending and time.monotonic() - last_round >= interval:
                    pending, last_round = False, time.monotonic()
                    directory = self.directory_fn()
                    for recorder in _copy(_RECORDERS):
                        try:
                            recorder.dump(directory, SIGUSR1_REASON)
                        except Exception as exc:  # the other recorders still dump
                            failed = repr(exc)
                            if failed != said:
                                _dump_failed(exc, recorder.comm)
                said = failed
            except Exception as exc:  # one failure must not silence every later SIGUSR1
                if repr(exc) != said:
                    said = repr(exc)
                    _dump_failed(exc, None)
                # Whatever failed may fail again at once: rest, so that the thread can never spin.
                time.sleep(FAILED_PAUSE_S)

    def undo(self) -> None:
        """Put back the wakeup fd and the handlers as they were, then stop the thread and close the pipe."""
        current = signal.set_wakeup_fd(self.forward_to)
        if current != self.write_fd:  # someone set it after us and owns it now: theirs stays
            signal.set_wakeup_fd(current)
        self.stacks.close()  # faulthandler's handler first: it chains to ours
        for sig, previous in self.handlers.items():
            if signal.getsignal(sig) == self._chain and previous is not None:
                signal.signal(sig, previous)
        os.close(self.write_fd)  # the thread reads the end of the pipe and returns
        self.thread.join(JOIN_S)
        if not self.thread.is_alive():
            os.close(self.read_fd)


_INSTALLED: list[_Installed] = []  # what install_sigusr1 set up in this process, until `release`


def release() -> None:
    """Leave the process as commlib found it: the SIGUSR1 thread stopped and its pipe closed,
    the signal handlers and wakeup fd put back, the stacks and log files closed (module
    docstring). From the main thread only (signals are set there); elsewhere, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        return
    if _INSTALLED:
        _INSTALLED.pop().undo()
        install_sigusr1.installed = False  # type: ignore[attr-defined]
    _log.release()


class _StackFile:
    """faulthandler's C handler on STACKS_SIGNAL (no GIL needed), writing into a file that gets
    its name in the log dir (`stacks_file_name`: its host and pid), only once a dump is in it
    (module docstring)."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self.fd: int | None = None
        self.named = False
        if directory is not None:
            try:  # unnamed until `publish` links it
                self.fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_APPEND, 0o644)
            except OSError:  # a file system without O_TMPFILE: named from the start, as it must be open now
                self.fd = os.open(
                    directory / stacks_file_name(socket.gethostname(), os.getpid()),
                    os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                    0o644,
                )
                self.named = True
        # Chained to our Python-level handler, installed just before: it writes the wakeup
        # byte that has the SIGUSR1 thread publish the dump.
        faulthandler.register(
            STACKS_SIGNAL, file=sys.stderr if self.fd is None else self.fd, all_threads=True, chain=True
        )
        atexit.register(self.close)

    def publish(self) -> None:
        """Give the dumps written so far their file's name (appended to a file of that name, if any)."""
        if self.fd is None or self.named or os.fstat(self.fd).st_size == 0:
            return
        assert self.directory is not None
        name = stacks_file_name(socket.gethostname(), os.getpid())
        directory = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:  # linkat(AT_SYMLINK_FOLLOW) of /proc/self/fd/N: os.link takes that path only with dir fds
            os.link(f"/proc/self/fd/{self.fd}", name, src_dir_fd=directory, dst_dir_fd=directory, follow_symlinks=True)
            self.named = True  # later dumps land in the named file
        except FileExistsError:  # an earlier install in this process named its own
            with open(self.directory / name, "ab") as out:
                out.write(os.pread(self.fd, os.fstat(self.fd).st_size, 0))
            os.ftruncate(self.fd, 0)
        finally:
            os.close(directory)

    def close(self) -> None:
        if self.fd == -1:
            return
        faulthandler.unregister(STACKS_SIGNAL)
        if self.fd is not None:
            with contextlib.suppress(OSError):  # the log dir may be gone: nothing to name then
                self.publish()
            os.close(self.fd)
        self.fd = -1
        atexit.unregister(self.close)


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
