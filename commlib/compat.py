"""The table of renamed `torch.distributed` APIs, and `resolve(name)`.

PyTorch keeps renaming collectives: 2.13 renamed `all_gather_into_tensor` /
`_all_gather_base` to `all_gather_single` and `reduce_scatter_tensor` /
`_reduce_scatter_base` to `reduce_scatter_single` (the old names stay as wrappers that warn
`FutureWarning`); 2.14 renames `gather_into_tensor` to `gather_single` and makes
`_set_pg_timeout` public as `set_timeout`. torchcomms says `root` where
`torch.distributed` says `src`/`dst`.

Each `Rename` row is the whole story of one API: its canonical (torchcomms) name, the
`torch.distributed` name that replaced older ones, the older names, the torch versions
that bound them, and how old keyword arguments map onto canonical ones. `resolve` looks
the callable up on the running torch at call time, preferring the newest name, so code
written against commlib runs unchanged on torch 2.9 through 2.15. `commlib.dist` reads
the same table to accept old names from user code.

`backfill()` (opt-in: it changes torch's namespace; `COMMLIB_BACKFILL=1` runs it where the
backend registers, at `import torch`) goes the other way, for code written against a newer
torch than the one running: it adds each row's newest name that the running torch lacks,
bound to the older callable that the row says it replaced (on torch 2.13:
`torch.distributed.set_timeout` = `_set_pg_timeout`, which torchtitan 0.3.0 calls). It never
replaces a name that exists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class Rename:
    """One API across torch versions.

    `torch_names` are the `torch.distributed` attributes that implement it, newest first;
    `new_since` is the first torch release of `torch_names[0]`; `old_until` the last
    release expected to keep the older names (None: not scheduled for removal).
    `arg_map` maps an old keyword (`src`, `dst`) to the canonical one (`root`).
    """

    canonical: str
    torch_names: tuple[str, ...]
    new_since: str
    old_until: str | None = None
    arg_map: dict[str, str] = field(default_factory=dict)
    functional: bool = False  # lives in torch.distributed._functional_collectives

    @property
    def old_names(self) -> tuple[str, ...]:
        return self.torch_names[1:]


RENAMES: dict[str, Rename] = {
    r.canonical: r
    for r in (
        Rename(
            "all_gather_single",
            ("all_gather_single", "all_gather_into_tensor", "_all_gather_base"),
            new_since="2.13",
        ),
        Rename(
            "reduce_scatter_single",
            ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base"),
            new_since="2.13",
        ),
        Rename(
            "all_gather_single_coalesced",
            ("all_gather_single_coalesced", "all_gather_into_tensor_coalesced"),
            new_since="2.13",
            functional=True,
        ),
        Rename(
            "reduce_scatter_single_coalesced",
            ("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced"),
            new_since="2.13",
            functional=True,
        ),
        Rename("gather_single", ("gather_single", "gather_into_tensor"), new_since="2.14"),
        Rename("set_timeout", ("set_timeout", "_set_pg_timeout"), new_since="2.14"),
        Rename("broadcast", ("broadcast",), new_since="1.0", arg_map={"src": "root"}),
        Rename("reduce", ("reduce",), new_since="1.0", arg_map={"dst": "root"}),
        Rename("gather", ("gather",), new_since="1.0", arg_map={"dst": "root"}),
        Rename("scatter", ("scatter",), new_since="1.0", arg_map={"src": "root"}),
    )
}

# Every old `torch.distributed` name -> the row it belongs to (for commlib.dist).
OLD_NAMES: dict[str, Rename] = {old: r for r in RENAMES.values() for old in r.old_names}

# The `ProcessGroup` methods torch renamed alongside the free functions: c10d calls a
# Python process group by whichever name its release uses, so commlib's answers to both
# (`commlib.process_group`). Backend objects (`ProcessGroupGloo`, `ProcessGroupNCCL`) keep
# the old names; `method` finds whichever one an engine object has.
METHOD_RENAMES: dict[str, Rename] = {
    r.canonical: r
    for r in (
        Rename("all_gather_single", ("all_gather_single", "_allgather_base"), new_since="2.13"),
        Rename("reduce_scatter_single", ("reduce_scatter_single", "_reduce_scatter_base"), new_since="2.13"),
        Rename("all_to_all_single", ("all_to_all_single", "alltoall_base"), new_since="2.13"),
        Rename(
            "all_gather_single_coalesced",
            ("all_gather_single_coalesced", "allgather_into_tensor_coalesced"),
            new_since="2.13",
        ),
        Rename(
            "reduce_scatter_single_coalesced",
            ("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced"),
            new_since="2.13",
        ),
    )
}


# The names `backfill` added in this process: newest name -> the older one it is bound to
# (the one registry this module owns).
BACKFILLED: dict[str, str] = {}


class CompatError(AttributeError):
    """The running torch has none of the names a row lists."""


def _lookup(name: str, functional: bool) -> Any:
    # Private names live in distributed_c10d on some releases and are re-exported on others;
    # the tensor-coalesced collectives exist only as functional collectives.
    owners = (_public_module(True),) if functional else (dist, dist.distributed_c10d)
    for owner in owners:
        fn = getattr(owner, name, None)
        if fn is not None:
            return fn
    return None


def resolve(name: str) -> Callable[..., Any]:
    """The `torch.distributed` callable for canonical `name` on the running torch.

    Names without a row resolve to themselves. Raises `CompatError` naming every
    candidate when the running torch has none of them.
    """
    row = RENAMES.get(name)
    candidates = row.torch_names if row else (name,)
    for candidate in candidates:
        fn = _lookup(candidate, row is not None and row.functional)
        if fn is not None:
            return fn
    raise CompatError(
        f"torch {_torch_version()} has none of {list(candidates)} for {name!r}"
        + (f" (the new name appeared in torch {row.new_since})" if row else "")
    )


def backfill() -> dict[str, str]:
    """Add to torch.distributed the newer names of the table that the running torch lacks.

    Each is bound to the callable of the row's first older name this torch has; a name that
    exists is never replaced, and a row whose every name is missing adds nothing. Returns
    what this call added (new name -> old name) and logs it (`compat.backfill`, a warning:
    torch's namespace changed); calling it again adds nothing.
    """
    added: dict[str, str] = {}
    shown: list[str] = []
    unavailable: list[str] = []
    for row in RENAMES.values():
        newest = row.torch_names[0]
        owner = _public_module(row.functional)
        if hasattr(owner, newest):
            continue
        older = next(((name, fn) for name in row.old_names if (fn := _lookup(name, row.functional)) is not None), None)
        if older is None:
            unavailable.append(newest)
            continue
        setattr(owner, newest, older[1])
        added[newest] = older[0]
        shown.append(f"{owner.__name__}.{newest} = {older[0]}")
    BACKFILLED.update(added)
    if added:
        from commlib.record import log as _log

        _log.get_logger().warning("compat.backfill", torch=_torch_version(), added=shown, unavailable=unavailable)
    return added


def _public_module(functional: bool) -> Any:
    """Where user code looks a row's names up: torch.distributed, or its functional collectives."""
    if functional:
        from torch.distributed import _functional_collectives

        return _functional_collectives
    return dist


def method(obj: Any, canonical: str) -> Callable[..., Any]:
    """`obj`'s method for the renamed ProcessGroup method `canonical`, newest name first."""
    names = METHOD_RENAMES[canonical].torch_names
    for name in names:
        fn = getattr(obj, name, None)
        if fn is not None:
            return fn
    raise CompatError(f"{type(obj).__name__} has none of {list(names)} for {canonical!r}")


def canonical_kwargs(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Rename old keywords (`src`, `dst`) of `name` to canonical ones (`root`)."""
    row = RENAMES.get(name)
    if not row or not row.arg_map:
        return kwargs
    out = dict(kwargs)
    for old, new in row.arg_map.items():
        if old in out:
            if new in out and out[new] is not None:
                raise TypeError(f"{name}() got both {old!r} and {new!r}; pass only {new!r}")
            out[new] = out.pop(old)
    return out


def _torch_version() -> str:
    import torch

    return torch.__version__
