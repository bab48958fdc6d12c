"""Stream order: what commlib sees of a device whose engine runs ops on streams (CUDA).

On such an engine (nccl; torchcomms on CUDA) an op is enqueued, not run: it starts on the
device once the stream it runs on has reached it and the op before it on the same engine
lane has ended, and it ends some time later. commlib keeps that asynchrony. It never blocks
the CPU for an op; what it knows of one comes from two points, which the watchdog
(`commlib.watchdog`) reads from its own thread:

- its start: an event `mark()`ed on the caller's current stream before the launch. The op
  runs on that stream (c10d's synchronous path) or on an engine stream that waits for that
  point of it (c10d's and torchcomms' asynchronous launches both do), so the op has started
  on the device once this event has completed and the op queued before it on its lane has
  ended;
- its end: what the engine offers that can be read from another thread without blocking and
  without the engine's locks (`BackendWork.end`: c10d's own verdict future, torchcomms' work
  status); where the engine offers nothing (c10d's synchronous path hands back no work),
  a second `mark()` right after the launch, on the stream the op ran on.

A caller's `Work.wait()` is the engine's stream-only wait (`BackendWork.order`); commlib
keeps no streams of its own.

A `Runtime` is the small surface this needs, so that a test engine can bring its own (CI has
no GPU: tests/commlib/emulated_device.py emulates streams, events, devices and graph capture
on CPU); `CudaRuntime` is torch.cuda's. Events are pooled (timing off): one whose op has
ended goes back for reuse.

Reading events from the watchdog's thread is done as c10d's watchdog does it (its event
queries run under a device guard and a thread-local capture mode): `Runtime.watching()` makes
the runtime's device the thread's current one, so a rank on GPU k never creates a context on
GPU 0 from that thread, and `Runtime.side_thread()` puts the watchdog's thread (once) in the
thread-local capture mode, so its queries never invalidate a CUDA graph that another thread
is capturing. An op issued while the caller's stream is capturing a graph is not watched at
all (`mark()` returns `CAPTURED`): it is recorded into the graph, not run, and its replays are the
graph's; and `commlib.check()` on a thread that is capturing reads no event (`capturing()`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from typing import Any, Protocol

import torch

POOL_CAP = 1024  # completed events kept for reuse per runtime; more are left to the garbage collector
ENGINE_TIMEOUT_MIN_S = 3600.0  # the engine's own timeout on a stream-ordered engine: see `engine_timeout_s`
ENGINE_TIMEOUT_FACTOR = 10.0
_CAPTURE_MODE_THREAD_LOCAL = 1  # cudaStreamCaptureModeThreadLocal


def engine_timeout_s(deadline_s: float) -> float:
    """The timeout a stream-ordered engine is given for an op whose commlib deadline is `deadline_s`.

    Far beyond the deadline: the engine's watchdog counts from the enqueue, so with the
    deadline itself it would time out an op that merely waits behind earlier GPU work, and
    it would act first (c10d marks the work failed; torchcomms aborts). commlib's watchdog
    (`commlib.watchdog`) decides; the engine's timeout only catches what commlib could not.
    The one home of this rule: the backends set it, the launch passes it, and every way of
    changing a group's timeout goes through it (`commlib.process_group`).
    """
    return max(ENGINE_TIMEOUT_FACTOR * deadline_s, ENGINE_TIMEOUT_MIN_S)


class Event(Protocol):
    def query(self) -> bool:
        """Whether the point it stands for has been reached; never blocks."""


class _Captured:
    """What `Runtime.mark` gives while the caller's stream captures a CUDA graph: no point of a
    stream that runs now (module docstring)."""

    def query(self) -> bool:
        return True


CAPTURED = _Captured()


class Runtime(Protocol):
    """The stream operations commlib uses (module docstring)."""

    device: torch.device

    def mark(self) -> Event:
        """A (pooled) event recorded on the caller's current stream of this device; `CAPTURED`
        while that stream is capturing a CUDA graph (the op is then not watched)."""

    def release(self, event: Event) -> None:
        """Hand a completed event that nothing holds back for reuse."""

    def watching(self) -> contextlib.AbstractContextManager[None]:
        """Around reads of this runtime's events: its device current on the reading thread."""

    def side_thread(self) -> None:
        """On a thread of commlib's own that reads events (the watchdog's): the thread-local
        capture mode, so its reads never disturb another thread's graph capture."""

    def capturing(self) -> bool:
        """Whether the calling thread's current stream is capturing a CUDA graph now."""


class CudaRuntime:
    """`Runtime` over torch.cuda, for one communicator on one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool: list[Any] = []  # list.pop and list.append are atomic: the watchdog releases, callers take

    def mark(self) -> Any:
        # Captures run on the device that is current (torch.cuda.graph's own stream): the one
        # whose current stream this asks about.
        if torch.cuda.is_current_stream_capturing():
            return CAPTURED
        event = self._pool.pop() if self._pool else torch.cuda.Event()  # timing off, not blocking
        event.record(torch.cuda.current_stream(self.device))
        return event

    def release(self, event: Any) -> None:
        if len(self._pool) < POOL_CAP:
            self._pool.append(event)

    def watching(self) -> contextlib.AbstractContextManager[None]:
        return torch.cuda.device(self.device)

    def side_thread(self) -> None:
        _thread_local_capture_mode()

    def capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()


_capture_mode_set = threading.local()


def _thread_local_capture_mode() -> None:
    """Put the calling thread in CUDA's thread-local stream capture mode, once per thread: its
    event queries then never invalidate another thread's capture (as c10d's and torchcomms'
    watchdogs do). torch has no Python call for it, so it goes to the CUDA runtime torch loaded;
    where that cannot be found, the log says that a capture on another thread is not safe."""
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
            "invalidated by the watchdog's event queries",
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
