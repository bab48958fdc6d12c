"""The vocabulary of a collective call: op names, reductions (and torch.distributed's spellings
of them, `to_reduction`), and the `Collective` record.

A `Collective` describes one call as it travels the single path in `Communicator`: hooks
see it, the flight recorder and logs describe it, and a backend launches it. Field names
follow torchcomms' per-op argument objects (`tensor`, `input`, `output`, `root`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as _c10d


class OpName(enum.StrEnum):
    """Canonical (torchcomms) names of every operation a Communicator issues."""

    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    ALL_GATHER = "all_gather"
    ALL_GATHER_SINGLE = "all_gather_single"
    REDUCE_SCATTER = "reduce_scatter"
    REDUCE_SCATTER_SINGLE = "reduce_scatter_single"
    ALL_TO_ALL_SINGLE = "all_to_all_single"
    GATHER = "gather"
    SCATTER = "scatter"
    SEND = "send"
    RECV = "recv"
    BARRIER = "barrier"


class ReduceOp(enum.StrEnum):
    """Reductions. `PREMUL_SUM` needs a factor: build it with `premul_sum(factor)`."""

    SUM = "sum"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"
    AVG = "avg"
    PREMUL_SUM = "premul_sum"


@dataclass(frozen=True)
class PremulSum:
    """Sum of every rank's input multiplied by `factor` (torchcomms' PREMUL_SUM(factor))."""

    factor: float
    kind: ReduceOp = ReduceOp.PREMUL_SUM

    def __str__(self) -> str:
        return f"premul_sum({self.factor})"


Reduction = ReduceOp | PremulSum

# For code that runs on every collective: reading a member through its enum class goes
# through EnumType.__getattr__ (on Python 3.11, ~100 ns, 5-10x a module global), and so does
# a member's `.value` (an enum property): `PLAIN_NAMES[op]` is the op's name as a plain str.
_RECV = OpName.RECV
PLAIN_NAMES: dict[OpName, str] = {op: op.value for op in OpName}


def premul_sum(factor: float) -> PremulSum:
    """The PREMUL_SUM reduction with the given factor."""
    return PremulSum(float(factor))


_FROM_TORCH = {
    _c10d.ReduceOp.SUM: ReduceOp.SUM,
    _c10d.ReduceOp.PRODUCT: ReduceOp.PRODUCT,
    _c10d.ReduceOp.MIN: ReduceOp.MIN,
    _c10d.ReduceOp.MAX: ReduceOp.MAX,
    _c10d.ReduceOp.BAND: ReduceOp.BAND,
    _c10d.ReduceOp.BOR: ReduceOp.BOR,
    _c10d.ReduceOp.BXOR: ReduceOp.BXOR,
    _c10d.ReduceOp.AVG: ReduceOp.AVG,
}


def to_reduction(op: Any) -> Reduction:
    """A commlib reduction from a commlib or torch.distributed one.

    torch.distributed spells a reduction as a bare `ReduceOp.RedOpType` (`ReduceOp.SUM`), a
    `ReduceOp` object wrapping one (`ReduceOp(ReduceOp.MAX)`), or `ReduceOp.PREMUL_SUM(factor)`,
    whose `.op` and `.factor` carry the kind and the factor (FSDP2 passes that one when a
    gradient divide factor is set).
    """
    if isinstance(op, (ReduceOp, PremulSum)):
        return op
    kind = getattr(op, "op", op)
    if kind == _c10d.ReduceOp.PREMUL_SUM:
        if op is kind:
            raise TypeError("commlib: expected ReduceOp.PREMUL_SUM(factor); found PREMUL_SUM without a factor")
        factor = getattr(op, "factor", None)
        if factor is None:
            # Before torch 2.13, `_make_nccl_premul_sum(f)` (FSDP2's gradient divide factor on
            # nccl) builds a ReduceOp whose factor Python cannot read back.
            raise TypeError(
                f"commlib: expected a PREMUL_SUM ReduceOp whose factor can be read (torch >= 2.13); "
                f"found one without `.factor` on torch {torch.__version__}: pass "
                f"commlib.premul_sum(factor) instead"
            )
        return premul_sum(float(factor.item() if isinstance(factor, torch.Tensor) else factor))
    try:
        return _FROM_TORCH[kind]
    except (KeyError, TypeError):
        raise TypeError(f"commlib: expected a commlib or torch.distributed ReduceOp; found {op!r}") from None


def reduction_kind(op: Reduction) -> ReduceOp:
    return op.kind if isinstance(op, PremulSum) else op


@dataclass(slots=True)
class Collective:
    """One call on a communicator, from validation to completion.

    Only the tensor fields that the op takes are set. `peer` is the other rank of a
    send/recv; `root` the root of a rooted collective; both are communicator ranks.
    """

    # `Communicator._call` passes every field in this order (positional: cheaper per call).
    op: OpName
    comm: str
    rank: int
    size: int
    async_op: bool
    deadline_s: float
    seq: int = -1
    tensor: torch.Tensor | None = None
    input: torch.Tensor | None = None
    output: torch.Tensor | None = None
    input_list: list[torch.Tensor] | None = None
    output_list: list[torch.Tensor] | None = None
    root: int | None = None
    peer: int | None = None
    reduce_op: Reduction | None = None
    context: dict[str, object] = field(default_factory=dict)
    tag: int = 0  # a send/recv's: its messages with the peer are matched and numbered per tag

    def inputs(self) -> list[torch.Tensor]:
        """Tensors the op reads on this rank."""
        return self._side(self.input, self.input_list, OpName.RECV)

    def outputs(self) -> list[torch.Tensor]:
        """Tensors the op writes on this rank."""
        return self._side(self.output, self.output_list, OpName.SEND)

    def _side(self, one: torch.Tensor | None, many: list[torch.Tensor] | None, not_of: OpName) -> list[torch.Tensor]:
        """One side of the op: its in-place tensor (which the op `not_of` only sends or only
        receives into, so that side has none), else its single tensor, else its list."""
        if self.tensor is not None:
            return [self.tensor] if self.op is not not_of else []
        if one is not None:
            return [one]
        return list(many or [])

    def tensors(self) -> list[torch.Tensor]:
        if self.tensor is not None:
            return [self.tensor]
        seen: dict[int, torch.Tensor] = {}
        for t in self.inputs() + self.outputs():
            seen.setdefault(id(t), t)
        return list(seen.values())

    def nbytes(self) -> int:
        """Bytes this rank contributes: the message size used for bandwidth figures."""
        if self.tensor is not None:  # the common case, kept cheap: this runs on every collective
            return self.tensor.nbytes if self.op is not _RECV else 0
        return sum(t.nbytes for t in self.inputs())

    def fingerprint(self) -> dict[str, object]:
        """What every rank must agree on for the call to be well formed."""
        fp: dict[str, object] = {"op": self.op.value}
        if self.reduce_op is not None:
            fp["reduce_op"] = str(self.reduce_op)
        if self.root is not None:
            fp["root"] = self.root
        if self.op in (OpName.SEND, OpName.RECV):
            return fp  # point-to-point: only the pair has to agree, and not on direction
        # Rooted list arguments exist only on the root, so compare the per-rank tensor.
        per_rank = {
            OpName.GATHER: lambda: [self.input],
            OpName.SCATTER: lambda: [self.output],
        }.get(self.op, self.tensors)()
        fp["shapes"] = [list(t.shape) for t in per_rank if t is not None]
        fp["dtypes"] = sorted({str(t.dtype) for t in per_rank if t is not None})
        return fp
