"""Deadlines of the ops a stream-ordered engine (a GPU's) runs after the CPU has moved on.

The shape is torchft's (torchft/futures.py: `_TimeoutManager`, `stream_timeout`,
`context_timeout`; torchft/process_group.py: `ProcessGroupNCCL`, `_WorkAcceleratorTimeout`):
one timer thread for the whole process. Each op of a stream-ordered communicator is handed
to it before its launch, with a deadline counted from its issue (as c10d's watchdog counts
from the enqueue), and once launched with the point at which it has ended: the engine's own
verdict where the engine gives one (c10d's `Work.get_future_result()`), else one event on
the caller's stream right after it (torchft's `stream_timeout`). A blocking call (building an
engine) runs under a deadline of its own (`bounded`, torchft's `context_timeout`).

At expiry the thread does one thing: it tells the op's owner, which starts the engine's abort
in a thread of its own (`InFlight`'s owner never blocks this thread). The typed error, its log
line, the store announcement, the flight dump and the failure hooks are the owner's, off this
thread. Every `TICK_S` the thread also asks each communicator with ops in flight for its
engine's error (c10d's `ProcessGroupNCCL.get_error()`, which takes only the engine's error
mutex and releases the GIL), so that an op whose peer c10d saw die fails within a tick, not
at its deadline; and it tells a communicator whose op has been in flight for a while, which
then reads its peers' abort announcements in the store on a thread of its own.

Events are read as c10d's watchdog reads its own (ProcessGroupNCCL's Watchdog::runLoop: a
device guard and the thread-local stream capture mode around every query): `StreamEvents.watching`
and `StreamEvents.side_thread` (`commlib.device`).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from commlib.device import Event, StreamEvents
from commlib.ops import Collective
from commlib.record.flight import FlightEntry

TICK_S = 0.1  # how often the thread looks: an expired deadline or an engine error is seen within this


@dataclass(slots=True, eq=False)
class PendingOp:
    """One op of a stream-ordered communicator, from before its launch until it has ended."""

    call: Collective
    entry: FlightEntry
    issued_ns: int  # monotonic; its deadline counts from here
    deadline_ns: int
    end: Event | None = None  # None while its launch has not returned
    marked: bool = False  # `end` is an event of commlib's own (`StreamEvents.mark`), reused once passed


class Owner(Protocol):
    """What the timer needs of the communicator whose ops it holds (`Communicator` is one).

    `deadline_passed`, `engine_failed` and `unwatchable` are called on the timer's thread and
    must not block: the owner starts its engine's abort in a thread of its own and returns.
    """

    abort_poll_s: float

    @property
    def broken(self) -> bool: ...

    def engine_error(self) -> BaseException | None:
        """The engine's own verdict on the communicator, as an error (None: none); never blocks."""

    def deadline_passed(self, op: PendingOp) -> None: ...

    def waiting_on_peers(self) -> None:
        """An op has been in flight for `abort_poll_s`: the owner reads its peers' abort
        announcements, on a thread of its own, until its ops have ended."""

    def engine_failed(self, error: BaseException, op: PendingOp) -> None: ...

    def unwatchable(self, exc: BaseException) -> None:
        """Reading the owner's events or engine raised (a broken device context)."""


class InFlight:
    """One communicator's ops in flight, in issue order (module docstring).

    The caller's thread appends (`add`, a deque append needs no lock) and fills an op's end;
    the timer's thread pops the ops that have ended from the front and judges the rest.
    """

    def __init__(self, owner: Owner, events: StreamEvents) -> None:
        self.owner = owner
        self.events = events
        self.ops: deque[PendingOp] = deque()
        self.registered = False  # held by the timer (`_Timer.register`)

    def add(self, op: PendingOp) -> None:
        self.ops.append(op)
        if not self.registered:
            _TIMER.register(self)

    def has_ended(self, op: PendingOp) -> bool:
        """Whether `op` has ended on its device (an op whose launch never returned has not)."""
        end = op.end
        if end is None:
            return False
        with self.events.watching():
            return end.query()

    def check(self, now_ns: int) -> None:
        """On the timer's thread: forget the ops that ended, fail one that failed or whose
        deadline passed. Once the owner is broken its ops are only forgotten as they end,
        until its engine's abort returns (`clear`)."""
        ops, owner, events = self.ops, self.owner, self.events
        with events.watching():
            while ops:
                head = ops[0]
                end = head.end
                if end is None or not end.query():
                    break
                # An engine's verdict (c10d's future) ends an op that failed as well.
                verdict = getattr(end, "failure", None)
                error = verdict() if verdict is not None else None
                if error is not None and not owner.broken:
                    owner.engine_failed(error, head)
                    return
                ops.popleft()
                if head.entry.state == "enqueued":
                    head.entry.state, head.entry.end_mono_ns = "completed", now_ns
                if head.marked:
                    events.release(end)
            if owner.broken:
                return
            # An op behind a running head may have ended already (another stream): only the
            # ones whose deadline has passed are asked.
            for op in list(ops):
                if op.deadline_ns > now_ns or (op.end is not None and op.end.query()):
                    continue
                owner.deadline_passed(op)
                return
        if ops:
            error = owner.engine_error()
            if error is not None:
                owner.engine_failed(error, ops[0])
            elif now_ns - ops[0].issued_ns >= owner.abort_poll_s * 1e9:
                owner.waiting_on_peers()

    def clear(self) -> None:
        """The engine was aborted and its abort has returned: nothing of it runs any more."""
        self.ops.clear()


@dataclass(order=True)
class _Bound:
    expires_ns: int
    number: int  # orders bounds of one instant; never compares the callbacks
    on_expiry: Callable[[], None]
    cancelled: bool = False


class _Timer:
    """The process's one timer thread, over every `InFlight` with ops and every `bounded` call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: list[InFlight] = []
        self._bounds: list[_Bound] = []  # a heap
        self._numbers = itertools.count()
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()

    def register(self, in_flight: InFlight) -> None:
        with self._lock:
            if not in_flight.registered:
                in_flight.registered = True
                self._watched.append(in_flight)
            self._start()

    def watched(self) -> list[InFlight]:
        with self._lock:
            return list(self._watched)

    def bound(self, seconds: float, on_expiry: Callable[[], None]) -> _Bound:
        bound = _Bound(time.monotonic_ns() + int(seconds * 1e9), next(self._numbers), on_expiry)
        with self._lock:
            heapq.heappush(self._bounds, bound)
            self._start()
        self._wake.set()
        return bound

    def _start(self) -> None:
        """With the lock held: a thread, if none runs."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="commlib-deadlines", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            self._loop()
        finally:  # whatever ended the loop, the next registration starts a thread again
            with self._lock:
                self._thread = None

    def _loop(self) -> None:
        side_thread_done: set[int] = set()
        while True:
            self._wake.wait(self._sleep_s())
            self._wake.clear()
            now_ns = time.monotonic_ns()
            for bound in self._due_bounds(now_ns):
                _in_a_thread_of_its_own(bound.on_expiry, "commlib-bounded-abort")
            for in_flight in self.watched():
                owner, events = in_flight.owner, in_flight.events
                try:
                    if id(events) not in side_thread_done:
                        events.side_thread()
                        side_thread_done.add(id(events))
                    in_flight.check(now_ns)
                except Exception as exc:  # one communicator's broken device must not stop the others'
                    in_flight.clear()
                    owner.unwatchable(exc)
            if not self._forget_idle():
                return

    def _sleep_s(self) -> float:
        with self._lock:
            if not self._bounds:
                return TICK_S
            return min(TICK_S, max(0.0, (self._bounds[0].expires_ns - time.monotonic_ns()) / 1e9))

    def _due_bounds(self, now_ns: int) -> list[_Bound]:
        due = []
        with self._lock:
            while self._bounds and self._bounds[0].expires_ns <= now_ns:
                bound = heapq.heappop(self._bounds)
                if not bound.cancelled:
                    due.append(bound)
        return due

    def _forget_idle(self) -> bool:
        """Let go of communicators with nothing in flight; False (the thread ends) once nothing is held."""
        with self._lock:
            keep = []
            for in_flight in self._watched:
                if not in_flight.ops:
                    in_flight.registered = False
                    # An op added meanwhile by a caller that found it still registered (`add`
                    # takes no lock) is seen once the flag is down, so it is never lost.
                    if not in_flight.ops:
                        continue
                    in_flight.registered = True
                keep.append(in_flight)
            self._watched = keep
            self._bounds = [b for b in self._bounds if not b.cancelled]
            heapq.heapify(self._bounds)
            return bool(keep or self._bounds)


def _in_a_thread_of_its_own(action: Callable[[], None], name: str) -> None:
    """An expiry's action: an abort can wait for the device to drain, and no deadline may wait behind it."""
    threading.Thread(target=action, name=name, daemon=True).start()


# The one registry this module owns.
_TIMER = _Timer()


@contextlib.contextmanager
def bounded(seconds: float, on_expiry: Callable[[], None]) -> Iterator[None]:
    """Run the block under a deadline: if it has not left the block within `seconds`,
    `on_expiry()` runs in a thread of its own (an engine's abort, which ends the blocking call
    with an error). torchft's `context_timeout`, around a call that can block on its peers."""
    bound = _TIMER.bound(seconds, on_expiry)
    try:
        yield
    finally:
        bound.cancelled = True


def watched() -> list[InFlight]:
    """Every communicator with ops in flight now (`commlib.check`)."""
    return _TIMER.watched()
