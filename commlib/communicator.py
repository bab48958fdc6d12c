"""`Communicator`: commlib's public API, the one path every operation takes, and its life.

    validate -> next sequence number -> (consistency check) -> pre-hooks -> record start
    -> backend launch -> wait with deadline (a CPU engine) or hand the op to the deadline
       thread (a stream-ordered engine) -> record end -> post-hooks

"Record" means the flight recorder, the progress board and the structured log, together.
A failure on that path is a typed error (worded by `commlib.failure_reports`): an expired
deadline is a `CollectiveTimeout` naming the ranks that never arrived, a peer's death a
`PeerFailure`. It is recorded once and everywhere (flight recorder, log, flight dump, board,
an announcement in the communicator's store for the peers), the engine is aborted, the
failure hooks run, and every later call raises `CommAborted` at once instead of blocking.
The caller's `abort()` and `finalize()` end a communicator on purpose.

A CPU engine's wait blocks the caller, in slices: between two slices the communicator reads
its peers' abort announcements, so a rank that broke the communicator ends its peers' waits
within a fraction of a second. Slices start at `abort_poll_s` and grow with the time waited
(a tenth of it); an op done within its first slice costs no store read. Every store call of a
wait or a failure runs on the communicator's store thread and is waited for a bounded time
(`commlib.store_thread`): a store that stopped answering holds no deadline. A caller's
`Work.wait(timeout)` shorter than what is left of the op's deadline is the caller's own
bound: `WaitTimeout` leaves the op and the communicator as they were.

On a stream-ordered engine (a GPU's: `Backend.events`) the CPU never waits for an op, but
for a barrier (the hosts' rendezvous). The op is handed to the process's deadline thread
(`commlib.deadlines`, torchft's shape) before its launch, with its deadline counted from the
issue and, once launched, the point at which it has ended; its host-side end (board, log,
post-hooks) is recorded once it is enqueued. A deadline that passes, or an error the engine
reports (a dead peer), aborts the engine from a thread of its own; that thread then words and
records the failure, and the error waits for the caller: it is raised at the caller's next
call on this communicator, `Work.wait()` or `commlib.check()`, with the failure hooks run
just before. The outputs of the failed op and of every op queued behind it are undefined.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from commlib.backends.base import Backend, BackendWork, keep_until_done
from commlib.consistency import ConsistencyCheck, agree_on_settings
from commlib.deadlines import InFlight, PendingOp
from commlib.device import CAPTURED, engine_timeout_s
from commlib.errors import CollectiveTimeout, CommAborted, CommError, PeerFailure
from commlib.failure_reports import FailureReports, report_side_failure
from commlib.failures import Failure
from commlib.hooks import HookRegistry, RemovableHandle, run_hooks
from commlib.members import Members
from commlib.ops import PLAIN_NAMES, Collective, OpName, ReduceOp, Reduction
from commlib.record import log as _log
from commlib.record.board import ProgressBoard
from commlib.record.flight import FlightEntry, FlightRecorder
from commlib.validation import CallChecker, Deadline, deadline_timedelta, seconds

CHECK_CONSISTENCY_ENV = "COMMLIB_CHECK_CONSISTENCY"
ABORT_POLL_S = 0.1  # the first slice of a wait between two reads of the peers' abort announcements
# What the reads of one communicator's ranks, all waiting at once (for a straggler), may ask of
# the job's store in the first second of their wait (`abort_poll_s`).
ABORT_READS_PER_S = 20_000
# The longest a failure's or an abort's log line may hold back the news to the peers
# (`_log_then_announce`): a log on a filesystem that stops answering must not keep them waiting
# out their own deadlines, nor keep this rank's engine from being aborted.
LINE_BEFORE_NEWS_S = 5.0
# How long a caller waits for a stream-ordered engine's abort (it can wait for a wedged device),
# and for the failure it caused to be worded and recorded, before it goes on without them.
ENGINE_ABORT_BOUND_S = 10.0
HOST_WAIT_POLL_S = 0.001  # a barrier's (or `check(wait=True)`'s) pause between two looks at its ops

_E = TypeVar("_E", bound=BaseException)

# The log event and flight-recorder state of each kind of failure (`_record_failure`).
_EVENTS: dict[type, tuple[str, str]] = {
    CollectiveTimeout: ("collective.timeout", "timed_out"),
    PeerFailure: ("peer.failure", "failed"),
}
# Read on every call: a module global reads faster than a member through its enum class (about
# 70 ns on Python 3.11, whose EnumType answers class attributes through a hook).
_ALL_REDUCE, _BROADCAST, _REDUCE = OpName.ALL_REDUCE, OpName.BROADCAST, OpName.REDUCE
_ALL_GATHER, _ALL_GATHER_SINGLE = OpName.ALL_GATHER, OpName.ALL_GATHER_SINGLE
_REDUCE_SCATTER, _REDUCE_SCATTER_SINGLE = OpName.REDUCE_SCATTER, OpName.REDUCE_SCATTER_SINGLE
_ALL_TO_ALL_SINGLE, _GATHER, _SCATTER = OpName.ALL_TO_ALL_SINGLE, OpName.GATHER, OpName.SCATTER
_SEND, _RECV, _BARRIER = OpName.SEND, OpName.RECV, OpName.BARRIER
_PROCESS_HOOKS = HookRegistry.process()


class _Untimed:
    """The end of an asynchronous op whose engine offers none to read from another thread (a
    torchcomms-routed c10d group): timed from its `Work.wait()` instead, as torchft times its
    works (`_WorkAcceleratorTimeout.wait`); until then the deadline thread lets it go."""

    def query(self) -> bool:
        return True


_UNTIMED = _Untimed()


def abort_poll_s(size: int) -> float:
    """The first slice of a wait on a communicator of `size` ranks: `ABORT_POLL_S`, or longer
    where all its ranks waiting at once would read the abort key more than `ABORT_READS_PER_S`
    times a second of the job's one store server (more than 2,000 ranks), never over a second."""
    return min(1.0, max(ABORT_POLL_S, size / ABORT_READS_PER_S))


class Work:
    """The handle of an asynchronous collective. `wait` takes the same path as a sync call."""

    __slots__ = ("_comm", "call", "_backend_work", "_entry", "done", "_pending")

    def __init__(
        self,
        comm: Communicator,
        call: Collective,
        backend_work: BackendWork,
        entry: FlightEntry,
        pending: PendingOp | None = None,
    ) -> None:
        self._comm = comm
        self.call = call
        self._backend_work = backend_work
        self._entry = entry
        self.done = False
        self._pending = pending  # a stream-ordered engine's op, as the deadline thread holds it

    def wait(self, timeout: Deadline | None = None) -> None:
        """Block until complete: at most `timeout` (a `WaitTimeout` if it passes first and the
        op's deadline has not), else what is left of the op's deadline.

        On a stream-ordered engine only the caller's current stream waits for the op, as
        NCCL's `wait()` does; the CPU returns at once (but for a barrier), and `timeout` has
        nothing to bound (the op's deadline is the deadline thread's).
        """
        if self._pending is not None:
            self._comm._order_after(self._pending, self._backend_work)
        elif not self.done:
            self._comm._complete(self.call, self._entry, self._backend_work, seconds(timeout), self)

    def __del__(self) -> None:
        # A Work given up on while its op runs (a `WaitTimeout` not waited again): dropping the
        # engine's work would block this thread until the op ends, so it is kept until then.
        if not self.done and self._pending is None and keep_until_done is not None:  # None: interpreter teardown
            self._comm._keep_until_done(self._backend_work)

    def is_completed(self) -> bool:
        """Whether the op has ended (on its device, for a stream-ordered engine); never blocks."""
        pending = self._pending
        if pending is not None:
            return self._comm._has_ended(pending)
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
        # Each creation over this store keys its own (a communicator made again under one name,
        # `commlib.init` twice in a job, never reads its predecessor's board, abort or settings):
        # a rank counts its own creations, and creation is collective, so the n-th is one.
        store = dist.PrefixStore(f"{store.add(f'created_by/{backend.rank}', 1)}/", store)
        self._store = store
        self.name = name
        self.rank = backend.rank
        self.size = backend.size
        self.timeout = timeout
        self.members = Members.of(name, backend.size, global_ranks)
        self.world_rank = self.members.global_ranks[backend.rank]
        self.hooks = HookRegistry()
        self.abort_poll_s = abort_poll_s(self.size)
        self._first_slice = timedelta(seconds=self.abort_poll_s)  # made once: a wait's path
        self._check = CallChecker(backend.supports)
        self._seq = 0  # collectives
        self._p2p_seq: dict[tuple[int, int], int] = {}  # send/recv, per (peer, tag)
        self._splits = 0  # numbers each split's store prefix: a name may be split into again
        self._dead: str | None = None  # why the communicator can no longer be used
        # A stream-ordered engine's ops in flight, held by the deadline thread (module docstring).
        self.events = backend.events
        self._in_flight = InFlight(self, self.events) if self.events is not None else None
        self._undelivered: tuple[Collective, CommError] | None = None  # a failure found off the caller's thread
        self._failure_thread: threading.Thread | None = None  # words and records such a failure
        self._failure_reported = threading.Event()  # set once it has (`_refuse_if_dead` waits for it)
        self._news_reader: threading.Thread | None = None  # reads peers' abort announcements (`waiting_on_peers`)
        self._end_lock = threading.Lock()  # one end at a time: its marking dead, its engine's abort
        self._engine_aborted = False  # its abort has begun (`_abort_engine`): once only
        self._engine_abort: threading.Thread | None = None  # a stream-ordered engine's abort, on its own thread
        self._barrier_tensor: torch.Tensor | None = None  # what a stream-ordered barrier all-reduces
        # Before the board, whose publisher would outlive a failed creation.
        agree_on_settings(store, name, self.rank, self.size, timeout, check_consistency)
        self.recorder = FlightRecorder(name, self.rank, world_rank=self.world_rank)
        self.board = ProgressBoard(store, self.rank, self.size, os.getpid())
        bound = {"comm": name, "backend": backend.name, "comm_rank": self.rank, "comm_size": self.size}
        self._log = _log.get_logger().bind(**bound)
        self._events = _log.event_writer(**bound)  # collective.start and .end: the hot path's own
        self._reports = FailureReports(self.members, self.rank, self.board, self._log, backend)
        # The check compares digests on a CPU engine, where that costs no device sync.
        self._consistency = (
            ConsistencyCheck(store, self.members, self.rank, via_engine=self.events is None)
            if check_consistency
            else None
        )
        self._log.info("comm.init", timeout_s=timeout, check_consistency=check_consistency)

    # -- identity ---------------------------------------------------------------------
    @property
    def backend(self) -> str:
        return self._backend.name

    @property
    def engine(self) -> Any:
        """The torch engine under this communicator (a c10d process group or backend), where
        the backend has one: what `commlib.process_group` registers with torch."""
        return getattr(self._backend, "engine", None)

    @property
    def device(self) -> torch.device:
        return self._backend.device

    @property
    def check_consistency(self) -> bool:
        """Fixed at creation, and the same on every rank (`commlib.consistency.agree_on_settings`)."""
        return self._consistency is not None

    @property
    def seq(self) -> int:
        """Sequence number of the last collective issued (0: none yet); send/recv are not counted."""
        return self._seq

    @property
    def stream_ordered(self) -> bool:
        """Whether ops run in stream order on a device, the CPU never waiting for them (module docstring)."""
        return self._in_flight is not None

    @property
    def broken(self) -> bool:
        """Whether the communicator can no longer be used (failed, aborted or finalized)."""
        return self._dead is not None

    def p2p_seq(self, peer: int, tag: int = 0) -> int:
        """Sequence number of the last send or recv with `peer` under `tag` (0: none yet)."""
        return self._p2p_seq.get((peer, tag), 0)

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
        return self._issue(_ALL_REDUCE, async_op, timeout, tensor=tensor, reduce_op=op)

    def broadcast(
        self, tensor: torch.Tensor, root: int, *, async_op: bool = False, timeout: Deadline | None = None
    ) -> Work | None:
        return self._issue(_BROADCAST, async_op, timeout, tensor=tensor, root=root)

    def reduce(
        self,
        tensor: torch.Tensor,
        root: int,
        op: Reduction = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: Deadline | None = None,
    ) -> Work | None:
        return self._issue(_REDUCE, async_op, timeout, tensor=tensor, root=root, reduce_op=op)

    def all_gather(
        self,
        tensor_list: list[torch.Tensor],
        tensor: torch.Tensor,
        *,
        async_op: bool = False,
        timeout: Deadline | None = None,
    ) -> Work | None:
        return self._issue(_ALL_GATHER, async_op, timeout, output_list=tensor_list, input=tensor)

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False, timeout: Deadline | None = None
    ) -> Work | None:
        return self._issue(_ALL_GATHER_SINGLE, async_op, timeout, output=output, input=input)

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
            _REDUCE_SCATTER,
            async_op,
            timeout,
            output=output,
            input_list=input_list,
            reduce_op=op,
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
            _REDUCE_SCATTER_SINGLE,
            async_op,
            timeout,
            output=output,
            input=input,
            reduce_op=op,
        )

    def all_to_all_single(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False, timeout: Deadline | None = None
    ) -> Work | None:
        return self._issue(_ALL_TO_ALL_SINGLE, async_op, timeout, output=output, input=input)

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
            _GATHER,
            async_op,
            timeout,
            output_list=output_list,
            input=input,
            root=root,
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
            _SCATTER,
            async_op,
            timeout,
            output=output,
            input_list=input_list,
            root=root,
        )

    def send(
        self, tensor: torch.Tensor, dst: int, *, tag: int = 0, async_op: bool = False, timeout: Deadline | None = None
    ) -> Work | None:
        """Send to `dst`. `tag` tells this pair's messages apart: a recv takes the send of its tag
        (gloo); engines that have no tags (nccl, torchcomms) match each peer's in order, as c10d's
        NCCL does."""
        return self._issue(_SEND, async_op, timeout, tensor=tensor, peer=dst, tag=tag)

    def recv(
        self, tensor: torch.Tensor, src: int, *, tag: int = 0, async_op: bool = False, timeout: Deadline | None = None
    ) -> Work | None:
        """Receive from `src` the send of the same `tag` (see `send`)."""
        return self._issue(_RECV, async_op, timeout, tensor=tensor, peer=src, tag=tag)

    def barrier(self, *, async_op: bool = False, timeout: Deadline | None = None) -> Work | None:
        return self._issue(_BARRIER, async_op, timeout)

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

    # -- splits --------------------------------------------------------------------------
    def split(self, ranks: list[int], name: str, *, timeout: Deadline | None = None) -> Communicator | None:
        """A communicator of `ranks` (ranks of this one, in the new rank order), named `name`.

        Collective: every rank of this communicator calls it with the same arguments.
        Returns None on ranks not in `ranks`.
        """
        self._refuse_if_dead("split")
        if not isinstance(name, str) or not name:
            raise ValueError(f"split on {self.name!r} rank {self.rank}: expected a non-empty name; found {name!r}")
        ranks = list(ranks)
        bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < self.size]
        if bad or len(set(ranks)) != len(ranks):
            raise ValueError(
                f"split on {self.name!r} rank {self.rank}: expected distinct ranks in [0, {self.size}); found {ranks}"
            )
        deadline = seconds(timeout) or self.timeout
        self._splits += 1
        store = dist.PrefixStore(f"{name}.{self._splits}/", self._store)
        try:
            backend = self._backend.split(ranks, name, timedelta(seconds=deadline)) if ranks else None
        except Exception as exc:
            self._log.error("comm.split_failed", new_comm=name, ranks=ranks, error=f"{type(exc).__name__}: {exc}")
            raise CommError(
                f"split of {self.name!r} into {name!r} failed on rank {self.rank}: {type(exc).__name__}: {exc}",
                op="split",
                comm=self.name,
                rank=self.rank,
            ) from exc
        self._log.info("comm.split", new_comm=name, ranks=ranks, member=backend is not None)
        if backend is None:
            return None
        return Communicator(backend, store, name, self.timeout, self.check_consistency, self.members.global_of(ranks))

    # -- its end, on purpose -------------------------------------------------------------
    def abort(self, reason: str = "aborted") -> None:
        """Tear down at once, without waiting for peers; later calls raise CommAborted.

        Peers blocked in one of this communicator's collectives learn of it (see the module
        docstring) and fail with a PeerFailure naming this rank and `reason`. A call of this rank
        blocked on another thread in a wait taken in slices (c10d's gloo: `resumable_wait`)
        raises CommAborted at the end of its slice (`_wait_in_slices`).
        """
        with self._end_lock:
            first = self._dead is None
            if first:
                self._dead = reason
        self._undelivered = None  # the caller chose to abort: a failure found meanwhile is moot
        dead = self._dead  # the line and the news as a failure gives them: the line first, the news once

        def news() -> None:
            self._reports.announce_abort(reason)

        self._log_then_announce(lambda: self._log.warning("comm.abort", reason=dead), news if first else None)
        self._dump("abort")
        self.board.close()
        self._abort_engine()
        self._await_engine_abort()
        self.recorder.aborted()  # in-job recovery may rebuild: the process keeps its signal handlers and log

    def finalize(self) -> None:
        """Release the communicator after a clean run; later calls raise CommAborted.

        On a stream-ordered engine the CPU first waits for every op in flight (each bounded by
        its deadline): one that fails meanwhile is raised here, and the communicator is aborted.
        """
        if self._dead is None and self._in_flight is not None:
            self._drain(float("inf"), "finalize")
        if self._dead is None:
            self._dead = "finalized"
            self.board.close()
            self._backend.finalize()
            self._log.info("comm.finalize", seq=self._seq)
        self.recorder.close()  # the process's last one leaves it as it was (commlib.record.flight)

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()

    # -- the one path ------------------------------------------------------------------
    def _issue(
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
        tag: int = 0,
    ) -> Work | None:
        # The hot path: every collective runs it, so what is fixed per communicator is computed
        # once and what most calls lack (hooks, a log dir, a dead communicator) costs a test.
        # Named parameters and the Collective's fields in their order, not **fields: packing
        # and unpacking a dict per call cost more than building the Collective.
        if async_op is not True and async_op is not False:
            raise TypeError(
                f"{op} on {self.name!r} rank {self.rank}: expected async_op to be a bool; "
                f"found {type(async_op).__name__}"
            )
        deadline = self.timeout if timeout is None else seconds(timeout)
        call = Collective(
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
            tag,
        )
        if self._dead is not None:
            self._refuse_if_dead(PLAIN_NAMES[op])
        self._check.check(call)
        if peer is None:
            self._seq += 1
            call.seq = self._seq
            if self._consistency is not None:
                self._agree(call)
        else:  # numbered per peer and tag: a pipeline's sends never shift the collective sequence
            key = (peer, tag)
            call.seq = self._p2p_seq[key] = self._p2p_seq.get(key, 0) + 1
        if _PROCESS_HOOKS.pre or self.hooks.pre:
            try:
                run_hooks(self.hooks, "pre", call)
            except BaseException as exc:
                # The number is spent and the peers will wait for it: record the call as failed
                # and break the communicator, then let the hook's own exception through.
                self._fail(call, self.recorder.start(call), exc, hooks=False)
                raise
        entry = self.recorder.start(call)
        if peer is None:
            self.board.started(call.seq, entry.op, call.context)
        if _log.STATE.enabled:
            self._log_start(call, entry)
        if self._in_flight is not None:
            return self._enqueue(call, entry)
        try:
            backend_work = self._backend.launch(call, deadline_timedelta(deadline))
        except Exception as exc:
            raise self._engine_failed(call, entry, exc) from exc
        if async_op:
            return Work(self, call, backend_work, entry)
        self._complete(call, entry, backend_work, None, None)  # a sync call needs no Work
        return None

    def _log_start(self, call: Collective, entry: FlightEntry) -> None:
        reduce_op = call.reduce_op
        fields = {
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
        }
        if call.tag:
            fields["tag"] = call.tag
        self._events.info("collective.start", fields)

    def _complete(
        self, call: Collective, entry: FlightEntry, backend_work: BackendWork, timeout: float | None, work: Work | None
    ) -> None:
        """A CPU engine's wait for an op, under its deadline; then its end is recorded."""
        # An op still in flight when the communicator broke: its failure was recorded once
        # already, by whichever call broke it.
        if self._dead is not None:
            self._refuse_if_dead(PLAIN_NAMES[call.op])
        wait_from_ns = done_before_wait = None
        # How long the caller's wait blocked, and whether the op was already done.
        if call.async_op and _log.STATE.enabled:
            wait_from_ns, done_before_wait = time.monotonic_ns(), backend_work.is_completed()
        left = call.deadline_s - (time.monotonic_ns() - entry.start_mono_ns) / 1e9
        # A caller's bound shorter than the deadline's rest is the caller's, not the op's (module docstring).
        callers = timeout is not None and timeout < left
        budget: float = max(timeout if callers else left, 1e-3)  # type: ignore[type-var, assignment]
        try:
            finished = (
                self._wait_in_slices(backend_work.wait, budget, entry.start_mono_ns)
                if self._backend.resumable_wait
                else backend_work.wait(timedelta(seconds=budget))
            )
        except Exception as exc:
            raise self._engine_failed(call, entry, exc) from exc
        if finished is None:  # ended from another thread while this one waited
            self._keep_until_done(backend_work)
            self._raise_dead(PLAIN_NAMES[call.op])
        if finished is not True:
            if finished is False and callers and (time.monotonic_ns() - entry.start_mono_ns) / 1e9 < call.deadline_s:
                self._log.debug(
                    "collective.wait_timeout",
                    op=call.op.value,
                    seq=call.seq,
                    peer=call.peer,
                    **({"tag": call.tag} if call.tag else {}),
                    waited_s=budget,
                    deadline_s=call.deadline_s,
                )
                raise self._reports.wait_timeout(call, entry, budget)
            self._keep_until_done(backend_work)
            if finished is False:
                raise self._fail(call, entry, self._reports.timeout(call, entry, None))
            # a peer's abort announcement, read between slices
            raise self._fail(call, entry, self._reports.peer_left(call, entry, finished))
        if work is not None:
            work.done = True
        self._record_end(call, entry, "completed", wait_from_ns, done_before_wait)

    def _wait_in_slices(
        self, wait: Callable[[timedelta], bool], budget_s: float, since_mono_ns: int
    ) -> bool | dict[str, Any] | None:
        """Call `wait(slice)` until it returns True (done), `budget_s` passes (False), a peer's
        abort announcement is read between two slices (its announcement), or this communicator
        was ended meanwhile from another thread (None)."""
        # Most waits end within the first slice, which is the same for all of them.
        if budget_s >= self.abort_poll_s:
            if wait(self._first_slice):
                return True
            slice_td = self._first_slice
        else:
            slice_td = timedelta(seconds=budget_s)
        until = time.monotonic() + budget_s - slice_td.total_seconds()
        while not wait(slice_td):
            # An abort from another thread (torchft's, a watchdog's): gloo's abort does not wake a
            # wait already blocked in it, so the wait stops here.
            if self._dead is not None:
                return None
            now = time.monotonic()
            if now >= until:
                return False
            # Waited for at most a slice and never past the deadline: a store that stopped
            # answering must not hold the wait (`commlib.store_thread`).
            announced = self._reports.abort_announced(min(self.abort_poll_s, until - now))
            if announced is not None:
                return announced
            now = time.monotonic()
            waited_s = now - since_mono_ns / 1e9
            slice_td = timedelta(seconds=max(min(until - now, max(self.abort_poll_s, waited_s / 10)), 1e-3))
        return True

    def _record_end(
        self,
        call: Collective,
        entry: FlightEntry,
        state: str,
        wait_from_ns: int | None = None,
        done_before_wait: bool | None = None,
    ) -> None:
        """Record an op that completed (a CPU engine's) or was enqueued (a stream-ordered one's):
        flight recorder, board, `collective.end` with how long an async caller's wait blocked
        (`wait_from_ns`: when it began; None where none did), then the post-hooks."""
        entry.end_mono_ns = end_ns = time.monotonic_ns()
        entry.state = state
        if call.peer is None:
            self.board.finished(call.seq, entry.op)
        if _log.STATE.enabled:
            fields = {
                "op": entry.op,
                "seq": call.seq,
                "bytes": entry.nbytes,
                "peer": call.peer,
                "duration_s": (end_ns - entry.start_mono_ns) / 1e9,
                "status": "ok",
            }
            if wait_from_ns is not None:
                fields["wait_s"] = (end_ns - wait_from_ns) / 1e9
                fields["done_before_wait"] = done_before_wait
            if call.tag:
                fields["tag"] = call.tag
            self._events.info("collective.end", fields)
        if _PROCESS_HOOKS.post or self.hooks.post:
            run_hooks(self.hooks, "post", call, (end_ns - entry.start_mono_ns) / 1e9)

    # -- the consistency check (`commlib.consistency`), on this path ---------------------
    def _agree(self, call: Collective) -> None:
        """Raise `CollectiveMismatch` on every rank unless every rank issues the same collective.

        The check says what to exchange and what the exchange means; its waits and failures
        are this path's own: waits in slices that a peer's abort announcement ends, and
        failures recorded as any op's."""
        check = self._consistency
        assert check is not None
        fingerprint = call.fingerprint()
        started = time.time_ns(), time.monotonic_ns()
        if check.via_engine:
            exchange = check.digest_exchange(call, fingerprint)
            outcome: bool | dict[str, Any] | None = False
            try:
                work = self._backend.launch(exchange, deadline_timedelta(call.deadline_s))
                outcome = (
                    self._wait_in_slices(work.wait, call.deadline_s, started[1])
                    if self._backend.resumable_wait
                    else work.wait(deadline_timedelta(call.deadline_s))
                )
            except Exception as exc:
                raise self._engine_failed(call, self._check_entry(call, started), exc) from exc
            if outcome is not True:
                self._keep_until_done(work)
                self._check_failed(call, started, outcome)
            if check.digests_agree():
                return
        through_store = check.fingerprints_through_store(call, fingerprint)
        try:  # in slices, like an op's wait: a peer that aborted meanwhile ends it at once
            outcome = self._wait_in_slices(through_store.poll, call.deadline_s, started[1])
        except Exception as exc:
            entry = self._check_entry(call, started)
            raise self._fail(call, entry, self._reports.timeout(call, entry, exc)) from exc
        if outcome is not True:
            self._check_failed(call, started, outcome)
        error = check.mismatch(call, through_store.values(), through_store.mine, self._reports.where(call))
        if error is not None:
            self._log.error(
                "collective.mismatch",
                op=call.op.value,
                seq=call.seq,
                error=str(error),
                differing_ranks=error.differing_ranks,
            )
            run_hooks(self.hooks, "failure", call, error)
            raise error

    def _check_entry(self, call: Collective, started: tuple[int, int]) -> FlightEntry:
        """The flight entry of a call whose check failed: the check's wait is what failed, so
        the entry starts when it did (the call itself never started)."""
        entry = self.recorder.start(call)
        entry.start_ns, entry.start_mono_ns = started
        return entry

    def _check_failed(self, call: Collective, started: tuple[int, int], outcome: bool | dict[str, Any] | None) -> None:
        """Raise for a check's wait that ended without every rank: its deadline passed (False),
        a peer's abort announcement was read, or this communicator was ended from another thread
        (None; `_wait_in_slices`)."""
        if outcome is None:
            self._raise_dead(PLAIN_NAMES[call.op])
        entry = self._check_entry(call, started)
        if outcome is False:
            raise self._fail(call, entry, self._reports.timeout(call, entry, None))
        assert isinstance(outcome, dict)
        raise self._fail(call, entry, self._reports.peer_left(call, entry, outcome))

    # -- a stream-ordered engine's ops (module docstring) ---------------------------------
    def _enqueue(self, call: Collective, entry: FlightEntry) -> Work | None:
        in_flight = self._in_flight
        assert in_flight is not None
        issued = entry.start_mono_ns
        pending = PendingOp(call, entry, issued, issued + int(call.deadline_s * 1e9))
        in_flight.add(pending)  # before the launch: a launch that blocks on its peers is timed too
        launched = self._as_all_reduce(call) if call.op is _BARRIER else call
        try:
            work = self._backend.launch(launched, deadline_timedelta(engine_timeout_s(call.deadline_s)))
        except Exception as exc:
            raise self._engine_failed(call, entry, exc) from exc
        end = work.end
        if end is not None:  # it runs on an engine stream, which said how its end is read
            if not call.async_op:
                work.order()
        else:
            if call.async_op:
                end = _UNTIMED  # timed from its wait (`_order_after`)
            else:  # it ran on the caller's current stream: the point right after it is its end
                end = self.events.mark()  # type: ignore[union-attr]  # stream-ordered: events is set
                pending.marked = end is not CAPTURED
        pending.end = end
        self._record_end(call, entry, "enqueued")
        if call.async_op:
            return Work(self, call, work, entry, pending)
        if call.op is _BARRIER:
            self._host_waits(pending)
        return None

    def _as_all_reduce(self, call: Collective) -> Collective:
        """A barrier on a stream-ordered engine: an all_reduce of one element on its own device,
        what c10d's NCCL barrier is made of, which the host then waits for under the deadline
        (`_host_waits`) instead of c10d's unbounded stream synchronize (WorkNCCL::wait)."""
        if self._barrier_tensor is None:
            self._barrier_tensor = torch.zeros(1, device=self.device)
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

    def _order_after(self, pending: PendingOp, work: BackendWork) -> None:
        """`Work.wait()` on a stream-ordered engine: the caller's stream waits for the op (the CPU
        does not, but for a barrier); a failure found meanwhile is raised here."""
        if self._dead is not None:
            self._refuse_if_dead(PLAIN_NAMES[pending.call.op])
        if pending.call.op is _BARRIER:
            self._host_waits(pending)
            return
        work.order()
        if pending.end is _UNTIMED:  # timed from now, by an event after the caller's stream's wait
            end = self.events.mark()  # type: ignore[union-attr]
            now = time.monotonic_ns()
            pending.end = end
            timed = PendingOp(pending.call, pending.entry, now, now + int(pending.call.deadline_s * 1e9), end)
            timed.marked = end is not CAPTURED
            self._in_flight.add(timed)  # type: ignore[union-attr]

    def _has_ended(self, pending: PendingOp) -> bool:
        return pending.end is not _UNTIMED and self._in_flight.has_ended(pending)  # type: ignore[union-attr]

    def _keep_until_done(self, work: BackendWork) -> None:
        keep_until_done(work, self._backend, work.is_completed)

    def _host_waits(self, pending: PendingOp) -> None:
        """The CPU waits for `pending` to end, its deadline held by the deadline thread, which
        aborts the engine when it passes (torchft waits so, under its `context_timeout`)."""
        in_flight = self._in_flight
        assert in_flight is not None
        while not in_flight.has_ended(pending):
            if self._dead is not None:
                self._refuse_if_dead(PLAIN_NAMES[pending.call.op])
            time.sleep(HOST_WAIT_POLL_S)

    def _drain(self, until_mono: float, what: str) -> bool:
        """The CPU waits until every op issued so far has ended (True) or `until_mono` passes
        (False); a failure found meanwhile is raised."""
        in_flight = self._in_flight
        assert in_flight is not None
        while True:
            if self._dead is not None:
                self._refuse_if_dead(what)
            if all(in_flight.has_ended(op) for op in list(in_flight.ops)):
                return True
            if time.monotonic() >= until_mono:
                return False
            time.sleep(HOST_WAIT_POLL_S)

    # `commlib.deadlines.Owner`: called on the deadline thread, which they must never block.
    def engine_error(self) -> BaseException | None:
        return self._backend.engine_error()

    def deadline_passed(self, op: PendingOp) -> None:
        self._failed_off_thread(op, None)

    def engine_failed(self, error: BaseException, op: PendingOp) -> None:
        self._failed_off_thread(op, error)

    def waiting_on_peers(self) -> None:
        if self._news_reader is None or not self._news_reader.is_alive():
            self._news_reader = threading.Thread(
                target=self._read_peer_news, name=f"commlib-peer-news-{self.name}", daemon=True
            )
            self._news_reader.start()

    def unwatchable(self, exc: BaseException) -> None:
        with self._end_lock:
            if self._dead is not None:
                return
            self._dead = f"aborted: its ops could not be watched ({type(exc).__name__}: {exc})"
        self._start_failure_thread(self._abort_unwatchable, exc)

    def _read_peer_news(self) -> None:
        """While ops are in flight: a peer's abort announcement fails the oldest with a
        `PeerFailure`, as a CPU wait's slices do; read at a wait's pace (`_wait_in_slices`)."""
        in_flight = self._in_flight
        assert in_flight is not None
        while self._dead is None and in_flight.ops:
            oldest = in_flight.ops[0]
            announced = self._reports.abort_announced()
            if announced is not None:
                self._failed_off_thread(oldest, announced)
                return
            running_s = (time.monotonic_ns() - oldest.issued_ns) / 1e9
            time.sleep(max(self.abort_poll_s, running_s / 10))

    def _failed_off_thread(self, op: PendingOp, cause: BaseException | dict[str, Any] | None) -> None:
        """Mark the communicator dead and start the thread that aborts its engine, then words and
        records the failure (`_record_failure_found`). `cause`: None, the deadline passed; the
        engine's error; or a peer's abort announcement."""
        if isinstance(cause, dict):
            kind = "PeerFailure"
        elif cause is None or self._backend.classify(cause) is Failure.TIMEOUT:
            kind = "CollectiveTimeout"
        else:
            kind = "PeerFailure"
        with self._end_lock:
            if self._dead is not None:
                return
            self._dead = f"broken by {kind} in {op.call.op} #{op.call.seq}"
        self._start_failure_thread(self._record_failure_found, op, cause)

    def _start_failure_thread(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=f"commlib-failure-{self.name}", daemon=True)
        self._failure_thread = thread
        thread.start()

    def _record_failure_found(self, op: PendingOp, cause: BaseException | dict[str, Any] | None) -> None:
        """On a thread of its own: the failure, worded and recorded as any op's and handed to the
        caller; then the engine's abort, which may wait for the device to drain, awaited here."""
        call, entry = op.call, op.entry
        try:
            if cause is None:
                error: CommError = self._reports.timeout(call, entry, None, stream_ordered=True)
            elif isinstance(cause, dict):
                error = self._reports.peer_left(call, entry, cause)
            else:
                error = self._reports.engine_failure(call, entry, cause)
            try:
                self._record_failure(call, entry, error)
            finally:
                self._undelivered = (call, error)
                _UNDELIVERED.add(self)
        except Exception as exc:  # nothing here may keep the caller from learning the communicator broke
            report_side_failure(self._log, "failure report", exc)
        finally:
            self._failure_reported.set()
            self._abort_engine()
            self._await_engine_abort()

    def _abort_unwatchable(self, exc: BaseException) -> None:
        try:
            report_side_failure(self._log, "deadline thread", exc)
            self._reports.announce_broken(type(exc).__name__)
        finally:
            self._failure_reported.set()
            self._abort_engine()
            self._await_engine_abort()

    # -- failures (module docstring) -----------------------------------------------------
    def _engine_failed(self, call: Collective, entry: FlightEntry, exc: BaseException) -> CommError:
        """Break the communicator for an op whose engine raised `exc`; the error to raise."""
        if self._dead is not None:  # the deadline thread broke it first: its failure is the one
            self._refuse_if_dead(PLAIN_NAMES[call.op])
        return self._fail(call, entry, self._reports.engine_failure(call, entry, exc))

    def _fail(self, call: Collective, entry: FlightEntry, error: _E, *, hooks: bool = True) -> _E:
        """On the caller's thread: record `error` everywhere, abort the engine, run the failure
        hooks; the error to raise. Nothing here may replace `error` or skip the abort."""
        try:
            self._record_failure(call, entry, error)
        finally:
            self._abort_engine()
        if hooks:
            self._run_hooks_quietly("failure", call, error)
        return error

    def _record_failure(self, call: Collective, entry: FlightEntry, error: BaseException) -> None:
        """The flight recorder, the log line, the peers' news, a flight dump and the board; once."""
        event, state = _EVENTS.get(type(error), ("collective.error", "failed"))
        entry.end_mono_ns, entry.state = time.monotonic_ns(), state
        dead = self._dead = f"broken by {type(error).__name__} in {call.op} #{call.seq}"

        def line() -> None:
            fields = _error_fields(error) if isinstance(error, CommError) else {}
            self._log.error(
                event,
                op=call.op.value,
                seq=call.seq,
                peer=call.peer,
                **({"tag": call.tag} if call.tag else {}),
                duration_s=entry.duration_s,
                status=state,
                error=str(error),
                error_type=type(error).__name__,
                **fields,
            )

        self._log_then_announce(line, lambda: self._reports.announce_abort(dead, error, call))
        try:
            self._dump(event.replace(".", "_"))
        except Exception as exc:  # the error still has to reach the caller
            report_side_failure(self._log, "dump", exc)
        finally:
            self._reports.announce_broken(type(error).__name__)

    def _log_then_announce(self, line: Callable[[], None], news: Callable[[], None] | None) -> None:
        """Write the log line of a failure or an abort, then tell the peers (`news`).

        The line goes first: a peer can only react to the news (its own op ending in a
        `peer.failure`) after this line's clock, so the doctor, folding the ranks' lines in
        clock order, sees every rank where it was when this one gave up. But a line that does
        not come within `LINE_BEFORE_NEWS_S` (a log on a filesystem that stopped answering)
        holds the news back no longer: its own thread writes it whenever the filesystem lets
        it. A line that cannot be written (a full disk) is reported as a side failure.
        """
        written = threading.Event()

        def write() -> None:
            try:
                line()
            except Exception as exc:
                report_side_failure(self._log, "log", exc)
            finally:
                written.set()

        try:
            threading.Thread(target=write, name="commlib-failure-line", daemon=True).start()
        except RuntimeError:  # no new thread while the interpreter shuts down: written here
            write()
        written.wait(LINE_BEFORE_NEWS_S)
        if news is not None:
            news()

    def _dump(self, reason: str) -> None:
        # Without a log dir the dump would flood stderr; SIGUSR1 still prints one on demand.
        directory = _log.log_dir()
        if directory is not None:
            self.recorder.dump(directory, reason)

    def _abort_engine(self) -> None:
        """Abort the engine once: at once on a CPU engine; on a stream-ordered one in a thread of
        its own (its abort waits for the device to drain: ncclCommAbort)."""
        with self._end_lock:
            if self._engine_aborted:
                return
            self._engine_aborted = True
            if self._in_flight is not None:
                self._engine_abort = threading.Thread(
                    target=self._abort_engine_now, name=f"commlib-abort-{self.name}", daemon=True
                )
                self._engine_abort.start()
                return
        self._abort_engine_now()

    def _abort_engine_now(self) -> None:
        started = time.monotonic()
        try:
            self._backend.abort()
            if self._in_flight is not None:
                self._log.info("comm.engine_aborted", duration_s=time.monotonic() - started)
        except Exception as exc:
            report_side_failure(self._log, "engine abort", exc)
        finally:
            # The abort has returned: nothing of the engine runs any more, so the ops' tensors,
            # kept until now with the ops, may go (an aborted kernel could still have written them).
            if self._in_flight is not None:
                self._in_flight.clear()

    def _await_engine_abort(self) -> None:
        """Wait for a stream-ordered engine's abort, at most `ENGINE_ABORT_BOUND_S`."""
        thread = self._engine_abort
        if thread is None or thread is threading.current_thread() or not thread.is_alive():
            return
        thread.join(ENGINE_ABORT_BOUND_S)
        if thread.is_alive():
            self._log.error(
                "comm.engine_abort_stuck",
                waited_s=ENGINE_ABORT_BOUND_S,
                action="going on without it; the engine and its device streams are left as they are",
            )

    def _refuse_if_dead(self, what: str) -> None:
        """Raise for a call on a communicator that can no longer be used: the failure found off
        the caller's thread first (once, after the failure hooks), else `CommAborted`."""
        if self._dead is not None:
            self._raise_dead(what)

    def _raise_dead(self, what: str) -> NoReturn:
        """`_refuse_if_dead` for a communicator known to be dead."""
        if self._failure_thread not in (None, threading.current_thread()):
            # A failure found off this thread: its report comes first on its thread (bounded by
            # LINE_BEFORE_NEWS_S and the store's answers), the engine's abort after it.
            self._failure_reported.wait(ENGINE_ABORT_BOUND_S)
        self._deliver_undelivered()
        raise CommAborted(
            f"{what} on {self.name!r} {self.members.name(self.rank)}: expected a live communicator; found it "
            f"{self._dead}",
            op=what,
            seq=self._seq,
            comm=self.name,
            rank=self.world_rank,
        )

    def _deliver_undelivered(self) -> None:
        """Raise, on the caller's thread, the failure found off it (once), after the failure hooks."""
        pending, self._undelivered = self._undelivered, None
        if pending is None:
            return
        _UNDELIVERED.discard(self)
        call, error = pending
        self._run_hooks_quietly("failure", call, error)
        raise error

    def _run_hooks_quietly(self, kind: str, *args: Any) -> None:
        """Hooks where one that raises must not replace the error being raised: its failure is
        logged and passed over."""
        try:
            run_hooks(self.hooks, kind, *args)
        except Exception as exc:
            report_side_failure(self._log, f"{kind} hook", exc)


def _error_fields(error: CommError) -> dict[str, Any]:
    return {k: v for k, v in error.fields().items() if k not in ("op", "seq", "comm", "rank")}


# The one registry this module owns: communicators whose failure was found off the caller's
# thread and has not been raised yet (`check`).
_UNDELIVERED: weakref.WeakSet[Communicator] = weakref.WeakSet()


def check(wait: bool = False, timeout: float | None = None) -> None:
    """Raise, on the calling thread, a failure found on a stream-ordered communicator of this
    process that no call has raised yet (the error its next call or `Work.wait()` would raise).

    Call it once a step, before the optimizer step. With `wait`, it first blocks the CPU until
    every op issued so far has ended or failed (at most `timeout` seconds; None: as long as
    that takes, which each op's deadline bounds): what a trainer wants before a checkpoint.
    CPU engines raise their errors on the call that met them, so this finds nothing for them.
    """
    from commlib import deadlines

    until = time.monotonic() + (timeout if timeout is not None else float("inf"))
    if wait:
        for in_flight in deadlines.watched():
            owner = in_flight.owner
            if isinstance(owner, Communicator):
                owner._drain(until, "check")
    for comm in list(_UNDELIVERED):
        comm._deliver_undelivered()
