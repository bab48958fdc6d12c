"""``torchcomms._comms._BackendWrapper``: a TorchComm as torch.distributed sees it.

TEST-ONLY: part of the torchcomms stand-in under tests/; it must never ship with commlib.

In torchcomms, ``_comms`` is the binding module, and ``_BackendWrapper`` is one of its classes.
Here the rest of the binding's names live in ``torchcomms`` itself (``_comm``, ``_types``) and
this module holds only the wrapper. torch 2.13's ``torch.distributed`` imports it while torch
itself is imported and, with ``TORCH_DISTRIBUTED_USE_TORCHCOMMS=1``, builds every process
group's backend as ``_BackendWrapper(new_comm(...))``. The module exists only when a test
opts in with ``TORCHCOMMS_STANDIN_BACKEND_WRAPPER=1``; otherwise importing it raises
ImportError, torch's probe fails and c10d never sees the stand-in.

torchcomms' wrapper (``BackendWrapper.cpp``) is a C++ ``c10d::Backend`` registered on a C++
ProcessGroup. Python cannot subclass ``c10d.Backend`` (it has no constructor), so this one is a
Python ``ProcessGroup`` (torch's PyProcessGroup trampoline, as in torch's Python process
groups); ``_new_process_group_helper`` then uses the wrapper itself as the group. So that
torch's torchcomms paths still find it, ``_get_backend(cpu)`` returns the wrapper and
``_device_types`` names the communicator's device. Each method maps c10d's arguments onto the
TorchComm call that torchcomms' wrapper makes. Works behave as torchcomms' ``WorkWrapper``:
``wait()`` with a finite timeout raises ``RuntimeError("wait timeout not supported")``, and
``is_completed()`` only turns True in ``wait()``. An op's own deadline is the ``timeout`` in
c10d's options, else the wrapper's default (600 s, set by ``_set_default_timeout``), never the
communicator's.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

# torch is still being imported when torch.distributed probes this module: only its C
# extension (already loaded) may be touched at import time.
from torch._C import _distributed_c10d as c10d

OPT_IN_ENV = "TORCHCOMMS_STANDIN_BACKEND_WRAPPER"

if os.environ.get(OPT_IN_ENV) != "1":
    raise ImportError(
        f"torchcomms._comms (test stand-in) is only importable with {OPT_IN_ENV}=1"
    )

__all__ = ["_BackendWrapper", "WorkWrapper", "_is_backend_registered"]

_log = logging.getLogger("torchcomms")

_NO_TIMEOUT = timedelta(0)  # c10d's kNoTimeout; kUnsetTimeout is negative
_DEFAULT_TIMEOUT = timedelta(seconds=600)  # BackendWrapper::Options::timeout (kDefaultTimeout)


def _is_backend_registered(backend: str) -> bool:
    """Whether a Python backend was added with `torchcomms.register_backend` (torch 2.14+ asks,
    beside `is_backend_built`, and imports it from here). The stand-in registers none."""
    return False


class WorkWrapper(c10d.Work):
    """A TorchWork as a c10d Work, with the semantics of torchcomms' ``WorkWrapper``."""

    def __init__(self, work: Any) -> None:
        super().__init__()
        self._work = work
        self._completed = False

    def wait(self, timeout: timedelta = _NO_TIMEOUT) -> bool:
        # Like c10d::Work::finish, a failed wait also completes the work.
        if timeout != _NO_TIMEOUT:
            self._completed = True
            raise RuntimeError("wait timeout not supported")
        try:
            self._work.wait()
        finally:
            self._completed = True
        return True

    def is_completed(self) -> bool:
        return self._completed


def _reduce_op(op: c10d.ReduceOp) -> Any:
    from ._types import ReduceOp

    kind = op.op
    if kind == c10d.ReduceOp.PREMUL_SUM:
        # torchcomms reads the factor from the op's NCCL supplement, which Python cannot see.
        raise NotImplementedError(
            "PREMUL_SUM through _BackendWrapper is not emulated by the torchcomms stand-in"
        )
    if not hasattr(ReduceOp, kind.name):
        raise RuntimeError("Unsupported reduce op")
    return getattr(ReduceOp, kind.name)


class _BackendWrapper(c10d.ProcessGroup):
    """``_BackendWrapper(comm)``: the c10d face of one stand-in TorchComm."""

    def __init__(self, comm: Any) -> None:
        from ._comm import TorchComm

        if not isinstance(comm, TorchComm):
            raise TypeError(
                f"_BackendWrapper expects a torchcomms.TorchComm, got {type(comm).__name__}"
            )
        super().__init__(comm.get_rank(), comm.get_size())
        self._comm = comm
        self._default_timeout = _DEFAULT_TIMEOUT
        self._group_name = ""
        self._group_desc = ""

    def _timeout(self, opts: Any) -> timedelta:
        return opts.timeout if opts.timeout >= _NO_TIMEOUT else self._default_timeout

    # -- identity, and what torch's torchcomms paths look up --------------------------------

    def get_comm(self) -> Any:
        return self._comm

    def getBackendName(self) -> str:
        return self._comm.get_backend()

    def _set_default_timeout(self, timeout: timedelta) -> None:
        self._default_timeout = timeout

    # A C++ ProcessGroup keeps its name on its backends; this group has none, so it keeps them.
    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    def _get_backend(self, device: Any) -> _BackendWrapper:
        device_type = getattr(device, "type", device)
        if device_type != self._comm.get_device().type:
            raise RuntimeError(
                f"Could not retrieve or create the backend for device type {device_type}"
            )
        return self

    @property
    def _device_types(self) -> list[Any]:
        return [self._comm.get_device()]

    @property
    def supports_splitting(self) -> bool:
        return False  # c10d::Backend's default, which torchcomms' wrapper keeps

    # -- collectives: c10d's argument shapes -> TorchComm calls -----------------------------

    def allreduce(self, tensors: list[Any], opts: Any) -> WorkWrapper:
        (tensor,) = tensors
        return WorkWrapper(self._comm.all_reduce(
            tensor, _reduce_op(opts.reduceOp), opts.asyncOp, timeout=self._timeout(opts)))

    def broadcast(self, tensors: list[Any], opts: Any) -> WorkWrapper:
        (tensor,) = tensors
        return WorkWrapper(self._comm.broadcast(
            tensor, opts.rootRank, opts.asyncOp, timeout=self._timeout(opts)))

    def reduce(self, tensors: list[Any], opts: Any) -> WorkWrapper:
        (tensor,) = tensors
        return WorkWrapper(self._comm.reduce(
            tensor, opts.rootRank, _reduce_op(opts.reduceOp), opts.asyncOp,
            timeout=self._timeout(opts)))

    def allgather(self, output_lists: list[list[Any]], inputs: list[Any], opts: Any) -> WorkWrapper:
        (outputs,), (tensor,) = output_lists, inputs
        return WorkWrapper(self._comm.all_gather(
            outputs, tensor, opts.asyncOp, timeout=self._timeout(opts)))

    def all_gather_single(self, output: Any, input: Any, opts: Any) -> WorkWrapper:
        return WorkWrapper(self._comm.all_gather_single(
            output, input, opts.asyncOp, timeout=self._timeout(opts)))

    def reduce_scatter(
        self, outputs: list[Any], input_lists: list[list[Any]], opts: Any
    ) -> WorkWrapper:
        (output,), (inputs,) = outputs, input_lists
        return WorkWrapper(self._comm.reduce_scatter(
            output, inputs, _reduce_op(opts.reduceOp), opts.asyncOp, timeout=self._timeout(opts)))

    def reduce_scatter_single(self, output: Any, input: Any, opts: Any) -> WorkWrapper:
        return WorkWrapper(self._comm.reduce_scatter_single(
            output, input, _reduce_op(opts.reduceOp), opts.asyncOp, timeout=self._timeout(opts)))

    def all_to_all_single(self, output: Any, input: Any, output_splits: list[int],
                          input_splits: list[int], opts: Any) -> WorkWrapper:
        if not output_splits and not input_splits:
            return WorkWrapper(self._comm.all_to_all_single(
                output, input, opts.asyncOp, timeout=self._timeout(opts)))
        return WorkWrapper(self._comm.all_to_all_v_single(
            output, input, list(output_splits), list(input_splits), opts.asyncOp,
            timeout=self._timeout(opts)))

    def alltoall(self, outputs: list[Any], inputs: list[Any], opts: Any) -> WorkWrapper:
        return WorkWrapper(self._comm.all_to_all(
            outputs, inputs, opts.asyncOp, timeout=self._timeout(opts)))

    def gather(self, output_lists: list[list[Any]], inputs: list[Any], opts: Any) -> WorkWrapper:
        # torch passes [[]] off the root when routed through torchcomms (and [] otherwise).
        (outputs,) = output_lists or [[]]
        (tensor,) = inputs
        return WorkWrapper(self._comm.gather(
            outputs, tensor, opts.rootRank, opts.asyncOp, timeout=self._timeout(opts)))

    def scatter(self, outputs: list[Any], input_lists: list[list[Any]], opts: Any) -> WorkWrapper:
        (output,) = outputs
        inputs = input_lists[0] if self._comm.get_rank() == opts.rootRank else []
        return WorkWrapper(self._comm.scatter(
            output, inputs, opts.rootRank, opts.asyncOp, timeout=self._timeout(opts)))

    def barrier(self, opts: Any) -> WorkWrapper:
        return WorkWrapper(self._comm.barrier(opts.asyncOp, timeout=self._timeout(opts)))

    # torchcomms' wrapper always sends and receives asynchronously, under its default timeout.
    # It passes the tag on to gloo; the stand-in's TorchComm has no tag, so it is dropped.
    def send(self, tensors: list[Any], dst: int, tag: int) -> WorkWrapper:
        (tensor,) = tensors
        return WorkWrapper(self._comm.send(tensor, dst, True, timeout=self._default_timeout))

    def recv(self, tensors: list[Any], src: int, tag: int) -> WorkWrapper:
        (tensor,) = tensors
        return WorkWrapper(self._comm.recv(tensor, src, True, timeout=self._default_timeout))

    # -- communicator management -------------------------------------------------------------

    def split_group(self, ranks: list[int], *, timeout: timedelta | None = None, opts: Any = None,
                    group_name: str, group_desc: str | None = None,
                    device_types: Any = None) -> _BackendWrapper | None:
        """Members only (torch calls ``get_comm().split([], name)`` on the others)."""
        child = self._comm.split(list(ranks), group_name, timeout=timeout)
        if child is None:
            return None
        group = _BackendWrapper(child)
        group._set_group_name(group_name)
        group._set_group_desc(group_desc if group_desc is not None else "")
        return group

    def abort(self) -> None:
        try:
            self._comm.abort()
        except RuntimeError as exc:
            _log.warning(
                "BackendWrapper::abort: TorchComm::abort() raised, treating as no-op: %s", exc
            )

    def shutdown(self) -> None:
        try:
            self._comm.finalize()
        except RuntimeError as exc:
            _log.warning("BackendWrapper::shutdown: TorchComm::finalize() raised, treating as "
                         "no-op (likely already finalized): %s", exc)
