"""torch's direct calls on the engines under a commlib group: timeouts followed, eager connects made safe.

torch reaches a group's engines directly, bypassing the commlib group in front of them: torch
2.13's `_set_pg_timeout` and other callers of `group._get_backend(device)` set an engine's
timeout, and `init_process_group(device_id=...)` connects the engine it finds eagerly. An
engine is a C++ object commlib's group cannot stand in for, so the engine classes' methods are
wrapped once per process (`follow_engine_calls`), acting as commlib means for the engines a
commlib group holds and leaving every other engine alone:

- `_set_default_timeout`: the timeout becomes the deadline of the commlib communicator over the
  engine, and the engine's own timeout is the one commlib gives it for that deadline
  (`engine_timeout`): never the raw deadline on a stream-ordered engine, whose c10d watchdog
  counts from the enqueue;
- `eager_connect_single_device`: commlib connected its engines when it built them
  (`commlib.backends.nccl.build_engine`); c10d's method does not check for an existing
  communicator and would initialise a second one, which c10d keeps out of its maps and never
  aborts (ProcessGroupNCCL::eagerConnectSingleDevice). On the engine's own device it does
  nothing; on another device it raises, naming both.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from commlib.communicator import Communicator
from commlib.device import engine_timeout_s


def follow_engine_calls(communicators_over: Callable[[Any], list[Communicator]]) -> None:
    """Wrap the engine classes' methods (module docstring), once per process.

    `communicators_over(engine)`: the communicators over an engine, in every commlib group of
    the process (`commlib.process_group` knows its groups); empty for an engine no group holds.
    """
    for engine_class in (getattr(dist, "ProcessGroupGloo", None), getattr(dist, "ProcessGroupNCCL", None)):
        if engine_class is None:
            continue
        setter = getattr(engine_class, "_set_default_timeout", None)
        if setter is not None and not getattr(setter, "follows_commlib", False):
            engine_class._set_default_timeout = _following_timeouts(setter, communicators_over)
        connect = getattr(engine_class, "eager_connect_single_device", None)
        if connect is not None and not getattr(connect, "follows_commlib", False):
            engine_class.eager_connect_single_device = _connecting_once(connect, communicators_over)


def _following_timeouts(setter: Any, communicators_over: Callable[[Any], list[Communicator]]) -> Any:
    def set_default_timeout(engine: Any, timeout: timedelta) -> None:
        over = communicators_over(engine)
        setter(engine, engine_timeout(over[0], timeout) if over else timeout)
        for comm in over:
            comm.set_timeout(timeout)

    set_default_timeout.follows_commlib = True  # type: ignore[attr-defined]
    set_default_timeout.engines_own = setter  # type: ignore[attr-defined]
    return set_default_timeout


def _connecting_once(connect: Any, communicators_over: Callable[[Any], list[Communicator]]) -> Any:
    def eager_connect_single_device(engine: Any, device: Any) -> None:
        over = communicators_over(engine)
        if not over:
            connect(engine, device)
            return
        comm, asked = over[0], torch.device(device)
        if asked != comm.device:
            raise ValueError(
                f"commlib process group {comm.name!r} rank {comm.rank}: expected device_id {comm.device} (the "
                f"device its engine was built and connected on); found {asked}. Pass that device_id, or build "
                f"the group with commlib.EngineOptions(device={asked!r})"
            )

    eager_connect_single_device.follows_commlib = True  # type: ignore[attr-defined]
    return eager_connect_single_device


def engine_timeout(comm: Communicator, deadline: timedelta) -> timedelta:
    """The engine's own timeout for a communicator whose deadline is `deadline` (`engine_timeout_s`)."""
    if not comm.stream_ordered:
        return deadline
    return timedelta(seconds=engine_timeout_s(deadline.total_seconds()))


def set_engine_timeout(engine: Any, timeout: timedelta) -> None:
    """The engine's own timeout, set with its class's own setter (not `follow_engine_calls`')."""
    setter = type(engine)._set_default_timeout
    getattr(setter, "engines_own", setter)(engine, timeout)
