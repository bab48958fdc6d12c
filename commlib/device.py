"""Stream order: what commlib sees of a device whose engine runs ops on streams (CUDA).

On such an engine (nccl; torchcomms on CUDA) an op is enqueued, not run: it starts on the
device once the caller's stream has reached it and the engine's stream has finished the
op before it, and it ends some time later. commlib keeps that asynchrony. It never blocks
the CPU for an op; it puts two events around each one instead, which the watchdog
(`commlib.watchdog`) reads from its own thread:

- `mark()` before the launch, on the caller's current stream. The engine's stream waits on
  that point of the caller's stream before the op's kernel can run (c10d's and torchcomms'
  launches both do), so the op has started on the device once this event has completed
  and the op queued before it on the same engine stream has ended;
- after the launch, an event that completes when the op does: for a synchronous call the
  caller's stream is ordered after the op (`BackendWork.order`, the engine's stream-only
  wait) and `mark()` records behind it; an asynchronous call must not order the caller's
  stream yet, so `mark_after(order, lane)` orders a watch stream of the runtime's own
  instead and records there. A runtime serves one communicator, with a watch stream per
  lane (collectives; send/recv with each peer), as the engine has a stream per lane: on a
  shared watch stream one op's end event would wait for another's.

`Work.wait()` then only makes the caller's stream wait for that event (`wait`).

A `Runtime` is the small surface this needs, so that a test engine can bring its own
(CI has no GPU: tests/commlib/emulated_device.py emulates streams and events on CPU);
`CudaRuntime` is torch.cuda's. Events are pooled (timing off): one that has completed and
that no `Work` holds goes back for reuse.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

POOL_CAP = 1024  # completed events kept for reuse per runtime; more are left to the garbage collector
ENGINE_TIMEOUT_MIN_S = 3600.0  # the engine's own timeout on a stream-ordered engine: see `engine_timeout_s`
ENGINE_TIMEOUT_FACTOR = 10.0


def engine_timeout_s(deadline_s: float) -> float:
    """The timeout a stream-ordered engine is given for an op whose commlib deadline is `deadline_s`.

    Far beyond the deadline: the engine's watchdog counts from the enqueue, so with the
    deadline itself it would time out an op that merely waits behind earlier GPU work, and
    it would act first (c10d marks the work failed; torchcomms aborts). commlib's watchdog
    (`commlib.watchdog`) decides; the engine's timeout only catches what commlib could not.
    The one home of this rule: the backends set it, the launch passes it.
    """
    return max(ENGINE_TIMEOUT_FACTOR * deadline_s, ENGINE_TIMEOUT_MIN_S)


class Event(Protocol):
    def query(self) -> bool:
        """Whether the stream has reached the event; never blocks."""


class Runtime(Protocol):
    """The stream operations commlib uses (module docstring)."""

    device: torch.device

    def mark(self) -> Event:
        """A (pooled) event recorded on the caller's current stream."""

    def mark_after(self, order: Callable[[], None], lane: int | None) -> Event:
        """Run `order()` with the watch stream of `lane` current (None: collectives; a peer: the
        send/recv with it), then record an event on it."""

    def wait(self, event: Event) -> None:
        """Make the caller's current stream wait for `event`; the CPU does not wait."""

    def release(self, event: Event) -> None:
        """Hand a completed event that nothing holds back for reuse."""


class CudaRuntime:
    """`Runtime` over torch.cuda, for one communicator on one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool: list[Any] = []  # list.pop and list.append are atomic: the watchdog releases, callers take
        self._watch: dict[int | None, Any] = {}  # per lane, created with its first asynchronous op

    def _event(self) -> Any:
        pool = self._pool
        return pool.pop() if pool else torch.cuda.Event()  # timing off, not blocking, not interprocess

    def mark(self) -> Any:
        event = self._event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def mark_after(self, order: Callable[[], None], lane: int | None) -> Any:
        watch = self._watch.get(lane)
        if watch is None:
            watch = self._watch[lane] = torch.cuda.Stream(self.device)
        caller = torch.cuda.current_stream(self.device)
        torch.cuda.set_stream(watch)
        try:
            order()
        finally:
            torch.cuda.set_stream(caller)
        event = self._event()
        event.record(watch)
        return event

    def wait(self, event: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def release(self, event: Any) -> None:
        if len(self._pool) < POOL_CAP:
            self._pool.append(event)
