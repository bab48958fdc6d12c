"""Value types of the torchcomms stand-in: pybind-like enums, ``ReduceOp``, hook handles.

TEST-ONLY: part of the torchcomms stand-in under tests/; it must never ship with commlib.
The shapes mirror torchcomms' Python bindings (meta-pytorch/torchcomms, TorchCommPy.cpp);
see ../README.md for what is and is not emulated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, ClassVar

import torch

__all__ = ["RedOpType", "ReduceOp", "OpName", "CommOptions", "RemovableHandle"]


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
        self._value = value

    def __init_subclass__(cls, names: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._NAMES = tuple(names.split())
        cls.__members__ = {name: cls(value) for value, name in enumerate(cls._NAMES)}
        for name, member in cls.__members__.items():
            setattr(cls, name, member)

    @property
    def name(self) -> str:
        return self._NAMES[self._value]

    def _copy(self) -> Any:
        """What Python receives when the binding hands this value out: a new object."""
        return type(self)(self._value)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._value == self._value  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self._value)

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self.name}: {self._value}>"


class RedOpType(_PybindEnum, names="SUM PRODUCT MIN MAX BAND BOR BXOR PREMUL_SUM AVG"):
    """Kind of a reduction, as ``torchcomms.RedOpType``."""


class OpName(
    _PybindEnum,
    names="send recv broadcast all_reduce reduce all_gather all_gather_v all_gather_single "
    "reduce_scatter reduce_scatter_v reduce_scatter_single all_to_all_single "
    "all_to_all_v_single all_to_all barrier scatter gather gather_single split new_window "
    "finalize",
):
    """Name passed as the first argument of a pre-hook, as ``torchcomms.OpName``."""


class ReduceOp:
    """A reduction for torchcomms collectives: ``ReduceOp.SUM`` ... or ``PREMUL_SUM(factor)``.

    As in torchcomms, only ``type`` is readable from Python; the premul factor is private.
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

    def __init__(self, opType: RedOpType) -> None:  # noqa: N803 - the binding's name
        if not isinstance(opType, RedOpType) or opType == RedOpType.PREMUL_SUM:
            raise TypeError(f"ReduceOp(opType) takes a torchcomms.RedOpType other than "
                            f"PREMUL_SUM (use ReduceOp.PREMUL_SUM(factor)), got {opType!r}")
        self._type: RedOpType = opType
        self._factor: float | torch.Tensor | None = None

    @staticmethod
    def PREMUL_SUM(factor: Any) -> ReduceOp:  # noqa: N802 - the binding's name
        """A sum of ``input * factor``; ``factor`` is a number or a (scalar) tensor."""
        if isinstance(factor, bool) or not isinstance(factor, int | float | torch.Tensor):
            raise TypeError("ReduceOp.PREMUL_SUM(factor) takes a float or a tensor, got "
                            f"{type(factor).__name__}")
        op = ReduceOp(RedOpType.SUM)
        op._type = RedOpType.PREMUL_SUM
        op._factor = factor if isinstance(factor, torch.Tensor) else float(factor)
        return op

    @property
    def type(self) -> RedOpType:
        return self._type._copy()


for _kind in RedOpType.__members__.values():
    if _kind != RedOpType.PREMUL_SUM:
        setattr(ReduceOp, _kind.name, ReduceOp(_kind))
del _kind


@dataclass
class CommOptions:
    """What ``TorchComm.get_options()`` returns (a copy)."""

    abort_process_on_timeout_or_error: bool
    timeout: timedelta
    hints: dict[str, str] = field(default_factory=dict)


class RemovableHandle:
    """Handle returned by ``register_*_hook``; ``remove()`` unregisters (idempotent)."""

    __slots__ = ("_key", "_table")

    def __init__(self, table: dict[int, Any], key: int) -> None:
        self._table, self._key = table, key

    def remove(self) -> None:
        self._table.pop(self._key, None)
