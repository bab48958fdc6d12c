"""Local checks of a collective's arguments, run by `Communicator` before anything is sent.

Called from exactly one place (`Communicator._issue`), so bad input is rejected on the rank
that made it, before any rank blocks. Messages say what was expected, what was found, the
op, the communicator and the rank.
"""

from __future__ import annotations

from datetime import timedelta

import torch

from commlib.ops import Collective, OpName, PremulSum, ReduceOp, reduction_kind

_INTEGER_ONLY = {ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR}
_FLOAT_ONLY = {ReduceOp.AVG, ReduceOp.PREMUL_SUM}


def seconds(timeout: float | timedelta | None, what: str = "timeout") -> float | None:
    """A timeout given as seconds or timedelta, as positive seconds (None stays None)."""
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        value = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        value = float(timeout)
    else:
        raise TypeError(f"{what} must be seconds (float) or a timedelta; found {type(timeout).__name__}")
    if not value > 0:
        raise ValueError(f"{what} must be positive; found {value} s")
    return value


class _Checker:
    def __init__(self, call: Collective) -> None:
        self.call = call

    def fail(self, exc_type: type[Exception], problem: str) -> Exception:
        c = self.call
        return exc_type(f"{c.op} on {c.comm!r} rank {c.rank}: {problem}")

    def tensor(self, t: object, role: str) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise self.fail(TypeError, f"expected {role} to be a torch.Tensor; found {type(t).__name__}")
        if not t.is_contiguous():
            raise self.fail(ValueError, f"expected {role} to be contiguous; found strides {t.stride()} for shape {tuple(t.shape)}")
        return t

    def tensor_list(self, ts: object, role: str, length: int) -> list[torch.Tensor]:
        if not isinstance(ts, (list, tuple)):
            raise self.fail(TypeError, f"expected {role} to be a list of tensors; found {type(ts).__name__}")
        if len(ts) != length:
            raise self.fail(ValueError, f"expected {role} to hold {length} tensors (one per rank); found {len(ts)}")
        return [self.tensor(t, f"{role}[{i}]") for i, t in enumerate(ts)]

    def rank_arg(self, value: object, role: str) -> None:
        c = self.call
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fail(TypeError, f"expected {role} to be an int rank; found {type(value).__name__}")
        if not 0 <= value < c.size:
            raise self.fail(ValueError, f"expected {role} in [0, {c.size}); found {value}")

    def same_dtype(self, a: torch.Tensor, b: torch.Tensor, what: str) -> None:
        if a.dtype != b.dtype:
            raise self.fail(TypeError, f"expected {what} dtypes to match; found {a.dtype} and {b.dtype}")

    def same_shape(self, a: torch.Tensor, b: torch.Tensor, what: str) -> None:
        if a.shape != b.shape:
            raise self.fail(ValueError, f"expected {what} shapes to match; found {tuple(a.shape)} and {tuple(b.shape)}")


def check_call(call: Collective, unsupported: "callable") -> None:  # type: ignore[valid-type]
    """Raise TypeError/ValueError when `call` is malformed on this rank.

    `unsupported(device, reduce_op)` is the backend's `supports`: None if it can serve them.
    """
    chk = _Checker(call)
    op, n = call.op, call.size

    for name in ("tensor", "input", "output"):
        t = getattr(call, name)
        if t is not None:
            chk.tensor(t, name)
    if call.root is not None:
        chk.rank_arg(call.root, "root")
    if call.peer is not None:
        role = "dst" if op is OpName.SEND else "src"
        chk.rank_arg(call.peer, role)
        if call.peer == call.rank:
            raise chk.fail(ValueError, f"expected {role} to be another rank than this one; found {call.peer}")

    if op is OpName.ALL_GATHER_SINGLE:
        chk.same_dtype(call.output, call.input, "output and input")
        if call.output.numel() != n * call.input.numel():
            raise chk.fail(ValueError, f"expected output of {n} x {call.input.numel()} = {n * call.input.numel()} "
                                       f"elements (size x input); found {call.output.numel()}")
    elif op is OpName.REDUCE_SCATTER_SINGLE:
        chk.same_dtype(call.output, call.input, "output and input")
        if call.input.numel() % n:
            raise chk.fail(ValueError, f"expected input elements divisible by size {n}; found {call.input.numel()}")
        if call.input.numel() != n * call.output.numel():
            raise chk.fail(ValueError, f"expected input of {n} x {call.output.numel()} = {n * call.output.numel()} "
                                       f"elements (size x output); found {call.input.numel()}")
    elif op is OpName.ALL_TO_ALL_SINGLE:
        chk.same_dtype(call.output, call.input, "output and input")
        if call.input.numel() % n:
            raise chk.fail(ValueError, f"expected input elements divisible by size {n}; found {call.input.numel()}")
        if call.output.numel() != call.input.numel():
            raise chk.fail(ValueError, f"expected output of {call.input.numel()} elements like input; found {call.output.numel()}")
    elif op is OpName.ALL_GATHER:
        for t in chk.tensor_list(call.output_list, "tensor_list", n):
            chk.same_dtype(t, call.input, "tensor_list and tensor")
            chk.same_shape(t, call.input, "tensor_list and tensor")
    elif op is OpName.REDUCE_SCATTER:
        for t in chk.tensor_list(call.input_list, "input_list", n):
            chk.same_dtype(t, call.output, "input_list and output")
            chk.same_shape(t, call.output, "input_list and output")
    elif op is OpName.GATHER and call.rank == call.root:
        for t in chk.tensor_list(call.output_list, "output_tensor_list", n):
            chk.same_dtype(t, call.input, "output_tensor_list and input")
            chk.same_shape(t, call.input, "output_tensor_list and input")
    elif op is OpName.SCATTER and call.rank == call.root:
        for t in chk.tensor_list(call.input_list, "input_tensor_list", n):
            chk.same_dtype(t, call.output, "input_tensor_list and output")
            chk.same_shape(t, call.output, "input_tensor_list and output")

    tensors = call.tensors()
    for t in tensors:
        why = unsupported(t.device, call.reduce_op)
        if why:
            raise chk.fail(ValueError, f"expected a tensor the backend can serve ({why}); found one on {t.device}")
    if call.reduce_op is not None:
        _check_reduction(chk, call, tensors)


def _check_reduction(chk: _Checker, call: Collective, tensors: list[torch.Tensor]) -> None:
    if not isinstance(call.reduce_op, (ReduceOp, PremulSum)):
        raise chk.fail(TypeError, f"expected op to be a commlib.ReduceOp or commlib.premul_sum(f); "
                                  f"found {type(call.reduce_op).__name__} {call.reduce_op!r}")
    kind = reduction_kind(call.reduce_op)
    if kind is ReduceOp.PREMUL_SUM and not isinstance(call.reduce_op, PremulSum):
        raise chk.fail(TypeError, "expected PREMUL_SUM with its factor: commlib.premul_sum(factor)")
    for t in tensors:
        if kind in _INTEGER_ONLY and (t.is_floating_point() or t.is_complex()):
            raise chk.fail(TypeError, f"expected an integer or bool dtype for {kind}; found {t.dtype}")
        if kind in _FLOAT_ONLY and not t.is_floating_point():
            raise chk.fail(TypeError, f"expected a floating dtype for {kind}; found {t.dtype}")
        if t.is_complex() and kind in (ReduceOp.MIN, ReduceOp.MAX):
            raise chk.fail(TypeError, f"expected a real dtype for {kind}; found {t.dtype}")
