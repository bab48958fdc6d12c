"""The `torch.distributed` backend: a registered c10d `ProcessGroup` (gloo on CPU, nccl on GPU).

Each op resolves through `commlib.compat`, so the same launch runs on every supported
torch. Reductions gloo lacks (AVG, PREMUL_SUM) are emulated here, because what a
reduction means is part of the op, and both backends must give the same numbers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from commlib import compat
from commlib.backends.base import Failure
from commlib.ops import Collective, OpName, PremulSum, ReduceOp, Reduction, reduction_kind

_DIST_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.BAND: dist.ReduceOp.BAND,
    ReduceOp.BOR: dist.ReduceOp.BOR,
    ReduceOp.BXOR: dist.ReduceOp.BXOR,
    ReduceOp.AVG: dist.ReduceOp.AVG,
}

# Substrings of engine errors, lower-cased. gloo: "Operation timed out!", "Timed out waiting
# ... for recv", "Connection closed by peer", "Connection reset by peer"; nccl: watchdog
# timeouts, "NCCL communicator was aborted", remote errors.
_TIMEOUT_TEXTS = ("timed out", "timeout")
_PEER_TEXTS = ("closed by peer", "reset by peer", "broken pipe", "connection refused",
               "remote process exited", "socket closed", "ncclremoteerror")
_ABORT_TEXTS = ("aborted", "not initialized", "has been destroyed", "pair closure")


def classify_text(message: str) -> Failure:
    """Map an engine's error text to its meaning (shared by both backends, which both wrap gloo/nccl)."""
    text = message.lower()
    if any(s in text for s in _PEER_TEXTS):
        return Failure.PEER
    if any(s in text for s in _TIMEOUT_TEXTS):
        return Failure.TIMEOUT
    if any(s in text for s in _ABORT_TEXTS):
        return Failure.ABORTED
    return Failure.OTHER


def _routed_through_torchcomms(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether torch built `group` over torchcomms (TORCH_DISTRIBUTED_USE_TORCHCOMMS=1)."""
    c10d = dist.distributed_c10d
    if not getattr(c10d, "_use_torchcomms_enabled", lambda: False)():
        return False
    return isinstance(group._get_backend(device), c10d._BackendWrapper)


def _wait_without_timeout(work: Any, timeout: timedelta) -> bool:
    """Wait for `work` at most `timeout`, for Works whose `wait` takes no timeout.

    torchcomms' WorkWrapper raises "wait timeout not supported" for any finite timeout and
    only reports completion from `wait()`, so the unbounded wait runs on a daemon thread.
    """
    done = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work.wait()
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name="commlib-c10d-wait", daemon=True).start()
    if not done.wait(timeout.total_seconds()):
        return False
    if errors:
        raise errors[0]
    return True


@dataclass
class C10dWork:
    work: Any  # torch.distributed.Work
    finish: Callable[[], None] | None = None  # emulation step run after completion
    timed_wait: bool = True  # False when Work.wait rejects a finite timeout (torchcomms)

    def wait(self, timeout: timedelta) -> bool:
        try:
            if not self.timed_wait:
                if not _wait_without_timeout(self.work, timeout):
                    return False
            else:
                self.work.wait(timeout)
        except RuntimeError as exc:
            if classify_text(str(exc)) is Failure.TIMEOUT:
                return False
            raise
        if self.finish is not None:
            self.finish()
            self.finish = None
        return True

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())


class C10dBackend:
    """A Communicator backend over one registered `torch.distributed.ProcessGroup`."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.rank = group.rank()
        self.size = group.size()
        self.name = dist.get_backend(group)
        self.global_ranks = dist.get_process_group_ranks(group)
        self._native_avg = self.name == "nccl"
        self._torchcomms = _routed_through_torchcomms(group, device)

    # -- launch -------------------------------------------------------------------------
    def launch(self, call: Collective, timeout: timedelta) -> C10dWork:
        op = call.op
        g = self.group
        red, finish = self._reduction(call)
        if op is OpName.ALL_REDUCE:
            w = dist.all_reduce(call.tensor, op=red, group=g, async_op=True)
        elif op is OpName.BROADCAST:
            w = dist.broadcast(call.tensor, group=g, group_src=call.root, async_op=True)
        elif op is OpName.REDUCE:
            w = dist.reduce(call.tensor, group=g, group_dst=call.root, op=red, async_op=True)
        elif op is OpName.ALL_GATHER:
            w = dist.all_gather(call.output_list, call.input, group=g, async_op=True)
        elif op is OpName.ALL_GATHER_SINGLE:
            w = compat.resolve("all_gather_single")(call.output, call.input, group=g, async_op=True)
        elif op is OpName.REDUCE_SCATTER:
            w = dist.reduce_scatter(call.output, call.input_list, op=red, group=g, async_op=True)
        elif op is OpName.REDUCE_SCATTER_SINGLE:
            w = compat.resolve("reduce_scatter_single")(call.output, call.input, op=red, group=g, async_op=True)
        elif op is OpName.ALL_TO_ALL_SINGLE:
            w = dist.all_to_all_single(call.output, call.input, group=g, async_op=True)
        elif op is OpName.GATHER:
            gather_list = call.output_list if call.rank == call.root else None
            w = dist.gather(call.input, gather_list, group=g, group_dst=call.root, async_op=True)
        elif op is OpName.SCATTER:
            scatter_list = call.input_list if call.rank == call.root else None
            w = dist.scatter(call.output, scatter_list, group=g, group_src=call.root, async_op=True)
        elif op is OpName.SEND:
            w = dist.isend(call.tensor, group=g, group_dst=call.peer)
        elif op is OpName.RECV:
            w = dist.irecv(call.tensor, group=g, group_src=call.peer)
        elif op is OpName.BARRIER:
            w = dist.barrier(group=g, async_op=True)
        else:  # pragma: no cover - OpName is closed
            raise NotImplementedError(op)
        return C10dWork(w, finish, timed_wait=not self._torchcomms)

    def _reduction(self, call: Collective) -> tuple[Any, Callable[[], None] | None]:
        """The dist.ReduceOp to launch with, and the emulation step to run on completion."""
        if call.reduce_op is None:
            return dist.ReduceOp.SUM, None
        kind = reduction_kind(call.reduce_op)
        if kind is ReduceOp.PREMUL_SUM:
            assert isinstance(call.reduce_op, PremulSum)
            factor = call.reduce_op.factor
            if self._native_avg:
                return dist._make_nccl_premul_sum(factor), None
            self._prescale(call, factor)
            return dist.ReduceOp.SUM, None
        if kind is ReduceOp.AVG and not self._native_avg:
            outputs = call.outputs()
            size = self.size
            is_root = call.op is not OpName.REDUCE or call.rank == call.root

            def divide() -> None:
                if is_root:
                    for t in outputs:
                        t.div_(size)

            return dist.ReduceOp.SUM, divide
        return _DIST_OPS[kind], None

    @staticmethod
    def _prescale(call: Collective, factor: float) -> None:
        # In-place ops (all_reduce, reduce) scale their one tensor; others scale a copy so
        # the caller's input is left as it was.
        if call.tensor is not None:
            call.tensor.mul_(factor)
        elif call.input is not None:
            call.input = call.input * factor
        elif call.input_list is not None:
            call.input_list = [t * factor for t in call.input_list]

    # -- the rest of the protocol ------------------------------------------------------
    def supports(self, device: torch.device, op: Reduction | None) -> str | None:
        if device.type != self.device.type:
            return f"backend {self.name} serves {self.device.type} tensors"
        return None

    def split(self, ranks: list[int], name: str, timeout: timedelta) -> "C10dBackend | None":
        global_ranks = [self.global_ranks[r] for r in ranks]
        # Every member of this group calls new_group, non-members included when the parent
        # is the world group, because c10d numbers groups by call order.
        # sort_ranks=False: new ranks follow the order of `ranks`, as torchcomms' split does.
        # Routed through torchcomms, new_group refuses sort_ranks=False even for sorted ranks.
        group = dist.new_group(global_ranks, timeout=timeout, group_desc=name,
                               sort_ranks=global_ranks == sorted(global_ranks),
                               use_local_synchronization=self.size != dist.get_world_size())
        if self.rank not in ranks:
            return None
        return C10dBackend(group, self.device)

    def classify(self, exc: BaseException) -> Failure:
        return classify_text(str(exc))

    def abort(self) -> None:
        try:
            self.group.abort()
        except RuntimeError:
            pass  # backends without abort support: the Communicator is marked dead anyway

    def finalize(self) -> None:
        if self.group is dist.GroupMember.WORLD:
            dist.destroy_process_group()
