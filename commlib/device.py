"""Stream order: the little commlib needs of a device whose engine runs ops on streams (CUDA).

On such an engine (nccl; torchcomms on CUDA) a collective is enqueued, not run, and commlib
keeps that asynchrony: the CPU never waits for an op (but for a barrier, whose point is the
hosts' rendezvous). What commlib reads of an op it reads from the engine where the engine
says it (c10d's verdict future, its error, torchcomms' work status); where it does not (c10d's
synchronous path hands back no work), one event is recorded on the caller's current stream
right after the launch, on which the op ran (`StreamEvents.mark`): torchft's `stream_timeout`.

`StreamEvents` is that small surface, so that a test engine brings its own (CI has no GPU:
tests/commlib/emulated_device.py emulates streams, events and graph capture on CPU);
`CudaStreamEvents` is torch.cuda's. Events are pooled (timing off). An op issued while the
caller's stream captures a CUDA graph is recorded into the graph, not run: `mark` gives
`CAPTURED` for it, and it is never timed (c10d does not watch captured works either).

The timer thread (`commlib.deadlines`) reads events as c10d's watchdog reads its own: with the
events' device current (`watching`, so a rank on GPU k never opens a context on GPU 0 from that
thread) and in the thread-local stream capture mode (`side_thread`, so its queries never
invalidate a graph another thread is capturing).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from typing import Any, Protocol

import torch

POOL_CAP = 1024  # passed events kept for reuse per communicator; more are left to the garbage collector
ENGINE_TIMEOUT_MIN_S = 3600.0  # the engine's own timeout on a stream-ordered engine: see `engine_timeout_s`
ENGINE_TIMEOUT_FACTOR = 10.0
_CAPTURE_MODE_THREAD_LOCAL = 1  # cudaStreamCaptureModeThreadLocal


def engine_timeout_s(deadline_s: float) -> float:
    """The timeout a stream-ordered engine is given for an op whose commlib deadline is `deadline_s`.

    Far beyond the deadline, as torchft gives c10d's (it resets an op's timeout to the default):
    c10d's own timeout path, on a false timeout of an op queued behind GPU work, left the
    process hung (MEASURED.md, "Surviving an NCCL timeout"); commlib's deadline aborts the
    engine first. The one home of this rule: the backends set it, the launch passes it, and
    every way of changing a group's timeout goes through it (`commlib.engine_calls`).
    """
    return max(ENGINE_TIMEOUT_FACTOR * deadline_s, ENGINE_TIMEOUT_MIN_S)


class Event(Protocol):
    def query(self) -> bool:
        """Whether the point it stands for has been passed; never blocks."""


class _Captured:
    """What `StreamEvents.mark` gives while the caller's stream captures a CUDA graph."""

    def query(self) -> bool:
        return True


CAPTURED = _Captured()


class StreamEvents(Protocol):
    """The stream operations commlib uses on one device (module docstring)."""

    device: torch.device

    def mark(self) -> Event:
        """A pooled event recorded on the caller's current stream of this device; `CAPTURED`
        while that stream captures a CUDA graph."""

    def release(self, event: Event) -> None:
        """Hand a passed event that nothing holds back for reuse."""

    def watching(self) -> contextlib.AbstractContextManager[None]:
        """Around reads of this device's events: its device current on the reading thread."""

    def side_thread(self) -> None:
        """On a thread of commlib's own that reads events: the thread-local capture mode."""


class CudaStreamEvents:
    """`StreamEvents` over torch.cuda, for one communicator on one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self._pool: list[Any] = []  # list.pop and list.append are atomic: the timer releases, callers take
        self._streams: dict[int, Any] = {}  # torch.cuda.Stream per stream id: building one per op costs more

    def mark(self) -> Any:
        # The C calls under torch.cuda's wrappers: this runs on every synchronous op.
        if torch._C._cuda_isCurrentStreamCapturing():
            return CAPTURED
        stream_id, device_index, device_type = torch._C._cuda_getCurrentStream(self._index)
        stream = self._streams.get(stream_id)
        if stream is None:
            stream = self._streams[stream_id] = torch.cuda.Stream(
                stream_id=stream_id, device_index=device_index, device_type=device_type
            )
        event = self._pool.pop() if self._pool else torch.cuda.Event()
        torch._C._CudaEventBase.record(event, stream)
        return event

    def release(self, event: Any) -> None:
        if len(self._pool) < POOL_CAP:
            self._pool.append(event)

    def watching(self) -> contextlib.AbstractContextManager[None]:
        return torch.cuda.device(self._index)

    def side_thread(self) -> None:
        _thread_local_capture_mode()


_capture_mode_set = threading.local()


def _thread_local_capture_mode() -> None:
    """Put the calling thread in CUDA's thread-local stream capture mode, once per thread, as
    c10d's watchdog does (a `CUDAStreamCaptureModeGuard` around its queries). torch has no
    Python call for it, so it goes to the CUDA runtime torch loaded; where that cannot be
    found, the log says that a capture on another thread is not safe."""
    if getattr(_capture_mode_set, "done", False):
        return
    _capture_mode_set.done = True
    cudart = _cudart()
    if cudart is None:
        from commlib.record import log as _log

        _log.get_logger().warning(
            "device.capture_mode_unset",
            cuda=torch.version.cuda,
            consequence="a CUDA graph captured on another thread in global mode may be "
            "invalidated by the deadline thread's event queries",
        )
        return
    mode = ctypes.c_int(_CAPTURE_MODE_THREAD_LOCAL)
    cudart.cudaThreadExchangeStreamCaptureMode(ctypes.byref(mode))


def _cudart() -> Any:
    """The CUDA runtime library this process's torch loaded (found by its soname), or None."""
    major = (torch.version.cuda or "").split(".")[0]
    for name in (f"libcudart.so.{major}", "libcudart.so"):
        try:
            return ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
        except OSError:
            continue
    return None
