"""A commlib group's deadlines as torch changes them through its engines: c10d engines'
`_set_default_timeout` followed, and the engine's own timeout that commlib gives it.

torch reaches a group's engines directly (torch 2.13's `_set_pg_timeout`, callers of
`group._get_backend(device)`, c10d's `ProcessGroup.set_timeout` forwarding to every registered
engine), bypassing the commlib group in front of them; so a timeout set there must become the
deadline of the commlib communicator over that engine, and a stream-ordered engine's own
timeout must stay the one commlib gives it (`commlib.device.engine_timeout_s`), never the raw
deadline, which its c10d watchdog would count from the enqueue. The groups themselves and
their communicators are `commlib.process_group`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from commlib.communicator import Communicator
from commlib.device import engine_timeout_s


def follow_engine_timeouts(communicators_over: Callable[[Any], list[Communicator]]) -> None:
    """Make an engine's `_set_default_timeout` set the deadline of the commlib communicator over it.

    torch 2.13's `_set_pg_timeout` (and code that sets a timeout on `group._get_backend(device)`)
    calls that method of the engine c10d finds registered for each device, a C++ object that
    commlib's group cannot stand in for, so the engine classes' method is wrapped, once per
    process: the timeout becomes the deadline of the communicator over that engine (over any
    engine the group ever registered for that device: a rebuilt group's retired ones stay
    registered, `CommlibProcessGroup._register_engines`), and the engine's own timeout is the
    one commlib gives that engine for it (`engine_timeout`): never the raw deadline on a
    stream-ordered engine, whose c10d watchdog counts from the enqueue. Engines no commlib
    group holds are untouched. `communicators_over(engine)`: the communicators over an engine,
    in every commlib group of the process (`commlib.process_group` knows its groups).
    """
    for engine_class in (getattr(dist, "ProcessGroupGloo", None), getattr(dist, "ProcessGroupNCCL", None)):
        setter = getattr(engine_class, "_set_default_timeout", None)
        if setter is None or getattr(setter, "follows_commlib", False):
            continue

        def set_default_timeout(engine: Any, timeout: timedelta, _engine_setter: Any = setter) -> None:
            over = communicators_over(engine)
            _engine_setter(engine, engine_timeout(over[0], timeout) if over else timeout)
            for comm in over:
                comm.set_timeout(timeout)

        set_default_timeout.follows_commlib = True  # type: ignore[attr-defined]
        set_default_timeout.engines_own = setter  # type: ignore[attr-defined]
        engine_class._set_default_timeout = set_default_timeout  # type: ignore[union-attr]


def engine_timeout(comm: Communicator, deadline: timedelta) -> timedelta:
    """The engine's own timeout for a communicator whose deadline is `deadline` (`engine_timeout_s`)."""
    if not comm.stream_ordered:
        return deadline
    return timedelta(seconds=engine_timeout_s(deadline.total_seconds()))


def set_engine_timeout(engine: Any, timeout: timedelta) -> None:
    """The engine's own timeout, set with its class's own setter (not `follow_engine_timeouts`'s)."""
    setter = type(engine)._set_default_timeout
    getattr(setter, "engines_own", setter)(engine, timeout)
