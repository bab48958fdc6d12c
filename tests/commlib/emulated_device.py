"""A stream-ordered engine on CPU (TEST-ONLY): gloo ops run on emulated device streams.

CI has no GPU, yet commlib's GPU path (`commlib.device`, `commlib.watchdog`) has to be tested
with real processes over a real engine. This emulates the part of a GPU that path relies on:

- `EmulatedStream`: a device stream, a thread that runs its tasks in order;
- `EmulatedEvent`: recorded on a stream, complete once the stream has reached it (an event
  never recorded is complete, as in CUDA); `query()` never blocks;
- `EmulatedDevice`: one per process (`device()`), whose current stream is the "default
  stream"; `busy(s)` runs a kernel of `s` seconds on it, `synchronize()` is the host
  waiting for it;
- `EmulatedRuntime`: commlib's `Runtime` over them, one per communicator, as `CudaRuntime`;
- `EmulatedBackend`: commlib's `Backend` over a gloo `C10dBackend`. A launch enqueues the
  op on the communicator's own engine stream for its lane (as NCCL has one per group for
  collectives, and one per pair of ranks for send/recv): the engine stream
  waits for the caller's stream to reach the launch, then runs the gloo op to its end, so
  the op starts on the "device" only once the work queued before it has run. `order()`
  makes the current stream wait for the op; an abort aborts gloo, which ends an op stuck
  waiting for a peer with an error (as ncclCommAbort makes a stuck kernel exit). Its works
  refuse `wait()`: commlib must never block on a stream-ordered engine's op. Dropping a
  work whose op still runs blocks until the op ends, as torchcomms' do.

`options()` gives the `EngineOptions` that build commlib process groups over it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from commlib.backends.c10d import C10dBackend
from commlib.failures import Failure
from commlib.ops import Collective, Reduction
from commlib.process_group import EngineOptions


class EmulatedEvent:
    def __init__(self) -> None:
        self._reached = threading.Event()
        self._reached.set()

    def record(self, stream: "EmulatedStream") -> None:
        reached = self._reached = threading.Event()
        stream.enqueue(reached.set)

    def query(self) -> bool:
        return self._reached.is_set()

    def synchronize(self) -> None:
        self._reached.wait()


class EmulatedStream:
    def __init__(self, name: str) -> None:
        self._tasks: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name=f"emulated-stream-{name}", daemon=True).start()

    def enqueue(self, task: Callable[[], None]) -> None:
        self._tasks.put(task)

    def wait_event(self, event: EmulatedEvent) -> None:
        reached = event._reached  # the point recorded now, as cudaStreamWaitEvent takes it
        self.enqueue(reached.wait)

    def _run(self) -> None:
        while True:
            self._tasks.get()()


class EmulatedDevice:
    """The process's emulated device: its current ("default") stream, and what tests do on it."""

    def __init__(self) -> None:
        self.current = EmulatedStream("default")

    def busy(self, seconds: float) -> None:
        """A kernel of `seconds` on the current stream (torch.cuda._sleep)."""
        self.current.enqueue(lambda: time.sleep(seconds))

    def synchronize(self) -> None:
        """The host waits for everything enqueued on the current stream (torch.cuda.synchronize)."""
        event = EmulatedEvent()
        event.record(self.current)
        event.synchronize()


_DEVICE: list[EmulatedDevice] = []  # this process's, made at first use


def device() -> EmulatedDevice:
    if not _DEVICE:
        _DEVICE.append(EmulatedDevice())
    return _DEVICE[0]


class EmulatedRuntime:
    """commlib's `Runtime` (commlib/device.py) on the emulated device, for one communicator
    (as `CudaRuntime` is): its watch streams, one per lane, and its pool of events."""

    def __init__(self, on: EmulatedDevice) -> None:
        self.on = on
        self.device = torch.device("cpu")
        self._watch: dict[int | None, EmulatedStream] = {}
        self._pool: list[EmulatedEvent] = []

    def _event(self) -> EmulatedEvent:
        return self._pool.pop() if self._pool else EmulatedEvent()

    def mark(self) -> EmulatedEvent:
        event = self._event()
        event.record(self.on.current)
        return event

    def mark_after(self, order: Callable[[], None], lane: int | None) -> EmulatedEvent:
        watch = self._watch.get(lane)
        if watch is None:
            watch = self._watch[lane] = EmulatedStream(f"watch-{lane}")
        caller, self.on.current = self.on.current, watch
        try:
            order()
        finally:
            self.on.current = caller
        event = self._event()
        event.record(watch)
        return event

    def wait(self, event: EmulatedEvent) -> None:
        self.on.current.wait_event(event)

    def release(self, event: EmulatedEvent) -> None:
        self._pool.append(event)


class _OpOnDevice:
    """What the engine stream does with one op, and when it ended; not the work, which the
    caller may drop while the op runs."""

    def __init__(self) -> None:
        self.end = EmulatedEvent()
        self.error: BaseException | None = None

    def run(self, inner: C10dBackend, call: Collective, timeout: timedelta) -> None:
        """On the engine stream: the gloo op, start to end (an error ends it too)."""
        try:
            if not inner.launch(call, timeout).wait(timeout):
                self.error = RuntimeError(f"emulated device: the engine's own timeout passed ({timeout})")
        except Exception as exc:
            self.error = exc


class EmulatedWork:
    def __init__(self, rt: EmulatedRuntime, op: _OpOnDevice) -> None:
        self._runtime = rt
        self._op = op
        self.end = op.end

    def wait(self, timeout: timedelta) -> bool:
        raise AssertionError("commlib called wait() on a stream-ordered engine's work: the CPU must never block")

    def __del__(self) -> None:
        # As torchcomms' works do: dropping one whose op still runs blocks until the op ends.
        self.end.synchronize()

    def is_completed(self) -> bool:
        return self.end.query()

    def order(self) -> None:
        self._runtime.on.current.wait_event(self.end)

    def failure(self) -> BaseException | None:
        return self._op.error


class EmulatedBackend:
    """A stream-ordered commlib backend over gloo (module docstring)."""

    resumable_wait = False

    def __init__(self, inner: C10dBackend) -> None:
        self.inner = inner
        self.runtime = EmulatedRuntime(device())
        self.name = f"emulated-{inner.name}"
        self.rank, self.size, self.device = inner.rank, inner.size, inner.device
        self.streams: dict[int | None, EmulatedStream] = {}  # per lane, as NCCL's: collectives, each peer
        self.launched = 0

    @classmethod
    def create(cls, *, store: dist.Store, rank: int, size: int, device: torch.device,
               timeout: timedelta) -> "EmulatedBackend":
        return cls(C10dBackend.create("gloo", store=store, rank=rank, size=size, device=device, timeout=timeout))

    def launch(self, call: Collective, timeout: timedelta) -> EmulatedWork:
        self.launched += 1
        op = _OpOnDevice()
        ready = EmulatedEvent()
        ready.record(self.runtime.on.current)  # the engine stream waits for the caller's stream here
        stream = self.streams.get(call.peer)
        if stream is None:
            stream = self.streams[call.peer] = EmulatedStream(f"engine-{id(self)}-{call.peer}")
        stream.wait_event(ready)
        stream.enqueue(lambda: op.run(self.inner, call, timeout))
        op.end.record(stream)
        return EmulatedWork(self.runtime, op)

    def split(self, ranks: list[int], name: str, timeout: timedelta) -> "EmulatedBackend | None":
        inner = self.inner.split(ranks, name, timeout)
        return None if inner is None else EmulatedBackend(inner)

    def supports(self, device: torch.device, op: Reduction | None) -> str | None:
        return self.inner.supports(device, op)

    def classify(self, exc: BaseException) -> Failure:
        return self.inner.classify(exc)

    def abort(self) -> None:
        self.inner.abort()

    def finalize(self) -> None:
        self.inner.finalize()


def options(**kwargs: Any) -> EngineOptions:
    """EngineOptions for commlib process groups over the emulated engine."""
    return EngineOptions(backend_factory=EmulatedBackend.create, **kwargs)
