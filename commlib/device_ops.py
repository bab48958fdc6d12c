"""A communicator's ops on a stream-ordered device: their launch, the caller's stream, and
what the watchdog saw of them.

On a stream-ordered engine (a GPU's: `Backend.runtime`, `commlib.device`) the CPU never
waits for an op. `DeviceOps.launch` marks an event on the caller's stream before the op
(the communicator does, before its pre-hooks) and one that completes with it, and hands the
op to the watchdog (`commlib.watchdog`); a synchronous call orders the caller's stream
behind the op (as NCCL's own calls do), an asynchronous one returns a `Work` whose `wait()`
does (`order_after`).

The deadline, the end and the failure of each op are the watchdog's verdicts, reached on
its thread; `DeviceOps` is the watchdog's `Owner` for one communicator and turns them into
what the communicator does with any op: an end recorded as a CPU wait's end is, a failure
through the communicator's failure path. That error then waits for the caller
(`undelivered`): it is raised at the caller's next call on the communicator, `Work.wait()`
or `commlib.check()`, with the failure hooks run just before.

The engine's abort can hang on a wedged device, so here it runs in a thread of its own
(`abort_engine`), which a caller's `abort()` waits for at most `ENGINE_ABORT_BOUND_S`.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from commlib.backends.base import keep_until_done
from commlib.device import Event, Runtime, engine_timeout_s
from commlib.errors import CommError
from commlib.observe.flight import FlightEntry, FlightRecorder
from commlib.ops import Collective, OpName
from commlib.validation import deadline_timedelta
from commlib.verdicts import report_side_failure
from commlib.watchdog import DeviceOp, InFlight

if TYPE_CHECKING:
    from commlib.communicator import Communicator

ENGINE_ABORT_BOUND_S = 10.0  # how long a caller waits for an engine abort running in its own thread


class DeviceOps:
    """One stream-ordered communicator's side of its ops (module docstring); the watchdog's `Owner`."""

    def __init__(self, comm: "Communicator", runtime: Runtime) -> None:
        self.comm = comm
        self.runtime = runtime
        self.abort_poll_s = comm.abort_poll_s  # the watchdog reads peers' announcements at a wait's pace
        self.in_flight = InFlight(self)
        # The watchdog's error that the caller has not been given yet, with the call it broke.
        self.undelivered: tuple[Collective, CommError] | None = None
        self._abort_thread: threading.Thread | None = None

    @property
    def broken(self) -> bool:
        return self.comm.broken

    @property
    def has_undelivered_error(self) -> bool:
        return self.undelivered is not None

    # -- the caller's thread -----------------------------------------------------------
    def launch(self, call: Collective, entry: FlightEntry, start: Event) -> DeviceOp:
        """Launch on the engine and hand the op to the watchdog; the CPU never waits (module docstring)."""
        comm, runtime = self.comm, self.runtime
        try:
            backend_work = comm._backend.launch(call, deadline_timedelta(engine_timeout_s(call.deadline_s)))
            if call.async_op:
                end = runtime.mark_after(backend_work.order, call.peer)
            else:
                backend_work.order()
                end = runtime.mark()
        except Exception as exc:
            raise comm._fail(call, entry, exc) from exc
        op = DeviceOp(call, entry, backend_work, start, end, call.async_op)
        self.in_flight.add(op)
        if call.op is OpName.BARRIER and not call.async_op:
            # A barrier is the hosts' rendezvous on every engine (NCCL's blocks the CPU too):
            # the CPU waits for it, bounded by the watchdog holding its deadline.
            self.in_flight.drain(float("inf"))
            if comm.broken:
                comm._ensure_usable(call.op.value)
        return op

    def order_after(self, op: DeviceOp) -> None:
        """`Work.wait()`: the caller's stream waits for the op; the CPU does not."""
        if op.entry.state == "completed":
            return
        if self.comm.broken:
            self.comm._ensure_usable(op.call.op.value)
        self.runtime.wait(op.end)

    def drain(self) -> None:
        """Block the CPU until every op issued so far has ended, or failed (then raised here)."""
        self.in_flight.drain(float("inf"))
        self.deliver_undelivered()

    def deliver_undelivered(self) -> None:
        """Raise, on the caller's thread, the error the watchdog found (once), after the failure hooks."""
        pending, self.undelivered = self.undelivered, None
        if pending is None:
            return
        call, error = pending
        self.comm._run_hooks_quietly("failure", call, error)
        raise error

    # -- the watchdog's thread (`commlib.watchdog.Owner`) --------------------------------
    def op_started(self, op: DeviceOp) -> None:
        if op.call.peer is None:
            self.comm.board.device_started(op.call.seq, op.entry.op)

    def op_ended(self, op: DeviceOp) -> None:
        """The watchdog saw the op end on its device: record it as a CPU wait's end is recorded."""
        comm, call, entry = self.comm, op.call, op.entry
        failure = op.work.failure()
        if failure is not None:  # the engine's own verdict on the op: its outputs are not to be used
            comm._fail(call, entry, failure, deferred=True)
            return
        comm._record_end(call, entry)
        self.runtime.release(op.start)
        if not op.held:
            self.runtime.release(op.end)
        comm._run_post_hooks_quietly(call, entry)

    def op_expired(self, op: DeviceOp, running_s: float) -> None:
        self.comm._timed_out(op.call, op.entry, None, deferred=True, running_s=running_s)

    def peer_aborted(self, op: DeviceOp) -> bool:
        """Fail `op` if a peer announced it aborted the communicator; whether it did."""
        announced = self.comm._judge.announced()
        if announced is None:
            return False
        self.comm._peer_left(op.call, op.entry, announced, deferred=True)
        return True

    def op_dropped(self, op: DeviceOp) -> None:
        if op.entry.state == "started":
            FlightRecorder.end(op.entry, "failed")
        # Kept until its op ends (the abort ends it): dropping a torchcomms work whose op still
        # runs blocks this thread until then (../shared/TORCHCOMMS_API.md).
        keep_until_done(op.work, self.comm._backend)

    def watchdog_failed(self, exc: BaseException) -> None:
        """The watchdog could not judge this communicator's ops (a bug): their deadlines no longer
        hold, so the communicator is aborted, saying why, rather than left to hang unwatched."""
        report_side_failure(self.comm._log, "watchdog", exc)
        self.comm.abort(f"aborted: the watchdog could not judge its ops ({type(exc).__name__}: {exc})")

    # -- the engine's abort --------------------------------------------------------------
    def abort_engine(self) -> None:
        """Start the engine's abort in a thread of its own (module docstring)."""
        comm = self.comm
        started = time.monotonic()

        def abort() -> None:
            try:
                comm._backend.abort()
                comm._log.info("comm.engine_aborted", duration_s=time.monotonic() - started)
            except Exception as exc:
                report_side_failure(comm._log, "engine abort", exc)

        self._abort_thread = threading.Thread(target=abort, name=f"commlib-abort-{comm.name}", daemon=True)
        self._abort_thread.start()

    def await_engine_abort(self) -> None:
        thread = self._abort_thread
        if thread is None or not thread.is_alive():
            return
        thread.join(ENGINE_ABORT_BOUND_S)
        if thread.is_alive():
            self.comm._log.error("comm.engine_abort_stuck", waited_s=ENGINE_ABORT_BOUND_S,
                                 action="going on without it; the engine and its device streams are left as they are")
