"""The narrow protocol a backend implements.

A backend launches one already-validated, already-numbered `Collective` and hands back a
`BackendWork`; it splits, aborts and finalizes itself, and it says what a raw failure of its
engine means (`classify`). A stream-ordered engine (a GPU's) also names its `StreamEvents`
(`commlib.device`), and says what it reports without blocking the CPU or taking its own locks
(an abort holds them while the device drains): an op's end where it has one to read from
another thread (`BackendWork.end`) and its own error (`engine_error`). Everything else
(validation, sequence numbers, deadlines, hooks, logs, flight recording, the progress board)
belongs to `Communicator`; a backend that repeats any of it is a bug.

Dropping an engine's work whose op still runs blocks the dropping thread until the op ends
(gloo's and torchcomms' works join the op's thread), so a work given up on while its op runs
(after a caller's shorter wait) is kept here until it has ended (`keep_until_done`): the one
registry of this module.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Protocol

import torch

from commlib.device import Event, StreamEvents
from commlib.failures import Failure
from commlib.ops import Collective, Reduction


class BackendWork(Protocol):
    def wait(self, timeout: timedelta) -> bool:
        """Block until done; False if `timeout` passed first. Raises the engine's error.

        Where the backend's `resumable_wait` is True, a wait that returned False leaves the
        op running, and may be called again. Never called on a stream-ordered engine.
        """

    def is_completed(self) -> bool:
        """CPU engines: whether the op has ended. Never called on a stream-ordered engine (c10d's
        takes the NCCL communicator's lock, which an abort holds while the device drains)."""

    # Stream-ordered engines only:
    @property
    def end(self) -> Event | None:
        """Passed once the op has ended on the device, read from another thread without blocking
        (an engine's verdict may also say how it failed: `failure()`); None: commlib marks it."""

    def order(self) -> None:
        """Make the caller's current stream wait for the op; the CPU does not wait."""


class Backend(Protocol):
    name: str  # e.g. "gloo", "nccl", "torchcomms:gloo"
    rank: int
    size: int
    device: torch.device
    resumable_wait: bool  # see BackendWork.wait: the Communicator may then wait in slices
    events: StreamEvents | None  # a stream-ordered engine's; None where the CPU waits for ops

    def launch(self, call: Collective, timeout: timedelta) -> BackendWork:
        """Start `call` without blocking on its completion."""

    def engine_error(self) -> BaseException | None:
        """Stream-ordered engines: the engine's own error, None while it has none; never blocks."""

    def split(self, ranks: list[int], name: str, timeout: timedelta) -> Backend | None:
        """Collective over every member: a backend for `ranks`, None where not a member."""

    def supports(self, device: torch.device, op: Reduction | None) -> str | None:
        """None if the backend serves tensors on `device` with reduction `op`, else why not."""

    def classify(self, exc: BaseException) -> Failure: ...

    def abort(self) -> None:
        """Tear down without waiting for peers."""

    def finalize(self) -> None:
        """Release resources after a clean run."""


# What was given up on while its op still ran, with the backend whose engine must outlive it
# and how to tell the op has ended; pruned at the next give-up (module docstring).
_KEPT: list[tuple[object, Backend, Callable[[], bool]]] = []


def keep_until_done(kept: object, backend: Backend, ended: Callable[[], bool]) -> None:
    """Keep `kept` (a work, or an op with its tensors) and `backend` until `ended()`."""
    _KEPT[:] = [entry for entry in _KEPT if not entry[2]()]
    if not ended():
        _KEPT.append((kept, backend, ended))
