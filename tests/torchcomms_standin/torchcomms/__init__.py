"""A strict, test-only stand-in for ``torchcomms`` (meta-pytorch/torchcomms), gloo on CPU only.

TEST-ONLY. This package lives under ``tests/torchcomms_standin`` and must NEVER ship with
commlib or be installed: tests put ``tests/torchcomms_standin`` on ``sys.path`` so that
``import torchcomms`` finds it where the real torchcomms cannot be installed. It mirrors the
Python surface of torchcomms' bindings and the observed behaviour of its gloo backend
(signatures, error texts, timeouts that kill the communicator, hooks, split), implemented over
``torch.distributed.ProcessGroupGloo`` without touching c10d's global state.
See ``tests/torchcomms_standin/README.md`` for what it enforces and what it does not emulate.
"""

from typing import TYPE_CHECKING, Any

# torch.distributed probes ``torchcomms._comms._BackendWrapper`` (and torch 2.14+
# ``is_backend_built``) while torch itself is being imported (to route c10d through
# torchcomms). ``_comms`` raises ImportError unless TORCHCOMMS_STANDIN_BACKEND_WRAPPER=1, so by
# default that probe fails and c10d stays unaware of the stand-in; to let the probe run cleanly
# mid-import, importing this package must not import torch: names load lazily on first use.
if TYPE_CHECKING:
    from ._comm import TorchComm, TorchWork, new_comm
    from ._types import (
        AllGatherPreHookArgs,
        AllGatherSinglePreHookArgs,
        AllReducePreHookArgs,
        AllToAllPreHookArgs,
        AllToAllSinglePreHookArgs,
        AllToAllVSinglePreHookArgs,
        BarrierPreHookArgs,
        BroadcastPreHookArgs,
        CollectivePostHookArgs,
        CommOptions,
        FinalizePostHookArgs,
        FinalizePreHookArgs,
        GatherPreHookArgs,
        GatherSinglePreHookArgs,
        OpName,
        RecvPreHookArgs,
        RedOpType,
        ReduceOp,
        ReducePreHookArgs,
        ReduceScatterPreHookArgs,
        ReduceScatterSinglePreHookArgs,
        RemovableHandle,
        ScatterPreHookArgs,
        SendPreHookArgs,
        SplitPostHookArgs,
        SplitPreHookArgs,
        WorkStatus,
    )

_FROM_COMM = frozenset({"new_comm", "TorchComm", "TorchWork"})


def __getattr__(name: str) -> Any:
    if name in _FROM_COMM:
        from . import _comm as module
    elif name in __all__:
        from . import _types as module  # type: ignore[no-redef]
    else:
        raise AttributeError(f"module 'torchcomms' (test stand-in) has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


#: Marks this module as the test stand-in (tests may assert it; commlib must not use it).
_IS_TEST_STANDIN = True


def is_backend_built(backend: str) -> bool:
    """Whether this build has ``backend`` (torch 2.14+ imports this): the stand-in has gloo."""
    return backend == "gloo"

__all__ = [
    "new_comm",
    "TorchComm",
    "TorchWork",
    "ReduceOp",
    "RedOpType",
    "OpName",
    "WorkStatus",
    "CommOptions",
    "RemovableHandle",
    "SendPreHookArgs",
    "RecvPreHookArgs",
    "BroadcastPreHookArgs",
    "AllReducePreHookArgs",
    "ReducePreHookArgs",
    "AllGatherPreHookArgs",
    "AllGatherSinglePreHookArgs",
    "ReduceScatterPreHookArgs",
    "ReduceScatterSinglePreHookArgs",
    "AllToAllSinglePreHookArgs",
    "AllToAllVSinglePreHookArgs",
    "AllToAllPreHookArgs",
    "BarrierPreHookArgs",
    "ScatterPreHookArgs",
    "GatherPreHookArgs",
    "GatherSinglePreHookArgs",
    "SplitPreHookArgs",
    "FinalizePreHookArgs",
    "CollectivePostHookArgs",
    "SplitPostHookArgs",
    "FinalizePostHookArgs",
]
