"""What commlib needs of c10d's NCCL engine: the settings it is built with, and what it reports.

Built by commlib (`build_engine`), an engine leaves every decision about a timeout or an error
to commlib, so that the process lives on and recovers in-job. The mechanisms are c10d's and
torchft's own (torchft/process_group.py, `ProcessGroupNCCL._create_pg`):

- `NCCL_ENV`, set where the user has not set it, turns off what c10d would do by itself on a
  timeout or an error (each of which ends the process, or freezes the group for a minute), and
  makes NCCL connect every algorithm's transport at init (`NCCL_RUNTIME_CONNECT=0`: no lazy
  connection left for the first collective of each algorithm, which would otherwise exchange
  data with the peers inside a launch);
- the communicator is nonblocking (`opts.config.blocking = False`, as torchft's): NCCL's init
  and any call that must wait for the peers poll inside c10d, bounded by
  `TORCH_NCCL_NONBLOCKING_TIMEOUT` (set as torchft sets it, where the user has not), and
  abortable from another thread;
- it is initialised eagerly on its device (`eager_connect_single_device`) under the creation's
  deadline (`commlib.deadlines.bounded`, torchft's `context_timeout`): `ncclCommInitRank` runs
  while the communicator is created, and a peer that never comes aborts it at the deadline;
- c10d reads the settings that would undo this while the engine is constructed:
  `TORCH_DISTRIBUTED_DEBUG=DETAIL` and `TORCH_NCCL_DESYNC_DEBUG` make its watchdog terminate the
  process at the first NCCL error, `TORCH_NCCL_BLOCKING_WAIT` starts no watchdog at all (no
  verdict, no error). Each is read under its legacy `NCCL_` alias too, the first name winning
  (c10d's `getCvarBool`), so the TORCH_ names are set to "0" explicitly while it is built.

A group commlib wraps rather than builds was constructed with the caller's settings, and commlib
cannot change them: `warn_wrapped` says what commlib cannot promise there.

What the engine reports is read without its locks: an asynchronous op's end from c10d's own
verdict (`Work.get_future_result()`, completed by c10d's watchdog: `VerdictEnd`); the engine's
error (`engine_error`: `ProcessGroupNCCL.get_error()`, which takes only its error mutex and
releases the GIL), which c10d sets from every work's failure, synchronous ones included.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from commlib import deadlines
from commlib.device import engine_timeout_s
from commlib.record import log as _log

# What c10d's NCCL engine would otherwise do by itself on a timeout or an error (MEASURED.md,
# torch 2.11; ProcessGroupNCCL's source), and what NCCL would leave for later. Read when an
# engine is constructed, and process-wide: every NCCL group of the process built afterwards,
# commlib's or not, behaves so. A value the user set is kept, with a warning.
NCCL_ENV = {
    # 0: on an error or a timeout c10d only marks the work failed. Its default (3) rethrows on
    # its watchdog thread, which terminates the process; 1 tears the process down; 2 aborts
    # the communicator behind commlib's back.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
    # The heartbeat monitor kills a process whose c10d watchdog looks stuck (as it is while an
    # abort waits for a wedged device) or after a dump signal.
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    # No debug dump on c10d's own timeouts; commlib's flight recorder dumps on commlib's.
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    # A CUDA error its watchdog meets is not rethrown on that thread (which would terminate).
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
    # On any failed work c10d's watchdog sleeps 4x this (60 s by default) holding the lock every
    # launch on the group needs (Watchdog::runLoop): survivors would miss recovery's join window.
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0",
    # Connect every algorithm's transport inside the (bounded) init, not inside the first
    # collective that needs it (NCCL's src/init.cc: RUNTIME_CONNECT, 1 by default).
    "NCCL_RUNTIME_CONNECT": "0",
}
# How long c10d polls a nonblocking NCCL call (init, a launch that waits for its peers) before it
# raises. c10d reads it once per process, at its first nonblocking call, so it is set before the
# first engine is built: to that engine's creation deadline, where the user has not set it.
NONBLOCKING_TIMEOUT_ENV = "TORCH_NCCL_NONBLOCKING_TIMEOUT"

# Settings c10d reads while constructing an engine that would undo `NCCL_ENV` (module docstring):
# each TORCH_ name with its legacy alias, and what stands in for it on commlib's engines.
HELD_OFF = {
    ("TORCH_NCCL_DESYNC_DEBUG", "NCCL_DESYNC_DEBUG"): "commlib's progress board and doctor say who is stuck where",
    ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"): "commlib's deadlines; the CPU never waits for an op",
}
DETAIL_STANDS_IN = "commlib's consistency check compares every collective across ranks"


def nccl_survives_timeouts(creation_timeout_s: float) -> dict[str, str]:
    """Set `NCCL_ENV` (and the nonblocking timeout) where the user has not; returns the
    variables of `NCCL_ENV` the user set otherwise (and warns)."""
    os.environ.setdefault(NONBLOCKING_TIMEOUT_ENV, str(math.ceil(creation_timeout_s)))
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
            consequence="a timeout or NCCL error may end the process, stall the group, or block a "
            "launch outside commlib's deadline; in-job recovery may then not work",
        )
    return kept


@contextlib.contextmanager
def _settings_held_off() -> Iterator[dict[str, str]]:
    """While an engine is constructed: DETAIL lowered to INFO, and the TORCH_ names of `HELD_OFF`
    set to "0" (which c10d reads before their aliases); then as they were. Yields what was held
    off, by the name the user had set."""
    held: dict[str, str] = {}
    level = dist.get_debug_level()
    if level == dist.DebugLevel.DETAIL:  # c10d copies the process's level when a backend is built
        dist.set_debug_level(dist.DebugLevel.INFO)
        held["TORCH_DISTRIBUTED_DEBUG"] = DETAIL_STANDS_IN
    saved = {name: os.environ.get(name) for name, _ in HELD_OFF}
    for (name, alias), instead in HELD_OFF.items():
        for key in (name, alias):
            if os.environ.get(key) not in (None, "", "0"):
                held[key] = instead
        os.environ[name] = "0"
    try:
        yield held
    finally:
        if "TORCH_DISTRIBUTED_DEBUG" in held:
            dist.set_debug_level(level)
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def build_engine(
    store: dist.Store, rank: int, size: int, device: torch.device, timeout: timedelta, engine_class: Any = None
) -> Any:
    """A ProcessGroupNCCL commlib decides for (module docstring), connected on `device` within
    `timeout`. `engine_class`: ProcessGroupNCCL, or a test's stand-in for it."""
    engine_class = engine_class or dist.ProcessGroupNCCL
    nccl_survives_timeouts(timeout.total_seconds())
    opts = engine_class.Options()
    # Far beyond commlib's deadline (`engine_timeout_s`).
    opts._timeout = timedelta(seconds=engine_timeout_s(timeout.total_seconds()))
    opts.is_high_priority_stream = False
    opts.config.blocking = False
    with _settings_held_off() as held:
        engine = engine_class(store, rank, size, opts)
    if held:
        _log.get_logger().warning(
            "comm.nccl_settings_held_off",
            held=sorted(held),
            instead=held,
            why="c10d would terminate the process at the first NCCL error, or give no verdict on any op",
        )
    expired = []

    def abort() -> None:
        expired.append(True)
        engine.abort()

    try:
        with deadlines.bounded(timeout.total_seconds(), abort):
            engine.eager_connect_single_device(device)
    except Exception as exc:
        if not expired:
            raise
        raise RuntimeError(
            f"building the NCCL engine of rank {rank} of {size} on {device}: expected every rank to connect "
            f"within {timeout.total_seconds():g} s; found the connection unfinished, and aborted it (a peer "
            f"dead, stuck or unreachable)"
        ) from exc
    return engine


def warn_wrapped(name: str, device: torch.device) -> None:
    """Say what commlib cannot promise over an NCCL group it did not build (module docstring)."""
    what = (
        f"commlib wraps the NCCL group {name!r} on {device}, which it did not build: that group's own c10d "
        f"settings decide what a timeout or an NCCL error does to the process (TORCH_NCCL_ASYNC_ERROR_HANDLING "
        f"defaults to tearing it down), and a blocking group initialises NCCL and its connections inside "
        f"launches that commlib's deadline can only abort. Make the group with "
        f"init_process_group(backend='commlib') for commlib's promises"
    )
    warnings.warn(what, stacklevel=3)
    _log.get_logger().warning("comm.nccl_group_wrapped", comm=name, device=str(device), consequence=what)


# c10d's WorkResult (Work.get_future_result()) and ErrorType (ProcessGroupNCCL.get_error()) values.
_SUCCESS = 0
# Worded so that `commlib.failures` reads each as what it is (a timeout, a peer failure).
_MEANING = {
    1: "TIMEOUT (c10d's own timeout passed: timed out)",
    2: "COMM_ERROR (an NCCL error: ncclRemoteError, a peer gone or its network failed)",
    3: "REMOTE_ERROR (ncclRemoteError: a peer gone or its network failed)",
}


def _error_of(value: int, whose: str) -> BaseException | None:
    if value == _SUCCESS:
        return None
    return RuntimeError(f"c10d's {whose} is {_MEANING.get(value, f'the engine failure {value}')}")


class VerdictEnd:
    """An asynchronous op's end, as c10d's watchdog judges it (module docstring)."""

    __slots__ = ("_verdict",)

    def __init__(self, work: Any) -> None:
        self._verdict = work.get_future_result()

    def query(self) -> bool:
        return self._verdict.done()

    def failure(self) -> BaseException | None:
        """Once ended: c10d's error for the op, None when it succeeded."""
        return _error_of(int(self._verdict.value()), "verdict on the op")


def engine_error(engine: Any) -> BaseException | None:
    """The engine's own error (`ProcessGroupNCCL.get_error()`), None while it has none."""
    return _error_of(int(engine.get_error()), "error on the engine")
