"""`shard`: FSDP2 on a model's blocks and root, its collectives routed through commlib.

Modes (`Mode`):

- ``dual``: all-gathers on `comm`, reduce-scatters on a second communicator
  ``comm.split(all ranks, f"{comm.name}.reduce_scatter")``, so a reduce-scatter does not
  queue behind an in-flight (prefetched) all-gather where a communicator runs one
  collective at a time (NCCL: one stream per communicator). A gloo process group already
  runs two at once (two worker threads), so on CPU dual changes little (see docs/measurements.md).
- ``single``: both on `comm` (the baseline for dual).
- ``native``: FSDP2's own ``set_separate_reduce_scatter_group(True)``: a second
  process group created by FSDP itself; it is there to compare against. Over the commlib
  process group (`commlib.init` makes the default group one) that group is a commlib group
  too, so its collectives take commlib's path.
- ``plain``: ``fully_shard`` untouched: FSDP2's default collectives and implicit
  prefetching; `prefetch` and `async_prefetch` are not applied. The numerics reference, and
  the reference trainer's default: over the commlib process group its collectives take
  commlib's path as well.

The all-gathers stay on `comm` itself rather than on a split named ``.all_gather``: the
logs already tell the two apart by op and communicator name (``world`` carries
``all_gather_single``, ``world.reduce_scatter`` carries ``reduce_scatter_single``), and
one more communicator would cost another gloo group (threads, sockets) or NCCL
communicator (GPU memory) for nothing, and make single and dual differ in more than the
one thing being compared.

Everything is checked before the first collective (the dual-mode split) is issued.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

import commlib
from fsdp_overlap import _fsdp_internals
from fsdp_overlap.comms import CommlibAllGather, CommlibReduceScatter


class Mode(enum.StrEnum):
    PLAIN = "plain"
    SINGLE = "single"
    DUAL = "dual"
    NATIVE = "native"


@dataclass
class Sharded:
    """What `shard` did. `model` is the caller's model, sharded in place (now an FSDPModule)."""

    model: nn.Module
    mode: Mode
    mesh: DeviceMesh
    # The communicators carrying FSDP's all-gathers / reduce-scatters; None where FSDP's own
    # process groups do (plain, native: commlib groups when the default group is one).
    all_gather_comm: commlib.Communicator | None
    reduce_scatter_comm: commlib.Communicator | None
    # commlib communicators this call created (dual: the reduce-scatter split).
    created: list[commlib.Communicator] = field(default_factory=list)
    # Process groups created outside commlib (native: FSDP caches one per distinct set of
    # shard ranks, and every block here shards over the same ranks).
    native_groups: int = 0

    @property
    def communicators_created(self) -> int:
        return len(self.created) + self.native_groups


def shard(
    model: nn.Module,
    comm: commlib.Communicator,
    blocks: Iterable[nn.Module] | None = None,
    mode: Mode | str = Mode.DUAL,
    prefetch: int = 1,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    *,
    async_prefetch: bool = True,
) -> Sharded:
    """Apply `fully_shard` to each of `blocks` (default `model.layers`) and to `model`.

    `reshard_after_forward` applies to the blocks; the root never reshards after forward.

    `prefetch=k` makes each block all-gather the next k blocks in forward and the previous
    k in backward (the root prefetches the first k / last k); 0 means none. With
    `async_prefetch` (and k > 0) those all-gathers are issued with `async_op=True`, the
    only way they run in the background on CPU, where FSDP2 otherwise issues every
    collective synchronously (see `_fsdp_internals`). The mesh is the 1-D mesh over
    torch.distributed's default process group, which must match `comm` rank for rank.
    """
    mode = _check_mode(mode, comm)
    where = f"fsdp_overlap.shard on rank {comm.world_rank}"
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
        raise ValueError(f"{where}: expected prefetch to be an int >= 0; found {prefetch!r}")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"{where}: expected reshard_after_forward to be a bool; found {reshard_after_forward!r}")
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"{where}: expected mp_policy to be a MixedPrecisionPolicy or None; found {type(mp_policy).__name__}"
        )
    block_list = _check_blocks(model, blocks, where)
    mesh = _world_mesh(comm, where)
    set_unshard_async_op = (
        _fsdp_internals.unshard_async_op_setter() if prefetch and async_prefetch and mode is not Mode.PLAIN else None
    )

    reduce_scatter_comm = comm
    created: list[commlib.Communicator] = []
    if mode is Mode.DUAL:
        split = comm.split(list(range(comm.size)), f"{comm.name}.reduce_scatter")
        assert split is not None  # every rank is a member
        reduce_scatter_comm = split
        created.append(split)

    policy = mp_policy or MixedPrecisionPolicy()
    for block in block_list:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    # The root keeps its parameters after forward (FSDP's own default for roots): backward
    # needs them first thing, so resharding would only add an all-gather.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    fsdp_modules: list[FSDPModule] = [*block_list, model]

    if mode is Mode.PLAIN:
        return Sharded(model, mode, mesh, None, None)
    if mode is Mode.NATIVE:
        model.set_separate_reduce_scatter_group(True)
    else:
        all_gather, reduce_scatter = CommlibAllGather(comm), CommlibReduceScatter(reduce_scatter_comm)
        for module in fsdp_modules:
            module.set_custom_all_gather(all_gather)
            module.set_custom_reduce_scatter(reduce_scatter)
    if prefetch:
        _set_prefetch(model, block_list, prefetch)
        if set_unshard_async_op is not None:
            set_unshard_async_op(model, True)
    if mode is Mode.NATIVE:
        return Sharded(model, mode, mesh, None, None, native_groups=1)
    return Sharded(model, mode, mesh, comm, reduce_scatter_comm, created)


def _check_mode(mode: Mode | str, comm: commlib.Communicator) -> Mode:
    if not isinstance(comm, commlib.Communicator):
        raise TypeError(f"fsdp_overlap.shard: expected comm to be a commlib Communicator; found {type(comm).__name__}")
    try:
        mode = Mode(mode)
    except ValueError:
        raise ValueError(
            f"fsdp_overlap.shard on rank {comm.world_rank}: expected mode in {[m.value for m in Mode]}; found {mode!r}"
        ) from None
    if mode is Mode.NATIVE and not hasattr(FSDPModule, "set_separate_reduce_scatter_group"):
        import torch

        raise RuntimeError(
            f"fsdp_overlap.shard on rank {comm.world_rank}: mode 'native' needs "
            f"FSDPModule.set_separate_reduce_scatter_group (torch 2.13+); torch "
            f"{torch.__version__} lacks it"
        )
    return mode


def _check_blocks(model: nn.Module, blocks: Iterable[nn.Module] | None, where: str) -> list[nn.Module]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where}: expected model to be an nn.Module; found {type(model).__name__}")
    names = {id(m): name for name, m in model.named_modules()}
    already = [names[id(m)] or "<root>" for m in model.modules() if isinstance(m, FSDPModule)]
    if already:
        raise ValueError(f"{where}: expected a model not yet sharded; found fully_shard already applied to {already}")
    if blocks is None:
        blocks = getattr(model, "layers", None)
        if blocks is None:
            raise ValueError(
                f"{where}: expected blocks, or a model with a `layers` attribute; found "
                f"{type(model).__name__} without one"
            )
    if isinstance(blocks, nn.Module) and not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        raise TypeError(
            f"{where}: expected blocks to be an iterable of modules (e.g. an nn.ModuleList); "
            f"found a single {type(blocks).__name__}"
        )
    block_list = list(blocks)
    for i, block in enumerate(block_list):
        if not isinstance(block, nn.Module):
            raise TypeError(f"{where}: expected blocks[{i}] to be an nn.Module; found {type(block).__name__}")
        if block is model:
            raise ValueError(
                f"{where}: expected blocks to be proper submodules of the model; found the model "
                f"itself at blocks[{i}] (the root is sharded anyway)"
            )
        if id(block) not in names:
            raise ValueError(
                f"{where}: expected blocks to be submodules of the model; blocks[{i}] "
                f"({type(block).__name__}) is not one"
            )
    if len({id(b) for b in block_list}) != len(block_list):
        raise ValueError(f"{where}: expected distinct blocks; found {[names[id(b)] for b in block_list]}")
    return block_list


def _world_mesh(comm: commlib.Communicator, where: str) -> DeviceMesh:
    """The 1-D mesh over the default process group, checked against `comm`."""
    if not dist.is_initialized():
        raise RuntimeError(
            f"{where}: expected torch.distributed's default process group (fully_shard's mesh "
            f"is built on it; commlib.init's c10d backend creates it); found none"
        )
    size, rank = dist.get_world_size(), dist.get_rank()
    if comm.size != size:
        raise ValueError(f"{where}: expected comm {comm.name!r} to span the mesh's {size} ranks; found {comm.size}")
    if comm.rank != rank:
        raise ValueError(
            f"{where}: expected comm {comm.name!r} rank to equal the mesh rank {rank} (FSDP places "
            f"each rank's shard by mesh rank); found {comm.rank}"
        )
    return init_device_mesh(comm.device.type, (size,))


def _set_prefetch(root: FSDPModule, blocks: list[FSDPModule], k: int) -> None:
    root.set_modules_to_forward_prefetch(blocks[:k])
    root.set_modules_to_backward_prefetch(blocks[::-1][:k])
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + k])
        block.set_modules_to_backward_prefetch(blocks[max(0, i - k) : i][::-1])
