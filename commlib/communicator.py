"""`Communicator`: commlib's public API, and the one path every operation takes.

    validate -> next sequence number -> (consistency check) -> pre-hooks -> record start
    -> backend launch -> wait with deadline (sync) or return a Work whose wait does (async)
    -> record end -> post-hooks

"Record" means the flight recorder, the progress board and the structured log, together.
Failures on that path become typed errors on it and only there (worded by the communicator's
`commlib.verdicts.Judge`, recorded by its `commlib.lifecycle.Lifecycle`): a deadline that
expires is a `CollectiveTimeout` naming the ranks that never arrived, a peer's death a
`PeerFailure`, and either leaves the communicator dead, so every later call raises
`CommAborted` at once instead of blocking. Backends only launch. Beside this module:
`commlib.consistency` (the check that every rank issues the same collective),
`commlib.device_ops` (the path's stream-ordered branch) and `commlib.lifecycle` (splits,
failures recorded, abort and finalize).

A CPU engine's wait blocks the caller, in slices: between two slices the communicator reads
its peers' abort announcements (`commlib.verdicts`), so a rank that broke the communicator
ends its peers' waits within a fraction of a second. Slices start at `ABORT_POLL_S` (longer on a
communicator of more than 2,000 ranks, whose waiting ranks would crowd the store: `abort_poll_s`) and grow
with the time already waited (a tenth of it), so a long wait costs the store one read per
~10% of its length; an op that completes within its first slice costs no store read at all.
Engines whose timed-out wait breaks the op wait in one piece (`Backend.resumable_wait`).

A caller's `Work.wait(timeout)` shorter than what is left of the op's deadline is the
caller's own bound, not the op's: when it passes, `WaitTimeout` leaves the op and the
communicator as they were (a raw gloo wait does the same), and a later wait goes on.

On a stream-ordered engine (a GPU's: `Backend.runtime`, `commlib.device`) the CPU never
waits: an event is marked on the caller's stream before the pre-hooks, and the launch,
the caller's stream and the watchdog's verdicts are `commlib.device_ops`'s. A failure the
watchdog finds waits for the caller: it is raised at the caller's next call on this
communicator, `Work.wait()` or `commlib.check()`, with the failure hooks run just before.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from commlib.backends.base import Backend, BackendWork, keep_until_done
from commlib.consistency import ConsistencyCheck, agree_on_settings
from commlib.device_ops import DeviceOps
from commlib.hooks import HookRegistry, RemovableHandle, run_hooks
from commlib.lifecycle import Lifecycle
from commlib.members import Members
from commlib.ops import Collective, OpName, ReduceOp, Reduction
from commlib.record import log as _log
from commlib.record.board import ProgressBoard
from commlib.record.flight import FlightEntry, FlightRecorder
from commlib.validation import CallChecker, Deadline, deadline_timedelta, seconds
from commlib.verdicts import Judge
from commlib.watchdog import DeviceOp

CHECK_CONSISTENCY_ENV = "COMMLIB_CHECK_CONSISTENCY"
ABORT_POLL_S = 0.1  # the first slice of a wait between two reads of the peers' abort announcements
# What the reads of one communicator's ranks, all waiting at once (for a straggler), may ask of
# the job's store in the first second of their wait (`abort_poll_s`).
ABORT_READS_PER_S = 20_000


def abort_poll_s(size: int) -> float:
    """The first slice of a wait on a communicator of `size` ranks: `ABORT_POLL_S`, or longer
    where all its ranks waiting at once would read the abort key more than `ABORT_READS_PER_S`
    times a second of the job's one store server (more than 2,000 ranks), never over a second."""
    return min(1.0, max(ABORT_POLL_S, size / ABORT_READS_PER_S))


_PROCESS_HOOKS = HookRegistry.process()


class Work:
    """The handle of an asynchronous collective. `wait` takes the same path as a sync call."""

    __slots__ = ("_comm", "call", "_backend_work", "_entry", "done", "_device_op")

    def __init__(
        self,
        comm: Communicator,
        call: Collective,
        backend_work: BackendWork,
        entry: FlightEntry,
        device_op: DeviceOp | None = None,
    ) -> None:
        self._comm = comm
        self.call = call
        self._backend_work = backend_work
        self._entry = entry
        self.done = False
        self._device_op = device_op

    def wait(self, timeout: Deadline | None = None) -> None:
        """Block until complete: at most `timeout` (a `WaitTimeout` if it passes first and the
        op's deadline has not), else what is left of the op's deadline.

        On a stream-ordered engine only the caller's current stream waits for the op, as
        NCCL's `wait()` does; the CPU returns at once, and `timeout` has nothing to bound
        (the op's deadline is the watchdog's).
        """
        if self._device_op is not None:
            # A device op exists only on a communicator with DeviceOps.
            self._comm._device.order_after(self._device_op)  # type: ignore[union-attr]
        elif not self.done:
            self._comm._complete(self.call, self._entry, self._backend_work, seconds(timeout), self)

    def __del__(self) -> None:
        # A Work given up on while its op runs (a `WaitTimeout` not waited again): dropping the
        # engine's work would block this thread until the op ends, so it is kept until then.
        if not self.done and self._device_op is None and keep_until_done is not None:  # None: interpreter teardown
            keep_until_done(self._backend_work, self._comm._backend, self._backend_work.is_completed)

    def is_completed(self) -> bool:
        """Whether the op has ended (on its device, for a stream-ordered engine); never blocks."""
        if self._device_op is not None:
            return self._device_op.end.query()
        return self.done or self._backend_work.is_completed()


class Communicator:
    """A group of ranks and the collectives among them. Create it with `commlib.init`."""

    def __init__(
        self,
        backend: Backend,
        store: dist.Store,
        name: str,
        timeout: float,
        check_consistency: bool = False,
        global_ranks: Sequence[int] | None = None,
    ) -> None:
        """`global_ranks`: the global rank of each member, by this communicator's rank (None: the
        same numbers, a world); errors and logs name global ranks (`commlib.members`)."""
        self._backend = backend
        self._store = store
        self.name = name
        self.rank = backend.rank
        self.size = backend.size
        self.timeout = timeout
        self._check_consistency = check_consistency
        # Where the consistency check compares digests: the engine where that costs no device sync.
        self._fingerprints_via_engine = backend.device.type == "cpu" and backend.runtime is None
        self.members = Members.of(name, backend.size, global_ranks)
        self.abort_poll_s = abort_poll_s(self.size)  # the watchdog reads peers' announcements at this pace too
        self._first_slice = timedelta(seconds=self.abort_poll_s)  # made once: a wait's path
        self.world_rank = self.members.global_ranks[backend.rank]
        self.hooks = HookRegistry()
        self._check = CallChecker(backend.supports)
        self._seq = 0  # collectives
        self._p2p_seq: dict[int, int] = {}  # send/recv, per peer
        self._dead: str | None = None  # why the communicator can no longer be used; only its lifecycle writes it
        self._lifecycle = Lifecycle(self)
        self._runtime = backend.runtime  # a stream-ordered engine's device runtime (module docstring)
        # Before the board, whose publisher would outlive a failed creation.
        agree_on_settings(store, name, self.rank, self.size, timeout, check_consistency)
        self.recorder = FlightRecorder(name, self.rank, world_rank=self.world_rank)
        self.board = ProgressBoard(store, self.rank, self.size, os.getpid(), stream_ordered=self._runtime is not None)
        bound = {"comm": name, "backend": backend.name, "comm_rank": self.rank, "comm_size": self.size}
        self._log = _log.get_logger().bind(**bound)
        self._events = _log.event_writer(**bound)  # collective.start and .end: the hot path's own
        self._judge = Judge(self.members, self.rank, store, self.board, self._log, backend)
        self._consistency = ConsistencyCheck(self) if check_consistency else None
        self._device = DeviceOps(self, self._runtime) if self._runtime is not None else None
        self._log.info("comm.init", timeout_s=timeout, check_consistency=check_consistency)

    # -- identity ---------------------------------------------------------------------
    @property
    def backend(self) -> str:
        return self._backend.name

    @property
    def device(self) -> torch.device:
        return self._backend.device

    @property
    def check_consistency(self) -> bool:
        """Fixed at creation, and the same on every rank (`commlib.consistency.agree_on_settings`)."""
        return self._check_consistency

    @property
    def seq(self) -> int:
        """Sequence number of the last collective issued (0: none yet); send/recv are not counted."""
        return self._seq

    @property
    def stream_ordered(self) -> bool:
        """Whether ops run in stream order on a device, the CPU never waiting for them (module docstring)."""
        return self._runtime is not None

    @property
    def broken(self) -> bool:
        """Whether the communicator can no longer be used (failed, aborted or finalized)."""
        return self._dead is not None

    def p2p_seq(self, peer: int) -> int:
        """Sequence number of the last send or recv with `peer` (0: none yet)."""
        return self._p2p_seq.get(peer, 0)

    def __repr__(self) -> str:
        return f"Communicator(name={self.name!r}, backend={self.backend!r}, rank={self.rank}, size={self.size})"

    # -- collectives (canonical torchcomms names) -------------------------------------
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: Reduction = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: Deadline | None = None,
    ) -> Work | None:
        return self._issue(self._call(OpName.ALL_REDUCE, async_op, timeout, tensor=tensor, reduce_op=op))

    def broadcast(
        self, tensor: torch.Tensor, root: int, *, async_op: bool = False, timeout: Deadline | None = None
    ) -> Work | None:
        return self._issue(self._call(OpName.BROADCAST, async_op, timeout, tensor=tensor, root=root))

    def reduce(
        self,
        tensor: torch.Tensor,
        root: int,
        op: Reduction = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: Deadline | None = None,
    ) -> Work | None:
        return self._issue(self._call(OpName.REDUCE, async_op, timeout, tensor=tensor, root=root, reduce_op=op))

    def all_gather(
        self,
        tensor_list: list[torch.Tensor],
        tensor: torch.Tensor,
        *,
        async_op: bool = False,
        timeout: Deadline | None = None,
    ) -> Work | None:
        return self._issue(self._call(OpName.ALL_GATHER, async_op, timeout, output_list=tensor_list, input=tensor))

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False, timeout: Deadline | None = None
    ) -> Work | None:
        return self._issue(self._call(OpName.ALL_GATHER_SINGLE, async_op, timeout, output=output, input=input))

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: Reduction = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: Deadline | None = None,
    ) -> Work | None:
        return self._issue(
            self._call(OpName.REDUCE_SCATTER, async_op, timeout, output=output, input_list=input_list, reduce_op=op)
        )

    def reduce_scatter_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: Reduction = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: Deadline | None = None,
    ) -> Work | None:
        return self._issue(
            self._call(OpName.REDUCE_SCATTER_SINGLE, async_op, timeout, output=output, input=input, reduce_op=op)
        )

    def all_to_all_single(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False, timeout: Deadline | None = None
    ) -> Work | None:
        return self._issue(self._call(OpName.ALL_TO_ALL_SINGLE, async_op, timeout, output=output, input=input))

    def gather(
        self,
        output_list: list[torch.Tensor] | None,
        input: torch.Tensor,
        root: int,
        *,
        async_op: bool = False,
        timeout: Deadline | None = None,
    ) -> Work | None:
        return self._issue(
            self._call(OpName.GATHER, async_op, timeout, output_list=output_list, input=input, root=root)
        )

    def scatter(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor] | None,
        root: int,
        *,
        async_op: bool = False,
        timeout: Deadline | None = None,
    ) -> Work | None:
        return self._issue(
            self._call(OpName.SCATTER, async_op, timeout, output=output, input_list=input_list, root=root)
        )

    def send(
        self, tensor: torch.Tensor, dst: int, *, async_op: bool = False, timeout: Deadline | None = None
    ) -> Work | None:
        return self._issue(self._call(OpName.SEND, async_op, timeout, tensor=tensor, peer=dst))

    def recv(
        self, tensor: torch.Tensor, src: int, *, async_op: bool = False, timeout: Deadline | None = None
    ) -> Work | None:
        return self._issue(self._call(OpName.RECV, async_op, timeout, tensor=tensor, peer=src))

    def barrier(self, *, async_op: bool = False, timeout: Deadline | None = None) -> Work | None:
        return self._issue(self._call(OpName.BARRIER, async_op, timeout))

    def set_timeout(self, timeout: Deadline) -> None:
        """The default deadline of later collectives (seconds or timedelta)."""
        value = seconds(timeout, f"set_timeout on {self.name!r} rank {self.rank}: timeout")
        assert value is not None
        self.timeout = value
        self._log.info("comm.set_timeout", timeout_s=value)

    # -- hooks ------------------------------------------------------------------------
    def register_pre_hook(self, fn: Any) -> RemovableHandle:
        return self.hooks.register_pre_hook(fn)

    def register_post_hook(self, fn: Any) -> RemovableHandle:
        return self.hooks.register_post_hook(fn)

    def register_failure_hook(self, fn: Any) -> RemovableHandle:
        return self.hooks.register_failure_hook(fn)

    # -- lifecycle --------------------------------------------------------------------
    def split(self, ranks: list[int], name: str, *, timeout: Deadline | None = None) -> Communicator | None:
        """A communicator of `ranks` (ranks of this one, in the new rank order), named `name`.

        Collective: every rank of this communicator calls it with the same arguments.
        Returns None on ranks not in `ranks`.
        """
        made = self._lifecycle.split(ranks, name, timeout)
        if made is None:
            return None
        backend, store, ranks = made
        return Communicator(backend, store, name, self.timeout, self.check_consistency, self.members.global_of(ranks))

    def abort(self, reason: str = "aborted") -> None:
        """Tear down at once, without waiting for peers; later calls raise CommAborted.

        Peers blocked in one of this communicator's collectives learn of it (see the module
        docstring) and fail with a PeerFailure naming this rank and `reason`.
        """
        self._lifecycle.abort(reason)

    def finalize(self) -> None:
        """Release the communicator after a clean run; later calls raise CommAborted.

        On a stream-ordered engine the CPU first waits for every op in flight (each bounded
        by its deadline once it has started on the device): one the watchdog fails then is
        raised here, and the communicator is aborted instead.
        """
        self._lifecycle.finalize()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()

    # -- the one path ------------------------------------------------------------------
    def _call(
        self,
        op: OpName,
        async_op: bool,
        timeout: Deadline | None,
        *,
        tensor: torch.Tensor | None = None,
        input: torch.Tensor | None = None,
        output: torch.Tensor | None = None,
        input_list: list[torch.Tensor] | None = None,
        output_list: list[torch.Tensor] | None = None,
        root: int | None = None,
        peer: int | None = None,
        reduce_op: Reduction | None = None,
    ) -> Collective:
        # Named parameters and the Collective's fields in their order, not **fields: packing
        # and unpacking a dict per call cost more than the rest of this function (cold, ~1 us).
        if not isinstance(async_op, bool):
            raise TypeError(
                f"{op} on {self.name!r} rank {self.rank}: expected async_op to be a bool; "
                f"found {type(async_op).__name__}"
            )
        deadline = self.timeout if timeout is None else seconds(timeout)
        return Collective(
            op,
            self.name,
            self.rank,
            self.size,
            async_op,
            deadline,
            -1,
            tensor,
            input,
            output,
            input_list,
            output_list,
            root,
            peer,
            reduce_op,
            _log.current_context(),
        )

    def _issue(self, call: Collective) -> Work | None:
        # The hot path: every collective runs it, so what is fixed per communicator is
        # computed once (the deadline's timedelta, the checker) and what most calls lack
        # (hooks, a log dir, a dead communicator) costs a test, not a call.
        if self._dead is not None:
            self._lifecycle.ensure_usable(call.op.value)
        self._check(call)
        p2p = call.peer is not None
        if p2p:  # numbered per peer: a pipeline's sends never shift the collective sequence
            # p2p: call.peer is not None.
            call.seq = self._p2p_seq[call.peer] = self._p2p_seq.get(call.peer, 0) + 1  # type: ignore[index, arg-type]
        else:
            self._seq += 1
            call.seq = self._seq
        if self._consistency is not None and not p2p:
            self._consistency.agree(call)
        # Marked before the pre-hooks: device work a hook enqueues belongs to the op's run.
        start = self._runtime.mark() if self._runtime is not None else None
        if _PROCESS_HOOKS.pre or self.hooks.pre:
            try:
                run_hooks(self.hooks, "pre", call)
            except BaseException as exc:
                # The number is spent and the peers will wait for it: record the call as failed
                # and break the communicator, then let the hook's own exception through.
                entry = self.recorder.start(call)
                self._lifecycle.die(call, entry, exc, hooks=False)
                raise
        entry = self.recorder.start(call)
        if not p2p:
            self.board.started(call.seq, entry.op, call.context)
        if _log.STATE.enabled:
            reduce_op = call.reduce_op
            self._events.info(
                "collective.start",
                {
                    "op": entry.op,
                    "seq": call.seq,
                    "shapes": entry.shapes,
                    "dtype": entry.dtype,
                    "bytes": entry.nbytes,
                    "root": entry.root,
                    "peer": call.peer,
                    "deadline_s": call.deadline_s,
                    "async_op": call.async_op,
                    "reduce_op": None if reduce_op is None else str(reduce_op),
                },
            )
        if start is not None:
            # A start mark comes only from a runtime, and a runtime comes with DeviceOps.
            op = self._device.launch(call, entry, start)  # type: ignore[union-attr]
            return Work(self, call, op.work, entry, op) if call.async_op else None
        try:
            backend_work = self._backend.launch(call, deadline_timedelta(call.deadline_s))
        except Exception as exc:
            raise self._lifecycle.fail(call, entry, exc) from exc
        if call.async_op:
            return Work(self, call, backend_work, entry)
        self._complete(call, entry, backend_work, None, None)  # a sync call needs no Work
        return None

    def _complete(
        self, call: Collective, entry: FlightEntry, backend_work: BackendWork, timeout: float | None, work: Work | None
    ) -> None:
        # An op still in flight when the communicator broke: its failure was recorded once
        # already, by whichever call broke it.
        if self._dead is not None:
            self._lifecycle.ensure_usable(call.op.value)
        wait_from_ns = done_before_wait = None
        # How long the caller's wait blocked, and whether the op was already done.
        if call.async_op and _log.STATE.enabled:
            wait_from_ns, done_before_wait = time.monotonic_ns(), backend_work.is_completed()
        left = call.deadline_s - (time.monotonic_ns() - entry.start_mono_ns) / 1e9
        # A caller's bound shorter than the deadline's rest is the caller's, not the op's (module docstring).
        callers = timeout is not None and timeout < left
        # `callers` holds only where timeout is not None.
        budget: float = max(timeout if callers else left, 1e-3)  # type: ignore[type-var, assignment]
        try:  # in slices where the backend allows (module docstring)
            finished = (
                self._wait_in_slices(backend_work.wait, budget, entry.start_mono_ns)
                if self._backend.resumable_wait
                else backend_work.wait(timedelta(seconds=budget))
            )
        except Exception as exc:
            raise self._lifecycle.fail(call, entry, exc) from exc
        if finished is False and callers and (time.monotonic_ns() - entry.start_mono_ns) / 1e9 < call.deadline_s:
            self._log.debug(
                "collective.wait_timeout",
                op=call.op.value,
                seq=call.seq,
                peer=call.peer,
                waited_s=budget,
                deadline_s=call.deadline_s,
            )
            raise self._judge.wait_timeout(call, entry, budget)
        if finished is not True:
            keep_until_done(backend_work, self._backend, backend_work.is_completed)
            if finished is False:
                raise self._lifecycle.timed_out(call, entry, None)
            raise self._lifecycle.peer_left(call, entry, finished)  # a peer's abort announcement, read between slices
        if work is not None:
            work.done = True
        self._record_end(call, entry, wait_from_ns, done_before_wait)
        if _PROCESS_HOOKS.post or self.hooks.post:
            run_hooks(self.hooks, "post", call, entry.duration_s)

    def _record_end(
        self,
        call: Collective,
        entry: FlightEntry,
        wait_from_ns: int | None = None,
        done_before_wait: bool | None = None,
    ) -> None:
        """Record an op that completed: flight recorder, board and `collective.end`, with how long
        an async caller's wait blocked (`wait_from_ns`: when it began; None where none did)."""
        FlightRecorder.end(entry, "completed")
        if call.peer is None:
            self.board.finished(call.seq, entry.op)
        if _log.STATE.enabled:
            fields = {
                "op": entry.op,
                "seq": call.seq,
                "bytes": entry.nbytes,
                "peer": call.peer,
                "duration_s": entry.duration_s,
                "status": "ok",
            }
            if wait_from_ns is not None:
                # FlightRecorder.end, above, set end_mono_ns.
                fields["wait_s"] = (entry.end_mono_ns - wait_from_ns) / 1e9  # type: ignore[operator]
                fields["done_before_wait"] = done_before_wait
            self._events.info("collective.end", fields)

    def _wait_in_slices(
        self, wait: Callable[[timedelta], bool], budget_s: float, since_mono_ns: int
    ) -> bool | dict[str, Any]:
        """Call `wait(slice)` until it returns True (done), `budget_s` passes (False), or a
        peer's abort announcement is read between two slices (`Judge.announced`)."""
        until = time.monotonic() + budget_s
        # Most waits end within the first slice, which is the same for all of them.
        slice_td = self._first_slice if budget_s >= self.abort_poll_s else timedelta(seconds=budget_s)
        while not wait(slice_td):
            now = time.monotonic()
            if now >= until:
                return False
            aborted_by = self._judge.announced()
            if aborted_by is not None:
                return aborted_by
            waited_s = now - since_mono_ns / 1e9
            slice_td = timedelta(seconds=max(min(until - now, max(self.abort_poll_s, waited_s / 10)), 1e-3))
        return True
