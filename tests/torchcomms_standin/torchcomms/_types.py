"""Value types of the torchcomms stand-in: reduce ops, hook names and hook argument objects.

TEST-ONLY: part of the torchcomms stand-in under tests/; it must never ship with commlib.
The shapes mirror torchcomms' Python bindings (meta-pytorch/torchcomms, TorchCommPy.cpp);
see ../README.md for what is and is not emulated.
"""

from __future__ import annotations

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


class _PybindEnum:
    """A value of a pybind11 ``enum_``, as torchcomms' enums are.

    Unlike ``enum.Enum``: every value that crosses the binding (a hook's ``op_name``,
    ``ReduceOp.type``) is a new object, so only ``==`` compares (``is`` is False); equality
    needs the same enum type; the class is not iterable (``__members__`` maps names to values).
    """

    __slots__ = ("_value",)
    _NAMES: ClassVar[tuple[str, ...]]
    __members__: ClassVar[dict[str, Any]]

    def __init__(self, value: int) -> None:
        if type(value) is not int or not 0 <= value < len(self._NAMES):
            raise ValueError(f"{type(self).__name__}({value!r}): not a value of this enum")
        self._value = value

    @property
    def name(self) -> str:
        return self._NAMES[self._value]

    @property
    def value(self) -> int:
        return self._value

    def _copy(self) -> Any:
        """What Python receives when the binding hands this value out: a new object."""
        return type(self)(self._value)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._value == self._value  # type: ignore

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(self._value)

    def __int__(self) -> int:
        return self._value

    def __index__(self) -> int:
        return self._value

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return type(self), (self._value,)

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self.name}: {self._value}>"

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


def _enum_values(cls: type[_PybindEnum], names: str) -> None:
    """Give ``cls`` its values 0, 1, ... as class attributes and in ``__members__``."""
    cls._NAMES = tuple(names.split())
    cls.__members__ = {name: cls(value) for value, name in enumerate(cls._NAMES)}
    for name, member in cls.__members__.items():
        setattr(cls, name, member)


class RedOpType(_PybindEnum):
    """Kind of a reduction, as ``torchcomms.RedOpType``."""

    SUM: ClassVar[RedOpType]
    PRODUCT: ClassVar[RedOpType]
    MIN: ClassVar[RedOpType]
    MAX: ClassVar[RedOpType]
    BAND: ClassVar[RedOpType]
    BOR: ClassVar[RedOpType]
    BXOR: ClassVar[RedOpType]
    PREMUL_SUM: ClassVar[RedOpType]
    AVG: ClassVar[RedOpType]


_enum_values(RedOpType, "SUM PRODUCT MIN MAX BAND BOR BXOR PREMUL_SUM AVG")


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
        if opType == RedOpType.PREMUL_SUM:
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
        return self._type._copy()

    def __copy__(self) -> ReduceOp:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> ReduceOp:
        return self

    def __repr__(self) -> str:
        if self._type == RedOpType.PREMUL_SUM:
            return f"ReduceOp.PREMUL_SUM({self._factor!r})"
        return f"ReduceOp.{self._type.name}"


for _kind in RedOpType.__members__.values():
    if _kind != RedOpType.PREMUL_SUM:
        setattr(ReduceOp, _kind.name, ReduceOp(_kind))
del _kind


class OpName(_PybindEnum):
    """Name passed as the first argument of a pre-hook, as ``torchcomms.OpName``."""


_enum_values(
    OpName,
    "send recv broadcast all_reduce reduce all_gather all_gather_v all_gather_single "
    "reduce_scatter reduce_scatter_v reduce_scatter_single all_to_all_single "
    "all_to_all_v_single all_to_all barrier scatter gather gather_single split new_window "
    "finalize",
)


class WorkStatus(_PybindEnum):
    """Life cycle of a ``TorchWork``, as ``torchcomms.WorkStatus``."""


_enum_values(WorkStatus, "NOT_STARTED INPROGRESS COMPLETED TIMEDOUT ERROR")


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
