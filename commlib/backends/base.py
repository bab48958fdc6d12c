"""The narrow protocol a backend implements.

A backend launches one already-validated, already-numbered `Collective` and hands back a
`BackendWork`; it splits, aborts and finalizes itself, and it says what a raw failure of
its engine means (`classify`). A stream-ordered engine (a GPU's) also names its device
runtime, and its works order the caller's stream and report the engine's verdict on an op
that has ended (`commlib.device`, `commlib.watchdog`). Everything else (validation, sequence numbers, deadlines,
hooks, logs, flight recording, the progress board) belongs to `Communicator`; a backend
that repeats any of it is a bug.

Dropping an engine's work whose op still runs blocks the dropping thread until the op ends
(gloo's and torchcomms' works join the op's thread), so a work given up on while its op
runs (a caller's shorter wait that passed, an op of a communicator that broke) is kept here
until it has ended (`keep_until_done`): the one registry of this module.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Protocol

import torch

from commlib.device import Runtime
from commlib.failures import Failure
from commlib.ops import Collective, Reduction


class BackendWork(Protocol):
    def wait(self, timeout: timedelta) -> bool:
        """Block until done; False if `timeout` passed first. Raises the engine's error.

        Where the backend's `resumable_wait` is True, a wait that returned False leaves the
        op running, and may be called again. Never called on a stream-ordered engine.
        """

    def is_completed(self) -> bool: ...

    def order(self) -> None:
        """Stream-ordered engines: make the caller's current stream wait for the op (the
        engine's stream-only wait); the CPU does not wait."""

    def failure(self) -> BaseException | None:
        """Stream-ordered engines, once the op has ended on the device: the engine's own error
        for it (an abort, a remote error), None when it completed."""


class Backend(Protocol):
    name: str  # e.g. "gloo", "nccl", "torchcomms:gloo"
    rank: int
    size: int
    device: torch.device
    resumable_wait: bool  # see BackendWork.wait: the Communicator may then wait in slices
    # A stream-ordered engine's device runtime (`commlib.device`); None where the CPU waits for ops.
    runtime: Runtime | None

    def launch(self, call: Collective, timeout: timedelta) -> BackendWork:
        """Start `call` without blocking on its completion."""

    def split(self, ranks: list[int], name: str, timeout: timedelta) -> "Backend | None":
        """Collective over every member: a backend for `ranks`, None where not a member."""

    def supports(self, device: torch.device, op: Reduction | None) -> str | None:
        """None if the backend serves tensors on `device` with reduction `op`, else why not."""

    def classify(self, exc: BaseException) -> Failure: ...

    def abort(self) -> None:
        """Tear down without waiting for peers; returns at once."""

    def finalize(self) -> None:
        """Release resources after a clean run."""


# Works given up on while their op still ran, each with its backend (whose engine must outlive
# it), pruned at the next give-up (module docstring).
_KEPT: list[tuple[BackendWork, Backend]] = []


def keep_until_done(work: BackendWork, backend: Backend) -> None:
    """Keep `work` (and `backend`) until its op has ended, so that dropping it never blocks."""
    _KEPT[:] = [kept for kept in _KEPT if not kept[0].is_completed()]
    if not work.is_completed():
        _KEPT.append((work, backend))
