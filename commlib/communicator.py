"""`Communicator`: commlib's public API, and the one path every operation takes.

    validate -> next sequence number -> (consistency check) -> pre-hooks -> record start
    -> backend launch -> wait with deadline (sync) or return a Work whose wait does (async)
    -> record end -> post-hooks

On a stream-ordered engine (a GPU's: `Backend.runtime`, `commlib.device`) the CPU never
waits: an event is marked on the caller's stream before the pre-hooks, and after the
launch a synchronous call orders the caller's stream behind the op (as NCCL's own calls
do) and an asynchronous one returns a Work whose `wait()` does; the op's deadline, its end
and its failure are the watchdog's (`commlib.watchdog`), which calls back into the
failure paths below from its thread. The error then waits for the caller: it is raised at
the caller's next call on this communicator, `Work.wait()` or `commlib.check()`, with the
failure hooks run just before.

"Record" means the flight recorder, the progress board and the structured log, together.
Failures on that path become typed errors here and only here: a deadline that expires is a
`CollectiveTimeout` naming the ranks that never arrived, a peer's death a `PeerFailure`,
and either leaves the communicator dead, so every later call raises `CommAborted` at once
instead of blocking. Backends only launch.

A rank that breaks or aborts its communicator says so in the communicator's store
(`ABORT_KEY`: its rank and why; the first one stays). A peer blocked in a collective of the
same communicator reads that key between slices of its wait and fails with a `PeerFailure`
naming the rank within a fraction of a second, instead of waiting out its deadline for a
rank that will never come (an exception in that rank's step, a rank that timed out on
another collective, a rank recovering in-job). A peer whose deadline expired in the same
collective, which this rank had started by then, is no culprit: it arrived like this rank,
so this rank fails with the same `CollectiveTimeout` naming the ranks that never did
(deadlines expire a little apart). Slices start at `ABORT_POLL_S` and grow with
the time already waited (a tenth of it), so a long wait costs the store one read per ~10%
of its length; an op that completes within its first slice costs no store read at all.
Engines whose timed-out wait breaks the op wait in one piece (`Backend.resumable_wait`).

A caller's `Work.wait(timeout)` shorter than what is left of the op's deadline is the
caller's own bound, not the op's: when it passes, `WaitTimeout` leaves the op and the
communicator as they were (a raw gloo wait does the same), and a later wait goes on.

Who is gone, when a peer's connection breaks: the announcement of a peer that aborted on
purpose names that peer; an announcement made because its maker met a peer's failure names
what its maker found, never its maker; otherwise the board tells (a process on this host
that has exited, a heartbeat that stopped), or the error says that nobody could tell.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
import time
from datetime import timedelta
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from commlib.backends.base import Backend, BackendWork, Failure
from commlib.device import Event
from commlib.errors import (CollectiveMismatch, CollectiveTimeout, CommAborted, CommError, PeerFailure,
                            WaitTimeout)
from commlib.hooks import HookRegistry, RemovableHandle, run_hooks
from commlib.observe import log as _log
from commlib.observe.board import (HEARTBEAT_S, STALE_AFTER_S, BoardEntry, ProgressBoard, ask_for_stacks,
                                   explain_timeout, find_gone, own_client)
from commlib.observe.flight import FlightEntry, FlightRecorder
from commlib.ops import Collective, OpName, Reduction, ReduceOp
from commlib.validation import CallChecker, seconds
from commlib.watchdog import DeviceOp, InFlight, engine_timeout_s

CHECK_CONSISTENCY_ENV = "COMMLIB_CHECK_CONSISTENCY"
ABORT_KEY = "commlib/aborted"  # in a communicator's store: the first rank that broke or aborted it
ABORT_POLL_S = 0.1  # the first slice of a wait between two reads of ABORT_KEY
CONSISTENCY_SLOTS = 2  # store keys per rank the consistency check reuses in turn (`_agree`)
ENGINE_ABORT_BOUND_S = 10.0  # how long a caller waits for an engine abort running in its own thread
GONE_GRACE_S = 1.0  # how long a broken connection's rank may take to show as exited (`_find_gone_peers`)
_FIRST_SLICE = timedelta(seconds=ABORT_POLL_S)
_PROCESS_HOOKS = HookRegistry.process()

# Works given up on while their op still ran, with their backend: dropping one would block
# the caller until the op ends (gloo and torchcomms join the op's thread), so they are kept
# here until it has, and pruned at the next give-up.
_ABANDONED: list[tuple[BackendWork, Backend]] = []


class Work:
    """The handle of an asynchronous collective. `wait` takes the same path as a sync call."""

    __slots__ = ("_comm", "call", "_backend_work", "_entry", "done", "_device_op")

    def __init__(self, comm: "Communicator", call: Collective, backend_work: BackendWork,
                 entry: FlightEntry, device_op: DeviceOp | None = None) -> None:
        self._comm = comm
        self.call = call
        self._backend_work = backend_work
        self._entry = entry
        self.done = False
        self._device_op = device_op

    def wait(self, timeout: float | timedelta | None = None) -> None:
        """Block until complete: at most `timeout` (a `WaitTimeout` if it passes first and the
        op's deadline has not), else what is left of the op's deadline.

        On a stream-ordered engine only the caller's current stream waits for the op, as
        NCCL's `wait()` does; the CPU returns at once, and `timeout` has nothing to bound
        (the op's deadline is the watchdog's).
        """
        if self._device_op is not None:
            self._comm._order_after(self._device_op)
        elif not self.done:
            self._comm._complete(self.call, self._entry, self._backend_work, seconds(timeout), self)

    def __del__(self) -> None:
        # A Work given up on while its op runs (a `WaitTimeout` not waited again): dropping the
        # engine's work would block this thread until the op ends (gloo's and torchcomms' join
        # the op's thread), so it is kept until then (`_abandon`).
        if not self.done and self._device_op is None and _abandon is not None:  # None: interpreter teardown
            _abandon(self._backend_work, self._comm._backend)

    def is_completed(self) -> bool:
        """Whether the op has ended (on its device, for a stream-ordered engine); never blocks."""
        if self._device_op is not None:
            return self._device_op.end.query()
        return self.done or self._backend_work.is_completed()


class Communicator:
    """A group of ranks and the collectives among them. Create it with `commlib.init`."""

    abort_poll_s = ABORT_POLL_S  # the watchdog reads peers' announcements at this pace too

    def __init__(self, backend: Backend, store: dist.Store, name: str, timeout: float,
                 check_consistency: bool = False, world_rank: int | None = None) -> None:
        self._backend = backend
        self._store = store
        self.name = name
        self.rank = backend.rank
        self.size = backend.size
        self.timeout = timeout
        self._check_consistency = check_consistency
        # Where the consistency check compares digests: the engine where that costs no device sync (`_agree`).
        self._fingerprints_via_engine = backend.device.type == "cpu" and backend.runtime is None
        # The digests it exchanges there, written and read through a numpy view (cheaper than torch's indexing).
        self._digest_tensor = torch.zeros(2, dtype=torch.int64)
        self._digest_pair = self._digest_tensor.numpy()
        self.world_rank = backend.rank if world_rank is None else world_rank
        self.hooks = HookRegistry()
        self._check = CallChecker(backend.supports)
        self._seq = 0  # collectives
        self._p2p_seq: dict[int, int] = {}  # send/recv, per peer
        self._splits = 0
        self._dead: str | None = None  # why the communicator can no longer be used
        # A stream-ordered engine's device runtime, its ops in flight, and the watchdog's error
        # that the caller has not been given yet (with the call it broke).
        self._runtime = backend.runtime
        self._in_flight = InFlight(self) if self._runtime is not None else None
        self._undelivered: tuple[Collective, CommError] | None = None
        self._abort_lock = threading.Lock()
        self._engine_aborting = False  # the engine's abort has been started (`_abort_engine`)
        self._abort_thread: threading.Thread | None = None  # a stream-ordered engine's abort, on its own thread
        self._owner_thread = threading.get_ident()
        self._side_store: dist.Store | None = None  # the store client of other threads (`_thread_store`)
        self._agree_on_settings()  # before the board, whose publisher would outlive a failed creation
        self.recorder = FlightRecorder(name, self.rank, world_rank=self.world_rank)
        self.board = ProgressBoard(store, self.rank, self.size, os.getpid(), stream_ordered=self._runtime is not None)
        bound = {"comm": name, "backend": backend.name, "comm_rank": self.rank, "comm_size": self.size}
        self._log = _log.get_logger().bind(**bound)
        self._events = _log.event_writer(**bound)  # collective.start and .end: the hot path's own
        self._log.info("comm.init", timeout_s=timeout, check_consistency=check_consistency)

    def _agree_on_settings(self) -> None:
        """Raise unless every rank has the consistency check on, or every rank has it off.

        A checked call issues one collective of its own on the engine (`_digests_agree`): a
        rank without the check would pair it with its real collective, and the two would mix
        each other's data instead of failing. So the setting is compared once, here, through
        the store, which makes creating a communicator wait for every rank to create it (as
        the engine's own rendezvous mostly does anyway), at most the default deadline.
        """
        keys = [f"settings/{r}" for r in range(self.size)]
        self._store.set(keys[self.rank], "on" if self._check_consistency else "off")
        try:
            self._store.wait(keys, timedelta(seconds=self.timeout))
        except Exception as exc:
            absent = [r for r, key in enumerate(keys) if not self._store.check([key])]
            raise CommError(f"creating {self.name!r} on rank {self.rank}: expected every rank to create it within "
                            f"{self.timeout:g} s; found ranks {absent} did not", op="init", comm=self.name,
                            rank=self.rank) from exc
        settings = [value.decode() for value in self._store.multi_get(keys)]
        if len(set(settings)) > 1:
            by_setting = {s: [r for r, v in enumerate(settings) if v == s] for s in ("on", "off")}
            raise ValueError(f"creating {self.name!r} on rank {self.rank}: expected every rank to create it with the "
                             f"same check_consistency (COMMLIB_CHECK_CONSISTENCY); found it on for ranks "
                             f"{by_setting['on']} and off for ranks {by_setting['off']}")

    # -- identity ---------------------------------------------------------------------
    @property
    def backend(self) -> str:
        return self._backend.name

    @property
    def device(self) -> torch.device:
        return self._backend.device

    @property
    def check_consistency(self) -> bool:
        """Fixed at creation, and the same on every rank (`_agree_on_settings`)."""
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

    @property
    def has_undelivered_error(self) -> bool:
        return self._undelivered is not None

    def p2p_seq(self, peer: int) -> int:
        """Sequence number of the last send or recv with `peer` (0: none yet)."""
        return self._p2p_seq.get(peer, 0)

    def __repr__(self) -> str:
        return f"Communicator(name={self.name!r}, backend={self.backend!r}, rank={self.rank}, size={self.size})"

    # -- collectives (canonical torchcomms names) -------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: Reduction = ReduceOp.SUM, *, async_op: bool = False,
                   timeout: float | timedelta | None = None) -> Work | None:
        return self._issue(self._call(OpName.ALL_REDUCE, async_op, timeout, tensor=tensor, reduce_op=op))

    def broadcast(self, tensor: torch.Tensor, root: int, *, async_op: bool = False,
                  timeout: float | timedelta | None = None) -> Work | None:
        return self._issue(self._call(OpName.BROADCAST, async_op, timeout, tensor=tensor, root=root))

    def reduce(self, tensor: torch.Tensor, root: int, op: Reduction = ReduceOp.SUM, *, async_op: bool = False,
               timeout: float | timedelta | None = None) -> Work | None:
        return self._issue(self._call(OpName.REDUCE, async_op, timeout, tensor=tensor, root=root, reduce_op=op))

    def all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor, *, async_op: bool = False,
                   timeout: float | timedelta | None = None) -> Work | None:
        return self._issue(self._call(OpName.ALL_GATHER, async_op, timeout, output_list=tensor_list, input=tensor))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False,
                          timeout: float | timedelta | None = None) -> Work | None:
        return self._issue(self._call(OpName.ALL_GATHER_SINGLE, async_op, timeout, output=output, input=input))

    def reduce_scatter(self, output: torch.Tensor, input_list: list[torch.Tensor], op: Reduction = ReduceOp.SUM, *,
                       async_op: bool = False, timeout: float | timedelta | None = None) -> Work | None:
        return self._issue(self._call(OpName.REDUCE_SCATTER, async_op, timeout, output=output,
                                      input_list=input_list, reduce_op=op))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, op: Reduction = ReduceOp.SUM, *,
                              async_op: bool = False, timeout: float | timedelta | None = None) -> Work | None:
        return self._issue(self._call(OpName.REDUCE_SCATTER_SINGLE, async_op, timeout, output=output,
                                      input=input, reduce_op=op))

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False,
                          timeout: float | timedelta | None = None) -> Work | None:
        return self._issue(self._call(OpName.ALL_TO_ALL_SINGLE, async_op, timeout, output=output, input=input))

    def gather(self, output_list: list[torch.Tensor] | None, input: torch.Tensor, root: int, *,
               async_op: bool = False, timeout: float | timedelta | None = None) -> Work | None:
        return self._issue(self._call(OpName.GATHER, async_op, timeout, output_list=output_list,
                                      input=input, root=root))

    def scatter(self, output: torch.Tensor, input_list: list[torch.Tensor] | None, root: int, *,
                async_op: bool = False, timeout: float | timedelta | None = None) -> Work | None:
        return self._issue(self._call(OpName.SCATTER, async_op, timeout, output=output,
                                      input_list=input_list, root=root))

    def send(self, tensor: torch.Tensor, dst: int, *, async_op: bool = False,
             timeout: float | timedelta | None = None) -> Work | None:
        return self._issue(self._call(OpName.SEND, async_op, timeout, tensor=tensor, peer=dst))

    def recv(self, tensor: torch.Tensor, src: int, *, async_op: bool = False,
             timeout: float | timedelta | None = None) -> Work | None:
        return self._issue(self._call(OpName.RECV, async_op, timeout, tensor=tensor, peer=src))

    def barrier(self, *, async_op: bool = False, timeout: float | timedelta | None = None) -> Work | None:
        return self._issue(self._call(OpName.BARRIER, async_op, timeout))

    def set_timeout(self, timeout: float | timedelta) -> None:
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
    def split(self, ranks: list[int], name: str, *, timeout: float | timedelta | None = None) -> "Communicator | None":
        """A communicator of `ranks` (ranks of this one, in the new rank order), named `name`.

        Collective: every rank of this communicator calls it with the same arguments.
        Returns None on ranks not in `ranks`.
        """
        self._ensure_usable("split")
        if not isinstance(name, str) or not name:
            raise ValueError(f"split on {self.name!r} rank {self.rank}: expected a non-empty name; found {name!r}")
        ranks = list(ranks)
        bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < self.size]
        if bad or len(set(ranks)) != len(ranks):
            raise ValueError(f"split on {self.name!r} rank {self.rank}: expected distinct ranks in [0, {self.size}); "
                             f"found {ranks}")
        deadline = seconds(timeout) or self.timeout
        self._splits += 1
        store = dist.PrefixStore(f"{name}.{self._splits}/", self._store)
        try:
            backend = self._backend.split(ranks, name, timedelta(seconds=deadline)) if ranks else None
        except Exception as exc:
            self._log.error("comm.split_failed", new_comm=name, ranks=ranks, error=f"{type(exc).__name__}: {exc}")
            raise CommError(f"split of {self.name!r} into {name!r} failed on rank {self.rank}: "
                            f"{type(exc).__name__}: {exc}", op="split", comm=self.name, rank=self.rank) from exc
        self._log.info("comm.split", new_comm=name, ranks=ranks, member=backend is not None)
        if backend is None:
            return None
        return Communicator(backend, store, name, self.timeout, self.check_consistency, self.world_rank)

    def abort(self, reason: str = "aborted") -> None:
        """Tear down at once, without waiting for peers; later calls raise CommAborted.

        Peers blocked in one of this communicator's collectives learn of it (see the module
        docstring) and fail with a PeerFailure naming this rank and `reason`.
        """
        if self._dead is None:
            self._dead = reason
            self._announce_abort(reason)
        # The caller chose to abort: an error the watchdog found meanwhile is moot.
        self._undelivered = None
        self._log.warning("comm.abort", reason=self._dead)
        self._dump("abort")
        self.board.close()
        # The engine first: an op of a dropped engine work may only end once it is aborted.
        self._abort_engine()
        if self._in_flight is not None:
            with self._in_flight.lock:
                self._in_flight.drop()
        self._await_engine_abort()
        self.recorder.aborted()  # in-job recovery may rebuild: the process keeps its signal handlers and log

    def finalize(self) -> None:
        """Release the communicator after a clean run; later calls raise CommAborted.

        On a stream-ordered engine the CPU first waits for every op in flight (each bounded
        by its deadline once it has started on the device): one the watchdog fails then is
        raised here, and the communicator is aborted instead.
        """
        if self._dead is None and self._in_flight is not None:
            self._in_flight.drain(float("inf"))
            self._deliver_undelivered()
        if self._dead is None:
            self._dead = "finalized"
            self.board.close()
            self._backend.finalize()
            self._log.info("comm.finalize", seq=self._seq)
        self.recorder.close()  # the process's last one leaves it as it was (commlib.observe.flight)

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()

    # -- the one path ------------------------------------------------------------------
    def _call(self, op: OpName, async_op: bool, timeout: float | timedelta | None, *,
              tensor: torch.Tensor | None = None, input: torch.Tensor | None = None,
              output: torch.Tensor | None = None, input_list: list[torch.Tensor] | None = None,
              output_list: list[torch.Tensor] | None = None, root: int | None = None, peer: int | None = None,
              reduce_op: Reduction | None = None) -> Collective:
        # Named parameters and the Collective's fields in their order, not **fields: packing
        # and unpacking a dict per call cost more than the rest of this function (cold, ~1 us).
        if not isinstance(async_op, bool):
            raise TypeError(f"{op} on {self.name!r} rank {self.rank}: expected async_op to be a bool; "
                            f"found {type(async_op).__name__}")
        deadline = self.timeout if timeout is None else seconds(timeout)
        return Collective(op, self.name, self.rank, self.size, async_op, deadline, -1, tensor, input, output,
                          input_list, output_list, root, peer, reduce_op, _log.current_context())

    def _issue(self, call: Collective) -> Work | None:
        # The hot path: every collective runs it, so what is fixed per communicator is
        # computed once (the deadline's timedelta, the checker) and what most calls lack
        # (hooks, a log dir, a dead communicator) costs a test, not a call.
        if self._dead is not None:
            self._ensure_usable(call.op.value)
        self._check(call)
        p2p = call.peer is not None
        if p2p:  # numbered per peer: a pipeline's sends never shift the collective sequence
            call.seq = self._p2p_seq[call.peer] = self._p2p_seq.get(call.peer, 0) + 1
        else:
            self._seq += 1
            call.seq = self._seq
        if self._check_consistency and not p2p:
            self._agree(call)
        # Marked before the pre-hooks: device work a hook enqueues belongs to the op's run.
        start = self._runtime.mark() if self._runtime is not None else None
        if _PROCESS_HOOKS.pre or self.hooks.pre:
            try:
                run_hooks(self.hooks, "pre", call)
            except BaseException as exc:
                # The number is spent and the peers will wait for it: record the call as failed
                # and break the communicator, then let the hook's own exception through.
                entry = self.recorder.start(call)
                self._die(call, entry, exc, "collective.error", "failed", hooks=False)
                raise
        entry = self.recorder.start(call)
        if not p2p:
            self.board.started(call.seq, entry.op, call.context)
        if _log.STATE.enabled:
            reduce_op = call.reduce_op
            self._events.info("collective.start", {
                "op": entry.op, "seq": call.seq, "shapes": entry.shapes, "dtype": entry.dtype, "bytes": entry.nbytes,
                "root": entry.root, "peer": call.peer, "deadline_s": call.deadline_s, "async_op": call.async_op,
                "reduce_op": None if reduce_op is None else str(reduce_op)})
        if start is not None:
            return self._launch_on_device(call, entry, start)
        try:
            backend_work = self._backend.launch(call, _timedelta(call.deadline_s))
        except Exception as exc:
            raise self._fail(call, entry, exc) from exc
        if call.async_op:
            return Work(self, call, backend_work, entry)
        self._complete(call, entry, backend_work, None, None)  # a sync call needs no Work
        return None

    def _complete(self, call: Collective, entry: FlightEntry, backend_work: BackendWork,
                  timeout: float | None, work: Work | None) -> None:
        # An op still in flight when the communicator broke: its failure was recorded once
        # already, by whichever call broke it.
        if self._dead is not None:
            self._ensure_usable(call.op.value)
        wait_from_ns = done_before_wait = None
        if call.async_op and _log.STATE.enabled:  # how long the caller's wait blocked, and whether the op was already done
            wait_from_ns, done_before_wait = time.monotonic_ns(), backend_work.is_completed()
        left = call.deadline_s - (time.monotonic_ns() - entry.start_mono_ns) / 1e9
        # A caller's bound shorter than the deadline's rest is the caller's, not the op's (module docstring).
        callers = timeout is not None and timeout < left
        budget = max(timeout if callers else left, 1e-3)
        try:  # in slices where the backend allows (module docstring)
            finished = (self._wait_in_slices(backend_work.wait, budget, entry.start_mono_ns)
                        if self._backend.resumable_wait else backend_work.wait(timedelta(seconds=budget)))
        except Exception as exc:
            raise self._fail(call, entry, exc) from exc
        if finished is False and callers and (time.monotonic_ns() - entry.start_mono_ns) / 1e9 < call.deadline_s:
            raise self._wait_timed_out(call, entry, budget)
        if finished is not True:
            _abandon(backend_work, self._backend)
            if finished is False:
                raise self._timed_out(call, entry, None)
            raise self._peer_left(call, entry, finished)  # a peer's abort announcement, read between slices
        if work is not None:
            work.done = True
        self._record_end(call, entry, wait_from_ns, done_before_wait)
        if _PROCESS_HOOKS.post or self.hooks.post:
            run_hooks(self.hooks, "post", call, entry.duration_s)

    def _record_end(self, call: Collective, entry: FlightEntry, wait_from_ns: int | None = None,
                    done_before_wait: bool | None = None) -> None:
        """Record an op that completed: flight recorder, board and `collective.end`, with how long
        an async caller's wait blocked (`wait_from_ns`: when it began; None where none did)."""
        FlightRecorder.end(entry, "completed")
        if call.peer is None:
            self.board.finished(call.seq, entry.op)
        if _log.STATE.enabled:
            fields = {"op": entry.op, "seq": call.seq, "bytes": entry.nbytes, "peer": call.peer,
                      "duration_s": entry.duration_s, "status": "ok"}
            if wait_from_ns is not None:
                fields["wait_s"] = (entry.end_mono_ns - wait_from_ns) / 1e9
                fields["done_before_wait"] = done_before_wait
            self._events.info("collective.end", fields)

    def _wait_in_slices(self, wait: Callable[[timedelta], bool], budget_s: float,
                        since_mono_ns: int) -> bool | dict[str, Any]:
        """Call `wait(slice)` until it returns True (done), `budget_s` passes (False), or a
        peer's abort announcement is read between two slices (`_announce_abort`)."""
        until = time.monotonic() + budget_s
        # Most waits end within the first slice, which is the same for all of them.
        slice_td = _FIRST_SLICE if budget_s >= ABORT_POLL_S else timedelta(seconds=budget_s)
        while not wait(slice_td):
            now = time.monotonic()
            if now >= until:
                return False
            aborted_by = self._peer_abort()
            if aborted_by is not None:
                return aborted_by
            waited_s = now - since_mono_ns / 1e9
            slice_td = timedelta(seconds=max(min(until - now, max(ABORT_POLL_S, waited_s / 10)), 1e-3))
        return True

    # -- stream-ordered engines: the launch, the caller's stream, the watchdog's callbacks --
    def _launch_on_device(self, call: Collective, entry: FlightEntry, start: Event) -> Work | None:
        """Launch on a stream-ordered engine and hand the op to the watchdog; the CPU never waits (module docstring)."""
        runtime = self._runtime
        try:
            backend_work = self._backend.launch(call, _timedelta(engine_timeout_s(call.deadline_s)))
            if call.async_op:
                end = runtime.mark_after(backend_work.order, call.peer)
            else:
                backend_work.order()
                end = runtime.mark()
        except Exception as exc:
            raise self._fail(call, entry, exc) from exc
        op = DeviceOp(call, entry, backend_work, start, end, call.async_op)
        self._in_flight.add(op)
        if call.async_op:
            return Work(self, call, backend_work, entry, op)
        if call.op is OpName.BARRIER:
            # A barrier is the hosts' rendezvous on every engine (NCCL's blocks the CPU too):
            # the CPU waits for it, bounded by the watchdog holding its deadline.
            self._in_flight.drain(float("inf"))
            if self._dead is not None:
                self._ensure_usable(call.op.value)
        return None

    def _order_after(self, op: DeviceOp) -> None:
        """`Work.wait()` on a stream-ordered engine: the caller's stream waits for the op."""
        if op.entry.state == "completed":
            return
        if self._dead is not None:
            self._ensure_usable(op.call.op.value)
        self._runtime.wait(op.end)

    def _device_op_started(self, op: DeviceOp) -> None:
        if op.call.peer is None:
            self.board.device_started(op.call.seq, op.entry.op)

    def _device_op_ended(self, op: DeviceOp) -> None:
        """The watchdog saw the op end on its device: record it as a CPU wait's end is recorded."""
        call, entry = op.call, op.entry
        failure = op.work.failure()
        if failure is not None:  # the engine's own verdict on the op: its outputs are not to be used
            self._fail(call, entry, failure, deferred=True)
            return
        self._record_end(call, entry)
        self._runtime.release(op.start)
        if not op.held:
            self._runtime.release(op.end)
        if _PROCESS_HOOKS.post or self.hooks.post:
            self._run_hooks_quietly("post", call, entry.duration_s)

    def _device_op_expired(self, op: DeviceOp, running_s: float) -> None:
        self._timed_out(op.call, op.entry, None, deferred=True, running_s=running_s)

    def _device_peer_aborted(self, op: DeviceOp) -> bool:
        announced = self._peer_abort()
        if announced is None:
            return False
        self._peer_left(op.call, op.entry, announced, deferred=True)
        return True

    def _device_op_dropped(self, op: DeviceOp) -> None:
        if op.entry.state == "started":
            FlightRecorder.end(op.entry, "failed")
        # Kept until its op ends (the abort ends it): dropping a torchcomms work whose op still
        # runs blocks this thread until then (../shared/TORCHCOMMS_API.md).
        _abandon(op.work, self._backend)

    def _deliver_undelivered(self) -> None:
        """Raise, on the caller's thread, the error the watchdog found (once), after the failure hooks."""
        pending, self._undelivered = self._undelivered, None
        if pending is None:
            return
        call, error = pending
        self._run_hooks_quietly("failure", call, error)
        raise error

    def _run_hooks_quietly(self, kind: str, *args: Any) -> None:
        """Hooks where one that raises must not replace the error being raised, nor stop the
        watchdog's thread: its failure is logged and passed over."""
        try:
            run_hooks(self.hooks, kind, *args)
        except Exception as exc:
            _report_side_failure(self._log, f"{kind} hook", exc)

    def _watchdog_failed(self, exc: BaseException) -> None:
        """The watchdog could not judge this communicator's ops (a bug): their deadlines no longer
        hold, so the communicator is aborted, saying why, rather than left to hang unwatched."""
        _report_side_failure(self._log, "watchdog", exc)
        self.abort(f"aborted: the watchdog could not judge its ops ({type(exc).__name__}: {exc})")

    def _thread_store(self) -> dist.Store:
        """The store client for the calling thread: the communicator's own on the thread that made
        it, a client of its own for any other (the watchdog's): a TCPStore client serializes its
        calls, and the watchdog must not queue behind a store wait of the caller's."""
        if threading.get_ident() == self._owner_thread:
            return self._store
        if self._side_store is None:
            self._side_store = own_client(self._store, self.rank)
        return self._side_store

    def _abort_engine(self) -> None:
        """Abort the engine once. A stream-ordered engine's abort can hang on a wedged device: it
        runs in a thread of its own, which the watchdog does not wait for (`_await_engine_abort`)."""
        with self._abort_lock:
            if self._engine_aborting:
                return
            self._engine_aborting = True
        if self._runtime is None:  # a CPU engine's abort returns at once
            self._backend.abort()
            return
        started = time.monotonic()

        def abort() -> None:
            try:
                self._backend.abort()
                self._log.info("comm.engine_aborted", duration_s=time.monotonic() - started)
            except Exception as exc:
                _report_side_failure(self._log, "engine abort", exc)

        self._abort_thread = threading.Thread(target=abort, name=f"commlib-abort-{self.name}", daemon=True)
        self._abort_thread.start()

    def _await_engine_abort(self) -> None:
        thread = self._abort_thread
        if thread is None or not thread.is_alive():
            return
        thread.join(ENGINE_ABORT_BOUND_S)
        if thread.is_alive():
            self._log.error("comm.engine_abort_stuck", waited_s=ENGINE_ABORT_BOUND_S,
                            action="going on without it; the engine and its device streams are left as they are")

    # -- failures ---------------------------------------------------------------------
    def _wait_timed_out(self, call: Collective, entry: FlightEntry, waited_s: float) -> WaitTimeout:
        """A caller's shorter wait passed: the op and the communicator stay as they are (module docstring)."""
        elapsed = (time.monotonic_ns() - entry.start_mono_ns) / 1e9
        self._log.info("collective.wait_timeout", op=call.op.value, seq=call.seq, peer=call.peer, waited_s=waited_s,
                       elapsed_s=elapsed, deadline_s=call.deadline_s)
        return WaitTimeout(f"{call.op} #{call.seq} on {self.name!r} rank {self.rank}: expected it to complete within "
                           f"the wait's {waited_s:g} s; found it still running after {elapsed:.1f} s of its "
                           f"{call.deadline_s:g} s deadline (the op goes on; wait again)",
                           waited=waited_s, deadline=call.deadline_s, **self._where(call))

    def _announce_abort(self, reason: str, error: BaseException | None = None, call: Collective | None = None) -> None:
        """Say in the store that this rank broke or aborted the communicator, and why (`_peer_left`).

        A collective's timeout adds its op, seq and the ranks that had not started it. A
        `PeerFailure` marks the announcement as made after a peer's failure, naming whom this
        rank found failed (if anyone): a reader must not take this rank for the culprit.
        """
        announcement: dict[str, Any] = {"rank": self.rank, "reason": reason}
        if isinstance(error, CollectiveTimeout) and call is not None and call.peer is None \
                and error.missing_ranks is not None:
            announcement.update(timed_out_in=[error.op, error.seq], missing=error.missing_ranks)
        elif isinstance(error, PeerFailure):
            announcement.update(after_peer_failure=True, failed=error.failed_ranks)
        try:
            self._thread_store().compare_set(ABORT_KEY, "", json.dumps(announcement))
        except Exception as exc:  # the store is gone too: peers fall back on their deadlines
            _report_side_failure(self._log, "abort announcement", exc)

    def _peer_abort(self) -> dict[str, Any] | None:
        """The announcement of the peer that aborted this communicator (`_announce_abort`), if one did."""
        store = self._thread_store()
        try:
            if not store.check([ABORT_KEY]):
                return None
            announced = json.loads(store.get(ABORT_KEY))
        except Exception:  # an unreachable store tells nothing: the deadline still holds
            return None
        return announced if announced["rank"] != self.rank else None

    def _peer_left(self, call: Collective, entry: FlightEntry, announced: dict[str, Any],
                   cause: BaseException | None = None, *, deferred: bool = False) -> CommError:
        """The error for `call` once a peer's abort announcement was read (`_announce_abort`).

        `cause`: the engine's own failure, when the peer's abort reached this rank as a
        broken connection rather than between two wait slices.
        """
        peer, reason = announced["rank"], announced["reason"]
        if announced.get("after_peer_failure"):
            # The peer only met a failure first: name what it found, or find out here.
            return self._peer_gone(call, entry, cause, announced, deferred=deferred)
        in_this_call = call.peer is None and announced.get("timed_out_in") == [call.op.value, call.seq]
        if in_this_call and self.rank not in announced["missing"]:
            # The peer's deadline expired first in this same collective, which this rank had
            # started by then: its wait is doomed by the same absent ranks. Blaming the peer,
            # which arrived too, would send the operator to the wrong rank; this is the same
            # timeout.
            return self._timed_out(call, entry, cause, expired_first_on=peer, deferred=deferred)
        elapsed = (time.monotonic_ns() - entry.start_mono_ns) / 1e9
        if in_this_call:  # this rank is one the peer gave up on: the late one, which the operator must hear
            found = (f"found rank {peer} had stopped waiting for it at its deadline and aborted the communicator, "
                     f"naming ranks {announced['missing']} (this one among them) as never having started it: "
                     f"this rank arrived late")
        else:
            found = f"found rank {peer} had aborted the communicator ({reason})"
        error = PeerFailure(f"{call.op} #{call.seq} on {self.name!r} failed on rank {self.rank} after {elapsed:.1f} s: "
                            f"expected every peer to complete it; {found}", failed_ranks=[peer], **self._where(call))
        if cause is not None:
            error.__cause__ = cause
        return self._die(call, entry, error, "peer.failure", "failed", deferred=deferred)

    def _peer_gone(self, call: Collective, entry: FlightEntry, cause: BaseException | None,
                   announced: dict[str, Any] | None, *, deferred: bool = False) -> CommError:
        """A `PeerFailure` naming the peers that are gone, as far as anyone can tell (module docstring)."""
        elapsed = (time.monotonic_ns() - entry.start_mono_ns) / 1e9
        if announced is not None and announced.get("failed"):
            gone = list(announced["failed"])
            how = f"as rank {announced['rank']}, which met the failure first and aborted the communicator, found"
        else:
            gone, how = self._find_gone_peers(None if announced is None else announced["rank"])
            if announced is not None:
                how += f"; rank {announced['rank']} met the failure first and aborted the communicator"
        found = f"found rank(s) {gone} gone ({how})" if gone else f"found a peer gone ({how})"
        if cause is not None:
            found += f"; the backend said: {_first_line(cause)}"
        error = PeerFailure(f"{call.op} #{call.seq} on {self.name!r} failed on rank {self.rank} after {elapsed:.1f} s: "
                            f"expected every peer alive; {found}", failed_ranks=gone or None, **self._where(call))
        if cause is not None:
            error.__cause__ = cause
        return self._die(call, entry, error, "peer.failure", "failed", deferred=deferred)

    def _find_gone_peers(self, announcer: int | None) -> tuple[list[int], str]:
        """The peers that are gone (`board.find_gone`) and how that was found; no ranks where
        nobody could tell. The board is read again for a while: a killed process closes its
        sockets before /proc shows it gone (`GONE_GRACE_S`), and another host's heartbeat
        takes up to `STALE_AFTER_S` to go stale."""
        store = self._thread_store()
        start = time.monotonic()
        while True:
            try:
                board = self.board.read(store)
            except Exception as exc:  # the store went with the dead rank's host
                return [], f"which one could not be told: the progress board could not be read ({_first_line(exc)})"
            gone, how, remote = find_gone(board, self.rank, announcer, time.time_ns())
            if gone:
                return gone, how
            if time.monotonic() - start >= (STALE_AFTER_S + HEARTBEAT_S if remote else GONE_GRACE_S):
                return [], f"which one could not be told: {how}"
            time.sleep(0.02)

    def _ensure_usable(self, what: str) -> None:
        if self._dead is not None:
            self._deliver_undelivered()
            raise CommAborted(
                f"{what} on {self.name!r} rank {self.rank}: expected a live communicator; found it {self._dead}",
                op=what, seq=self._seq, comm=self.name, rank=self.rank)

    def _where(self, call: Collective) -> dict[str, Any]:
        return {"op": call.op.value, "seq": call.seq, "comm": self.name, "rank": self.rank}

    def _timed_out(self, call: Collective, entry: FlightEntry, cause: BaseException | None,
                   expired_first_on: int | None = None, *, deferred: bool = False,
                   running_s: float | None = None) -> CommError:
        """`expired_first_on`: the peer whose deadline for this same collective expired before
        this rank's, which ends this rank's wait early (`_peer_left`). `running_s`: on a
        stream-ordered engine, how long the op has run since it started on the device (its
        deadline counts from there, not from the launch)."""
        elapsed = (time.monotonic_ns() - entry.start_mono_ns) / 1e9 if running_s is None else running_s
        try:
            board = self.board.read(self._thread_store())
            if call.peer is not None:
                message, missing, stale = _explain_p2p_timeout(call, self.name, elapsed, board)
            else:
                diagnosis = explain_timeout(call.op.value, call.seq, self.name, self.rank, elapsed,
                                            board, time.time_ns())
                message, missing, stale = diagnosis.message, diagnosis.missing_ranks, diagnosis.stale_ranks
            # Where the ranks it waited for are stuck: their stacks, for the doctor.
            asked = ask_for_stacks(board, sorted(set(missing) | set(stale)))
            if asked:
                self._log.info("comm.asked_for_stacks", op=call.op.value, seq=call.seq, ranks=asked)
        except Exception as exc:  # the store itself may be gone with a dead rank 0
            message = (f"{call.op} #{call.seq} on {self.name!r} timed out after {elapsed:.1f} s on rank "
                       f"{self.rank}; the progress board could not be read ({exc})")
            missing, stale = None, None
        if running_s is not None:
            issued_s = (time.monotonic_ns() - entry.start_mono_ns) / 1e9
            message += (f" (its deadline counts from its start on the device; it was issued {issued_s:.1f} s ago. "
                        f"Its outputs, and those of the ops queued behind it on this communicator, are undefined: "
                        f"roll the step back)")
        if expired_first_on is not None:
            message += (f" (rank {expired_first_on}'s deadline for it expired first: this rank stopped waiting "
                        f"before its own {call.deadline_s:g} s)")
        error = CollectiveTimeout(message, elapsed=elapsed, deadline=call.deadline_s, missing_ranks=missing,
                                  stale_ranks=stale, **self._where(call))
        if cause is not None:
            error.__cause__ = cause
        return self._die(call, entry, error, "collective.timeout", "timed_out", deferred=deferred)

    def _fail(self, call: Collective, entry: FlightEntry, exc: BaseException, *, deferred: bool = False) -> CommError:
        kind = self._backend.classify(exc)
        if kind is Failure.TIMEOUT:
            return self._timed_out(call, entry, exc, deferred=deferred)
        where = self._where(call)
        head = f"{call.op} #{call.seq} on {self.name!r} failed on rank {self.rank}"
        if kind is Failure.PEER:
            # A peer that aborted on purpose said why before it closed its connections: that,
            # not the broken connection, is what this rank's error has to say.
            announced = self._peer_abort()
            if announced is not None and not announced.get("after_peer_failure"):
                return self._peer_left(call, entry, announced, exc, deferred=deferred)
            return self._peer_gone(call, entry, exc, announced, deferred=deferred)
        if kind is Failure.ABORTED:
            error: CommError = CommAborted(f"{head}: expected a live communicator; the backend says it is not "
                                           f"({exc})", **where)
        else:
            error = CommError(f"{head}: {type(exc).__name__}: {exc}", **where)
        error.__cause__ = exc
        return self._die(call, entry, error, "collective.error", "failed", deferred=deferred)

    def _die(self, call: Collective, entry: FlightEntry, error: BaseException, event: str, state: str, *,
             hooks: bool = True, deferred: bool = False) -> Any:
        """Record a failure everywhere, mark the communicator dead, and hand back the error to raise.

        `deferred`: on the watchdog's thread; the error and the failure hooks wait for the
        caller (`_deliver_undelivered`). Nothing here may replace `error` or skip the abort: a
        dump that cannot be written or a failure hook that raises is logged and passed over.
        """
        FlightRecorder.end(entry, state)
        if deferred:
            self._undelivered = (call, error)  # before `_dead`, which the caller's thread reads first
        self._dead = f"broken by {type(error).__name__} in {call.op} #{call.seq}"
        self._announce_abort(self._dead, error, call)
        try:
            fields = _error_fields(error) if isinstance(error, CommError) else {}
            self._log.error(event, op=call.op.value, seq=call.seq, peer=call.peer, duration_s=entry.duration_s,
                            status=state, error=str(error), error_type=type(error).__name__, **fields)
            self._dump(event.replace(".", "_"))
        except Exception as exc:  # a full disk, a closed log file: the error still has to reach the caller
            _report_side_failure(self._log, "dump", exc)
        finally:
            self.board.close_broken(type(error).__name__)
            self._abort_engine()
        if hooks and not deferred:
            self._run_hooks_quietly("failure", call, error)
        return error

    def _dump(self, reason: str) -> None:
        # Without a log dir the dump would flood stderr; SIGUSR1 still prints one on demand.
        directory = _log.log_dir()
        if directory is not None:
            self.recorder.dump(directory, reason)

    def _digests_agree(self, call: Collective, fingerprint: dict[str, object], started: tuple[int, int]) -> bool:
        """Whether every rank's fingerprint has the digest of this rank's: an all_reduce(MAX)
        of (digest, -digest) on the engine, which every rank issues for every checked call (the
        setting is agreed at creation, `_agree_on_settings`), so it pairs with nothing else."""
        # repr, not JSON: the fingerprint is built in one order on every rank, and this is cheaper.
        digest = int.from_bytes(hashlib.blake2b(repr(fingerprint).encode(), digest_size=8).digest(), "little") >> 2
        both = self._digest_pair
        both[0], both[1] = digest, -digest  # after MAX: the largest digest, and minus the smallest
        exchange = Collective(op=OpName.ALL_REDUCE, comm=self.name, rank=self.rank, size=self.size, async_op=False,
                              deadline_s=call.deadline_s, seq=call.seq, tensor=self._digest_tensor,
                              reduce_op=ReduceOp.MAX)
        try:
            work = self._backend.launch(exchange, _timedelta(call.deadline_s))
            resumable = self._backend.resumable_wait
            outcome = (self._wait_in_slices(work.wait, call.deadline_s, started[1]) if resumable
                       else work.wait(_timedelta(call.deadline_s)))
        except Exception as exc:
            raise self._fail(call, self._check_entry(call, started), exc) from exc
        if outcome is not True:
            _abandon(work, self._backend)
            self._check_failed(call, started, outcome)
        return int(both[0]) == digest == -int(both[1])

    def _fingerprints_through_store(self, call: Collective, mine: str, started: tuple[int, int]) -> list[str]:
        """Every rank's fingerprint, in rank order, through the store.

        Each rank's fingerprint goes to one of `CONSISTENCY_SLOTS` keys of its own, in turn,
        tagged with the call's number, so an exchange costs two store round trips (set, then
        one multi_get that finds every peer's value already there) and leaves nothing to
        delete. Two slots suffice: no rank passes check n+1 before every rank has set n+1,
        so a peer's slot holds either this call's value or one of an earlier call (that
        peer has not arrived yet: read again until it has, in slices, like an op's wait).
        """
        tag = f"{call.seq}|".encode()
        keys = [f"fp/{call.seq % CONSISTENCY_SLOTS}/{r}" for r in range(self.size)]
        self._store.set(keys[self.rank], tag + mine.encode())
        # A peer's key may not exist yet: in its first calls, or at all where only a
        # mismatch of digests brings the ranks here.
        may_be_unset = self._fingerprints_via_engine or call.seq <= CONSISTENCY_SLOTS
        values: list[bytes] = []

        def every_rank_set(slice_td: timedelta) -> bool:
            nonlocal values
            until = time.monotonic() + slice_td.total_seconds()
            pause_s = 0.0005
            while True:
                if may_be_unset:
                    try:
                        self._store.wait(keys, timedelta(seconds=max(until - time.monotonic(), 1e-3)))
                    except Exception as exc:
                        if self._backend.classify(exc) is Failure.TIMEOUT:
                            return False
                        raise
                values = self._store.multi_get(keys)
                if all(v.startswith(tag) for v in values):
                    return True
                left = until - time.monotonic()
                if left <= 0:
                    return False
                time.sleep(min(pause_s, left))
                pause_s = min(pause_s * 2, ABORT_POLL_S / 2)

        try:  # in slices, like an op's wait: a peer that aborted meanwhile ends it at once
            outcome = self._wait_in_slices(every_rank_set, call.deadline_s, started[1])
        except Exception as exc:
            raise self._timed_out(call, self._check_entry(call, started), exc) from exc
        if outcome is not True:
            self._check_failed(call, started, outcome)
        return [v[len(tag):].decode() for v in values]

    def _check_entry(self, call: Collective, started: tuple[int, int]) -> FlightEntry:
        """The flight entry of a call whose consistency check failed: the check's wait is what
        failed, so the entry starts when it did (the call itself never started)."""
        entry = self.recorder.start(call)
        entry.start_ns, entry.start_mono_ns = started
        return entry

    def _check_failed(self, call: Collective, started: tuple[int, int], outcome: bool | dict[str, Any]) -> None:
        """Raise for a consistency check's wait that ended without every rank: its deadline
        expired (False), or a peer's abort announcement was read (`_wait_in_slices`)."""
        if outcome is False:
            raise self._timed_out(call, self._check_entry(call, started), None)
        raise self._peer_left(call, self._check_entry(call, started), outcome)

    def _agree(self, call: Collective) -> None:
        """Raise `CollectiveMismatch` on every rank unless every rank issues the same collective.

        On a CPU engine the ranks first compare a digest of their fingerprints with one small
        collective of the engine's own (`_digests_agree`): one all_reduce, where the store
        exchange costs two TCP round trips. Elsewhere that exchange would sync the device on
        every call (its result is read on the host), so GPU communicators compare through the
        store alone. Only when the digests differ, which every rank then sees, do the ranks
        swap whole fingerprints through the store, to say who issued what.
        """
        fingerprint = call.fingerprint()
        started = time.time_ns(), time.monotonic_ns()
        if self._fingerprints_via_engine and self._digests_agree(call, fingerprint, started):
            return
        mine = json.dumps(fingerprint, sort_keys=True)
        values = self._fingerprints_through_store(call, mine, started)
        if len(set(values)) == 1:
            return
        groups: dict[str, list[int]] = {}
        for r, v in enumerate(values):
            groups.setdefault(v, []).append(r)
        differing = sorted(r for v, rs in groups.items() if v != mine for r in rs)
        detail = "; ".join(f"ranks {rs}: {v}" for v, rs in groups.items())
        error = CollectiveMismatch(
            f"{call.op} #{call.seq} on {self.name!r} rank {self.rank}: expected every rank to issue the same "
            f"collective; found {detail}", differing_ranks=differing, **self._where(call))
        self._log.error("collective.mismatch", op=call.op.value, seq=call.seq, error=str(error),
                        differing_ranks=differing)
        run_hooks(self.hooks, "failure", call, error)
        raise error


def _explain_p2p_timeout(call: Collective, comm: str, elapsed: float,
                         board: dict[int, BoardEntry | None]) -> tuple[str, list[int], list[int]]:
    """A send/recv waits on its one peer: name it, and say whether it is still beating."""
    peer = call.peer
    assert peer is not None
    direction = "to" if call.op is OpName.SEND else "from"
    entry = board.get(peer)
    age_s = None if entry is None else (time.time_ns() - entry.heartbeat_ns) / 1e9
    stale = [peer] if age_s is None or age_s > STALE_AFTER_S else []
    where = ("never published progress" if entry is None else
             f"last reported finishing collective {entry.finished_op} #{entry.finished_seq}"
             + (f" at step {entry.step}, phase {entry.phase}" if entry.step is not None or entry.phase is not None
                else ""))
    if stale and age_s is not None:
        where += f"; no heartbeat for {age_s:.1f} s: possibly dead or stopped"
    message = (f"{call.op} #{call.seq} {direction} rank {peer} on {comm!r} timed out after {elapsed:.1f} s on rank "
               f"{call.rank}: expected rank {peer} to post the matching "
               f"{'recv' if call.op is OpName.SEND else 'send'}; it did not complete it (rank {peer} {where})")
    return message, [peer], stale


@functools.lru_cache(maxsize=64)
def _timedelta(seconds_: float) -> timedelta:
    """An op's deadline as the timedelta backends take: one per distinct deadline, not per call."""
    return timedelta(seconds=seconds_)


def _abandon(backend_work: BackendWork, backend: Backend) -> None:
    _ABANDONED[:] = [kept for kept in _ABANDONED if not kept[0].is_completed()]
    if not backend_work.is_completed():
        _ABANDONED.append((backend_work, backend))


def _first_line(exc: BaseException) -> str:
    """An engine error's first line: c10d appends its whole C++ stack to the message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"


def _error_fields(error: CommError) -> dict[str, Any]:
    return {k: v for k, v in error.fields().items() if k not in ("op", "seq", "comm", "rank")}


def _report_side_failure(log: Any, what: str, exc: BaseException) -> None:
    try:
        log.error("comm.side_failure", what=what, error=f"{type(exc).__name__}: {exc}")
    except Exception:
        pass  # the log itself is what failed
