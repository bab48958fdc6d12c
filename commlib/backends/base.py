"""The narrow protocol a backend implements.

A backend launches one already-validated, already-numbered `Collective` and hands back a
`BackendWork`; it splits, aborts and finalizes itself, and it says what a raw failure of
its engine means (`classify`). A stream-ordered engine (a GPU's) also names its device
runtime and the lane each op runs on, and its works order the caller's stream, say when
their op has ended and give the engine's verdict on it (`commlib.device`, `commlib.watchdog`),
all without blocking the CPU and without taking the engine's locks (an abort holds them
while the device drains). Everything else (validation, sequence numbers, deadlines, hooks,
logs, flight recording, the progress board) belongs to `Communicator`; a backend that
repeats any of it is a bug.

Dropping an engine's work whose op still runs blocks the dropping thread until the op ends
(gloo's and torchcomms' works join the op's thread), and an op of an aborted engine may
still write its buffers until it has ended; so what is given up on while its op runs (a
work after a caller's shorter wait, the ops of a communicator that broke, with their
tensors) is kept here until it has ended (`keep_until_done`): the one registry of this module.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Protocol

import torch

from commlib.device import Event, Runtime
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
        """Completes once the op has ended on the device; None: commlib marks the end."""

    def order(self) -> None:
        """Make the caller's current stream wait for the op; the CPU does not wait."""

    def failure(self) -> BaseException | None:
        """Once `end` has completed: the engine's own error for the op (an abort, a remote
        error, a timeout of its own), None when it completed."""


class Backend(Protocol):
    name: str  # e.g. "gloo", "nccl", "torchcomms:gloo"
    rank: int
    size: int
    device: torch.device
    resumable_wait: bool  # see BackendWork.wait: the Communicator may then wait in slices

    @property
    def runtime(self) -> Runtime | None:
        """A stream-ordered engine's device runtime (`commlib.device`); None where the CPU waits for ops."""

    def launch(self, call: Collective, timeout: timedelta) -> BackendWork:
        """Start `call` without blocking on its completion."""

    def lane(self, call: Collective) -> int | None:
        """Stream-ordered engines: the engine lane `call` runs on, where ops run one after the
        other (None: the collectives'; a peer: its send/recv, where the engine has such lanes)."""

    def split(self, ranks: list[int], name: str, timeout: timedelta) -> Backend | None:
        """Collective over every member: a backend for `ranks`, None where not a member."""

    def supports(self, device: torch.device, op: Reduction | None) -> str | None:
        """None if the backend serves tensors on `device` with reduction `op`, else why not."""

    def classify(self, exc: BaseException) -> Failure: ...

    def abort(self) -> None:
        """Tear down without waiting for peers; returns at once."""

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
