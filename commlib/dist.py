"""`commlib.dist`: a drop-in for code written against the `torch.distributed` free functions.

Old and new names both work (`all_gather_into_tensor`, `_all_gather_base` and
`all_gather_single`; `reduce_scatter_tensor`, `_reduce_scatter_base` and
`reduce_scatter_single`; `broadcast(tensor, src=...)`, `reduce(tensor, dst=...)`), with no
FutureWarning, because every call is routed through a `Communicator`: the one passed as
`group=`, else the one given to `use(comm)`, else the one under torch.distributed's default
group as it is now (a commlib group's: so after in-job recovery calls go to the rebuilt
communicator, and after `destroy_process_group` nothing here keeps the old one, its sockets
and its store client, alive). `commlib.init` over a default group of another backend hands
its communicator to `use`. Old names come from `commlib.compat`'s table,
so this module holds no list of renames of its own. `src`/`dst` here are ranks of the
communicator (torch.distributed's `group_src`/`group_dst`), and reductions may be
`torch.distributed.ReduceOp`s.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as _tdist

from commlib import compat
from commlib.communicator import Communicator, Work
from commlib.ops import ReduceOp, to_reduction

_DEFAULT: list[Communicator] = []  # the one registry this module owns


def use(comm: Communicator) -> None:
    """Make `comm` the communicator that calls without `group=` go to."""
    if not isinstance(comm, Communicator):
        raise TypeError(f"commlib.dist.use: expected a commlib Communicator; found {type(comm).__name__}")
    _DEFAULT[:] = [comm]


def use_if_unset(comm: Communicator) -> None:
    """`use(comm)` unless a default is set already (what `commlib.init` does over another
    backend's default group; a commlib default group needs none: module docstring)."""
    if not _DEFAULT:
        use(comm)


def _comm(group: Communicator | None) -> Communicator:
    if group is not None:
        if not isinstance(group, Communicator):
            raise TypeError(f"commlib.dist: expected group to be a commlib Communicator; found {type(group).__name__}")
        return group
    if _DEFAULT:
        return _DEFAULT[0]
    from commlib.process_group import CommlibProcessGroup  # it imports this module

    world = _tdist.group.WORLD if _tdist.is_initialized() else None
    if not isinstance(world, CommlibProcessGroup):
        raise RuntimeError(
            "commlib.dist: expected a default communicator; found none "
            "(call commlib.init, or commlib.dist.use(comm), or pass group=)"
        )
    return world.communicator()


def _root(name: str, kwargs: dict[str, Any]) -> int:
    kwargs = compat.canonical_kwargs(name, {k: v for k, v in kwargs.items() if v is not None})
    group_root = kwargs.get("group_src", kwargs.get("group_dst"))
    root = kwargs.get("root") if kwargs.get("root") is not None else group_root
    if root is None:
        raise TypeError(f"commlib.dist.{name}: expected a root rank (src/dst/root); found none")
    return root


def get_rank(group: Communicator | None = None) -> int:
    return _comm(group).rank


def get_world_size(group: Communicator | None = None) -> int:
    return _comm(group).size


def all_reduce(
    tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Communicator | None = None, async_op: bool = False
) -> Work | None:
    return _comm(group).all_reduce(tensor, to_reduction(op), async_op=async_op)


def broadcast(
    tensor: torch.Tensor,
    src: int | None = None,
    group: Communicator | None = None,
    async_op: bool = False,
    **kwargs: Any,
) -> Work | None:
    return _comm(group).broadcast(tensor, _root("broadcast", {"src": src, **kwargs}), async_op=async_op)


def reduce(
    tensor: torch.Tensor,
    dst: int | None = None,
    op: Any = ReduceOp.SUM,
    group: Communicator | None = None,
    async_op: bool = False,
    **kwargs: Any,
) -> Work | None:
    return _comm(group).reduce(tensor, _root("reduce", {"dst": dst, **kwargs}), to_reduction(op), async_op=async_op)


def all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Communicator | None = None, async_op: bool = False
) -> Work | None:
    return _comm(group).all_gather(tensor_list, tensor, async_op=async_op)


def all_gather_single(
    output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Communicator | None = None, async_op: bool = False
) -> Work | None:
    return _comm(group).all_gather_single(output_tensor, input_tensor, async_op=async_op)


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: Any = ReduceOp.SUM,
    group: Communicator | None = None,
    async_op: bool = False,
) -> Work | None:
    return _comm(group).reduce_scatter(output, input_list, to_reduction(op), async_op=async_op)


def reduce_scatter_single(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Communicator | None = None,
    async_op: bool = False,
) -> Work | None:
    return _comm(group).reduce_scatter_single(output, input, to_reduction(op), async_op=async_op)


def all_to_all_single(
    output: torch.Tensor, input: torch.Tensor, group: Communicator | None = None, async_op: bool = False
) -> Work | None:
    return _comm(group).all_to_all_single(output, input, async_op=async_op)


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int | None = None,
    group: Communicator | None = None,
    async_op: bool = False,
    **kwargs: Any,
) -> Work | None:
    return _comm(group).gather(gather_list, tensor, _root("gather", {"dst": dst, **kwargs}), async_op=async_op)


def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int | None = None,
    group: Communicator | None = None,
    async_op: bool = False,
    **kwargs: Any,
) -> Work | None:
    return _comm(group).scatter(tensor, scatter_list, _root("scatter", {"src": src, **kwargs}), async_op=async_op)


def send(tensor: torch.Tensor, dst: int, group: Communicator | None = None) -> None:
    _comm(group).send(tensor, dst)


def recv(tensor: torch.Tensor, src: int, group: Communicator | None = None) -> None:
    _comm(group).recv(tensor, src)


def barrier(group: Communicator | None = None, async_op: bool = False) -> Work | None:
    return _comm(group).barrier(async_op=async_op)


def gather_single(
    output: torch.Tensor | None,
    input: torch.Tensor,
    dst: int | None = None,
    group: Communicator | None = None,
    async_op: bool = False,
    **kwargs: Any,
) -> Work | None:
    """Gather every rank's `input` into `output` (size x input, on the root only) as one gather."""
    comm = _comm(group)
    root = _root("gather", {"dst": dst, **kwargs})
    if comm.rank != root:
        return comm.gather(None, input, root, async_op=async_op)
    if not isinstance(output, torch.Tensor) or output.numel() != comm.size * input.numel():
        found = f"{tuple(output.shape)}" if isinstance(output, torch.Tensor) else type(output).__name__
        raise ValueError(
            f"commlib.dist.gather_single on {comm.name!r} rank {comm.rank}: expected an output of "
            f"{comm.size} x {input.numel()} elements on the root; found {found}"
        )
    return comm.gather(list(output.view(comm.size, *input.shape).unbind(0)), input, root, async_op=async_op)


def set_timeout(timeout: Any, group: Communicator | None = None) -> None:
    """The default deadline of `group`'s later collectives (seconds or timedelta)."""
    _comm(group).set_timeout(timeout)


def __getattr__(name: str) -> Any:
    """Old names (`all_gather_into_tensor`, `_reduce_scatter_base`, ...) from the compat table."""
    row = compat.OLD_NAMES.get(name)
    if row is not None and row.canonical in globals():
        return globals()[row.canonical]
    raise AttributeError(f"module 'commlib.dist' has no attribute {name!r}")
