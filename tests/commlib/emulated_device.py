"""A stream-ordered engine on CPU (TEST-ONLY): gloo ops run on emulated device streams, with what
c10d's NCCL engine really does around them.

CI has no GPU, yet commlib's GPU path (`commlib.device`, `commlib.device_ops`, `commlib.watchdog`)
has to be tested with real processes over a real engine. This emulates the part of a GPU, and
of ProcessGroupNCCL (torch 2.13's source), that the path relies on or must survive:

- `EmulatedStream`: a device stream, a thread that runs its tasks in order;
- `EmulatedEvent`: recorded on a stream, reached once the stream has got there (an event never
  recorded is reached, as in CUDA); `query()` never blocks. A query opens a context on the
  querying thread's current device (as a CUDA runtime call does: `EmulatedGpu.contexts`), and
  a query from a thread in the global capture mode while another thread captures a graph in
  that mode invalidates the capture (`EmulatedGpu.capture_broken`);
- `EmulatedGpu`: the process's device: per thread, the current stream (a shared default
  stream at first) and current device (0 at first) and capture mode; `busy(s)` runs a kernel
  of `s` seconds on the current stream, `synchronize()` is the host waiting for it,
  `capture()` records a graph on the calling thread;
- `EmulatedRuntime`: commlib's `Runtime` over them, one per communicator, as `CudaRuntime`;
- `EmulatedBackend`: commlib's `Backend` over a gloo `C10dBackend`, behaving as c10d's NCCL
  engine does:
  * a synchronous collective runs on the caller's current stream and hands back no end
    (c10d's synchronous path); an asynchronous one, and every send/recv, runs on an engine
    stream of its lane after the caller's stream has reached the launch, and its end is the
    engine's verdict (`EmulatedWork.end`); `order()` makes the current stream wait for it;
  * lanes: one for collectives, one per peer for send/recv, or a single one where the engine
    was initialised eagerly (`eager=True`: ProcessGroupNCCL::pointToPoint then uses the
    collective stream);
  * a barrier launched on it is c10d's: its work's `order()` blocks the CPU until the barrier
    has run, with no deadline (WorkNCCL::wait on a barrier work);
  * `is_completed()` takes the engine's lock, which `abort()` holds until the engine's streams
    have drained (NCCLComm::abort holds its mutex for the whole of ncclCommAbort); an abort
    ends an op stuck waiting for a peer with an error (gloo's abort cannot, so the emulation
    ends it), and leaves the peers' ops hanging, as a kernel whose peer's communicator was
    aborted does (gloo would complete them with the aborted rank's posted half: the abort is
    announced in the engine's store, and no op of a peer completes after it);
  * every op gets the engine's current timeout (the gloo engine's `options._timeout`, which
    `ProcessGroup.set_timeout` and `_set_default_timeout` overwrite), counted from the enqueue,
    whatever timeout the launch was given (c10d's `assignTimeoutToWork`);
  * its works refuse `wait()`: commlib must never block on a stream-ordered engine's op.

`options()` gives the `EngineOptions` that build commlib process groups over it, `init()` the
default group over it in a rank of `commlib.testing.run(..., backend=None)`, and `raised(fn)`
what a rank's call raised, as plain data.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from commlib.backends.c10d import C10dBackend
from commlib.device import CAPTURED, engine_timeout_s
from commlib.failures import Failure
from commlib.ops import Collective, OpName, Reduction
from commlib.process_group import EngineOptions

GLOBAL, THREAD_LOCAL = "global", "thread_local"  # CUDA's stream capture modes that matter here


class EmulatedEvent:
    def __init__(self, device_index: int = 0) -> None:
        self.device_index = device_index
        self._reached = threading.Event()
        self._reached.set()

    def record(self, stream: "EmulatedStream") -> None:
        reached = self._reached = threading.Event()
        stream.enqueue(reached.set)

    def query(self) -> bool:
        gpu().queried()
        return self._reached.is_set()

    def synchronize(self) -> None:
        self._reached.wait()


class EmulatedStream:
    def __init__(self, name: str) -> None:
        self._tasks: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._pending = 0  # tasks enqueued and not yet run
        self._count = threading.Lock()
        threading.Thread(target=self._run, name=f"emulated-stream-{name}", daemon=True).start()

    @property
    def drained(self) -> bool:
        return self._pending == 0

    def enqueue(self, task: Callable[[], None]) -> None:
        with self._count:
            self._pending += 1
        self._tasks.put(task)

    def wait_event(self, event: EmulatedEvent) -> None:
        reached = event._reached  # the point recorded now, as cudaStreamWaitEvent takes it
        self.enqueue(reached.wait)

    def _run(self) -> None:
        while True:
            self._tasks.get()()
            with self._count:
                self._pending -= 1


class EmulatedGpu:
    """The process's emulated device (module docstring)."""

    def __init__(self) -> None:
        self.default = EmulatedStream("default")
        self._thread = threading.local()  # current stream, current device, capture mode
        self.contexts: set[int] = set()  # devices a context was opened on
        self._capturing: tuple[int, str] | None = None  # (thread, mode) of the capture in progress
        self.capture_broken = False

    @property
    def current(self) -> EmulatedStream:
        return getattr(self._thread, "stream", self.default)

    @current.setter
    def current(self, stream: EmulatedStream) -> None:
        self._thread.stream = stream

    @property
    def current_device(self) -> int:
        return getattr(self._thread, "device", 0)

    @contextlib.contextmanager
    def on_device(self, index: int) -> Iterator[None]:
        before, self._thread.device = self.current_device, index
        try:
            yield
        finally:
            self._thread.device = before

    def set_capture_mode(self, mode: str) -> None:
        self._thread.capture_mode = mode

    def is_capturing(self) -> bool:
        return self._capturing is not None and self._capturing[0] == threading.get_ident()

    @contextlib.contextmanager
    def capture(self, mode: str = GLOBAL) -> Iterator[None]:
        """Capture a graph on the calling thread (`torch.cuda.graph`, capture_error_mode=`mode`)."""
        self._capturing, self.capture_broken = (threading.get_ident(), mode), False
        try:
            yield
        finally:
            self._capturing = None

    def queried(self) -> None:
        """An event query from the calling thread: what a CUDA runtime call does besides."""
        self.contexts.add(self.current_device)
        capturing = self._capturing
        mine = getattr(self._thread, "capture_mode", GLOBAL)
        if capturing is not None and capturing[1] == GLOBAL and mine == GLOBAL:
            self.capture_broken = True  # cudaErrorStreamCaptureInvalidated for the capturing thread

    def busy(self, seconds: float) -> None:
        """A kernel of `seconds` on the current stream (torch.cuda._sleep)."""
        self.current.enqueue(lambda: time.sleep(seconds))

    def synchronize(self) -> None:
        """The host waits for everything enqueued on the current stream (torch.cuda.synchronize)."""
        event = EmulatedEvent()
        event.record(self.current)
        event.synchronize()


_GPU: list[EmulatedGpu] = []  # this process's, made at first use


def gpu() -> EmulatedGpu:
    if not _GPU:
        _GPU.append(EmulatedGpu())
    return _GPU[0]


device = gpu  # the tests' name for it


class EmulatedRuntime:
    """commlib's `Runtime` (commlib/device.py) on the emulated device, for one communicator, as
    `CudaRuntime`; it counts what it is asked to do (`calls`: the hot path's device calls)."""

    def __init__(self, on: EmulatedGpu, index: int) -> None:
        self.on = on
        self.index = index
        self.device = torch.device("cpu")
        self._pool: list[EmulatedEvent] = []
        self.created = 0  # events made, not taken from the pool
        self.calls = {"mark": 0}

    def mark(self) -> Any:
        if self.on.is_capturing():
            return CAPTURED
        self.calls["mark"] += 1
        if self._pool:
            event = self._pool.pop()
        else:
            self.created += 1
            event = EmulatedEvent(self.index)
        event.record(self.on.current)
        return event

    def release(self, event: EmulatedEvent) -> None:
        self._pool.append(event)

    def watching(self) -> contextlib.AbstractContextManager[None]:
        return self.on.on_device(self.index)

    def side_thread(self) -> None:
        self.on.set_capture_mode(THREAD_LOCAL)

    def capturing(self) -> bool:
        return self.on.is_capturing()


class _OpOnDevice:
    """What a stream does with one op, and when it ended; not the work, which the caller may
    drop while the op runs."""

    def __init__(self, enqueued: float, timeout_s: float, verdict: bool) -> None:
        self.end = EmulatedEvent()
        self.error: BaseException | None = None
        self._until = enqueued + timeout_s  # the engine's own timeout, counted from the enqueue
        # Whether the engine hands back a verdict on it (an asynchronous op's work): without one
        # (c10d's synchronous path), a failed kernel just hangs, as NCCL's does when a peer is gone.
        self._verdict = verdict

    def run(self, backend: "EmulatedBackend", call: Collective) -> None:
        """On its stream: the gloo op, start to end (an error, the engine's timeout or an abort end it)."""
        try:
            work = backend.inner.launch(call, timedelta(seconds=3600))
            while not work.wait(timedelta(seconds=0.05)):  # gloo's waits resume (`commlib.backends.gloo_p2p`)
                self._check(backend)
            while backend.peer_aborted():  # the kernel hangs: its peer's half is gone
                self._check(backend)
                time.sleep(0.05)
        except Exception as exc:
            self.error = exc
            while not self._verdict:
                try:
                    self._check(backend)
                except RuntimeError:
                    return
                time.sleep(0.05)

    def _check(self, backend: "EmulatedBackend") -> None:
        if backend.aborted.is_set():
            raise RuntimeError("emulated NCCL communicator was aborted")
        if time.monotonic() >= self._until:
            raise RuntimeError("emulated device: the engine's own timeout passed, counted from the enqueue")


class EmulatedWork:
    def __init__(self, backend: "EmulatedBackend", op: _OpOnDevice | None, barrier: bool) -> None:
        self._backend = backend
        self._op = op
        self._barrier = barrier
        # The engine's verdict on an op of an engine stream; none for one on the caller's stream.
        self.end = op.end if op is not None else None

    def wait(self, timeout: timedelta) -> bool:
        raise AssertionError("commlib called wait() on a stream-ordered engine's work: the CPU must never block")

    def __del__(self) -> None:
        # As torchcomms' works do: dropping one whose op still runs blocks until the op ends.
        if self.end is not None:
            self.end.synchronize()

    def is_completed(self) -> bool:
        with self._backend.lock:  # WorkNCCL::isCompleted takes the communicator's lock
            return self.end is None or self.end._reached.is_set()

    def order(self) -> None:
        if self.end is None:
            return
        gpu().current.wait_event(self.end)
        if self._barrier:  # WorkNCCL::wait on a barrier work: the CPU synchronizes, no deadline
            self.end.synchronize()

    def failure(self) -> BaseException | None:
        return None if self._op is None else self._op.error


class EmulatedBackend:
    """A stream-ordered commlib backend over gloo, as c10d's NCCL engine behaves (module docstring)."""

    resumable_wait = False

    def __init__(self, inner: C10dBackend, store: dist.Store, index: int = 0, eager: bool = False) -> None:
        self.inner = inner
        self._store = store  # where an abort is announced to the peers' engines (module docstring)
        self.engine = inner.engine  # what a commlib process group registers for its device
        self.index, self.eager = index, eager
        self.runtime = EmulatedRuntime(gpu(), index)
        self.name = f"emulated-{inner.name}"
        self.rank, self.size, self.device = inner.rank, inner.size, inner.device
        self.streams: dict[int | None, EmulatedStream] = {}  # per lane
        self.launched: list[str] = []  # the ops the engine was asked to run
        self.lock = threading.Lock()  # the communicator's lock (NCCLComm::mutex_)
        self.aborted = threading.Event()

    @classmethod
    def create(cls, *, store: dist.Store, rank: int, size: int, device: torch.device, timeout: timedelta,
               index: int = 0, eager: bool = False) -> "EmulatedBackend":
        # The engine's own timeout, as commlib gives a stream-ordered engine (`nccl.build_engine`).
        engine_timeout = timedelta(seconds=engine_timeout_s(timeout.total_seconds()))
        inner = C10dBackend.create("gloo", store=store, rank=rank, size=size, device=device, timeout=engine_timeout)
        return cls(inner, dist.PrefixStore("emulated/", store), index, eager)

    def peer_aborted(self) -> bool:
        return self._store.check(["aborted"])

    def lane(self, call: Collective) -> int | None:
        return None if self.eager else call.peer

    def launch(self, call: Collective, timeout: timedelta) -> EmulatedWork:
        self.launched.append(call.op.value)
        synchronous = not call.async_op and call.peer is None
        op = _OpOnDevice(time.monotonic(), self.engine.options._timeout.total_seconds(), not synchronous)
        caller = gpu().current
        if synchronous:  # c10d's synchronous path: on the caller's stream
            caller.enqueue(lambda: op.run(self, call))
            op.end.record(caller)
            if call.op is OpName.BARRIER:  # ProcessGroupNCCL::barrier: the CPU synchronizes, no deadline
                op.end.synchronize()
            return EmulatedWork(self, None, False)
        ready = EmulatedEvent()
        ready.record(caller)  # the engine stream waits for the caller's stream here
        lane = self.lane(call)
        stream = self.streams.get(lane)
        if stream is None:
            stream = self.streams[lane] = EmulatedStream(f"engine-{id(self)}-{lane}")
        stream.wait_event(ready)
        stream.enqueue(lambda: op.run(self, call))
        op.end.record(stream)
        return EmulatedWork(self, op, call.op is OpName.BARRIER)

    def split(self, ranks: list[int], name: str, timeout: timedelta) -> "EmulatedBackend | None":
        inner = self.inner.split(ranks, name, timeout)
        store = dist.PrefixStore(f"split-{name}/", self._store)
        return None if inner is None else EmulatedBackend(inner, store, self.index, self.eager)

    def supports(self, device: torch.device, op: Reduction | None) -> str | None:
        return self.inner.supports(device, op)

    def classify(self, exc: BaseException) -> Failure:
        return self.inner.classify(exc)

    def abort(self) -> None:
        """NCCLComm::abort: the lock held while the engine's streams drain."""
        with self.lock:
            self.aborted.set()
            self._store.set("aborted", str(self.rank))
            self.inner.abort()
            while not all(s.drained for s in [gpu().default, *self.streams.values()]):
                time.sleep(0.005)

    def finalize(self) -> None:
        self.inner.finalize()


def options(index: int = 0, eager: bool = False, **kwargs: Any) -> EngineOptions:
    """EngineOptions for commlib process groups over the emulated engine."""

    def factory(**engine: Any) -> EmulatedBackend:
        return EmulatedBackend.create(**engine, index=index, eager=eager)

    return EngineOptions(backend_factory=factory, **kwargs)


def init(timeout_s: float = 30.0, **kwargs: Any) -> Any:
    """torch.distributed's default group over the emulated engine (`options(**kwargs)`), in a rank
    of `commlib.testing.run`; its world communicator."""
    import commlib
    from commlib._torch_backend import register

    register()
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, is_master=False)
    dist.init_process_group("commlib", store=store, rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s),
                            pg_options=options(**kwargs))
    return commlib.current()


def raised(fn: Callable[[], object]) -> dict[str, object] | None:
    """What `fn()` raised (a commlib error's type, message and fields), or None."""
    import commlib

    try:
        fn()
    except commlib.CommError as exc:
        return {"type": type(exc).__name__, "message": str(exc), **exc.fields()}
    return None
