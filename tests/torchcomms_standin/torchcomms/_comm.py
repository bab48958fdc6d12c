"""``new_comm``, ``TorchComm`` and ``TorchWork`` of the torchcomms stand-in, over gloo.

TEST-ONLY: this emulates torchcomms' gloo backend on CPU so commlib's torchcomms backend can
be tested where torchcomms cannot be installed. It must never ship with commlib.

Each communicator owns one ``torch.distributed.ProcessGroupGloo`` built directly on a store
(c10d's global state is never touched). Every op of the binding is one row of ``_OPS``: its
parameters (the binding's signature), its pre-hook fields, the checks torchcomms' gloo makes
and how it runs on the process group. ``TorchComm._call`` is the one path all of them take,
as torchcomms' ``TorchComm.cpp`` + ``TorchCommGloo.cpp`` do: pybind11's conversions -> rank
range -> op id and pre-hooks -> initialized? -> contiguity and the op's checks -> launch
(sync: wait, and run the abort hooks if it fails; async or CUDA-like: a ``TorchWork``) ->
post-hooks. Deadlines are gloo's own: a collective passes its timeout in the c10d options
("Timed out waiting ...ms for recv operation to complete", then "Application timeout caused
pair closure"), a point-to-point op passes it to ``Work.wait``. See ../README.md.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, make_dataclass, replace
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import torch
from torch._C import _distributed_c10d as c10d
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, Store, TCPStore

from . import _types
from ._types import CommOptions, OpName, RedOpType, ReduceOp, RemovableHandle

_log = logging.getLogger("torchcomms")

BACKEND = "gloo"
# torchcomms runs finalize's hooks under a sentinel op id (SIZE_MAX) instead of consuming one.
FINALIZE_OP_ID = 2**64 - 1
_PAIR_CLOSED = "Application timeout caused pair closure"
_TIMEOUT_MARKERS = ("Timed out waiting", _PAIR_CLOSED)
_NOT_EMULATED = "is not emulated by the torchcomms stand-in"
# Set to 1 to make communicators stream-ordered, as on CUDA: TorchWork.wait() does not block.
NONBLOCKING_WAIT_ENV = "TORCHCOMMS_STANDIN_NONBLOCKING_WAIT"

# One process-wide, increasing op id sequence shared by all communicators, as in torchcomms.
_next_op_id = functools.partial(next, itertools.count())
_next_hook_key = functools.partial(next, itertools.count())


# -- pybind11's conversions: what the binding rejects with TypeError --------------------------


def _type_name(value: object) -> str:
    return type(value).__module__ + "." + type(value).__qualname__


def _refuse(what: str, expected: str, value: object) -> Any:
    raise TypeError(f"{what} must be {expected}, got {_type_name(value)}")


def _as_bool(what: str, value: object) -> bool:
    """None is False, anything with ``__bool__`` converts (1, 0, 2.5), a string does not."""
    if value is None or getattr(type(value), "__bool__", None) is not None:
        try:
            return bool(value)
        except Exception:  # pybind11 turns a failing __bool__ into a failed conversion
            pass
    return _refuse(what, "a bool", value)


def _as_tensor(what: str, value: object) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else _refuse(what, "a torch.Tensor", value)


def _as_tensors(what: str, value: object) -> list[torch.Tensor]:
    if not isinstance(value, list | tuple):
        return _refuse(what, "a list of torch.Tensor", value)
    return [_as_tensor(f"every element of {what}", v) for v in value]


def _as_int(what: str, value: object, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (
            minimum is not None and value < minimum):
        return _refuse(what, "an int" if minimum is None else f"an int >= {minimum}", value)
    return value


def _as_ints(what: str, value: object, minimum: int | None = None) -> list[int]:
    if not isinstance(value, list | tuple):
        return _refuse(what, "a list of int", value)
    return [_as_int(f"every element of {what}", v, minimum) for v in value]


def _as_str(what: str, value: object) -> str:
    return value if isinstance(value, str) else _refuse(what, "a str", value)


def _as_op(what: str, value: object) -> ReduceOp:
    if isinstance(value, ReduceOp):
        return value
    return _refuse(what, "a torchcomms.ReduceOp (e.g. torchcomms.ReduceOp.SUM; "
                   "torch.distributed.ReduceOp and strings are not accepted)", value)


def _as_hints(what: str, value: object) -> dict[str, str]:
    if value is None:
        return {}
    if isinstance(value, dict) and all(isinstance(x, str) for kv in value.items() for x in kv):
        return dict(value)
    return _refuse(what, "a dict[str, str] or None", value)


def _as_timeout(what: str, value: object) -> timedelta | None:
    """A timedelta, or a float of seconds (std::chrono's caster refuses an int)."""
    if value is None or isinstance(value, timedelta):
        return value
    if isinstance(value, float):
        return timedelta(seconds=value)
    return _refuse(what, "a datetime.timedelta, a float of seconds or None", value)


_CONVERT: dict[str, Callable[[str, Any], Any]] = {
    **dict.fromkeys(("tensor", "input", "output", "input_tensor", "output_tensor"), _as_tensor),
    **dict.fromkeys(("tensor_list", "input_list", "input_tensor_list", "output_tensor_list"),
                    _as_tensors),
    **dict.fromkeys(("dst", "src", "root"), _as_int),
    **dict.fromkeys(("output_split_sizes", "input_split_sizes"),
                    functools.partial(_as_ints, minimum=0)),  # uint64 in the binding
    "op": _as_op,
    "async_op": _as_bool,
    "hints": _as_hints,
    "timeout": _as_timeout,
}
_RANK_PARAMS = ("dst", "src", "root")  # TorchComm::validateRank, before the op id and hooks


# -- how each op runs on the ProcessGroupGloo: (comm, args, deadline) -> (c10d work, finisher) --

Finisher = Callable[[], object] | None
Launch = Callable[[Any, SimpleNamespace, timedelta], tuple[Any, Finisher]]

# gloo has neither AVG nor PREMUL_SUM: both are sums, scaled before or divided after.
_C10D_REDUCE = {
    kind: c10d.ReduceOp(getattr(c10d.ReduceOp, "SUM" if kind.name in ("AVG", "PREMUL_SUM")
                                else kind.name))
    for kind in RedOpType.__members__.values()
}


def _opts(kind: Any, deadline: timedelta, **fields: Any) -> Any:
    opts = kind()
    opts.timeout = deadline
    for name, value in fields.items():
        setattr(opts, name, value)
    return opts


def _reduced(c: TorchComm, tensor: torch.Tensor, op: ReduceOp, issue: Callable[[Any], Any],
             then: Finisher = None) -> tuple[Any, Finisher]:
    """As torchcomms' gloo pre/postReduce: PREMUL_SUM scales ``tensor`` in place before the
    sum (an int tensor and a float factor fail here), AVG divides after it (truncating ints)."""
    if op.type == RedOpType.PREMUL_SUM:
        tensor.mul_(op._factor)
    work = issue(_C10D_REDUCE[op.type])

    def finish() -> None:
        if op.type == RedOpType.AVG:
            exact = tensor.dtype.is_floating_point or tensor.dtype.is_complex
            tensor.div_(c._size, rounding_mode=None if exact else "trunc")
        if then is not None:
            then()

    return work, finish


def _all_reduce(c: TorchComm, flat: torch.Tensor, op: ReduceOp, d: timedelta,
                then: Finisher = None) -> tuple[Any, Finisher]:
    return _reduced(c, flat, op, lambda kind: c._pg.allreduce(
        [flat], _opts(c10d.AllreduceOptions, d, reduceOp=kind)), then)


def _reduce(c: TorchComm, a: SimpleNamespace, d: timedelta) -> tuple[Any, Finisher]:
    return _reduced(c, a.tensor, a.op, lambda kind: c._pg.reduce([a.tensor], _opts(
        c10d.ReduceOptions, d, reduceOp=kind, rootRank=a.root, rootTensor=0)))


def _reduce_scatter(c: TorchComm, a: SimpleNamespace, flat: torch.Tensor,
                    d: timedelta) -> tuple[Any, Finisher]:
    """torchcomms' gloo: all-reduce the flat input in place, then copy this rank's chunk."""
    n = a.output.numel()
    return _all_reduce(c, flat, a.op, d,
                       lambda: a.output.view(-1).copy_(flat[c._rank * n:(c._rank + 1) * n]))


def _via_flat(c: TorchComm, like: torch.Tensor, outputs: list[torch.Tensor],
              issue: Callable[[torch.Tensor], Any]) -> tuple[Any, Finisher]:
    """Run into one flat buffer of comm_size chunks shaped like ``like``, then copy each out."""
    flat = torch.empty(like.numel() * c._size, dtype=like.dtype)

    def finish() -> None:
        for out, chunk in zip(outputs, flat.chunk(c._size), strict=False):
            out.copy_(chunk.view(out.shape))

    return issue(flat), finish


def _all_gather(c: TorchComm, a: SimpleNamespace, d: timedelta) -> tuple[Any, Finisher]:
    return _via_flat(c, a.tensor, a.tensor_list, lambda flat: c._pg._allgather_base(
        flat, a.tensor.reshape(-1), _opts(c10d.AllgatherOptions, d)))


def _all_to_all(c: TorchComm, a: SimpleNamespace, d: timedelta) -> tuple[Any, Finisher]:
    flat_input = torch.cat([t.reshape(-1) for t in a.input_tensor_list])
    return _via_flat(c, a.output_tensor_list[0], a.output_tensor_list, lambda flat: c._pg.alltoall_base(
        flat, flat_input, [], [], _opts(c10d.AllToAllOptions, d)))


def _scatter(c: TorchComm, a: SimpleNamespace, d: timedelta) -> tuple[Any, Finisher]:
    shape = a.output_tensor.shape
    send = [[t.view(shape) for t in a.input_tensor_list]] if c._rank == a.root else []
    return c._pg.scatter([a.output_tensor], send, _opts(c10d.ScatterOptions, d, rootRank=a.root)), None


def _gather(c: TorchComm, outputs: list[torch.Tensor], tensor: torch.Tensor, root: int,
            d: timedelta) -> tuple[Any, Finisher]:
    receive = [[t.view(tensor.shape) for t in outputs]] if c._rank == root else []
    return c._pg.gather(receive, [tensor], _opts(c10d.GatherOptions, d, rootRank=root)), None


def _gather_single(c: TorchComm, a: SimpleNamespace, d: timedelta) -> tuple[Any, Finisher]:
    rows = list(a.output.view(c._size, a.input.numel())) if c._rank == a.root else []
    return _gather(c, rows, a.input, a.root, d)


# -- the checks torchcomms' gloo makes after contiguity: (ok(comm, args), its error) -----------

Check = tuple[Callable[[Any, Any], bool], str]


def _one_per_rank(param: str, op: str) -> Check:
    return (lambda c, a: len(getattr(a, param)) == c._size,
            f"{param} size must equal comm_size for {op}")


def _numels(param: str, numel: Callable[[Any], int], message: str) -> Check:
    return (lambda c, a: all(t.numel() == numel(a) for t in getattr(a, param)), message)


def _times_size(big: str, small: str, op: str) -> Check:
    return (lambda c, a: getattr(a, big).numel() == getattr(a, small).numel() * c._size,
            f"{big.title()} tensor size must be {small}_size * comm_size for {op}")


def _splits(side: str) -> tuple[Check, Check]:
    sizes = f"{side}_split_sizes"
    return ((lambda c, a: len(getattr(a, sizes)) == c._size,
             f"{sizes} length must equal comm_size for all_to_all_v_single"),
            (lambda c, a: sum(getattr(a, sizes)) == getattr(a, side).size(0),
             f"Sum of {sizes} must equal {side} tensor size for all_to_all_v_single"))


@dataclass(frozen=True)
class _Op:
    """One op of the binding. ``params``: its parameters before ``async_op``; ``hook``: its
    pre-hook's fields (``field`` or ``field=param``; ``async_op`` follows); ``run``: None when
    not emulated; ``checks``: made after contiguity, and only on the root where ``root_only``
    names the parameters only the root's call uses (ignored elsewhere)."""

    params: str
    hook: str = ""
    run: Launch | None = None
    checks: tuple[Check, ...] = ()
    root_only: str = ""
    p2p: bool = False


def _op(params: str, hook: str, run: Launch, *checks: Check, root_only: str = "",
        p2p: bool = False) -> _Op:
    return _Op(params, hook, run, checks, root_only, p2p)


_OPS: dict[str, _Op] = {
    "send": _op("tensor dst", "tensor peer=dst",
                lambda c, a, d: (c._pg.send([a.tensor], a.dst, 0), None),
                (lambda c, a: a.dst != c._rank, "Cannot send to self"), p2p=True),
    "recv": _op("tensor src", "tensor peer=src",
                lambda c, a, d: (c._pg.recv([a.tensor], a.src, 0), None),
                (lambda c, a: a.src != c._rank, "Cannot recv from self"), p2p=True),
    "broadcast": _op("tensor root", "tensor root", lambda c, a, d: (c._pg.broadcast(
        [a.tensor], _opts(c10d.BroadcastOptions, d, rootRank=a.root, rootTensor=0)), None)),
    "all_reduce": _op("tensor op", "tensor", lambda c, a, d: _all_reduce(c, a.tensor, a.op, d)),
    "reduce": _op("tensor root op", "tensor root", _reduce),
    "all_gather": _op(
        "tensor_list tensor", "input=tensor output=tensor_list", _all_gather,
        _one_per_rank("tensor_list", "all_gather"),
        _numels("tensor_list", lambda a: a.tensor.numel(),
                "All tensors in tensor_list must have same size as input tensor")),
    "all_gather_v": _Op("tensor_list tensor"),
    "all_gather_single": _op(
        "output input", "input output", lambda c, a, d: (c._pg._allgather_base(
            a.output.view(-1), a.input.reshape(-1), _opts(c10d.AllgatherOptions, d)), None),
        _times_size("output", "input", "all_gather_single")),
    # reduce_scatter concatenates its list into a copy; reduce_scatter_single reduces its own
    # input in place, which ends up holding the full reduction, as with torchcomms' gloo.
    "reduce_scatter": _op(
        "output input_list op", "input=input_list output",
        lambda c, a, d: _reduce_scatter(c, a, torch.cat([t.reshape(-1) for t in a.input_list]), d),
        _one_per_rank("input_list", "reduce_scatter"),
        _numels("input_list", lambda a: a.output.numel(),
                "All input tensors must have same size as output tensor")),
    "reduce_scatter_v": _Op("output input_list op"),
    "reduce_scatter_single": _op(
        "output input op", "input output",
        lambda c, a, d: _reduce_scatter(c, a, a.input.view(-1), d),
        _times_size("input", "output", "reduce_scatter_single")),
    "all_to_all_single": _op(
        "output input", "input output", lambda c, a, d: (c._pg.alltoall_base(
            a.output.view(-1), a.input.reshape(-1), [], [], _opts(c10d.AllToAllOptions, d)), None),
        (lambda c, a: a.input.numel() == a.output.numel(),
         "Input and output tensors must have same size for all_to_all_single"),
        (lambda c, a: a.input.numel() % c._size == 0,
         "Tensor size must be divisible by comm_size for all_to_all_single")),
    "all_to_all_v_single": _op(
        "output input output_split_sizes input_split_sizes",
        "input output input_split_sizes output_split_sizes",
        lambda c, a, d: (c._pg.alltoall_base(a.output, a.input, a.output_split_sizes,
                                             a.input_split_sizes, _opts(c10d.AllToAllOptions, d)), None),
        *_splits("input"), *_splits("output")),
    "all_to_all": _op(
        "output_tensor_list input_tensor_list", "input=input_tensor_list output=output_tensor_list",
        _all_to_all,
        (lambda c, a: len(a.output_tensor_list) == len(a.input_tensor_list) == c._size,
         "Tensor list sizes must equal comm_size for all_to_all"),
        *(_numels(f"{side}_tensor_list", lambda a: a.input_tensor_list[0].numel(),
                  f"All {side} tensors must have same size for all_to_all")
          for side in ("input", "output"))),
    "barrier": _op("", "", lambda c, a, d: (c._pg.barrier(_opts(c10d.BarrierOptions, d)), None)),
    "scatter": _op(
        "output_tensor input_tensor_list root", "output=output_tensor input=input_tensor_list root",
        _scatter, _one_per_rank("input_tensor_list", "scatter"),
        _numels("input_tensor_list", lambda a: a.output_tensor.numel(),
                "All input tensors must have same size as output tensor"),
        root_only="input_tensor_list"),
    "gather": _op(
        "output_tensor_list input_tensor root", "input=input_tensor output=output_tensor_list root",
        lambda c, a, d: _gather(c, a.output_tensor_list, a.input_tensor, a.root, d),
        _one_per_rank("output_tensor_list", "gather"),
        _numels("output_tensor_list", lambda a: a.input_tensor.numel(),
                "All output tensors must have same size as input tensor"),
        root_only="output_tensor_list"),
    "gather_single": _op("output input root", "input output root", _gather_single,
                         _times_size("output", "input", "gather_single"), root_only="output"),
}


# -- hook argument classes (the binding's names and attributes) -----------------------------


def _hook_args(name: str, fields: list[str]) -> type:
    return make_dataclass(name, fields, frozen=True, eq=False, namespace={"__module__": __name__})


def _hook_fields(op: _Op) -> dict[str, str]:
    """Pre-hook field -> the op's parameter it shows."""
    pairs = (item.partition("=") for item in f"{op.hook} async_op".split())
    return {field: param or field for field, _, param in pairs}


_PRE_HOOK_ARGS = {
    name: _hook_args("".join(w.title() for w in name.split("_")) + "PreHookArgs",
                     list(_hook_fields(op)))
    for name, op in _OPS.items() if op.run is not None
}
SplitPreHookArgs = _hook_args("SplitPreHookArgs", ["ranks", "name"])
FinalizePreHookArgs = _hook_args("FinalizePreHookArgs", [])
# torchcomms' post-hook arguments hold a weak reference to the work (not emulated).
CollectivePostHookArgs = _hook_args("CollectivePostHookArgs", [])
SplitPostHookArgs = _hook_args("SplitPostHookArgs", [])
FinalizePostHookArgs = _hook_args("FinalizePostHookArgs", [])
globals().update({cls.__name__: cls for cls in _PRE_HOOK_ARGS.values()})

__all__ = [
    "new_comm", "TorchComm", "TorchWork", *_types.__all__,
    *(cls.__name__ for cls in _PRE_HOOK_ARGS.values()), "SplitPreHookArgs", "FinalizePreHookArgs",
    "CollectivePostHookArgs", "SplitPostHookArgs", "FinalizePostHookArgs",
]


# -- environment and stores -----------------------------------------------------------------


def _env_int(key: str, default: int) -> int:
    raw = os.environ.get(key, "").strip()
    try:
        return int(raw) if raw else default
    except ValueError:
        raise RuntimeError(f"environment variable {key}={raw!r} is not an integer") from None


def _parse_bool(raw: str, what: str) -> bool:
    value = raw.strip().lower()
    if value not in ("1", "true", "yes", "y", "0", "false", "no", "n"):
        raise RuntimeError(f"{what}: {raw!r} is not a boolean")
    return value in ("1", "true", "yes", "y")


def _env_bool(key: str, default: bool) -> bool:
    raw = os.environ.get(key)
    return default if raw is None else _parse_bool(raw, key)


def _rank_and_size_from_env() -> tuple[int, int]:
    # torchcomms' "auto" order, minus PALS: its own variables, MPI, then torchrun's.
    for rank_key, size_key in (("TORCHCOMM_RANK", "TORCHCOMM_SIZE"),
                               ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                               ("PMI_RANK", "PMI_SIZE"), ("RANK", "WORLD_SIZE")):
        rank, size = _env_int(rank_key, -1), _env_int(size_key, -1)
        if rank > -1 and size > 0:
            if rank >= size:
                raise RuntimeError(f"{rank_key}={rank} is not below {size_key}={size}")
            return rank, size
    raise RuntimeError(
        "torchcomms stand-in: cannot tell this process's rank and world size from the "
        "environment; set TORCHCOMM_RANK and TORCHCOMM_SIZE, or RANK and WORLD_SIZE (torchrun)")


def _default_timeout() -> timedelta:
    return timedelta(seconds=_env_int("TORCHCOMM_TIMEOUT_SECONDS", 600))


def _claim_once(store: Store, key: str) -> None:
    if store.add(key, 1) != 1:
        raise RuntimeError("detected multiple communicators on same store!")


def _communicator_store(store: Store | None, name: str, rank: int, hints: dict[str, str],
                        timeout: timedelta) -> Store:
    if store is not None and _parse_bool(hints.get("persistent_store", "false"),
                                         "hint persistent_store"):
        # Used as is: one communicator per store (names do not separate). torchcomms checks
        # on rank 0; every rank checks here, so all fail fast instead of rendezvousing with the
        # previous communicator's keys.
        if rank == 0:
            _claim_once(store, "init_count")
        _claim_once(store, f"torchcomms_standin/init_count/{rank}")
        return store
    host = os.environ.get("MASTER_ADDR")
    if not host:
        raise RuntimeError("MASTER_ADDR env is not set")
    if store is None:
        port = _env_int("MASTER_PORT", -1)
        if port < 0:
            raise RuntimeError("MASTER_PORT env is not set")
        # The launcher (torchrun, a test) serves MASTER_ADDR:MASTER_PORT; no rank serves it.
        store = TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)
    # Rank 0 serves a fresh TCPStore for the communicator and publishes its port. torchcomms
    # uses one fixed key, so communicators made at once on one store race; here the key names
    # the communicator and how many of that name this rank made on the store (ranks that create
    # them in the same order agree, and a name may be used again, as torchcomms allows).
    bootstrap = PrefixStore(name, store)
    key = f"dup_store_port/{bootstrap.add(f'torchcomms_standin/created/{rank}', 1)}"
    if rank == 0:
        own = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        bootstrap.set(key, str(own.port))
    else:
        bootstrap.wait([key], timeout)
        own = TCPStore(host, int(bootstrap.get(key).decode()), is_master=False,
                       wait_for_workers=False, timeout=timeout)
    return PrefixStore(name, own)


# -- the public API -------------------------------------------------------------------------


def new_comm(
    backend: str,
    device: torch.device,
    name: str,
    abort_process_on_timeout_or_error: bool | None = None,
    timeout: timedelta | float | None = None,
    high_priority_stream: bool | None = None,
    store: Store | None = None,
    enable_reconfigure: bool = False,
    hints: dict[str, str] | None = None,
) -> TorchComm:
    """Create a communicator over all ranks; every rank must call it (it blocks until all do).

    The binding's order and conversions; ``high_priority_stream`` has no effect on gloo, and
    ``abort_process_on_timeout_or_error`` is only stored.
    """
    if _as_str("backend", backend) != BACKEND:
        raise RuntimeError(f"the torchcomms stand-in only emulates the 'gloo' backend, not {backend!r}")
    if not isinstance(device, torch.device):
        _refuse("device", "a torch.device", device)
    if device.type != "cpu":
        raise RuntimeError(f"the torchcomms stand-in runs on CPU only, got device {device}")
    _as_str("name", name)
    abort = None if abort_process_on_timeout_or_error is None else _as_bool(
        "abort_process_on_timeout_or_error", abort_process_on_timeout_or_error)
    _as_bool("high_priority_stream", high_priority_stream)
    if store is not None and not isinstance(store, Store):
        _refuse("store", "a torch.distributed.Store or None", store)
    if _as_bool("enable_reconfigure", enable_reconfigure):
        raise NotImplementedError(f"enable_reconfigure=True {_NOT_EMULATED}")
    options = CommOptions(
        abort_process_on_timeout_or_error=_env_bool("TORCHCOMM_ABORT_ON_ERROR", True)
        if abort is None else abort,
        timeout=_default_timeout() if timeout is None else _as_timeout("timeout", timeout),
        hints=_as_hints("hints", hints),
    )
    rank, size = _rank_and_size_from_env()
    comm_store = _communicator_store(store, name, rank, options.hints, options.timeout)
    return TorchComm._create(name, rank, list(range(size)), device, comm_store, options,
                             _env_bool(NONBLOCKING_WAIT_ENV, False))


def _plain(exc: BaseException) -> RuntimeError:
    """``exc`` as a plain RuntimeError, caused by ``exc`` when it was of another type."""
    if type(exc) is RuntimeError:
        return exc
    error = RuntimeError(str(exc))
    error.__cause__ = exc
    return error


class TorchWork:
    """Handle of one operation. ``wait()`` returns once the op finished, raising its error.

    Dropping a work whose op still runs blocks until the op ends or times out (torchcomms'
    gloo runs it on a ``std::async`` thread, whose future joins it when destroyed). On a
    stream-ordered communicator (the CUDA case) the op runs to its end on a thread of its own,
    ``wait()`` returns at once and raises nothing, and ``is_completed()`` says when it ended.
    """

    _comm: TorchComm
    _async: bool
    _pending: tuple[Any, Finisher, timedelta | None] | None  # c10d work, finisher, p2p deadline
    _completed: bool
    _error: RuntimeError | None
    _waited: bool

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TypeError("torchcomms.TorchWork: No constructor defined!")

    @classmethod
    def _new(cls, comm: TorchComm, async_op: bool,
             pending: tuple[Any, Finisher, timedelta | None] | None = None,
             error: RuntimeError | None = None) -> TorchWork:
        work = object.__new__(cls)
        work._comm, work._async, work._pending, work._error = comm, async_op, pending, error
        work._completed = pending is None and error is None
        work._waited = False
        if pending is not None and comm._stream_ordered:
            # The "device" runs the op; the thread holds the work until the op has ended.
            threading.Thread(target=work._settle, name="torchcomms-standin-stream",
                             daemon=True).start()
        return work

    def _settle(self) -> None:
        """Collect the gloo op's outcome (blocking until it ends) and run the finisher."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pg_work, finish, p2p_deadline = pending
        try:
            pg_work.wait() if p2p_deadline is None else pg_work.wait(p2p_deadline)
            if finish is not None:
                finish()
        except Exception as exc:
            self._error = self._comm._translate_error(exc)
        else:
            self._completed = True

    def __del__(self) -> None:
        if getattr(self, "_pending", None) is not None:
            self._settle()

    def is_completed(self) -> bool:
        """True once the op finished successfully (False while running and after an error).

        A point-to-point op only completes in ``wait()``, as with torchcomms' gloo.
        """
        pending = self._pending
        if (pending is not None and pending[2] is None and not self._comm._stream_ordered
                and pending[0].is_completed()):
            self._settle()
        return self._completed

    def wait(self) -> None:
        """Wait for the op; its error is raised by the first ``wait()`` only, as in torchcomms."""
        if self._waited:
            return
        self._waited = True
        if self._comm._stream_ordered:
            return
        self._settle()
        if self._error is not None:
            raise self._error

    def wait_blocking(self) -> None:
        """Only works complete from the start (gloo's sync ops) support it, as in torchcomms."""
        if self._async or self._comm._stream_ordered:
            raise RuntimeError("[TorchWork]: waitBlocking not implemented for this work type")
        self.wait()


class TorchComm:
    """A communicator. Create it with ``torchcomms.new_comm`` or ``TorchComm.split``.

    Its ops are the rows of ``_OPS``, all run by ``_call``.
    """

    _name: str
    _rank: int
    _size: int
    _global_ranks: list[int]  # the new_comm ranks of the members, in this communicator's order
    _device: torch.device
    _store: Store  # the store this communicator's gloo group rendezvoused on
    _options: CommOptions
    _pg: Any  # a ProcessGroupGloo; torch's stubs omit its collective methods
    _finalized: bool
    _timed_out: bool  # gloo closed the pairs after a timeout: every later op fails
    _stream_ordered: bool  # CUDA-like: wait() does not block (TORCHCOMMS_STANDIN_NONBLOCKING_WAIT)
    _split_count: int
    _hooks: dict[str, dict[int, Callable[..., Any]]]

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TypeError("torchcomms.TorchComm: No constructor defined!")

    @classmethod
    def _create(cls, name: str, rank: int, global_ranks: list[int], device: torch.device,
                store: Store, options: CommOptions, stream_ordered: bool) -> TorchComm:
        size = len(global_ranks)
        try:
            pg = ProcessGroupGloo(store, rank, size, options.timeout)
            pg.barrier(_opts(c10d.BarrierOptions, options.timeout)).wait()
        except RuntimeError as exc:  # e.g. DistStoreError: the stand-in raises plain ones
            raise _plain(exc)
        comm = object.__new__(cls)
        comm._name, comm._rank, comm._size, comm._global_ranks = name, rank, size, global_ranks
        comm._device, comm._store, comm._options, comm._pg = device, store, options, pg
        comm._finalized = comm._timed_out = False
        comm._stream_ordered = stream_ordered
        comm._split_count = 0
        comm._hooks = {"pre": {}, "post": {}, "abort": {}}
        return comm

    # -- identity ---------------------------------------------------------------------------

    def get_rank(self) -> int:
        return self._rank

    def get_size(self) -> int:
        return self._size

    def get_name(self) -> str:
        return self._name

    def get_device(self) -> torch.device:
        return self._device

    def get_backend(self) -> str:
        return BACKEND

    def get_options(self) -> CommOptions:
        return replace(self._options, hints=dict(self._options.hints))

    # -- what torchcomms' gloo does not support ------------------------------------------------

    def abort(self) -> None:
        raise RuntimeError(f"[TorchCommBackend]: abort not implemented for communicator:{self._name}")

    def is_abort_supported(self) -> bool:
        return False

    def is_aborted(self) -> bool:
        return False

    def set_timeout(self, timeout: timedelta) -> None:
        if not isinstance(timeout, timedelta):
            _refuse("timeout", "a datetime.timedelta", timeout)
        raise RuntimeError(
            f"[TorchCommBackend]: setTimeout not implemented for communicator:{self._name}")

    # -- hooks ------------------------------------------------------------------------------

    def _register(self, kind: str, callback: object) -> RemovableHandle:
        if not callable(callback):
            _refuse("callback", "callable", callback)
        table = self._hooks[kind]
        key = _next_hook_key()
        table[key] = callback
        return RemovableHandle(table, key)

    def register_pre_hook(self, callback: Callable[[OpName, int, Any], object]) -> RemovableHandle:
        """``callback(op_name: OpName, op_id: int, args)`` runs before every op."""
        return self._register("pre", callback)

    def register_post_hook(self, callback: Callable[[int, Any], object]) -> RemovableHandle:
        """``callback(op_id: int, args)`` runs after an op was issued (not when it raised)."""
        return self._register("post", callback)

    def register_abort_hook(self, callback: Callable[[], object]) -> RemovableHandle:
        """``callback()`` runs when a synchronous collective fails (e.g. times out)."""
        return self._register("abort", callback)

    def _pre_hooks(self, op_name: OpName, op_id: int, args: Any) -> None:
        for hook in list(self._hooks["pre"].values()):
            hook(op_name._copy(), op_id, args)  # a new object per call, as from the binding

    def _post_hooks(self, op_id: int, args: Any) -> None:
        for hook in list(self._hooks["post"].values()):
            hook(op_id, args)

    def _begin(self, op_name: OpName, args: Any, *, initialized: bool = True) -> int:
        """Take an op id and run the pre-hooks; ``initialized``: refuse after finalize()."""
        op_id = _next_op_id()
        self._pre_hooks(op_name, op_id, args)
        if initialized and self._finalized:
            raise RuntimeError("TorchCommGloo not initialized")
        return op_id

    # -- the one path of every op -----------------------------------------------------------

    def _translate_error(self, exc: BaseException) -> RuntimeError:
        """Record a gloo timeout (the communicator is dead after it) and type it RuntimeError."""
        if any(marker in str(exc) for marker in _TIMEOUT_MARKERS):
            self._timed_out = True
        return _plain(exc)

    def _call(self, name: str, op: _Op, arguments: dict[str, Any]) -> TorchWork:
        if op.run is None:
            raise NotImplementedError(f"{name} {_NOT_EMULATED}")
        a = SimpleNamespace(**{k: _CONVERT[k](k, v) for k, v in arguments.items()})
        for param in _RANK_PARAMS:
            rank = vars(a).get(param, 0)
            if not 0 <= rank < self._size:
                raise RuntimeError(f"{param} must be in range [0, {self._size}), but got {rank}")
        pre_args = _PRE_HOOK_ARGS[name](**{f: getattr(a, p) for f, p in _hook_fields(op).items()})
        op_id = self._begin(OpName.__members__[name], pre_args)
        at_root = not op.root_only or self._rank == a.root
        for param in op.params.split():
            value = getattr(a, param)
            if param in op.root_only.split() and not at_root:
                continue
            for t in value if isinstance(value, list) else [value]:
                if isinstance(t, torch.Tensor) and not t.is_contiguous():
                    raise RuntimeError("Tensor must be contiguous for Gloo operations")
        for ok, message in op.checks if at_root else ():
            if not ok(self, a):
                raise RuntimeError(message)

        positive = a.timeout is not None and a.timeout > timedelta(0)
        deadline = a.timeout if positive else self._options.timeout
        enqueue = a.async_op or self._stream_ordered  # stream-ordered: a sync op is only enqueued
        try:
            if self._timed_out:  # gloo closed this communicator's pairs when an op timed out
                raise RuntimeError(_PAIR_CLOSED)
            pg_work, finish = op.run(self, a, deadline)
            if not enqueue:
                pg_work.wait(deadline) if op.p2p else pg_work.wait()
                if finish is not None:
                    finish()
        except Exception as exc:
            error = self._translate_error(exc)
            if not enqueue and not op.p2p:
                # torchcomms' gloo runs abort hooks when a synchronous collective fails.
                for hook in list(self._hooks["abort"].values()):
                    try:
                        hook()
                    except Exception:
                        _log.exception("torchcomms stand-in: an abort hook raised")
            if not a.async_op:
                raise error
            work = TorchWork._new(self, True, error=error)
        else:
            pending = (pg_work, finish, deadline if op.p2p else None) if enqueue else None
            work = TorchWork._new(self, a.async_op, pending)
        self._post_hooks(op_id, CollectivePostHookArgs())
        return work

    # -- communicator management ------------------------------------------------------------

    def finalize(self) -> None:
        """End the communicator; every later op but ``split`` raises "TorchCommGloo not
        initialized"."""
        self._pre_hooks(OpName.finalize, FINALIZE_OP_ID, FinalizePreHookArgs())
        if self._finalized:
            raise RuntimeError("TorchCommGloo already finalized")
        self._finalized = True
        self._post_hooks(FINALIZE_OP_ID, FinalizePostHookArgs())

    def split(self, ranks: list[int], name: str, hints: dict[str, str] | None = None,
              timeout: timedelta | None = None) -> TorchComm | None:
        """A sub-communicator of ``ranks`` (this group's ranks; the new rank is the position
        in the list), as torchcomms' gloo makes it: only the members meet, under
        ``f"{split_id}/{name}_{min(ranks)}"``, where ``split_id`` counts this rank's non-empty
        splits of this parent. ``[]`` returns None before that counter moves. Lists that differ
        between ranks are not detected. The child is named ``f"{name}_{min(ranks)}"``; its
        timeout is ``timeout`` or the environment's default (not the parent's). Works after
        ``finalize()``. See ../README.md for what follows from the counter.
        """
        group, name = _as_ints("ranks", ranks), _as_str("name", name)
        hint_map, timeout = _as_hints("hints", hints), _as_timeout("timeout", timeout)
        op_id = self._begin(OpName.split, SplitPreHookArgs(group, name), initialized=False)
        for r in group:
            if not 0 <= r < self._size:
                raise RuntimeError(f"Invalid rank {r} in ranks. Valid ranks are 0 to {self._size - 1}")
        if len(set(group)) != len(group):
            raise RuntimeError("Duplicate ranks found in ranks list")
        if not group:
            return None
        if self._rank not in group:
            raise RuntimeError(f"Current rank {self._rank} is not included in the provided ranks list")
        split_id, self._split_count = self._split_count, self._split_count + 1
        options = CommOptions(self._options.abort_process_on_timeout_or_error,
                              _default_timeout() if timeout is None else timeout,
                              {**hint_map, "persistent_store": "true"})
        child_name = f"{name}_{min(group)}"
        child = TorchComm._create(child_name, group.index(self._rank),
                                  [self._global_ranks[r] for r in group], self._device,
                                  PrefixStore(f"{split_id}/{child_name}", self._store), options,
                                  self._stream_ordered)
        self._post_hooks(op_id, SplitPostHookArgs())
        return child


def _op_method(name: str, op: _Op) -> Callable[..., TorchWork]:
    """``TorchComm.<name>`` with the binding's signature: the op's parameters and ``async_op``
    (required, no default), then ``hints=None, timeout=None``, all positional-or-keyword."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    signature = inspect.Signature(
        [inspect.Parameter(p, kind) for p in ["self", *op.params.split(), "async_op"]]
        + [inspect.Parameter(p, kind, default=None) for p in ("hints", "timeout")])

    def method(self: TorchComm, *args: Any, **kwargs: Any) -> TorchWork:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        del bound.arguments["self"]
        return self._call(name, op, bound.arguments)

    method.__name__, method.__qualname__ = name, f"TorchComm.{name}"
    method.__signature__ = signature  # type: ignore[attr-defined]
    return method


def _not_emulated(name: str) -> Callable[..., Any]:
    def method(self: TorchComm, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{name} {_NOT_EMULATED}")

    method.__name__, method.__qualname__ = name, f"TorchComm.{name}"
    return method


for _name, _spec in _OPS.items():
    setattr(TorchComm, _name, _op_method(_name, _spec))
for _name in ("reconfigure", "batch_op_create"):
    setattr(TorchComm, _name, _not_emulated(_name))
del _name, _spec
