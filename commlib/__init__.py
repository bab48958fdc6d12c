"""commlib: the communication layer trainers import instead of torch.distributed or torchcomms.

    comm = commlib.init()                       # from torchrun's environment; also torch's default group
    torch.distributed.init_process_group(backend="commlib")   # or: an unmodified trainer, one word changed
    comm = commlib.current()                    # the Communicator behind any torch.distributed group
    comm.all_reduce(t); comm.all_gather_single(out, inp); comm.reduce_scatter_single(out, inp)
    with commlib.context(step=3, phase="backward"): ...
    commlib.check()                             # once a step: a GPU collective's failure, raised here

One stable API (torchcomms' names) over torchcomms or torch.distributed, per-collective
deadlines, typed errors naming the ranks that did not arrive, structured logs, a flight
recorder and a progress board. See docs/using-commlib.md.

Names are imported lazily, so tools that only read logs (`python -m commlib.doctor`) start
without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Communicator": "commlib.communicator",
    "Work": "commlib.communicator",
    "CommError": "commlib.errors",
    "CollectiveTimeout": "commlib.errors",
    "PeerFailure": "commlib.errors",
    "CollectiveMismatch": "commlib.errors",
    "CommAborted": "commlib.errors",
    "WaitTimeout": "commlib.errors",
    "find_comm_error": "commlib.errors",
    "register_pre_hook": "commlib.hooks",
    "register_post_hook": "commlib.hooks",
    "register_failure_hook": "commlib.hooks",
    "init": "commlib.initialize",
    "current": "commlib.process_group",
    "EngineOptions": "commlib.engines",
    "Recovered": "commlib.recovery",
    "Recovery": "commlib.recovery",
    "RecoveryFailed": "commlib.recovery",
    "RecoveryPolicy": "commlib.recovery",
    "check": "commlib.communicator",
    "context": "commlib.record.log",
    "get_logger": "commlib.record.log",
    "Collective": "commlib.ops",
    "OpName": "commlib.ops",
    "PremulSum": "commlib.ops",
    "ReduceOp": "commlib.ops",
    "premul_sum": "commlib.ops",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'commlib' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
