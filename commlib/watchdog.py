"""The watchdog: deadlines of ops that run in stream order on a device, held off the calling thread.

On a stream-ordered engine (`commlib.device`) a collective returns as soon as it is
enqueued and ordered, so nobody waits on the calling thread for it to end. This module
keeps every such op of the process, per communicator and in the order the device runs them
(`InFlight`: one queue per engine lane, `Backend.lane`), and one daemon thread per process
(`_Watchdog`, running while any op is in flight or any error waits for its caller) looks at
the head of each queue every `POLL_S`, with the communicator's device current on its thread
and its queries safe from CUDA graph captures (`Runtime.watching`):

- the op's end has been reached (`BackendWork.end`, or commlib's own end event): the op is
  done, and the Communicator records it (flight recorder, progress board, log, post-hooks)
  unless the engine's own verdict says it failed, and hands its events back to the pool;
- its start event has completed and the op before it has ended: it has started on the
  device, and the board says so (what every rank's device has started is what lets a
  timeout name "issued it, but its GPU never started it");
- it has run longer than its deadline since that start: the Communicator fails it, on this
  thread, exactly as it fails a CPU wait: the typed error naming who did not arrive, the
  flight recorder, the log, the board, the abort announced in the store, the engine aborted
  (in a thread of its own: an abort can hang on a wedged device);
- a peer announced that it aborted the communicator (read from the store once the op has
  run its communicator's `abort_poll_s`, then at a tenth of its running time, as a CPU wait
  does): the
  Communicator fails it with a `PeerFailure` naming that peer.

Counting from the start on the device, not from the enqueue, is what keeps a deep queue of
earlier GPU work from looking like a timeout (c10d's own watchdog counts from the enqueue).
The error waits for the caller: it is raised on the calling thread at its next call on that
communicator, at `Work.wait()`, or at `check()`, which a trainer calls once a step. The
outputs of a failed op, and of every op queued behind it on the aborted communicator, are
undefined; so are the step's results computed from them: the caller rolls the step back.

`check()` scans every communicator on the calling thread first (under the same lock as the
watchdog), so an op that the device has finished by then is judged before `check` returns;
`check(wait=True)` first waits for every op issued so far, which is the caller's choice
of a host sync (before a checkpoint).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from commlib.backends.base import BackendWork
from commlib.device import Event, Runtime
from commlib.ops import Collective
from commlib.record.flight import FlightEntry

POLL_S = 0.05  # how often the watchdog looks: an expired deadline is seen within this (and the scan)
_WAIT_PAUSE_S = 0.001  # `check(wait=True)`'s pause between two scans


@dataclass(slots=True, eq=False)
class DeviceOp:
    """One op of a stream-ordered communicator, from its launch until the watchdog saw it end."""

    call: Collective
    entry: FlightEntry
    work: BackendWork
    lane: int | None  # the engine lane it runs on (`Backend.lane`)
    start: Event  # on the caller's stream before the launch (`commlib.device`)
    end: Event  # reached once the op has ended: the engine's (`BackendWork.end`) or commlib's own event
    marked_end: bool  # `end` is commlib's own event, which goes back to the pool
    started_mono_ns: int | None = None  # when the watchdog first saw it started on the device
    next_read_ns: int = 0  # when to read the store for a peer's abort announcement next


class Owner(Protocol):
    """What the watchdog needs of the communicator whose ops it watches (`commlib.device_ops.DeviceOps`
    is its side of them): the verdicts are the watchdog's, what follows from them is the communicator's."""

    abort_poll_s: float
    runtime: Runtime

    @property
    def broken(self) -> bool: ...

    @property
    def has_undelivered_error(self) -> bool: ...

    def op_started(self, op: DeviceOp) -> None: ...

    def op_ended(self, op: DeviceOp) -> None: ...

    def op_expired(self, op: DeviceOp, running_s: float) -> None: ...

    def peer_aborted(self, op: DeviceOp) -> bool:
        """Fail `op` if a peer announced it aborted the communicator; whether it did."""

    def op_dropped(self, op: DeviceOp) -> None: ...

    def deliver_undelivered(self) -> None:
        """Raise the error found on the watchdog's thread, if one waits for the caller."""

    def watchdog_failed(self, exc: BaseException) -> None:
        """A scan raised: the communicator cannot be watched any more."""


class InFlight:
    """One communicator's ops on its device, in the order they run.

    An engine runs the ops of one lane one after the other (`Backend.lane`: the collectives;
    send/recv with one peer, where the engine has such lanes), so there is one queue per lane.
    Only the head of a queue can be running; the ones behind it wait for it.
    """

    def __init__(self, comm: Owner) -> None:
        self.comm = comm
        self.queues: dict[int | None, deque[DeviceOp]] = {}
        self.lock = threading.Lock()  # one scan at a time: the watchdog's or a `check`'s
        self.registered = False

    def add(self, op: DeviceOp) -> None:
        """On the calling thread, after the launch: deque.append needs no lock."""
        queue = self.queues.get(op.lane)
        if queue is None:
            queue = self.queues[op.lane] = deque()
        queue.append(op)
        if not self.registered:
            _WATCHDOG.register(self)

    def pending(self) -> bool:
        return any(self.queues.values())

    def scan(self, now_ns: int) -> None:
        """Judge the head of every queue (module docstring). Called with `lock` held."""
        comm = self.comm
        if comm.broken:
            self.drop()
            return
        if not self.pending():
            return
        with comm.runtime.watching():
            self._scan_queues(now_ns)

    def _scan_queues(self, now_ns: int) -> None:
        comm = self.comm
        for queue in list(self.queues.values()):
            while queue:
                op = queue[0]
                if op.end.query():
                    queue.popleft()
                    comm.op_ended(op)
                    if comm.broken:  # the engine said the op failed
                        self.drop()
                        return
                    continue
                if op.started_mono_ns is None:
                    if not op.start.query():
                        break  # still queued behind earlier work on the device
                    op.started_mono_ns = now_ns
                    op.next_read_ns = now_ns + int(comm.abort_poll_s * 1e9)
                    comm.op_started(op)
                running_ns = now_ns - op.started_mono_ns
                if running_ns >= op.call.deadline_s * 1e9:
                    comm.op_expired(op, running_ns / 1e9)
                    self.drop()
                    return
                if now_ns >= op.next_read_ns:
                    op.next_read_ns = now_ns + int(max(comm.abort_poll_s * 1e9, running_ns / 10))
                    if comm.peer_aborted(op):
                        self.drop()
                        return
                break

    def drop(self) -> None:
        """The communicator broke: its ops still queued end with it, their outputs undefined."""
        for queue in self.queues.values():
            while queue:
                self.comm.op_dropped(queue.popleft())

    def drain(self, until_mono: float) -> bool:
        """Scan until nothing is in flight (True) or `until_mono` passes (False); the CPU waits."""
        while True:
            with self.lock:
                self.scan(time.monotonic_ns())
                if not self.pending():
                    return True
            if time.monotonic() >= until_mono:
                return False
            time.sleep(_WAIT_PAUSE_S)


class _Watchdog:
    """The process's one watchdog thread, over every `InFlight` with ops or an undelivered error."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: list[InFlight] = []
        self._thread: threading.Thread | None = None

    def register(self, in_flight: InFlight) -> None:
        with self._lock:
            if not in_flight.registered:
                in_flight.registered = True
                self._watched.append(in_flight)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="commlib-watchdog", daemon=True)
                self._thread.start()

    @staticmethod
    def _busy(in_flight: InFlight) -> bool:
        return in_flight.pending() or in_flight.comm.has_undelivered_error

    def watched(self) -> list[InFlight]:
        with self._lock:
            return list(self._watched)

    def _run(self) -> None:
        while True:
            time.sleep(POLL_S)
            for in_flight in self.watched():
                try:
                    in_flight.comm.runtime.side_thread()
                    with in_flight.lock:
                        in_flight.scan(time.monotonic_ns())
                except Exception as exc:  # the thread must outlive any one communicator's failure
                    in_flight.comm.watchdog_failed(exc)
            if not self._forget_idle():
                return

    def _forget_idle(self) -> bool:
        """Let go of communicators with nothing in flight and nothing left to tell their caller;
        False (and the thread's slot freed: the next op starts one) once none is left."""
        with self._lock:
            keep = []
            for in_flight in self._watched:
                if self._busy(in_flight):
                    keep.append(in_flight)
                    continue
                in_flight.registered = False
                # An op added meanwhile, by a caller that found it still registered (`InFlight.add`
                # takes no lock): looked at again once the flag is down, so it is never lost.
                if self._busy(in_flight):
                    in_flight.registered = True
                    keep.append(in_flight)
            self._watched = keep
            if not keep:
                self._thread = None
            return bool(keep)


# The one registry this module owns.
_WATCHDOG = _Watchdog()


def check(wait: bool = False, timeout: float | None = None) -> None:
    """Raise, on the calling thread, the error commlib's watchdog found on any communicator of this process.

    Call it once a step, before the optimizer step: it judges every op the device has
    finished by now (scanning on this thread), and raises the first error not yet raised
    (the error an op's next call or `Work.wait()` would raise). With `wait`, it first
    blocks the CPU until every op issued so far has ended or failed (at most `timeout`
    seconds; None: as long as that takes, which each op's deadline bounds once it has
    started): what a trainer wants before a checkpoint. CPU engines raise their errors on
    the call that met them, so this finds nothing to raise for them.
    """
    until = time.monotonic() + (timeout if timeout is not None else float("inf"))
    for in_flight in _WATCHDOG.watched():
        if in_flight.comm.runtime.capturing():
            pass  # reading an event now would break the caller's own graph capture: the watchdog's thread judges
        elif wait:
            in_flight.drain(until)
        else:
            with in_flight.lock:
                in_flight.scan(time.monotonic_ns())
        in_flight.comm.deliver_undelivered()


def watched_count() -> int:
    """How many communicators the watchdog holds now (tests; what a leak would grow)."""
    return len(_WATCHDOG.watched())
