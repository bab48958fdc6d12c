"""Value types of the torchcomms stand-in: reduce ops, hook names and hook argument objects.

TEST-ONLY: part of the torchcomms stand-in under tests/; it must never ship with commlib.
The shapes mirror torchcomms' Python bindings (meta-pytorch/torchcomms, TorchCommPy.cpp);
see ../README.md for what is and is not emulated.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, ClassVar

import torch

__all__ = [
    "RedOpType",
    "ReduceOp",
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


class RedOpType(enum.Enum):
    """Kind of a reduction, as ``torchcomms.RedOpType``."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BAND = 4
    BOR = 5
    BXOR = 6
    PREMUL_SUM = 7
    AVG = 8


PremulFactor = float | torch.Tensor


class ReduceOp:
    """A reduction for torchcomms collectives.

    Use the class attributes (``ReduceOp.SUM`` ...) or ``ReduceOp.PREMUL_SUM(factor)``.
    As in torchcomms, only ``type`` is readable from Python; the premul factor is private,
    and there is no value equality (compare ``op.type`` instead).
    """

    SUM: ClassVar[ReduceOp]
    PRODUCT: ClassVar[ReduceOp]
    MIN: ClassVar[ReduceOp]
    MAX: ClassVar[ReduceOp]
    BAND: ClassVar[ReduceOp]
    BOR: ClassVar[ReduceOp]
    BXOR: ClassVar[ReduceOp]
    AVG: ClassVar[ReduceOp]

    __slots__ = ("_factor", "_type")
    _type: RedOpType
    _factor: PremulFactor | None

    def __init__(self, opType: RedOpType) -> None:  # noqa: N803 - the binding's name
        if not isinstance(opType, RedOpType):
            raise TypeError(
                f"ReduceOp(opType) takes a torchcomms.RedOpType, got {type(opType).__name__}"
            )
        if opType is RedOpType.PREMUL_SUM:
            raise TypeError("construct a premul-sum op with ReduceOp.PREMUL_SUM(factor)")
        self._type = opType
        self._factor = None

    @staticmethod
    def PREMUL_SUM(factor: Any) -> ReduceOp:  # noqa: N802 - the binding's name
        """A sum of ``input * factor``; ``factor`` is a number or a (scalar) tensor."""
        if isinstance(factor, bool) or not isinstance(factor, int | float | torch.Tensor):
            raise TypeError(
                "ReduceOp.PREMUL_SUM(factor) takes a float or a tensor, got "
                f"{type(factor).__name__}"
            )
        op = object.__new__(ReduceOp)
        op._type = RedOpType.PREMUL_SUM
        op._factor = factor if isinstance(factor, torch.Tensor) else float(factor)
        return op

    @property
    def type(self) -> RedOpType:
        return self._type

    def __copy__(self) -> ReduceOp:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> ReduceOp:
        return self

    def __repr__(self) -> str:
        if self._type is RedOpType.PREMUL_SUM:
            return f"ReduceOp.PREMUL_SUM({self._factor!r})"
        return f"ReduceOp.{self._type.name}"


for _kind in RedOpType:
    if _kind is not RedOpType.PREMUL_SUM:
        setattr(ReduceOp, _kind.name, ReduceOp(_kind))
del _kind


class OpName(enum.Enum):
    """Name passed as the first argument of a pre-hook, as ``torchcomms.OpName``."""

    send = 0
    recv = 1
    broadcast = 2
    all_reduce = 3
    reduce = 4
    all_gather = 5
    all_gather_v = 6
    all_gather_single = 7
    reduce_scatter = 8
    reduce_scatter_v = 9
    reduce_scatter_single = 10
    all_to_all_single = 11
    all_to_all_v_single = 12
    all_to_all = 13
    barrier = 14
    scatter = 15
    gather = 16
    gather_single = 17
    split = 18
    new_window = 19
    finalize = 20


class WorkStatus(enum.Enum):
    """Life cycle of a ``TorchWork``, as ``torchcomms.WorkStatus``."""

    NOT_STARTED = 0
    INPROGRESS = 1
    COMPLETED = 2
    TIMEDOUT = 3
    ERROR = 4


@dataclass
class CommOptions:
    """What ``TorchComm.get_options()`` returns (a copy; the store is not kept)."""

    abort_process_on_timeout_or_error: bool = True
    timeout: timedelta = timedelta(seconds=600)
    store: Any = None
    enable_reconfigure: bool = False
    hints: dict[str, str] = field(default_factory=dict)


class RemovableHandle:
    """Handle returned by ``register_*_hook``; ``remove()`` unregisters (idempotent)."""

    __slots__ = ("_remove", "_lock")

    def __init__(self, remove: Callable[[], None]) -> None:
        self._remove: Callable[[], None] | None = remove
        self._lock = threading.Lock()

    def remove(self) -> None:
        with self._lock:
            remove, self._remove = self._remove, None
        if remove is not None:
            remove()


# -- pre-hook argument objects (attribute names as in torchcomms' bindings) -------------------


@dataclass(frozen=True, eq=False)
class SendPreHookArgs:
    tensor: torch.Tensor
    peer: int
    async_op: bool


@dataclass(frozen=True, eq=False)
class RecvPreHookArgs:
    tensor: torch.Tensor
    peer: int
    async_op: bool


@dataclass(frozen=True, eq=False)
class BroadcastPreHookArgs:
    tensor: torch.Tensor
    root: int
    async_op: bool


@dataclass(frozen=True, eq=False)
class AllReducePreHookArgs:
    tensor: torch.Tensor
    async_op: bool


@dataclass(frozen=True, eq=False)
class ReducePreHookArgs:
    tensor: torch.Tensor
    root: int
    async_op: bool


@dataclass(frozen=True, eq=False)
class AllGatherPreHookArgs:
    input: torch.Tensor
    output: list[torch.Tensor]
    async_op: bool


@dataclass(frozen=True, eq=False)
class AllGatherSinglePreHookArgs:
    input: torch.Tensor
    output: torch.Tensor
    async_op: bool


@dataclass(frozen=True, eq=False)
class ReduceScatterPreHookArgs:
    input: list[torch.Tensor]
    output: torch.Tensor
    async_op: bool


@dataclass(frozen=True, eq=False)
class ReduceScatterSinglePreHookArgs:
    input: torch.Tensor
    output: torch.Tensor
    async_op: bool


@dataclass(frozen=True, eq=False)
class AllToAllSinglePreHookArgs:
    input: torch.Tensor
    output: torch.Tensor
    async_op: bool


@dataclass(frozen=True, eq=False)
class AllToAllVSinglePreHookArgs:
    input: torch.Tensor
    output: torch.Tensor
    input_split_sizes: list[int]
    output_split_sizes: list[int]
    async_op: bool


@dataclass(frozen=True, eq=False)
class AllToAllPreHookArgs:
    input: list[torch.Tensor]
    output: list[torch.Tensor]
    async_op: bool


@dataclass(frozen=True, eq=False)
class BarrierPreHookArgs:
    async_op: bool


@dataclass(frozen=True, eq=False)
class ScatterPreHookArgs:
    output: torch.Tensor
    input: list[torch.Tensor]
    root: int
    async_op: bool


@dataclass(frozen=True, eq=False)
class GatherPreHookArgs:
    input: torch.Tensor
    output: list[torch.Tensor]
    root: int
    async_op: bool


@dataclass(frozen=True, eq=False)
class GatherSinglePreHookArgs:
    input: torch.Tensor
    output: torch.Tensor
    root: int
    async_op: bool


@dataclass(frozen=True, eq=False)
class SplitPreHookArgs:
    ranks: list[int]
    name: str


@dataclass(frozen=True, eq=False)
class FinalizePreHookArgs:
    pass


# -- post-hook argument objects (empty, as in torchcomms' bindings) ----------------------------


@dataclass(frozen=True, eq=False)
class CollectivePostHookArgs:
    pass


@dataclass(frozen=True, eq=False)
class SplitPostHookArgs:
    pass


@dataclass(frozen=True, eq=False)
class FinalizePostHookArgs:
    pass


PreHookArgs = (
    SendPreHookArgs
    | RecvPreHookArgs
    | BroadcastPreHookArgs
    | AllReducePreHookArgs
    | ReducePreHookArgs
    | AllGatherPreHookArgs
    | AllGatherSinglePreHookArgs
    | ReduceScatterPreHookArgs
    | ReduceScatterSinglePreHookArgs
    | AllToAllSinglePreHookArgs
    | AllToAllVSinglePreHookArgs
    | AllToAllPreHookArgs
    | BarrierPreHookArgs
    | ScatterPreHookArgs
    | GatherPreHookArgs
    | GatherSinglePreHookArgs
    | SplitPreHookArgs
    | FinalizePreHookArgs
)
PostHookArgs = CollectivePostHookArgs | SplitPostHookArgs | FinalizePostHookArgs
PreHook = Callable[[OpName, int, PreHookArgs], object]
PostHook = Callable[[int, PostHookArgs], object]
AbortHook = Callable[[], object]
