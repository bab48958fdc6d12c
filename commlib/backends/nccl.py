"""What commlib needs of c10d's NCCL engine: the settings it is built with, and how its ops are
judged from another thread. Facts from ProcessGroupNCCL's source (torch 2.13, 2.11 alike)
are cited by function where they decide something.

Built by commlib (`build_engine`), an engine leaves every decision about a timeout or an error
to commlib, so that the process lives on and recovers in-job:

- `NCCL_ENV`, set where the user has not set it, turns off what c10d would do by itself on a
  timeout or an error (each of which ends the process, or freezes the group for a minute);
- three settings that would undo it are held off while the engine is constructed (c10d reads
  them then): `TORCH_DISTRIBUTED_DEBUG=DETAIL` and `TORCH_NCCL_DESYNC_DEBUG=1` make its
  watchdog rethrow on its thread (ProcessGroupNCCL's constructor sets async error handling to
  3, which terminates the process at the first NCCL error), and `TORCH_NCCL_BLOCKING_WAIT=1`
  makes every stream-only wait busy-wait the CPU and stops its watchdog. On commlib's engines
  commlib's consistency check stands in for DETAIL's (`commlib.engines.check_consistency`
  turns it on), its progress board and doctor for the desync report, and its deadlines for the
  blocking wait; the log says so once;
- it is initialised eagerly on its device (`eager_connect_single_device`): `ncclCommInitRank`
  runs now, while the communicator is created, instead of inside the first op of each lane
  on the caller's thread with no deadline; send/recv then run on the collective stream
  (ProcessGroupNCCL::pointToPoint uses the device's communicator once it was initialised
  eagerly), so the engine has one lane.

A group commlib wraps rather than builds was constructed with the caller's settings, and
commlib cannot change them: `warn_wrapped` says what commlib cannot promise there.

An op's end is read from c10d's own verdict (`Work.get_future_result()`, completed by c10d's
watchdog thread within its 100 ms poll): `VerdictEnd`. It takes no lock: `WorkNCCL::isCompleted`
does take the NCCL communicator's lock, which `NCCLComm::abort` holds for the whole of
`ncclCommAbort` while the device drains, so commlib never calls it on this engine. A
synchronous op hands back no work (c10d runs it on the caller's current stream and returns
None), so its end is commlib's own event.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from commlib.device import engine_timeout_s
from commlib.record import log as _log

# What c10d's NCCL engine would otherwise do by itself on a timeout or an error (MEASURED.md,
# torch 2.11; ProcessGroupNCCL's source): commlib's watchdog decides instead, and the process
# lives on to recover in-job. Read when an engine is constructed, and process-wide: every NCCL
# group of the process built afterwards, commlib's or not, behaves so. A value the user set is
# kept, with a warning that a timeout may then end the process.
NCCL_ENV = {
    # 0: on an error or a timeout c10d only marks the work failed. Its default (3) rethrows on
    # its watchdog thread, which terminates the process; 1 tears the process down; 2 aborts
    # the communicator behind commlib's back.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
    # The heartbeat monitor kills a process whose c10d watchdog looks stuck (as it is while an
    # abort waits for a wedged device) or after a dump signal.
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    # No debug dump on c10d's own timeouts (which count from the enqueue: false ones behind a
    # busy GPU); commlib's flight recorder dumps on commlib's.
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    # A CUDA error its watchdog meets is not rethrown on that thread (which would terminate).
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
    # On any failed work c10d's watchdog sleeps 4x this (60 s by default), whatever the two
    # settings above say, holding the lock every launch on the group needs (Watchdog::runLoop):
    # survivors would miss recovery's join window. 0: no sleep.
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0",
}

# Settings c10d reads while constructing an engine that would undo `NCCL_ENV` (module docstring),
# with what stands in for each on commlib's engines.
HELD_OFF = {
    "TORCH_NCCL_DESYNC_DEBUG": "commlib's progress board and doctor say who is stuck where",
    "TORCH_NCCL_BLOCKING_WAIT": "commlib's deadlines; the CPU never waits for an op",
}
DETAIL_STANDS_IN = "commlib's consistency check compares every collective across ranks"


def nccl_survives_timeouts() -> dict[str, str]:
    """Set `NCCL_ENV` where the user has not; returns the variables the user set otherwise (and warns)."""
    kept = {}
    for key, value in NCCL_ENV.items():
        current = os.environ.setdefault(key, value)
        if current != value:
            kept[key] = current
    if kept:
        _log.get_logger().warning(
            "comm.nccl_env_kept",
            kept=kept,
            wanted={k: NCCL_ENV[k] for k in kept},
            consequence="a timeout or NCCL error may end the process, or stall the group; "
            "in-job recovery then cannot work",
        )
    return kept


@contextlib.contextmanager
def _settings_held_off() -> Iterator[dict[str, str]]:
    """While an engine is constructed: DETAIL lowered to INFO, and `HELD_OFF` turned off; then as they were."""
    held: dict[str, str] = {}
    level = dist.get_debug_level()
    if level == dist.DebugLevel.DETAIL:  # c10d copies the process's level when a backend is built
        dist.set_debug_level(dist.DebugLevel.INFO)
        held["TORCH_DISTRIBUTED_DEBUG"] = DETAIL_STANDS_IN
    saved = {key: os.environ.get(key) for key in HELD_OFF}
    for key, value in saved.items():
        if value not in (None, "", "0"):
            os.environ[key] = "0"
            held[key] = HELD_OFF[key]
    try:
        yield held
    finally:
        if "TORCH_DISTRIBUTED_DEBUG" in held:
            dist.set_debug_level(level)
        for key, value in saved.items():
            if key in held:
                os.environ[key] = value  # type: ignore[assignment]


def build_engine(store: dist.Store, rank: int, size: int, device: torch.device, timeout: timedelta) -> Any:
    """A ProcessGroupNCCL commlib decides for (module docstring), initialised on `device` now."""
    nccl_survives_timeouts()
    opts = dist.ProcessGroupNCCL.Options()
    # Far beyond commlib's deadline: c10d's watchdog counts from the enqueue (`engine_timeout_s`).
    opts._timeout = timedelta(seconds=engine_timeout_s(timeout.total_seconds()))
    opts.is_high_priority_stream = False
    with _settings_held_off() as held:
        engine = dist.ProcessGroupNCCL(store, rank, size, opts)
    if held:
        _log.get_logger().warning(
            "comm.nccl_settings_held_off",
            held=sorted(held),
            instead=held,
            why="c10d would terminate the process at the first NCCL error, or block the CPU on every wait",
        )
    engine.eager_connect_single_device(device)
    return engine


def warn_wrapped(name: str, device: torch.device) -> None:
    """Say what commlib cannot promise over an NCCL group it did not build (module docstring)."""
    what = (
        f"commlib wraps the NCCL group {name!r} on {device}, which it did not build: that group's own c10d "
        f"settings decide what a timeout or an NCCL error does to the process (TORCH_NCCL_ASYNC_ERROR_HANDLING "
        f"defaults to tearing it down), c10d's own timeout counts from the enqueue, and a lazily initialised "
        f"group initialises NCCL inside its first op of each lane without commlib's deadline. Make the group "
        f"with init_process_group(backend='commlib') for commlib's promises"
    )
    warnings.warn(what, stacklevel=3)
    _log.get_logger().warning("comm.nccl_group_wrapped", comm=name, device=str(device), consequence=what)


class VerdictEnd:
    """An op's end, as c10d's watchdog judges it (module docstring): reached once its verdict is in."""

    __slots__ = ("_verdict",)

    def __init__(self, work: Any) -> None:
        self._verdict = work.get_future_result()

    def query(self) -> bool:
        return self._verdict.done()

    def failure(self) -> BaseException | None:
        result = self._verdict.value()
        if int(result) == 0:  # WorkResult.SUCCESS
            return None
        return RuntimeError(
            f"c10d reports the op ended with {result!s} (a timeout of its own, or "
            f"ncclRemoteError: a peer gone or its network failed)"
        )
