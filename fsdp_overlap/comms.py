"""FSDP2's all-gather and reduce-scatter, issued through commlib Communicators.

`CommlibAllGather` and `CommlibReduceScatter` implement FSDP2's `AllGather` /
`ReduceScatter` extension points (`FSDPModule.set_custom_all_gather` /
`set_custom_reduce_scatter`), so every FSDP collective takes commlib's one path: deadline,
typed errors, structured log, flight recorder, progress board, hooks. They use only the
public `Communicator` API, so they work the same over the c10d and torchcomms backends.
The `group` FSDP passes (the mesh's process group) is only checked for its size: the
communicator chosen at construction is what carries the data.

FSDP waits on an async all-gather only if the handle is a `torch.distributed.Work`
(`isinstance` checks in `foreach_all_gather_copy_out`, `finalize_backward` and
`_reset_iter_state`), so `FSDPWork` subclasses it and forwards `wait` to commlib's
`Work.wait`. commlib's `collective.end` of such an op carries `wait_s` (how long the
training thread was blocked) and `done_before_wait`, which `fsdp_overlap.timeline` uses to
tell the exposed part of an async collective from the part hidden behind compute, and a
certain flight from a possibly overstated one.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import commlib
from commlib.ops import to_reduction
from fsdp_overlap._fsdp_internals import AllGather, ReduceScatter


class FSDPWork(dist.Work):
    """A `torch.distributed.Work` whose `wait` is commlib's `Work.wait` (deadline and all)."""

    def __init__(self, work: commlib.Work) -> None:
        super().__init__()
        self._work = work

    def wait(self, timeout: timedelta | None = None) -> bool:
        # FSDP calls wait() without a timeout; a timedelta(0) from c10d code means "none".
        self._work.wait(timeout if timeout else None)
        return True

    def is_completed(self) -> bool:
        return self._work.is_completed()


class _CommlibComm:
    """Allocation and the group check shared by both collectives."""

    kind = "collective"

    def __init__(self, comm: commlib.Communicator) -> None:
        self.comm = comm

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _check_group(self, group: dist.ProcessGroup) -> None:
        if group.size() != self.comm.size:
            raise ValueError(
                f"fsdp_overlap {self.kind} on {self.comm.name!r} rank {self.comm.rank}: expected "
                f"FSDP's group to have the communicator's {self.comm.size} ranks; found "
                f"{group.size()}"
            )

    @staticmethod
    def _wrap(work: commlib.Work | None) -> FSDPWork | None:
        return None if work is None else FSDPWork(work)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.comm.name!r})"


class CommlibAllGather(_CommlibComm, AllGather):
    """FSDP2 all-gather as `comm.all_gather_single`."""

    kind = "all-gather"

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> FSDPWork | None:
        self._check_group(group)
        return self._wrap(self.comm.all_gather_single(output_tensor, input_tensor, async_op=async_op))


class CommlibReduceScatter(_CommlibComm, ReduceScatter):
    """FSDP2 reduce-scatter as `comm.reduce_scatter_single`, with FSDP's reduction mapped to commlib's."""

    kind = "reduce-scatter"

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> FSDPWork | None:
        self._check_group(group)
        return self._wrap(
            self.comm.reduce_scatter_single(output_tensor, input_tensor, to_reduction(op), async_op=async_op)
        )
