"""A stream-ordered engine on CPU (TEST-ONLY): gloo ops run on emulated device streams, with what
c10d's NCCL engine really does around them.

CI has no GPU, yet commlib's GPU path (`commlib.device`, `commlib.deadlines`, the communicator's
stream-ordered branch, `commlib.backends.nccl`) has to be tested with real processes over a
real engine. This emulates the part of a GPU, and of ProcessGroupNCCL (torch 2.13's source, as
../shared/reviews/gpu-path-2026-12-06.md reads it), that the path relies on or must survive:

- `EmulatedStream`: a device stream, a thread that runs its tasks in order;
- `EmulatedEvent`: recorded on a stream, passed once the stream has got there (an event never
  recorded is passed, as in CUDA); `query()` never blocks. A query from a thread in the global
  capture mode while another thread captures a graph in that mode invalidates the capture
  (`EmulatedGpu.capture_broken`), and opens a context on the thread's current device;
- `EmulatedGpu`: the process's device: per thread, the current stream, device and capture mode;
  `busy(s)` runs a kernel of `s` seconds on the current stream, `synchronize()` is the host
  waiting for it, `capture()` records a graph on the calling thread;
- `EmulatedStreamEvents`: commlib's `StreamEvents` over them, counting its device calls;
- `EmulatedNccl`: ProcessGroupNCCL, over a gloo engine that moves the data:
  * built by commlib's own `nccl.build_engine` (it takes `Options`, reads c10d's settings when
    constructed, with the legacy aliases as `getCvarBool` reads them: the first name that is
    set wins; `TORCH_DISTRIBUTED_DEBUG=DETAIL` or desync debug turn on mode 3, which terminates
    the process at the first failed work; blocking wait starts no watchdog at all);
  * `eager_connect_single_device`: ncclCommInitRank, a rendezvous of every rank in the store;
    a blocking communicator waits for it without end, a nonblocking one polls and ends with an
    error once aborted; every call initialises again (c10d checks for no existing communicator);
  * a synchronous collective runs on the caller's current stream and hands back no work
    (c10d's synchronous path); an asynchronous one runs on the engine's stream after the
    caller's stream has reached the launch, and hands back a work whose
    `get_future_result()` c10d's watchdog completes (SUCCESS, TIMEOUT, COMM_ERROR);
  * c10d's watchdog (a thread, every 100 ms) watches every work, synchronous ones too: a work
    whose op met an error (a peer died) is COMM_ERROR at once, before its kernel ends (the
    kernel hangs until the engine is aborted, as NCCL's does; a peer that aborted its own
    communicator leaves it hanging with no error at all); one past the engine's own
    timeout, counted from the enqueue, is TIMEOUT; either sets the engine's error
    (`get_error()`); a work's future completes only when the watchdog sees it;
  * `abort()` holds the engine's lock while the engine's streams drain (NCCLComm::abort), ends
    the op stuck waiting for a peer, and leaves the peers' ops hanging as a kernel whose peer's
    communicator was aborted does;
  * with `NCCL_RUNTIME_CONNECT` other than "0", the first collective connects lazily inside its
    launch: a rendezvous on the launching thread (nonblocking: polled, and abortable).
- `EmulatedBackend`: commlib's `Backend` over it, as `commlib.backends.c10d.C10dBackend` is over
  ProcessGroupNCCL (it registers the gloo engine with torch, which needs a C++ engine).

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
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from commlib.backends import nccl
from commlib.backends.c10d import C10dBackend
from commlib.device import CAPTURED
from commlib.failures import Failure
from commlib.ops import Collective, OpName, Reduction
from commlib.process_group import EngineOptions

GLOBAL, THREAD_LOCAL = "global", "thread_local"  # CUDA's stream capture modes that matter here
WATCHDOG_POLL_S = 0.1  # c10d's kWatchdogThreadSleepMillis
SUCCESS, TIMEOUT, COMM_ERROR = 0, 1, 2  # c10d's WorkResult / ErrorType values


class EmulatedEvent:
    def __init__(self) -> None:
        self._reached = threading.Event()
        self._reached.set()

    def record(self, stream: EmulatedStream) -> None:
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


class EmulatedStreamEvents:
    """commlib's `StreamEvents` (commlib/device.py) on the emulated device, for one communicator,
    as `CudaStreamEvents`; it counts what it is asked to do (`calls`: the hot path's device calls)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.device = torch.device("cpu")
        self._pool: list[EmulatedEvent] = []
        self.calls = {"mark": 0}

    def mark(self) -> Any:
        if gpu().is_capturing():
            return CAPTURED
        self.calls["mark"] += 1
        event = self._pool.pop() if self._pool else EmulatedEvent()
        event.record(gpu().current)
        return event

    def release(self, event: EmulatedEvent) -> None:
        self._pool.append(event)

    def watching(self) -> contextlib.AbstractContextManager[None]:
        return gpu().on_device(self.index)

    def side_thread(self) -> None:
        gpu().set_capture_mode(THREAD_LOCAL)


def _cvar_bool(*names: str) -> bool:
    """c10d's getCvarBool: the first of `names` that is set decides."""
    for name in names:
        value = os.environ.get(name)
        if value is not None:
            return value.lower() in ("1", "true", "yes", "y")
    return False


class _Future:
    """c10d's `Work.get_future_result()`: completed by the engine's watchdog alone."""

    def __init__(self) -> None:
        self._value: int | None = None

    def done(self) -> bool:
        return self._value is not None

    def value(self) -> int:
        assert self._value is not None
        return self._value


@dataclass
class _Config:
    blocking: int = -(2**31)  # NCCL_CONFIG_UNDEF_INT: c10d then decides


class _Options:
    """ProcessGroupNCCL.Options, as `nccl.build_engine` fills it."""

    def __init__(self) -> None:
        self._timeout = timedelta(minutes=10)
        self.is_high_priority_stream = False
        self.config = _Config()


class _EmulatedWork:
    """One op on the emulated device, as c10d's watchdog sees it."""

    def __init__(self, engine: EmulatedNccl, synchronous: bool) -> None:
        self.end = EmulatedEvent()
        self.error: BaseException | None = None
        self.enqueued = time.monotonic()
        self.future = _Future()
        self.synchronous = synchronous
        self._engine = engine

    def run(self, call: Collective) -> None:
        """On its stream: the gloo op, start to end (an error makes its kernel hang until an abort)."""
        engine = self._engine
        try:
            work = engine.gloo.launch(call, timedelta(seconds=3600))
            while not work.wait(timedelta(seconds=0.05)):  # gloo's waits resume (`commlib.backends.gloo_p2p`)
                engine.raise_if_aborted()
            while engine.peer_aborted():  # the kernel hangs: its peer's half is gone
                engine.raise_if_aborted()
                time.sleep(0.05)
        except Exception as exc:
            # NCCL's kernel hangs with its peer gone; c10d hears of an error only where the peer
            # died (ncclRemoteError), not where it aborted its own communicator.
            if not engine.peer_aborted():
                self.error = exc
            while not engine.aborted.is_set():
                time.sleep(0.05)

    # What commlib asks of c10d's work: its stream-only wait and its verdict.
    def block_current_stream(self) -> None:
        gpu().current.wait_event(self.end)

    def get_future_result(self) -> _Future:
        return self.future

    def wait(self, *args: Any) -> None:
        raise AssertionError("commlib called wait() on a stream-ordered engine's work: the CPU must never block")

    def is_completed(self) -> bool:
        with self._engine.lock:  # WorkNCCL::isCompleted takes the communicator's lock
            return self.end._reached.is_set()


class EmulatedNccl:
    """ProcessGroupNCCL's behaviour (module docstring) over a gloo engine."""

    Options = _Options
    inits = 0  # ncclCommInitRank calls in this process (every engine's)

    def __init__(self, store: dist.Store, rank: int, size: int, opts: _Options) -> None:
        self.rank, self.size = rank, size
        self._store = store
        self._opts = opts
        self.gloo: C10dBackend | None = None  # what moves the data, made by the first init
        self.timeout_s = opts._timeout.total_seconds()
        self.nonblocking = opts.config.blocking == 0
        # What c10d reads while it constructs the engine.
        self.blocking_wait = _cvar_bool("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT")
        desync = _cvar_bool("TORCH_NCCL_DESYNC_DEBUG", "NCCL_DESYNC_DEBUG")
        detail = dist.get_debug_level() == dist.DebugLevel.DETAIL
        self.error_handling = 3 if desync or detail else int(os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"))
        self.lazy_connect = os.environ.get("NCCL_RUNTIME_CONNECT", "1") != "0"
        self.lock = threading.Lock()  # NCCLComm::mutex_
        self.aborted = threading.Event()
        self.stream = EmulatedStream(f"engine-{id(self)}")
        self._works: list[_EmulatedWork] = []
        self._error = SUCCESS
        self._connected = False
        self._inits = 0
        if not self.blocking_wait:  # with blocking wait c10d starts no watchdog
            threading.Thread(target=self._watchdog, name="emulated-c10d-watchdog", daemon=True).start()

    # -- ncclCommInitRank ------------------------------------------------------------------
    def eager_connect_single_device(self, device: Any) -> None:
        self._inits += 1
        EmulatedNccl.inits += 1
        self._rendezvous(f"init{self._inits}")
        if self.gloo is None:
            self.gloo = C10dBackend.create(
                "gloo", store=dist.PrefixStore("gloo/", self._store), rank=self.rank, size=self.size,
                device=torch.device("cpu"), timeout=self._opts._timeout,
            )
        self._connected = not self.lazy_connect  # NCCL_RUNTIME_CONNECT=0: every transport connected now

    def connect_lazily(self) -> None:
        """The first collective's lazy connection, where NCCL_RUNTIME_CONNECT leaves one."""
        if self.lazy_connect and not self._connected:
            self._rendezvous("runtime-connect")
            self._connected = True

    def _rendezvous(self, key: str) -> None:
        self._store.add(key, 1)
        while int(self._store.add(key, 0)) < self.size:
            if self.nonblocking:  # polled in c10d; an abort from another thread ends it
                self.raise_if_aborted()
            time.sleep(0.01)

    # -- ops -------------------------------------------------------------------------------
    def launch(self, call: Collective, synchronous: bool) -> _EmulatedWork | None:
        self.connect_lazily()  # on the launching thread, as NCCL's runtime connection is
        work = _EmulatedWork(self, synchronous)
        caller = gpu().current
        if synchronous:  # c10d's synchronous path: on the caller's stream, no work handed back
            caller.enqueue(lambda: work.run(call))
            work.end.record(caller)
        else:
            ready = EmulatedEvent()
            ready.record(caller)  # the engine stream waits for the caller's stream here
            self.stream.wait_event(ready)
            self.stream.enqueue(lambda: work.run(call))
            work.end.record(self.stream)
        with self.lock:
            self._works.append(work)
        if not synchronous and call.op is OpName.BARRIER:  # WorkNCCL::wait on a barrier: the CPU synchronizes
            work.end.synchronize()
        return None if synchronous else work

    def _watchdog(self) -> None:
        """c10d's Watchdog::runLoop: every work, its verdict, and the engine's error."""
        while True:
            time.sleep(WATCHDOG_POLL_S)
            with self.lock:
                works = list(self._works)
            for work in works:
                verdict = None
                if work.error is not None and not self.aborted.is_set():
                    verdict = COMM_ERROR  # ncclCommGetAsyncError, before the kernel ends
                elif work.end._reached.is_set():
                    verdict = SUCCESS
                elif time.monotonic() - work.enqueued >= self.timeout_s:
                    verdict = TIMEOUT
                if verdict is None:
                    continue
                if verdict != SUCCESS:
                    self._error = verdict
                    if self.error_handling == 3:  # rethrown on the watchdog thread: std::terminate
                        os._exit(134)
                work.future._value = verdict
                with self.lock:
                    self._works.remove(work)

    def get_error(self) -> int:
        return self._error

    # -- abort -----------------------------------------------------------------------------
    def peer_aborted(self) -> bool:
        return self._store.check(["aborted"])

    def raise_if_aborted(self) -> None:
        if self.aborted.is_set():
            raise RuntimeError("emulated NCCL communicator was aborted")

    def abort(self) -> None:
        """NCCLComm::abort: the lock held while the engine's streams drain."""
        with self.lock:
            self.aborted.set()
            self._store.set("aborted", str(self.rank))
            if self.gloo is not None:
                self.gloo.abort()
            while not all(s.drained for s in (gpu().default, self.stream)):
                time.sleep(0.005)


class EmulatedBackend:
    """A stream-ordered commlib backend over `EmulatedNccl`, as C10dBackend is over ProcessGroupNCCL."""

    resumable_wait = False

    def __init__(self, nccl_engine: EmulatedNccl, store: dist.Store, index: int, timeout: timedelta) -> None:
        self.nccl = nccl_engine
        self.engine = nccl_engine.gloo.engine  # what a commlib process group registers for its device
        self._store = store
        self._timeout = timeout
        self.index = index
        self.events = EmulatedStreamEvents(index)
        self.name = "emulated-nccl"
        self.rank, self.size, self.device = nccl_engine.rank, nccl_engine.size, torch.device("cpu")
        self.launched: list[str] = []  # the ops the engine was asked to run
        self._splits = 0

    @classmethod
    def create(cls, *, store: dist.Store, rank: int, size: int, device: torch.device, timeout: timedelta,
               index: int = 0) -> EmulatedBackend:
        engine = nccl.build_engine(store, rank, size, device, timeout, engine_class=EmulatedNccl)
        return cls(engine, store, index, timeout)

    def launch(self, call: Collective, timeout: timedelta) -> Any:
        self.launched.append(call.op.value)
        work = self.nccl.launch(call, synchronous=not call.async_op)
        return _Handed(work)

    def engine_error(self) -> BaseException | None:
        return nccl.engine_error(self.nccl)

    def split(self, ranks: list[int], name: str, timeout: timedelta) -> EmulatedBackend | None:
        self._splits += 1
        if self.rank not in ranks:
            return None
        store = dist.PrefixStore(f"split{self._splits}.{name}/", self._store)
        return EmulatedBackend.create(store=store, rank=ranks.index(self.rank), size=len(ranks), device=self.device,
                                      timeout=timeout, index=self.index)

    def supports(self, device: torch.device, op: Reduction | None) -> str | None:
        return self.nccl.gloo.supports(device, op)

    def classify(self, exc: BaseException) -> Failure:
        return self.nccl.gloo.classify(exc)

    def abort(self) -> None:
        self.nccl.abort()

    def finalize(self) -> None:
        self.nccl.gloo.finalize()


class _Handed:
    """What C10dBackend hands back for an emulated work (its `C10dWork`)."""

    def __init__(self, work: _EmulatedWork | None) -> None:
        self.work = work
        self.end = None if work is None else nccl.VerdictEnd(work)

    def order(self) -> None:
        if self.work is not None:
            self.work.block_current_stream()

    def wait(self, timeout: timedelta) -> bool:
        raise AssertionError("commlib called wait() on a stream-ordered engine's work: the CPU must never block")

    def is_completed(self) -> bool:
        raise AssertionError("commlib asked is_completed() of a stream-ordered engine's work: it takes its lock")


def options(index: int = 0, **kwargs: Any) -> EngineOptions:
    """EngineOptions for commlib process groups over the emulated engine."""

    def factory(**engine: Any) -> EmulatedBackend:
        return EmulatedBackend.create(**engine, index=index)

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
