"""Local checks of a collective's arguments, run by `Communicator` before anything is sent.

Called from exactly one place (`Communicator._issue`, through its `CallChecker`), so bad
input is rejected on the rank that made it, before any rank blocks. Messages say what was
expected, what was found, the op, the communicator and the rank.

A training loop issues the same few calls again and again, so `CallChecker` remembers the
signatures of calls that passed `check_call`: what the rules read of a call (the op, each
tensor's type, dtype, device, contiguity and, where a rule compares sizes, element count;
the root, the peer and the reduction, with their types), and no more. A call whose
signature passed before is accepted without the rules; any other call (and every call with
tensor lists) takes the full check, so a bad call is rejected with the same message
whether or not good ones came before it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import timedelta
from typing import TypeAlias, overload

import torch

from commlib.ops import Collective, OpName, PremulSum, ReduceOp, Reduction, reduction_kind

# A backend's `supports`: None if it serves tensors on the device with the reduction, else why not.
Unsupported: TypeAlias = Callable[[torch.device, Reduction | None], str | None]

# The ops whose rules compare their two tensors' shapes (`_check_shapes`).
_SIZED = frozenset({OpName.ALL_GATHER_SINGLE, OpName.REDUCE_SCATTER_SINGLE, OpName.ALL_TO_ALL_SINGLE})

_INTEGER_ONLY = {ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR}
_FLOAT_ONLY = {ReduceOp.AVG, ReduceOp.PREMUL_SUM}


# A deadline as the API takes it: seconds, or a timedelta (`seconds` reads both).
Deadline = float | timedelta


@overload
def seconds(timeout: None, what: str = ...) -> None: ...
@overload
def seconds(timeout: Deadline, what: str = ...) -> float: ...
@overload
def seconds(timeout: Deadline | None, what: str = ...) -> float | None: ...


def seconds(timeout: Deadline | None, what: str = "timeout") -> float | None:
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


@functools.lru_cache(maxsize=64)
def deadline_timedelta(seconds_: float) -> timedelta:
    """An op's deadline as the timedelta backends take: one per distinct deadline, not per call."""
    return timedelta(seconds=seconds_)


def _fail(call: Collective, exc_type: type[Exception], problem: str) -> Exception:
    return exc_type(f"{call.op} on {call.comm!r} rank {call.rank}: {problem}")


def _tensor(call: Collective, t: object, role: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise _fail(call, TypeError, f"expected {role} to be a torch.Tensor; found {type(t).__name__}")
    if not t.is_contiguous():
        raise _fail(
            call, ValueError, f"expected {role} to be contiguous; found strides {t.stride()} for shape {tuple(t.shape)}"
        )
    return t


def _tensor_list(call: Collective, ts: object, role: str) -> list[torch.Tensor]:
    if not isinstance(ts, (list, tuple)):
        raise _fail(call, TypeError, f"expected {role} to be a list of tensors; found {type(ts).__name__}")
    if len(ts) != call.size:
        raise _fail(call, ValueError, f"expected {role} to hold {call.size} tensors (one per rank); found {len(ts)}")
    return [_tensor(call, t, f"{role}[{i}]") for i, t in enumerate(ts)]


def _rank_arg(call: Collective, value: object, role: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _fail(call, TypeError, f"expected {role} to be an int rank; found {type(value).__name__}")
    if not 0 <= value < call.size:
        raise _fail(call, ValueError, f"expected {role} in [0, {call.size}); found {value}")


def _same_dtype(call: Collective, a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.dtype != b.dtype:
        raise _fail(call, TypeError, f"expected {what} dtypes to match; found {a.dtype} and {b.dtype}")


def _like(call: Collective, ts: list[torch.Tensor], one: torch.Tensor, what: str) -> None:
    """Every tensor of a per-rank list has `one`'s dtype and shape."""
    for t in ts:
        _same_dtype(call, t, one, what)
        if t.shape != one.shape:
            raise _fail(
                call, ValueError, f"expected {what} shapes to match; found {tuple(t.shape)} and {tuple(one.shape)}"
            )


def _concatenated(call: Collective, big: torch.Tensor, small: torch.Tensor, big_role: str, small_role: str) -> None:
    """`big` must be `size` copies of `small` along its first dimension, as every engine takes
    it (gloo refuses the stacked (size, *shape) form NCCL would take: one rule for both)."""
    n, shape = call.size, tuple(small.shape)
    expected = (n * shape[0], *shape[1:]) if shape else (n,)
    if tuple(big.shape) != expected:
        raise _fail(
            call,
            ValueError,
            f"expected {big_role} of shape {expected} ({n} x {small_role} {shape}, "
            f"along the first dimension); found {tuple(big.shape)}",
        )


def check_call(call: Collective, unsupported: Unsupported) -> None:
    """Raise TypeError/ValueError when `call` is malformed on this rank.

    `unsupported(device, reduce_op)` is the backend's `supports`: None if it can serve them.
    The full check: `CallChecker` runs it on every call whose signature has not passed it
    yet. Single-tensor ops skip the per-op shape rules, and the dtype rules of a reduction
    are looked up, not recomputed.
    """
    op = call.op
    if call.tensor is not None:
        tensors = [_tensor(call, call.tensor, "tensor")]
    else:
        if call.input is not None:
            _tensor(call, call.input, "input")
        if call.output is not None:
            _tensor(call, call.output, "output")
        _check_shapes(call)
        tensors = call.tensors()
    if call.root is not None:
        _rank_arg(call, call.root, "root")
    if call.peer is not None:
        role = "dst" if op is OpName.SEND else "src"
        _rank_arg(call, call.peer, role)
        if call.peer == call.rank:
            raise _fail(call, ValueError, f"expected {role} to be another rank than this one; found {call.peer}")

    devices = {t.device for t in tensors}
    for device in devices:
        why = unsupported(device, call.reduce_op)
        if why:
            raise _fail(call, ValueError, f"expected a tensor the backend can serve ({why}); found one on {device}")
    if call.reduce_op is not None:
        _check_reduction(call, tensors)


def _check_shapes(call: Collective) -> None:
    """The shape and dtype rules of the ops that take an input and an output (or lists)."""
    op, n = call.op, call.size
    if op is OpName.ALL_GATHER_SINGLE:
        _same_dtype(call, call.output, call.input, "output and input")
        _concatenated(call, call.output, call.input, "output", "input")
    elif op is OpName.REDUCE_SCATTER_SINGLE:
        _same_dtype(call, call.output, call.input, "output and input")
        _concatenated(call, call.input, call.output, "input", "output")
    elif op is OpName.ALL_TO_ALL_SINGLE:
        _same_dtype(call, call.output, call.input, "output and input")
        assert call.input is not None and call.output is not None  # the API's all_to_all_single takes both
        if call.input.dim() == 0 or call.input.shape[0] % n:
            raise _fail(
                call,
                ValueError,
                f"expected input's first dimension divisible by size {n}; found shape {tuple(call.input.shape)}",
            )
        if call.output.shape != call.input.shape:
            raise _fail(
                call,
                ValueError,
                f"expected output of input's shape {tuple(call.input.shape)}; found {tuple(call.output.shape)}",
            )
    elif op is OpName.ALL_GATHER:
        _like(call, _tensor_list(call, call.output_list, "tensor_list"), call.input, "tensor_list and tensor")
    elif op is OpName.REDUCE_SCATTER:
        _like(call, _tensor_list(call, call.input_list, "input_list"), call.output, "input_list and output")
    elif op is OpName.GATHER and call.rank == call.root:
        _like(
            call, _tensor_list(call, call.output_list, "output_tensor_list"), call.input, "output_tensor_list and input"
        )
    elif op is OpName.SCATTER and call.rank == call.root:
        _like(
            call, _tensor_list(call, call.input_list, "input_tensor_list"), call.output, "input_tensor_list and output"
        )


def _check_reduction(call: Collective, tensors: list[torch.Tensor]) -> None:
    op = call.reduce_op
    if not isinstance(op, (ReduceOp, PremulSum)):
        raise _fail(
            call,
            TypeError,
            f"expected op to be a commlib.ReduceOp or commlib.premul_sum(f); found {type(op).__name__} {op!r}",
        )
    kind = reduction_kind(op)
    if kind is ReduceOp.PREMUL_SUM and not isinstance(op, PremulSum):
        raise _fail(call, TypeError, "expected PREMUL_SUM with its factor: commlib.premul_sum(factor)")
    for t in tensors:
        expected = _dtype_rule(kind, t.dtype)
        if expected:
            raise _fail(call, TypeError, f"expected {expected} for {kind}; found {t.dtype}")


@functools.cache
def _dtype_rule(kind: ReduceOp, dtype: torch.dtype) -> str | None:
    """What dtype `kind` expects, when `dtype` is not one; None when it is."""
    if kind in _INTEGER_ONLY and (dtype.is_floating_point or dtype.is_complex):
        return "an integer or bool dtype"
    if kind in _FLOAT_ONLY and not dtype.is_floating_point:
        return "a floating dtype"
    if dtype.is_complex and kind in (ReduceOp.MIN, ReduceOp.MAX):
        return "a real dtype"
    return None


class CallChecker:
    """`check_call` for one communicator, skipped for call signatures that passed it before.

    The communicator's rank, size and backend are fixed, so a signature (module docstring)
    decides the outcome of every rule. At most `MAX_SIGNATURES` are kept; later new ones
    are checked in full every time.
    """

    MAX_SIGNATURES = 4096

    def __init__(self, unsupported: Unsupported) -> None:
        self._unsupported = unsupported
        self._passed: set[tuple[object, ...]] = set()

    def check(self, call: Collective) -> None:
        """Raise TypeError/ValueError when `call` is malformed on this rank (`check_call`)."""
        t = call.tensor
        # The common case (one tensor, a plain reduction or none) keyed here, not in `_signature`:
        # this runs on every collective.
        if t is not None and type(t) is torch.Tensor and type(call.reduce_op) in _PLAIN_REDUCTIONS:
            key: tuple[object, ...] | None = (
                call.op,
                call.reduce_op,
                type(call.root),
                call.root,
                type(call.peer),
                call.peer,
                t.dtype,
                t.device,
                t.is_contiguous(),
            )
        else:
            key = _signature(call)
        if key is not None:
            try:
                if key in self._passed:
                    return
            except TypeError:  # an unhashable root or peer: the full check says what is wrong with it
                key = None
        check_call(call, self._unsupported)
        if key is not None and len(self._passed) < self.MAX_SIGNATURES:
            self._passed.add(key)


_PLAIN_REDUCTIONS = (ReduceOp, type(None))


def _signature(call: Collective) -> tuple[object, ...] | None:
    """What the rules of `check_call` read of `call`; None for calls always checked in full.

    Every value comes with its type where the rules check types: `ReduceOp.SUM == "sum"`
    and `True == 1`, but only the first of each passes.
    """
    if call.input_list is not None or call.output_list is not None:
        return None  # per-rank lists: a signature would cost as much as the rules
    red = call.reduce_op
    red_type = type(red)
    if red_type is PremulSum:
        # red_type is PremulSum: narrowed by type(), which mypy does not follow.
        red = red.kind  # type: ignore[union-attr]  # the factor is no rule's concern
    elif red is not None and red_type is not ReduceOp:
        return None
    root, peer, t = call.root, call.peer, call.tensor
    if t is not None:  # the common case, built in one go
        if not isinstance(t, torch.Tensor):
            return None
        return (
            call.op,
            red_type,
            red,
            type(root),
            root,
            type(peer),
            peer,
            type(t),
            t.dtype,
            t.device,
            t.is_contiguous(),
        )
    head = (call.op, red_type, red, type(root), root, type(peer), peer)
    sized = call.op in _SIZED
    tensors: list[object] = []
    for t in (call.input, call.output):
        if t is None:
            tensors.append(None)
        elif isinstance(t, torch.Tensor):
            tensors += (type(t), t.dtype, t.device, t.is_contiguous(), t.shape if sized else None)
        else:
            return None
    return (*head, *tensors)
