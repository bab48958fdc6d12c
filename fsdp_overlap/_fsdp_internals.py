"""The one place fsdp_overlap touches FSDP2 internals (torch 2.13); nothing is patched.

- `AllGather` / `ReduceScatter`: the base classes that the public
  `FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter` take. torch exports them
  only from the private `torch.distributed.fsdp._fully_shard._fsdp_api`.
- `FSDPModule._set_unshard_async_op` (private): makes the pre-forward, pre-backward and
  prefetch all-gathers of every FSDP parameter group under a module use `async_op=True`.
  On CPU (gloo) that is what lets a prefetched all-gather run in gloo's background thread
  while the current block computes; without it FSDP2 issues every all-gather
  synchronously and prefetching only reorders blocking calls.

`tests/fsdp/test_shard.py::test_fsdp_internals_unchanged` and `::test_unshard_async_op_knob`
fail loudly if torch moves or reshapes either.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

__all__ = ["AllGather", "FSDPInternalsChanged", "ReduceScatter", "unshard_async_op_setter"]


class FSDPInternalsChanged(RuntimeError):
    """The running torch no longer has an FSDP2 internal that fsdp_overlap relies on."""


def unshard_async_op_setter() -> Callable[[FSDPModule, bool], None]:
    """`set(module, enabled)`: issue the all-gathers of `module` and every FSDP module under it
    with `async_op=enabled`. Raises `FSDPInternalsChanged` now, before anything is sharded,
    if this torch lacks the knob.
    """
    setter = getattr(FSDPModule, "_set_unshard_async_op", None)
    if not callable(setter):
        raise FSDPInternalsChanged(
            f"fsdp_overlap: expected FSDPModule._set_unshard_async_op (present in torch 2.13) for "
            f"asynchronous prefetch; found none in torch {torch.__version__}. Pass async_prefetch=False, "
            f"or update fsdp_overlap/_fsdp_internals.py for this torch"
        )
    return setter
