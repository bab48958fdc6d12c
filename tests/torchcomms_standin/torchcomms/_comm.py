"""``new_comm``, ``TorchComm`` and ``TorchWork`` of the torchcomms stand-in, over gloo.

TEST-ONLY: this emulates torchcomms' gloo backend on CPU so commlib's torchcomms backend can
be tested where torchcomms cannot be installed. It must never ship with commlib.

Each communicator owns one ``torch.distributed.ProcessGroupGloo`` built directly on a store
(c10d's global state -- ``init_process_group``, the default group, the group registry -- is
never touched) and calls its methods directly. Deadlines are gloo's own: a collective passes
its timeout in the c10d options, so gloo itself raises "Timed out waiting ...ms for recv
operation to complete" and closes the pairs ("Application timeout caused pair closure"),
exactly the failure torchcomms' gloo backend shows. Point-to-point ops pass the deadline to
``Work.wait``. A stream-ordered communicator (``TORCHCOMMS_STANDIN_NONBLOCKING_WAIT=1``) waits
as CUDA does: each op runs on a thread of its own and ``TorchWork.wait()`` does not block.
See ../README.md for the decisions and for what is not emulated.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, NoReturn

import torch
from torch._C import _distributed_c10d as c10d
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, Store, TCPStore

from ._types import (
    AbortHook,
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
    PostHook,
    PostHookArgs,
    PreHook,
    PreHookArgs,
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

__all__ = ["new_comm", "TorchComm", "TorchWork"]

_log = logging.getLogger("torchcomms")

BACKEND = "gloo"
DEFAULT_TIMEOUT_SECONDS = 600
# torchcomms runs finalize's hooks under a sentinel op id (SIZE_MAX) instead of consuming one.
FINALIZE_OP_ID = 2**64 - 1
_TIMEOUT_MARKERS = ("Timed out waiting", "Application timeout caused pair closure")
_PAIR_CLOSED = "Application timeout caused pair closure"
_NOT_EMULATED = "is not emulated by the torchcomms stand-in"
# Set to 1 to make communicators stream-ordered, as on CUDA: TorchWork.wait() does not block.
NONBLOCKING_WAIT_ENV = "TORCHCOMMS_STANDIN_NONBLOCKING_WAIT"

# One process-wide, increasing op id sequence shared by all communicators, as in torchcomms.
_op_ids = itertools.count()
_op_id_lock = threading.Lock()


def _next_op_id() -> int:
    with _op_id_lock:
        return next(_op_ids)


# -- argument checks (what the pybind11 binding rejects with TypeError) -----------------------


def _type_name(value: object) -> str:
    return type(value).__module__ + "." + type(value).__qualname__


def _check_bool(what: str, value: object) -> bool:
    """pybind11's ``bool`` conversion: None is False, anything with ``__bool__`` converts
    (1, 0, 2.5), a string does not."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if getattr(type(value), "__bool__", None) is not None:
        try:
            return bool(value)
        except Exception:
            pass
    raise TypeError(f"{what} must be a bool, got {_type_name(value)}")


def _check_tensor(what: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {_type_name(value)}")
    return value


def _check_tensor_list(what: str, value: object) -> list[torch.Tensor]:
    if not isinstance(value, list | tuple):
        raise TypeError(f"{what} must be a list of torch.Tensor, got {_type_name(value)}")
    for item in value:
        _check_tensor(f"every element of {what}", item)
    return list(value)


def _check_int(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {_type_name(value)}")
    return value


def _check_int_list(what: str, value: object, *, non_negative: bool = False) -> list[int]:
    if not isinstance(value, list | tuple):
        raise TypeError(f"{what} must be a list of int, got {_type_name(value)}")
    out = [_check_int(f"every element of {what}", v) for v in value]
    if non_negative and any(v < 0 for v in out):
        raise TypeError(f"{what} must hold non-negative ints, got {out}")
    return out


def _check_hints(hints: object) -> dict[str, str]:
    if hints is None:
        return {}
    if not isinstance(hints, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in hints.items()
    ):
        raise TypeError(f"hints must be a dict[str, str] or None, got {hints!r}")
    return dict(hints)


def _check_timeout(timeout: object) -> timedelta | None:
    """pybind11's ``std::chrono`` conversion: a timedelta, or a float of seconds (not an int)."""
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, float):
        return timedelta(seconds=timeout)
    raise TypeError(
        f"timeout must be a datetime.timedelta, a float of seconds or None, got "
        f"{_type_name(timeout)}"
    )


def _check_op(op: object) -> ReduceOp:
    if not isinstance(op, ReduceOp):
        raise TypeError(
            f"op must be a torchcomms.ReduceOp (e.g. torchcomms.ReduceOp.SUM), got "
            f"{_type_name(op)}; torch.distributed.ReduceOp and strings are not accepted"
        )
    return op


def _check_callable(callback: object) -> Callable[..., Any]:
    if not callable(callback):
        raise TypeError(f"callback must be callable, got {_type_name(callback)}")
    return callback


def _ensure_contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if not t.is_contiguous():
            raise RuntimeError("Tensor must be contiguous for Gloo operations")


# -- reductions -----------------------------------------------------------------------------

_C10dOp = c10d.ReduceOp
_C10D_REDUCE: dict[RedOpType, c10d.ReduceOp] = {
    RedOpType.SUM: _C10dOp(_C10dOp.SUM),
    RedOpType.PRODUCT: _C10dOp(_C10dOp.PRODUCT),
    RedOpType.MIN: _C10dOp(_C10dOp.MIN),
    RedOpType.MAX: _C10dOp(_C10dOp.MAX),
    RedOpType.BAND: _C10dOp(_C10dOp.BAND),
    RedOpType.BOR: _C10dOp(_C10dOp.BOR),
    RedOpType.BXOR: _C10dOp(_C10dOp.BXOR),
    # gloo has neither: AVG is a sum divided by the size, PREMUL_SUM a sum of scaled inputs.
    RedOpType.AVG: _C10dOp(_C10dOp.SUM),
    RedOpType.PREMUL_SUM: _C10dOp(_C10dOp.SUM),
}


def _premultiply(tensor: torch.Tensor, op: ReduceOp) -> None:
    """Scale ``tensor`` in place for PREMUL_SUM (an int tensor and a float factor fail here)."""
    if op.type == RedOpType.PREMUL_SUM:
        assert op._factor is not None
        tensor.mul_(op._factor)


def _average(tensor: torch.Tensor, op: ReduceOp, size: int) -> None:
    """Finish an AVG: divide the sum by the size (truncating for integer tensors)."""
    if op.type != RedOpType.AVG:
        return
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        tensor.div_(size)
    else:
        tensor.div_(size, rounding_mode="trunc")


# -- environment ----------------------------------------------------------------------------


def _env_int(key: str, default: int) -> int:
    raw = os.environ.get(key)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise RuntimeError(f"environment variable {key}={raw!r} is not an integer") from None


def _rank_and_size_from_env() -> tuple[int, int]:
    # torchcomms' "auto" order, minus PALS: its own variables, MPI, then torchrun's.
    for rank_key, size_key in (
        ("TORCHCOMM_RANK", "TORCHCOMM_SIZE"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("PMI_RANK", "PMI_SIZE"),
        ("RANK", "WORLD_SIZE"),
    ):
        rank, size = _env_int(rank_key, -1), _env_int(size_key, -1)
        if rank > -1 and size > 0:
            if rank >= size:
                raise RuntimeError(f"{rank_key}={rank} is not below {size_key}={size}")
            return rank, size
    raise RuntimeError(
        "torchcomms stand-in: cannot tell this process's rank and world size from the "
        "environment; set TORCHCOMM_RANK and TORCHCOMM_SIZE, or RANK and WORLD_SIZE (torchrun)"
    )


def _default_timeout() -> timedelta:
    return timedelta(seconds=_env_int("TORCHCOMM_TIMEOUT_SECONDS", DEFAULT_TIMEOUT_SECONDS))


def _env_bool(key: str, default: bool) -> bool:
    raw = os.environ.get(key)
    return default if raw is None else _parse_bool(raw, key)


def _parse_bool(raw: str, what: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "y"):
        return True
    if value in ("0", "false", "no", "n"):
        return False
    raise RuntimeError(f"{what}: {raw!r} is not a boolean")


def _require_env(key: str) -> str:
    value = os.environ.get(key)
    if not value:
        raise RuntimeError(f"{key} env is not set")
    return value


# -- stores ---------------------------------------------------------------------------------


def _claim_once(store: Store, key: str, message: str) -> None:
    if store.add(key, 1) != 1:
        raise RuntimeError(message)


def _dup_store(bootstrap: Store, key: str, rank: int, host: str, timeout: timedelta) -> Store:
    """Rank 0 serves a fresh TCPStore for this communicator and publishes its port."""
    if rank == 0:
        server = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        bootstrap.set(key, str(server.port))
        return server
    bootstrap.wait([key], timeout)
    port = int(bootstrap.get(key).decode())
    return TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)


def _communicator_store(
    store: Store | None,
    name: str,
    rank: int,
    hints: dict[str, str],
    timeout: timedelta,
) -> Store:
    persistent = _parse_bool(hints.get("persistent_store", "false"), "hint persistent_store")
    if store is not None and persistent:
        # The given store is used as is: one communicator per store (names do not separate).
        duplicate = "detected multiple communicators on same store!"
        if rank == 0:
            _claim_once(store, "init_count", duplicate)
        # Stand-in addition: every rank checks, so all of them fail fast instead of rank 0
        # failing while the others rendezvous with the previous communicator's keys.
        _claim_once(store, f"torchcomms_standin/init_count/{rank}", duplicate)
        return store
    host = _require_env("MASTER_ADDR")
    if store is None:
        port = _env_int("MASTER_PORT", -1)
        if port < 0:
            raise RuntimeError("MASTER_PORT env is not set")
        # The launcher (torchrun, a test) serves MASTER_ADDR:MASTER_PORT; no rank serves it.
        store = TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)
    # torchcomms publishes the port under one fixed key, so communicators made at once on one
    # store race. Here the key names the communicator and how many of that name this rank
    # made on the store before: ranks that create them in the same order agree, and a name
    # may be used again (torchcomms accepts that too).
    bootstrap = PrefixStore(name, store)
    count = bootstrap.add(f"torchcomms_standin/created/{rank}", 1)
    key = f"dup_store_port/{count}"
    return PrefixStore(name, _dup_store(bootstrap, key, rank, host, timeout))


def _make_process_group(
    store: Store, rank: int, size: int, timeout: timedelta, hints: dict[str, str]
) -> Any:
    hostname = hints.get("hostname", os.environ.get("TORCHCOMM_GLOO_HOSTNAME", ""))
    interface = hints.get("interface", os.environ.get("TORCHCOMM_GLOO_INTERFACE", ""))
    pg: Any  # torch's stubs omit ProcessGroupGloo's collective methods
    try:
        if hostname or interface:
            opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            opts._timeout = timeout
            opts._devices = [ProcessGroupGloo.create_device(hostname=hostname, interface=interface)]
            pg = ProcessGroupGloo(store, rank, size, opts)
        else:
            pg = ProcessGroupGloo(store, rank, size, timeout)
        barrier = c10d.BarrierOptions()
        barrier.timeout = timeout
        pg.barrier(barrier).wait()
    except Exception as exc:
        if type(exc) is RuntimeError:
            raise
        raise RuntimeError(str(exc)) from exc
    return pg


# -- the public API -------------------------------------------------------------------------

_Finisher = Callable[[], None] | None
_Launch = Callable[[timedelta], tuple[Any, _Finisher]]


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

    The binding's order and conversions: ``name`` third and required, the flags converted as
    pybind11 converts a ``bool``, ``timeout`` a timedelta or a float of seconds.
    ``high_priority_stream`` has no effect on gloo.
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {_type_name(backend)}")
    if backend != BACKEND:
        raise RuntimeError(
            f"the torchcomms stand-in only emulates the 'gloo' backend, not {backend!r}"
        )
    if not isinstance(device, torch.device):
        raise TypeError(f"device must be a torch.device, got {_type_name(device)}")
    if device.type != "cpu":
        raise RuntimeError(f"the torchcomms stand-in runs on CPU only, got device {device}")
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {_type_name(name)}")
    if abort_process_on_timeout_or_error is not None:
        abort_process_on_timeout_or_error = _check_bool(
            "abort_process_on_timeout_or_error", abort_process_on_timeout_or_error
        )
    timeout = _check_timeout(timeout)
    if high_priority_stream is not None:
        _check_bool("high_priority_stream", high_priority_stream)
    if store is not None and not isinstance(store, Store):
        raise TypeError(f"store must be a torch.distributed.Store or None, got {_type_name(store)}")
    if _check_bool("enable_reconfigure", enable_reconfigure):
        raise NotImplementedError(f"enable_reconfigure=True {_NOT_EMULATED}")
    hint_map = _check_hints(hints)

    options = CommOptions(
        abort_process_on_timeout_or_error=(
            _env_bool("TORCHCOMM_ABORT_ON_ERROR", True)
            if abort_process_on_timeout_or_error is None
            else abort_process_on_timeout_or_error
        ),
        timeout=timeout if timeout is not None else _default_timeout(),
        hints=hint_map,
    )
    rank, size = _rank_and_size_from_env()
    comm_store = _communicator_store(store, name, rank, hint_map, options.timeout)
    stream_ordered = _env_bool(NONBLOCKING_WAIT_ENV, False)
    return TorchComm._create(
        name, rank, list(range(size)), device, comm_store, options, stream_ordered
    )


class TorchWork:
    """Handle of one operation. ``wait()`` returns once the op finished, raising its error.

    On a stream-ordered communicator (``TORCHCOMMS_STANDIN_NONBLOCKING_WAIT=1``, the CUDA
    case) ``wait()`` returns at once and raises nothing, as NCCL's only makes the current
    stream wait; the op runs to its end on a thread of its own and ``is_completed()`` says
    when it did.
    """

    _comm: TorchComm
    _async: bool
    _status: WorkStatus
    _pg_work: Any  # the c10d Work while the gloo op runs, then None
    _finish: _Finisher
    _p2p_timeout: timedelta | None
    _error: RuntimeError | None
    _waited: bool

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TypeError("torchcomms.TorchWork: No constructor defined!")

    @classmethod
    def _new(
        cls,
        comm: TorchComm,
        *,
        async_op: bool,
        status: WorkStatus,
        pg_work: Any = None,
        finish: _Finisher = None,
        p2p_timeout: timedelta | None = None,
        error: RuntimeError | None = None,
    ) -> TorchWork:
        work = object.__new__(cls)
        work._comm = comm
        work._async = async_op
        work._status = status
        work._pg_work = pg_work
        work._finish = finish
        work._p2p_timeout = p2p_timeout
        work._error = error
        work._waited = False
        if status is WorkStatus.INPROGRESS and comm._stream_ordered:
            # The "device" runs the op; the thread holds the work until the op has ended.
            threading.Thread(target=work._settle, name="torchcomms-standin-stream",
                             daemon=True).start()
        return work

    def _settle(self) -> None:
        """Collect the gloo op's outcome (blocking until it ends) and run the finisher."""
        if self._status is not WorkStatus.INPROGRESS:
            return
        try:
            if self._p2p_timeout is not None:
                self._pg_work.wait(self._p2p_timeout)
            else:
                self._pg_work.wait()
            if self._finish is not None:
                self._finish()
        except Exception as exc:
            self._error = self._comm._translate_error(exc)
            self._status = WorkStatus.ERROR
        else:
            self._status = WorkStatus.COMPLETED
        finally:
            self._pg_work = None
            self._finish = None

    def __del__(self) -> None:
        # torchcomms' gloo runs an async op on a std::async thread whose future joins it when
        # destroyed: dropping an unfinished work blocks until the op ends or times out.
        if getattr(self, "_status", None) is WorkStatus.INPROGRESS:
            self._settle()

    def is_completed(self) -> bool:
        """True once the op finished successfully (False while running and after an error).

        With gloo a point-to-point op only completes in ``wait()``, as with torchcomms' gloo.
        """
        if (
            self._status is WorkStatus.INPROGRESS
            and not self._comm._stream_ordered
            and self._p2p_timeout is None
            and self._pg_work.is_completed()
        ):
            self._settle()
        return self._status is WorkStatus.COMPLETED

    def wait(self) -> None:
        """Wait for the op. Its error is raised by the first ``wait()`` only, as in torchcomms.

        Stream-ordered: returns at once, whatever the op's state (NCCL's enqueues a stream wait).
        """
        if self._waited:
            return
        self._waited = True
        if self._comm._stream_ordered:
            return
        self._settle()
        if self._status is WorkStatus.ERROR:
            assert self._error is not None
            raise self._error

    def wait_blocking(self) -> None:
        """Supported only by works that are complete from the start (gloo's synchronous ops),
        as in torchcomms: neither gloo's async works nor NCCL's implement it."""
        if self._async or self._comm._stream_ordered:
            raise RuntimeError("[TorchWork]: waitBlocking not implemented for this work type")
        self.wait()


class TorchComm:
    """A communicator. Create it with ``torchcomms.new_comm`` or ``TorchComm.split``."""

    _name: str
    _rank: int
    _size: int
    _global_ranks: list[int]  # the new_comm ranks of the members, in this communicator's order
    _device: torch.device
    _store: Store  # the store this communicator's gloo group rendezvoused on
    _options: CommOptions
    _pg: Any  # a ProcessGroupGloo; typed Any because torch's stubs omit the Backend methods
    _finalized: bool
    _timed_out: bool  # gloo closed the pairs after a timeout: every later op fails
    _stream_ordered: bool  # CUDA-like: wait() does not block (TORCHCOMMS_STANDIN_NONBLOCKING_WAIT)
    _split_count: int
    _hook_ids: Iterator[int]
    _pre_hooks: dict[int, PreHook]
    _post_hooks: dict[int, PostHook]
    _abort_hooks: dict[int, AbortHook]

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TypeError("torchcomms.TorchComm: No constructor defined!")

    @classmethod
    def _create(
        cls,
        name: str,
        rank: int,
        global_ranks: list[int],
        device: torch.device,
        store: Store,
        options: CommOptions,
        stream_ordered: bool,
    ) -> TorchComm:
        size = len(global_ranks)
        pg = _make_process_group(store, rank, size, options.timeout, options.hints)
        comm = object.__new__(cls)
        comm._name = name
        comm._rank = rank
        comm._size = size
        comm._global_ranks = global_ranks
        comm._device = device
        comm._store = store
        comm._options = options
        comm._pg = pg
        comm._finalized = False
        comm._timed_out = False
        comm._stream_ordered = stream_ordered
        comm._split_count = 0
        comm._hook_ids = itertools.count()
        comm._pre_hooks = {}
        comm._post_hooks = {}
        comm._abort_hooks = {}
        return comm

    def __copy__(self) -> TorchComm:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> TorchComm:
        return self

    def __repr__(self) -> str:
        return f"<torchcomms stand-in TorchComm {self._name!r} rank {self._rank}/{self._size}>"

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
        o = self._options
        return CommOptions(
            abort_process_on_timeout_or_error=o.abort_process_on_timeout_or_error,
            timeout=o.timeout,
            store=None,
            enable_reconfigure=o.enable_reconfigure,
            hints=dict(o.hints),
        )

    # -- life cycle and fault tolerance -------------------------------------------------------

    def finalize(self) -> None:
        """End the communicator; every later op raises "TorchCommGloo not initialized"."""
        self._call_pre_hooks(OpName.finalize, FINALIZE_OP_ID, FinalizePreHookArgs())
        if self._finalized:
            raise RuntimeError("TorchCommGloo already finalized")
        self._finalized = True
        self._call_post_hooks(FINALIZE_OP_ID, FinalizePostHookArgs())

    def abort(self) -> None:
        raise RuntimeError(
            f"[TorchCommBackend]: abort not implemented for communicator:{self._name}"
        )

    def is_abort_supported(self) -> bool:
        return False

    def is_aborted(self) -> bool:
        return False

    def set_timeout(self, timeout: timedelta) -> None:
        """Not supported by torchcomms' gloo backend: raises RuntimeError, as it does."""
        if not isinstance(timeout, timedelta):
            raise TypeError(f"timeout must be a datetime.timedelta, got {_type_name(timeout)}")
        raise RuntimeError(
            f"[TorchCommBackend]: setTimeout not implemented for communicator:{self._name}"
        )

    def reconfigure(
        self,
        uuid: int,
        init_handles: list[str] | set[str],
        timeout: timedelta | None = None,
        hints: dict[str, str] | None = None,
    ) -> TorchWork:
        raise NotImplementedError(f"reconfigure {_NOT_EMULATED}")

    def get_init_handle(self) -> str:
        raise NotImplementedError(f"get_init_handle {_NOT_EMULATED}")

    def batch_op_create(self) -> NoReturn:
        raise NotImplementedError(f"batch_op_create {_NOT_EMULATED}")

    def new_window(self, tensor: torch.Tensor | None = None) -> NoReturn:
        raise NotImplementedError(f"new_window {_NOT_EMULATED}")

    def set_hints(self, hints: dict[str, str]) -> None:
        _check_hints(hints)
        raise RuntimeError(
            f"[TorchCommBackend]: setHints not implemented for communicator:{self._name}"
        )

    # -- hooks ------------------------------------------------------------------------------

    def register_pre_hook(self, callback: PreHook) -> RemovableHandle:
        """``callback(op_name: OpName, op_id: int, args)`` runs before every op."""
        return self._register(self._pre_hooks, _check_callable(callback))

    def register_post_hook(self, callback: PostHook) -> RemovableHandle:
        """``callback(op_id: int, args)`` runs after an op was issued (sync: finished)."""
        return self._register(self._post_hooks, _check_callable(callback))

    def register_abort_hook(self, callback: AbortHook) -> RemovableHandle:
        """``callback()`` runs when a synchronous collective fails (e.g. times out)."""
        return self._register(self._abort_hooks, _check_callable(callback))

    def _register(self, table: dict[int, Any], callback: Callable[..., Any]) -> RemovableHandle:
        hook_id = next(self._hook_ids)
        table[hook_id] = callback
        return RemovableHandle(lambda: table.pop(hook_id, None))

    def _call_pre_hooks(self, op_name: OpName, op_id: int, args: PreHookArgs) -> None:
        for hook in list(self._pre_hooks.values()):
            hook(op_name._copy(), op_id, args)  # a new object per call, as from the binding

    def _call_post_hooks(self, op_id: int, args: PostHookArgs) -> None:
        for hook in list(self._post_hooks.values()):
            hook(op_id, args)

    def _begin(self, op_name: OpName, args: PreHookArgs, *, initialized: bool = True) -> int:
        """Take an op id and run the pre-hooks; ``initialized``: refuse after finalize()."""
        op_id = _next_op_id()
        self._call_pre_hooks(op_name, op_id, args)
        if initialized and self._finalized:
            raise RuntimeError("TorchCommGloo not initialized")
        return op_id

    def _run_abort_hooks(self) -> None:
        for hook in list(self._abort_hooks.values()):
            try:
                hook()
            except Exception:
                _log.exception("torchcomms stand-in: an abort hook raised")

    # -- execution --------------------------------------------------------------------------

    def _validate_rank(self, what: str, rank: int) -> None:
        if not 0 <= rank < self._size:
            raise RuntimeError(f"{what} must be in range [0, {self._size}), but got {rank}")

    def _deadline(self, timeout: timedelta | None) -> timedelta:
        if timeout is not None and timeout > timedelta(0):
            return timeout
        return self._options.timeout

    def _translate_error(self, exc: BaseException) -> RuntimeError:
        """Record a gloo timeout (the communicator is dead after it) and type it RuntimeError."""
        message = str(exc)
        if any(marker in message for marker in _TIMEOUT_MARKERS):
            self._timed_out = True
        if type(exc) is RuntimeError:
            return exc
        error = RuntimeError(message)
        error.__cause__ = exc
        return error

    def _launch(self, launch: _Launch, deadline: timedelta) -> tuple[Any, _Finisher]:
        if self._timed_out:
            # gloo closed this communicator's pairs when an op timed out; keep it dead.
            raise RuntimeError(_PAIR_CLOSED)
        return launch(deadline)

    def _run(
        self,
        op_id: int,
        launch: _Launch,
        async_op: bool,
        timeout: timedelta | None,
        *,
        p2p: bool = False,
    ) -> TorchWork:
        deadline = self._deadline(timeout)
        if async_op or self._stream_ordered:  # stream-ordered: a sync op is only enqueued too
            try:
                pg_work, finish = self._launch(launch, deadline)
            except Exception as exc:
                error = self._translate_error(exc)
                if not async_op:
                    if error is exc:
                        raise
                    raise error from exc
                work = TorchWork._new(self, async_op=True, status=WorkStatus.ERROR, error=error)
            else:
                work = TorchWork._new(
                    self,
                    async_op=async_op,
                    status=WorkStatus.INPROGRESS,
                    pg_work=pg_work,
                    finish=finish,
                    p2p_timeout=deadline if p2p else None,
                )
        else:
            try:
                pg_work, finish = self._launch(launch, deadline)
                if p2p:
                    pg_work.wait(deadline)
                else:
                    pg_work.wait()
                if finish is not None:
                    finish()
            except Exception as exc:
                error = self._translate_error(exc)
                if not p2p:
                    # torchcomms' gloo runs abort hooks when a synchronous collective fails.
                    self._run_abort_hooks()
                if error is exc:
                    raise
                raise error from exc
            work = TorchWork._new(self, async_op=False, status=WorkStatus.COMPLETED)
        self._call_post_hooks(op_id, CollectivePostHookArgs())
        return work

    # -- point to point ---------------------------------------------------------------------

    def send(
        self,
        tensor: torch.Tensor,
        dst: int,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        _check_tensor("tensor", tensor)
        _check_int("dst", dst)
        async_op = _check_bool("async_op", async_op)
        _check_hints(hints)
        timeout = _check_timeout(timeout)
        self._validate_rank("dst", dst)
        op_id = self._begin(OpName.send, SendPreHookArgs(tensor, dst, async_op))
        _ensure_contiguous(tensor)
        if dst == self._rank:
            raise RuntimeError("Cannot send to self")
        return self._run(
            op_id, lambda _: (self._pg.send([tensor], dst, 0), None), async_op, timeout, p2p=True
        )

    def recv(
        self,
        tensor: torch.Tensor,
        src: int,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        _check_tensor("tensor", tensor)
        _check_int("src", src)
        async_op = _check_bool("async_op", async_op)
        _check_hints(hints)
        timeout = _check_timeout(timeout)
        self._validate_rank("src", src)
        op_id = self._begin(OpName.recv, RecvPreHookArgs(tensor, src, async_op))
        _ensure_contiguous(tensor)
        if src == self._rank:
            raise RuntimeError("Cannot recv from self")
        return self._run(
            op_id, lambda _: (self._pg.recv([tensor], src, 0), None), async_op, timeout, p2p=True
        )

    # -- collectives ------------------------------------------------------------------------

    def broadcast(
        self,
        tensor: torch.Tensor,
        root: int,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        _check_tensor("tensor", tensor)
        _check_int("root", root)
        async_op = _check_bool("async_op", async_op)
        _check_hints(hints)
        timeout = _check_timeout(timeout)
        self._validate_rank("root", root)
        op_id = self._begin(OpName.broadcast, BroadcastPreHookArgs(tensor, root, async_op))
        _ensure_contiguous(tensor)

        def launch(deadline: timedelta) -> tuple[Any, _Finisher]:
            opts = c10d.BroadcastOptions()
            opts.rootRank, opts.rootTensor, opts.timeout = root, 0, deadline
            return self._pg.broadcast([tensor], opts), None

        return self._run(op_id, launch, async_op, timeout)

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        _check_tensor("tensor", tensor)
        _check_op(op)
        async_op = _check_bool("async_op", async_op)
        _check_hints(hints)
        timeout = _check_timeout(timeout)
        op_id = self._begin(OpName.all_reduce, AllReducePreHookArgs(tensor, async_op))
        _ensure_contiguous(tensor)

        def launch(deadline: timedelta) -> tuple[Any, _Finisher]:
            _premultiply(tensor, op)  # in place: the tensor is the op's input and output
            opts = c10d.AllreduceOptions()
            opts.reduceOp, opts.timeout = _C10D_REDUCE[op.type], deadline
            return self._pg.allreduce([tensor], opts), lambda: _average(tensor, op, self._size)

        return self._run(op_id, launch, async_op, timeout)

    def reduce(
        self,
        tensor: torch.Tensor,
        root: int,
        op: ReduceOp,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        _check_tensor("tensor", tensor)
        _check_int("root", root)
        _check_op(op)
        async_op = _check_bool("async_op", async_op)
        _check_hints(hints)
        timeout = _check_timeout(timeout)
        self._validate_rank("root", root)
        op_id = self._begin(OpName.reduce, ReducePreHookArgs(tensor, root, async_op))
        _ensure_contiguous(tensor)

        def launch(deadline: timedelta) -> tuple[Any, _Finisher]:
            _premultiply(tensor, op)
            opts = c10d.ReduceOptions()
            opts.reduceOp, opts.rootRank, opts.rootTensor = _C10D_REDUCE[op.type], root, 0
            opts.timeout = deadline
            return self._pg.reduce([tensor], opts), lambda: _average(tensor, op, self._size)

        return self._run(op_id, launch, async_op, timeout)

    def all_gather(
        self,
        tensor_list: list[torch.Tensor],
        tensor: torch.Tensor,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        outputs = _check_tensor_list("tensor_list", tensor_list)
        _check_tensor("tensor", tensor)
        async_op = _check_bool("async_op", async_op)
        _check_hints(hints)
        timeout = _check_timeout(timeout)
        op_id = self._begin(OpName.all_gather, AllGatherPreHookArgs(tensor, outputs, async_op))
        if len(outputs) != self._size:
            raise RuntimeError("tensor_list size must equal comm_size for all_gather")
        _ensure_contiguous(tensor)
        n = tensor.numel()
        if any(t.numel() != n for t in outputs):
            raise RuntimeError("All tensors in tensor_list must have same size as input tensor")

        def launch(deadline: timedelta) -> tuple[Any, _Finisher]:
            flat = torch.empty(n * self._size, dtype=tensor.dtype)
            opts = c10d.AllgatherOptions()
            opts.timeout = deadline
            pg_work = self._pg._allgather_base(flat, tensor.reshape(-1), opts)

            def finish() -> None:
                for i, out in enumerate(outputs):
                    out.copy_(flat[i * n : (i + 1) * n].view(out.shape))

            return pg_work, finish

        return self._run(op_id, launch, async_op, timeout)

    def all_gather_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        _check_tensor("output", output)
        _check_tensor("input", input)
        async_op = _check_bool("async_op", async_op)
        _check_hints(hints)
        timeout = _check_timeout(timeout)
        op_id = self._begin(
            OpName.all_gather_single, AllGatherSinglePreHookArgs(input, output, async_op)
        )
        _ensure_contiguous(output, input)
        if output.numel() != input.numel() * self._size:
            raise RuntimeError("all_gather_single: output must hold input.numel() * comm_size")

        def launch(deadline: timedelta) -> tuple[Any, _Finisher]:
            opts = c10d.AllgatherOptions()
            opts.timeout = deadline
            return self._pg._allgather_base(output.view(-1), input.reshape(-1), opts), None

        return self._run(op_id, launch, async_op, timeout)

    def all_gather_v(
        self,
        tensor_list: list[torch.Tensor],
        tensor: torch.Tensor,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        raise NotImplementedError(f"all_gather_v {_NOT_EMULATED}")

    def _reduce_scatter_flat(
        self,
        op_id: int,
        output: torch.Tensor,
        make_input: Callable[[], torch.Tensor],
        op: ReduceOp,
        async_op: bool,
        timeout: timedelta | None,
    ) -> TorchWork:
        """torchcomms' gloo: all-reduce the flat input in place, then copy this rank's chunk."""

        def launch(deadline: timedelta) -> tuple[Any, _Finisher]:
            flat_input = make_input()
            _premultiply(flat_input, op)
            opts = c10d.AllreduceOptions()
            opts.reduceOp, opts.timeout = _C10D_REDUCE[op.type], deadline
            pg_work = self._pg.allreduce([flat_input], opts)
            n = output.numel()

            def finish() -> None:
                _average(flat_input, op, self._size)
                output.view(-1).copy_(flat_input[self._rank * n : (self._rank + 1) * n])

            return pg_work, finish

        return self._run(op_id, launch, async_op, timeout)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: ReduceOp,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        _check_tensor("output", output)
        inputs = _check_tensor_list("input_list", input_list)
        _check_op(op)
        async_op = _check_bool("async_op", async_op)
        _check_hints(hints)
        timeout = _check_timeout(timeout)
        op_id = self._begin(
            OpName.reduce_scatter, ReduceScatterPreHookArgs(inputs, output, async_op)
        )
        _ensure_contiguous(output)
        if len(inputs) != self._size:
            raise RuntimeError("input_list size must equal comm_size for reduce_scatter")
        _ensure_contiguous(*inputs)
        if any(t.numel() != output.numel() for t in inputs):
            raise RuntimeError("All input tensors must have same size as output tensor")
        return self._reduce_scatter_flat(
            op_id, output, lambda: torch.cat([t.reshape(-1) for t in inputs]), op, async_op, timeout
        )

    def reduce_scatter_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        _check_tensor("output", output)
        _check_tensor("input", input)
        _check_op(op)
        async_op = _check_bool("async_op", async_op)
        _check_hints(hints)
        timeout = _check_timeout(timeout)
        op_id = self._begin(
            OpName.reduce_scatter_single, ReduceScatterSinglePreHookArgs(input, output, async_op)
        )
        _ensure_contiguous(output, input)
        if input.numel() != output.numel() * self._size:
            raise RuntimeError(
                "reduce_scatter_single: input must hold output.numel() * comm_size elements"
            )

        # As with torchcomms' gloo, the caller's input ends up holding the full reduction
        # (scaled for PREMUL_SUM, divided for AVG); reduce_scatter's list is copied first.
        return self._reduce_scatter_flat(
            op_id, output, lambda: input.view(-1), op, async_op, timeout
        )

    def reduce_scatter_v(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: ReduceOp,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        raise NotImplementedError(f"reduce_scatter_v {_NOT_EMULATED}")

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        _check_tensor("output", output)
        _check_tensor("input", input)
        async_op = _check_bool("async_op", async_op)
        _check_hints(hints)
        timeout = _check_timeout(timeout)
        op_id = self._begin(
            OpName.all_to_all_single, AllToAllSinglePreHookArgs(input, output, async_op)
        )
        _ensure_contiguous(output, input)
        if input.numel() != output.numel():
            raise RuntimeError("all_to_all_single: input and output must have the same numel")
        if input.numel() % self._size != 0:
            raise RuntimeError("all_to_all_single: numel must be divisible by comm_size")

        def launch(deadline: timedelta) -> tuple[Any, _Finisher]:
            opts = c10d.AllToAllOptions()
            opts.timeout = deadline
            pg_work = self._pg.alltoall_base(output.view(-1), input.reshape(-1), [], [], opts)
            return pg_work, None

        return self._run(op_id, launch, async_op, timeout)

    def all_to_all_v_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        _check_tensor("output", output)
        _check_tensor("input", input)
        out_splits = _check_int_list("output_split_sizes", output_split_sizes, non_negative=True)
        in_splits = _check_int_list("input_split_sizes", input_split_sizes, non_negative=True)
        async_op = _check_bool("async_op", async_op)
        _check_hints(hints)
        timeout = _check_timeout(timeout)
        op_id = self._begin(
            OpName.all_to_all_v_single,
            AllToAllVSinglePreHookArgs(input, output, in_splits, out_splits, async_op),
        )
        _ensure_contiguous(output, input)
        if len(in_splits) != self._size or len(out_splits) != self._size:
            raise RuntimeError("all_to_all_v_single: split size lists must have comm_size entries")
        in_rows, out_rows = sum(in_splits), sum(out_splits)
        if in_rows > input.size(0) or out_rows > output.size(0):
            raise RuntimeError("all_to_all_v_single: split sizes exceed the tensor's dim 0")

        def launch(deadline: timedelta) -> tuple[Any, _Finisher]:
            opts = c10d.AllToAllOptions()
            opts.timeout = deadline
            pg_work = self._pg.alltoall_base(
                output.narrow(0, 0, out_rows),
                input.narrow(0, 0, in_rows),
                out_splits,
                in_splits,
                opts,
            )
            return pg_work, None

        return self._run(op_id, launch, async_op, timeout)

    def all_to_all(
        self,
        output_tensor_list: list[torch.Tensor],
        input_tensor_list: list[torch.Tensor],
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        outputs = _check_tensor_list("output_tensor_list", output_tensor_list)
        inputs = _check_tensor_list("input_tensor_list", input_tensor_list)
        async_op = _check_bool("async_op", async_op)
        _check_hints(hints)
        timeout = _check_timeout(timeout)
        op_id = self._begin(OpName.all_to_all, AllToAllPreHookArgs(inputs, outputs, async_op))
        if len(outputs) != self._size or len(inputs) != self._size:
            raise RuntimeError("Tensor list sizes must equal comm_size for all_to_all")
        _ensure_contiguous(*inputs, *outputs)
        n = inputs[0].numel()
        if any(t.numel() != n for t in inputs) or any(t.numel() != n for t in outputs):
            raise RuntimeError("all_to_all: all tensors must have the same numel")

        def launch(deadline: timedelta) -> tuple[Any, _Finisher]:
            flat_in = torch.cat([t.reshape(-1) for t in inputs])
            flat_out = torch.empty(n * self._size, dtype=outputs[0].dtype)
            opts = c10d.AllToAllOptions()
            opts.timeout = deadline
            pg_work = self._pg.alltoall_base(flat_out, flat_in, [], [], opts)

            def finish() -> None:
                for i, out in enumerate(outputs):
                    out.copy_(flat_out[i * n : (i + 1) * n].view(out.shape))

            return pg_work, finish

        return self._run(op_id, launch, async_op, timeout)

    def barrier(
        self,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        async_op = _check_bool("async_op", async_op)
        _check_hints(hints)
        timeout = _check_timeout(timeout)
        op_id = self._begin(OpName.barrier, BarrierPreHookArgs(async_op))

        def launch(deadline: timedelta) -> tuple[Any, _Finisher]:
            opts = c10d.BarrierOptions()
            opts.timeout = deadline
            return self._pg.barrier(opts), None

        return self._run(op_id, launch, async_op, timeout)

    def scatter(
        self,
        output_tensor: torch.Tensor,
        input_tensor_list: list[torch.Tensor],
        root: int,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        """Only ``root``'s ``input_tensor_list`` is used; other ranks' lists are ignored."""
        _check_tensor("output_tensor", output_tensor)
        inputs = _check_tensor_list("input_tensor_list", input_tensor_list)
        _check_int("root", root)
        async_op = _check_bool("async_op", async_op)
        _check_hints(hints)
        timeout = _check_timeout(timeout)
        self._validate_rank("root", root)
        op_id = self._begin(
            OpName.scatter, ScatterPreHookArgs(output_tensor, inputs, root, async_op)
        )
        _ensure_contiguous(output_tensor)
        is_root = self._rank == root
        if is_root:
            if len(inputs) != self._size:
                raise RuntimeError("input_tensor_list size must equal comm_size for scatter")
            _ensure_contiguous(*inputs)
            if any(t.numel() != output_tensor.numel() for t in inputs):
                raise RuntimeError("All input tensors must have same size as output tensor")

        def launch(deadline: timedelta) -> tuple[Any, _Finisher]:
            opts = c10d.ScatterOptions()
            opts.rootRank, opts.timeout = root, deadline
            send = [[t.view(output_tensor.shape) for t in inputs]] if is_root else []
            return self._pg.scatter([output_tensor], send, opts), None

        return self._run(op_id, launch, async_op, timeout)

    def _gather_into(
        self,
        op_id: int,
        outputs: list[torch.Tensor],
        input_tensor: torch.Tensor,
        root: int,
        async_op: bool,
        timeout: timedelta | None,
    ) -> TorchWork:
        _ensure_contiguous(input_tensor)
        is_root = self._rank == root
        if is_root:
            if len(outputs) != self._size:
                raise RuntimeError("output_tensor_list size must equal comm_size for gather")
            _ensure_contiguous(*outputs)
            if any(t.numel() != input_tensor.numel() for t in outputs):
                raise RuntimeError("All output tensors must have same size as input tensor")

        def launch(deadline: timedelta) -> tuple[Any, _Finisher]:
            opts = c10d.GatherOptions()
            opts.rootRank, opts.timeout = root, deadline
            receive = [[t.view(input_tensor.shape) for t in outputs]] if is_root else []
            return self._pg.gather(receive, [input_tensor], opts), None

        return self._run(op_id, launch, async_op, timeout)

    def gather(
        self,
        output_tensor_list: list[torch.Tensor],
        input_tensor: torch.Tensor,
        root: int,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        """Only ``root``'s ``output_tensor_list`` is used; other ranks' lists are ignored."""
        outputs = _check_tensor_list("output_tensor_list", output_tensor_list)
        _check_tensor("input_tensor", input_tensor)
        _check_int("root", root)
        async_op = _check_bool("async_op", async_op)
        _check_hints(hints)
        timeout = _check_timeout(timeout)
        self._validate_rank("root", root)
        op_id = self._begin(OpName.gather, GatherPreHookArgs(input_tensor, outputs, root, async_op))
        return self._gather_into(op_id, outputs, input_tensor, root, async_op, timeout)

    def gather_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        root: int,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        """Root's ``output`` holds the ranks' inputs along dim 0; other ranks' is ignored."""
        _check_tensor("output", output)
        _check_tensor("input", input)
        _check_int("root", root)
        async_op = _check_bool("async_op", async_op)
        _check_hints(hints)
        timeout = _check_timeout(timeout)
        self._validate_rank("root", root)
        op_id = self._begin(
            OpName.gather_single, GatherSinglePreHookArgs(input, output, root, async_op)
        )
        outputs = list(output.chunk(self._size, 0)) if self._rank == root else []
        return self._gather_into(op_id, outputs, input, root, async_op, timeout)

    # -- communicator management ------------------------------------------------------------

    def split(
        self,
        ranks: list[int],
        name: str,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchComm | None:
        """Make a sub-communicator of ``ranks``, as torchcomms' gloo does: only members meet.

        A member passes the group's parent ranks (its new rank is its position in the list);
        the members rendezvous under ``f"{split_id}/{name}_{min(ranks)}"``, where ``split_id``
        counts this rank's non-empty splits of this parent. ``[]`` returns None at once,
        before that counter moves: after a split that left a rank out, that rank's next
        split rendezvouses under other keys than the members' and waits out its timeout (a
        non-member that calls ``split([own_rank])`` instead keeps the counters in step).
        Lists that differ between ranks are not detected: each rank meets whoever used its
        keys (a rank alone gets a 1-rank communicator, a rank waiting for absent members
        times out). A non-empty list without the caller raises. The child is named
        ``f"{name}_{min(ranks)}"``; its timeout is ``timeout`` or the environment default
        (not the parent's). Works after ``finalize()``, as in torchcomms.
        """
        group = _check_int_list("ranks", ranks)
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {_type_name(name)}")
        hint_map = _check_hints(hints)
        timeout = _check_timeout(timeout)
        op_id = self._begin(OpName.split, SplitPreHookArgs(list(group), name), initialized=False)
        for r in group:
            if not 0 <= r < self._size:
                raise RuntimeError(
                    f"Invalid rank {r} in ranks. Valid ranks are 0 to {self._size - 1}"
                )
        if len(set(group)) != len(group):
            raise RuntimeError("Duplicate ranks found in ranks list")
        if not group:
            return None
        if self._rank not in group:
            raise RuntimeError(
                f"Current rank {self._rank} is not included in the provided ranks list"
            )
        color = min(group)
        split_id = self._split_count
        self._split_count += 1
        hint_map["persistent_store"] = "true"
        options = CommOptions(
            abort_process_on_timeout_or_error=self._options.abort_process_on_timeout_or_error,
            timeout=timeout if timeout is not None else _default_timeout(),
            hints=hint_map,
        )
        store = PrefixStore(f"{split_id}/{name}_{color}", self._store)
        child = TorchComm._create(
            f"{name}_{color}",
            group.index(self._rank),
            [self._global_ranks[r] for r in group],
            self._device,
            store,
            options,
            self._stream_ordered,
        )
        self._call_post_hooks(op_id, SplitPostHookArgs())
        return child
