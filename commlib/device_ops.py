"""A communicator's ops on a stream-ordered device: their launch, the caller's stream, and
what the watchdog saw of them.

On a stream-ordered engine (a GPU's: `Backend.runtime`, `commlib.device`) the CPU never
waits for an op. The communicator marks an event on the caller's stream before the op
(before its pre-hooks); `DeviceOps.launch` launches it, takes the op's end (the engine's, or
an event marked right after a launch that ran on the caller's stream) and hands the op to
the watchdog (`commlib.watchdog`). A synchronous call leaves the caller's stream ordered
behind the op (as NCCL's own calls do: the op ran on it, or `BackendWork.order`), an
asynchronous one returns a `Work` whose `wait()` orders it (`order_after`).

A barrier is the hosts' rendezvous, as NCCL's is, but never an unwatched one: c10d's NCCL
barrier picks a device by guessing when it has none bound, and its work's `wait()` blocks the
CPU in a stream synchronize without any deadline (ProcessGroupNCCL::barrier, WorkNCCL::wait).
So on a stream-ordered engine a barrier is launched as what c10d's is made of, an all_reduce of
one element on the communicator's own device, and the CPU then waits for that op to end while
the watchdog holds its deadline (`_host_waits`): it is recorded, numbered and logged as the
barrier it is.

The deadline, the end and the failure of each op are the watchdog's verdicts, reached on
its thread; `DeviceOps` is the watchdog's `Owner` for one communicator and turns them into
what the communicator does with any op: an end recorded as a CPU wait's end is, a failure
through the communicator's failure path. That error then waits for the caller
(`undelivered`): it is raised at the caller's next call on the communicator, `Work.wait()`
or `commlib.check()`, with the failure hooks run just before.

The engine's abort can hang on a wedged device, so here it runs in a thread of its own
(`abort_engine`), which a caller's `abort()` waits for at most `ENGINE_ABORT_BOUND_S`. The ops
of an aborted engine may still run until the abort has returned (ncclCommAbort returns once
the device has drained them), so each is kept with its tensors until its end is reached or
the abort has returned: memory an aborted kernel may still write is never handed back early.

An op issued while the caller's stream captures a CUDA graph (`Runtime.mark` gives `CAPTURED`)
is recorded into the graph, not run: it is recorded as ended at once and never watched; the
graph's replays are the caller's (the log says so once per communicator).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

import torch

from commlib.backends.base import Backend, keep_until_done
from commlib.device import CAPTURED, Event, Runtime, engine_timeout_s
from commlib.lifecycle import Lifecycle
from commlib.ops import Collective, OpName, ReduceOp
from commlib.record.board import ProgressBoard
from commlib.record.flight import FlightEntry, FlightRecorder
from commlib.validation import deadline_timedelta
from commlib.verdicts import Judge, report_side_failure
from commlib.watchdog import DeviceOp, InFlight

ENGINE_ABORT_BOUND_S = 10.0  # how long a caller waits for an engine abort running in its own thread


class DeviceComm(Protocol):
    """What `DeviceOps` needs of the communicator whose ops it carries (`Communicator` is one): its
    engine and board, its one path's records and failures, and its abort."""

    name: str
    abort_poll_s: float
    board: ProgressBoard
    _backend: Backend
    _judge: Judge
    _lifecycle: Lifecycle
    _log: Any

    @property
    def broken(self) -> bool: ...

    def abort(self, reason: str = "aborted") -> None: ...

    def _record_end(self, call: Collective, entry: FlightEntry) -> None: ...


class DeviceOps:
    """One stream-ordered communicator's side of its ops (module docstring); the watchdog's `Owner`."""

    def __init__(self, comm: DeviceComm, runtime: Runtime) -> None:
        self.comm = comm
        self.runtime = runtime
        self.abort_poll_s = comm.abort_poll_s  # the watchdog reads peers' announcements at a wait's pace
        self.in_flight = InFlight(self)
        # The watchdog's error that the caller has not been given yet, with the call it broke.
        self.undelivered: tuple[Collective, BaseException] | None = None
        self._abort_thread: threading.Thread | None = None
        self._aborted = threading.Event()  # the engine's abort has returned: its ops have all ended
        self._barrier_tensor: torch.Tensor | None = None  # what a barrier all-reduces (module docstring)
        self._told_captured = False

    @property
    def broken(self) -> bool:
        return self.comm.broken

    @property
    def has_undelivered_error(self) -> bool:
        return self.undelivered is not None

    # -- the caller's thread -----------------------------------------------------------
    def launch(self, call: Collective, entry: FlightEntry, start: Event) -> DeviceOp:
        """Launch on the engine and hand the op to the watchdog; the CPU never waits (module
        docstring). An op captured into a CUDA graph (`start` is `CAPTURED`) is not handed over."""
        comm, backend = self.comm, self.comm._backend
        launched = self._as_all_reduce(call) if call.op is OpName.BARRIER else call
        try:
            work = backend.launch(launched, deadline_timedelta(engine_timeout_s(call.deadline_s)))
            end = work.end
            if end is not None:  # it runs on an engine stream, which said how its end is read
                if not call.async_op:
                    work.order()
            elif call.async_op:
                raise RuntimeError(f"backend {backend.name} gave an asynchronous op no end to watch")
            else:  # it ran on the caller's stream: the point right after it is its end
                end = self.runtime.mark()
        except Exception as exc:
            raise comm._lifecycle.fail(call, entry, exc) from exc
        op = DeviceOp(call, entry, work, backend.lane(launched), start, end, work.end is None)
        if start is CAPTURED:
            self._captured(call, entry)
            return op
        self.in_flight.add(op)
        if call.op is OpName.BARRIER and not call.async_op:
            self._host_waits(op)
        return op

    def order_after(self, op: DeviceOp) -> None:
        """`Work.wait()`: the caller's stream waits for the op; the CPU does not, but for a barrier."""
        if self.comm.broken:
            self.comm._lifecycle.ensure_usable(op.call.op.value)
        if op.call.op is OpName.BARRIER:
            self._host_waits(op)
        else:
            op.work.order()

    def _host_waits(self, op: DeviceOp) -> None:
        """The CPU waits for a barrier to end, the watchdog holding its deadline (module docstring)."""
        self.in_flight.drain(float("inf"))
        if self.comm.broken:
            self.comm._lifecycle.ensure_usable(op.call.op.value)

    def _as_all_reduce(self, call: Collective) -> Collective:
        """What a barrier is launched as on the engine (module docstring)."""
        if self._barrier_tensor is None:
            self._barrier_tensor = torch.zeros(1, device=self.runtime.device)
        return Collective(
            OpName.ALL_REDUCE,
            call.comm,
            call.rank,
            call.size,
            call.async_op,
            call.deadline_s,
            call.seq,
            tensor=self._barrier_tensor,
            reduce_op=ReduceOp.SUM,
            context=call.context,
        )

    def _captured(self, call: Collective, entry: FlightEntry) -> None:
        """An op recorded into a CUDA graph (module docstring): ended here, never watched."""
        if not self._told_captured:
            self._told_captured = True
            self.comm._log.warning(
                "comm.captured_ops_not_watched",
                op=call.op.value,
                seq=call.seq,
                consequence="ops recorded into a CUDA graph run at its replays, which commlib neither times nor names",
            )
        self.comm._record_end(call, entry)
        self.comm._lifecycle.run_post_hooks_quietly(call, entry)

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
        self.comm._lifecycle.run_hooks_quietly("failure", call, error)
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
            comm._lifecycle.fail(call, entry, failure, deferred=True)
            return
        comm._record_end(call, entry)
        self.runtime.release(op.start)
        if op.marked_end:
            self.runtime.release(op.end)
        comm._lifecycle.run_post_hooks_quietly(call, entry)

    def op_expired(self, op: DeviceOp, running_s: float) -> None:
        self.comm._lifecycle.timed_out(op.call, op.entry, None, deferred=True, running_s=running_s)

    def peer_aborted(self, op: DeviceOp) -> bool:
        """Fail `op` if a peer announced it aborted the communicator; whether it did."""
        announced = self.comm._judge.announced()
        if announced is None:
            return False
        self.comm._lifecycle.peer_left(op.call, op.entry, announced, deferred=True)
        return True

    def op_dropped(self, op: DeviceOp) -> None:
        if op.entry.state == "started":
            FlightRecorder.end(op.entry, "failed")
        # Kept with its tensors until its op has ended or the abort has returned (module
        # docstring); dropping a torchcomms work whose op still runs would also block this
        # thread until then (../shared/TORCHCOMMS_API.md).
        aborted = self._aborted
        keep_until_done(op, self.comm._backend, lambda: aborted.is_set() or op.end.query())

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
            finally:
                self._aborted.set()

        self._abort_thread = threading.Thread(target=abort, name=f"commlib-abort-{comm.name}", daemon=True)
        self._abort_thread.start()

    def drop_in_flight(self) -> None:
        """Forget every op in flight (the caller aborted): their tensors are kept by the aborted
        engine's works until `await_engine_abort` returns."""
        with self.in_flight.lock:
            self.in_flight.drop()

    def await_engine_abort(self) -> None:
        thread = self._abort_thread
        if thread is None or not thread.is_alive():
            return
        thread.join(ENGINE_ABORT_BOUND_S)
        if thread.is_alive():
            self.comm._log.error(
                "comm.engine_abort_stuck",
                waited_s=ENGINE_ABORT_BOUND_S,
                action="going on without it; the engine and its device streams are left as they are",
            )
