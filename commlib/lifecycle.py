"""A communicator's life after its creation: split into new communicators, and its end (broken
by a failure on its path, aborted by its caller, or finalized after a clean run), after
which every call is refused.

`Lifecycle` (one per `Communicator`) is the one place a communicator becomes unusable. A
failure (an engine error, an expired deadline, a peer's abort announcement read during a
wait) is worded by the communicator's `commlib.verdicts.Judge` and recorded here, once and
everywhere: the flight recorder, the structured log, a flight dump, the progress board, the
announcement to the peers; then the engine is aborted once and the failure hooks run. The
caller's `abort()` and `finalize()` end it on purpose; after any of the three, a call raises
`CommAborted` at once instead of blocking.

Why the communicator keeps the reason it is dead (`Communicator._dead`) rather than this
owner: its one path tests it on every call, and one attribute read there is cheaper than two.

A side failure during a failure (a dump that cannot be written, a failure hook that raises)
is logged and passed over: nothing here may replace the error being raised or skip the abort.
On a stream-ordered engine (`commlib.device_ops`) a failure the watchdog finds is recorded on
its thread (`deferred`), and the error and the failure hooks wait for the caller.

A split checks its arguments and splits the engine here; the communicator builds the new
`Communicator` over what `split` hands back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch.distributed as dist

from commlib.backends.base import Backend
from commlib.errors import CollectiveTimeout, CommAborted, CommError, PeerFailure
from commlib.hooks import HookRegistry, run_hooks
from commlib.members import Members
from commlib.ops import Collective
from commlib.record import log as _log
from commlib.record.board import ProgressBoard
from commlib.record.flight import FlightEntry, FlightRecorder
from commlib.validation import Deadline, seconds
from commlib.verdicts import Judge, report_side_failure

_E = TypeVar("_E", bound=BaseException)  # `die` hands back the error it was given

_PROCESS_HOOKS = HookRegistry.process()

# The longest a failure's or an abort's log line may hold back the news to the peers
# (`Lifecycle._line_then_news`): a log on a filesystem that stops answering must not keep
# them waiting out their own deadlines, nor keep this rank's engine from being aborted.
LINE_BEFORE_NEWS_S = 5.0

# The log event and flight-recorder state of each kind of failure (`Lifecycle.die`).
_EVENTS: dict[type, tuple[str, str]] = {
    CollectiveTimeout: ("collective.timeout", "timed_out"),
    PeerFailure: ("peer.failure", "failed"),
}


class EndsDeviceOps(Protocol):
    """What `Lifecycle` needs of a stream-ordered communicator's device side
    (`commlib.device_ops.DeviceOps` is one): the failure the watchdog found and the caller has
    not been given yet, and the device side's own ways to drain, deliver and abort. A protocol,
    not an import: device_ops reaches this module through its communicator, so the two never
    import each other."""

    undelivered: tuple[Collective, BaseException] | None

    def drain(self) -> None: ...

    def deliver_undelivered(self) -> None: ...

    def abort_engine(self) -> None: ...

    def drop_in_flight(self) -> None: ...

    def await_engine_abort(self) -> None: ...


class LifecycleComm(Protocol):
    """What `Lifecycle` needs of the communicator it splits and ends (`Communicator` is one): who it
    is, what records it, its engine, store and judge, and the reason it is dead, which only its
    lifecycle writes."""

    name: str
    rank: int
    size: int
    timeout: float
    world_rank: int
    members: Members
    hooks: HookRegistry
    recorder: FlightRecorder
    board: ProgressBoard
    _backend: Backend
    _store: dist.Store
    _judge: Judge
    _log: Any
    _seq: int
    _dead: str | None
    _device: EndsDeviceOps | None


class Lifecycle:
    """One communicator's splits and end (module docstring)."""

    def __init__(self, comm: LifecycleComm) -> None:
        self._comm = comm
        self._splits = 0  # numbers each split's store prefix: a name may be split into again
        self._abort_lock = threading.Lock()
        self._engine_aborting = False  # the engine's abort has been started (`abort_engine`)

    def split(
        self, ranks: Sequence[int], name: str, timeout: Deadline | None
    ) -> tuple[Backend, dist.Store, list[int]] | None:
        """`Communicator.split`'s checks and engine split: the new communicator's engine, store and
        ranks (`ranks` as a list) on a member; None elsewhere."""
        comm = self._comm
        self.ensure_usable("split")
        if not isinstance(name, str) or not name:
            raise ValueError(f"split on {comm.name!r} rank {comm.rank}: expected a non-empty name; found {name!r}")
        ranks = list(ranks)
        bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < comm.size]
        if bad or len(set(ranks)) != len(ranks):
            raise ValueError(
                f"split on {comm.name!r} rank {comm.rank}: expected distinct ranks in [0, {comm.size}); found {ranks}"
            )
        deadline = seconds(timeout) or comm.timeout
        self._splits += 1
        store = dist.PrefixStore(f"{name}.{self._splits}/", comm._store)
        try:
            backend = comm._backend.split(ranks, name, timedelta(seconds=deadline)) if ranks else None
        except Exception as exc:
            comm._log.error("comm.split_failed", new_comm=name, ranks=ranks, error=f"{type(exc).__name__}: {exc}")
            raise CommError(
                f"split of {comm.name!r} into {name!r} failed on rank {comm.rank}: {type(exc).__name__}: {exc}",
                op="split",
                comm=comm.name,
                rank=comm.rank,
            ) from exc
        comm._log.info("comm.split", new_comm=name, ranks=ranks, member=backend is not None)
        if backend is None:
            return None
        return backend, store, ranks

    # -- failures: recorded here, worded by the judge (`commlib.verdicts`) -----------------
    def fail(self, call: Collective, entry: FlightEntry, exc: BaseException, *, deferred: bool = False) -> CommError:
        """Break the communicator for an op whose engine raised `exc`; the error to raise."""
        return self.die(call, entry, self._comm._judge.engine_failure(call, entry, exc), deferred=deferred)

    def timed_out(
        self,
        call: Collective,
        entry: FlightEntry,
        cause: BaseException | None,
        *,
        deferred: bool = False,
        running_s: float | None = None,
    ) -> CommError:
        """Break the communicator for an op whose deadline expired; the error to raise."""
        judge = self._comm._judge
        return self.die(call, entry, judge.timeout(call, entry, cause, running_s=running_s), deferred=deferred)

    def peer_left(
        self, call: Collective, entry: FlightEntry, announced: dict[str, Any], *, deferred: bool = False
    ) -> CommError:
        """Break the communicator for an op ended by a peer's abort announcement; the error to raise."""
        return self.die(call, entry, self._comm._judge.peer_left(call, entry, announced), deferred=deferred)

    def die(self, call: Collective, entry: FlightEntry, error: _E, *, hooks: bool = True, deferred: bool = False) -> _E:
        """Record a failure everywhere, mark the communicator dead, and hand back the error to raise.

        `deferred`: on the watchdog's thread; the error and the failure hooks wait for the
        caller (`DeviceOps.deliver_undelivered`). Nothing here may replace `error` or skip the
        abort: a dump that cannot be written or a failure hook that raises is logged and passed over.
        """
        comm = self._comm
        event, state = _EVENTS.get(type(error), ("collective.error", "failed"))
        FlightRecorder.end(entry, state)
        if deferred:
            assert comm._device is not None
            comm._device.undelivered = (call, error)  # before `_dead`, which the caller's thread reads first
        dead = comm._dead = f"broken by {type(error).__name__} in {call.op} #{call.seq}"

        def line() -> None:
            fields = _error_fields(error) if isinstance(error, CommError) else {}
            comm._log.error(
                event,
                op=call.op.value,
                seq=call.seq,
                peer=call.peer,
                duration_s=entry.duration_s,
                status=state,
                error=str(error),
                error_type=type(error).__name__,
                **fields,
            )

        self._line_then_news(line, lambda: comm._judge.announce(dead, error, call))
        try:
            self.dump(event.replace(".", "_"))
        except Exception as exc:  # the error still has to reach the caller
            report_side_failure(comm._log, "dump", exc)
        finally:
            comm.board.close_broken(type(error).__name__)
            self.abort_engine()
        if hooks and not deferred:
            self.run_hooks_quietly("failure", call, error)
        return error

    # -- ended on purpose ------------------------------------------------------------------
    def abort(self, reason: str) -> None:
        """`Communicator.abort`: tear down at once, the peers told (`Judge.announce`)."""
        comm = self._comm
        first = comm._dead is None
        if first:
            comm._dead = reason
        device = comm._device
        if device is not None:  # the caller chose to abort: an error the watchdog found meanwhile is moot
            device.undelivered = None
        dead = comm._dead  # the line and the news as `die` gives them: the line first, the news once

        def news() -> None:
            comm._judge.announce(reason)

        self._line_then_news(lambda: comm._log.warning("comm.abort", reason=dead), news if first else None)
        self.dump("abort")
        comm.board.close()
        # The engine first: an op of a dropped engine work may only end once it is aborted.
        self.abort_engine()
        if device is not None:
            device.drop_in_flight()
            device.await_engine_abort()
        comm.recorder.aborted()  # in-job recovery may rebuild: the process keeps its signal handlers and log

    def finalize(self) -> None:
        """`Communicator.finalize`: release after a clean run, a stream-ordered engine's ops drained first."""
        comm = self._comm
        if comm._dead is None and comm._device is not None:
            comm._device.drain()
        if comm._dead is None:
            comm._dead = "finalized"
            comm.board.close()
            comm._backend.finalize()
            comm._log.info("comm.finalize", seq=comm._seq)
        comm.recorder.close()  # the process's last one leaves it as it was (commlib.observe.flight)

    # -- the pieces ------------------------------------------------------------------------
    def _line_then_news(self, line: Callable[[], None], news: Callable[[], None] | None) -> None:
        """Write the log line of a failure or an abort, then tell the peers (`news`).

        The line goes first: a peer can only react to the news (its own op ending in a
        `peer.failure`) after this line's clock, so the doctor, folding the ranks' lines in
        clock order, sees every rank where it was when this one gave up, not already moved on
        by the abort it caused. But a line that does not come within `LINE_BEFORE_NEWS_S` (a
        log on a filesystem that stopped answering) does not hold the news back any longer:
        it is written by its own thread whenever the filesystem lets it. A line that cannot
        be written (a full disk, a closed file) is reported as a side failure.
        """
        written = threading.Event()

        def write() -> None:
            try:
                line()
            except Exception as exc:
                report_side_failure(self._comm._log, "log", exc)
            finally:
                written.set()

        try:
            threading.Thread(target=write, name="commlib-failure-line", daemon=True).start()
        except RuntimeError:  # no new thread while the interpreter shuts down: written here
            write()
        written.wait(LINE_BEFORE_NEWS_S)
        if news is not None:
            news()

    def dump(self, reason: str) -> None:
        # Without a log dir the dump would flood stderr; SIGUSR1 still prints one on demand.
        directory = _log.log_dir()
        if directory is not None:
            self._comm.recorder.dump(directory, reason)

    def abort_engine(self) -> None:
        """Abort the engine once: at once on a CPU engine, in a thread of its own on a
        stream-ordered one, whose abort can hang on a wedged device (`DeviceOps.abort_engine`)."""
        with self._abort_lock:
            if self._engine_aborting:
                return
            self._engine_aborting = True
        device = self._comm._device
        if device is None:
            self._comm._backend.abort()
        else:
            device.abort_engine()

    def ensure_usable(self, what: str) -> None:
        comm = self._comm
        if comm._dead is not None:
            if comm._device is not None:
                comm._device.deliver_undelivered()
            raise CommAborted(
                f"{what} on {comm.name!r} {comm.members.name(comm.rank)}: expected a live communicator; found it "
                f"{comm._dead}",
                op=what,
                seq=comm._seq,
                comm=comm.name,
                rank=comm.world_rank,
            )

    def run_hooks_quietly(self, kind: str, *args: Any) -> None:
        """Hooks where one that raises must not replace the error being raised, nor stop the
        watchdog's thread: its failure is logged and passed over."""
        try:
            run_hooks(self._comm.hooks, kind, *args)
        except Exception as exc:
            report_side_failure(self._comm._log, f"{kind} hook", exc)

    def run_post_hooks_quietly(self, call: Collective, entry: FlightEntry) -> None:
        if _PROCESS_HOOKS.post or self._comm.hooks.post:
            self.run_hooks_quietly("post", call, entry.duration_s)


def _error_fields(error: CommError) -> dict[str, Any]:
    return {k: v for k, v in error.fields().items() if k not in ("op", "seq", "comm", "rank")}
