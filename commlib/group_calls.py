"""c10d's calling convention around commlib's: what a commlib process group hands back to torch.

A c10d collective method takes tensor lists and an option object and returns a c10d `Work`
(or None for a call it completed); commlib's take single tensors and keywords and return a
commlib `Work`. The helpers here translate, once per call: the one tensor of a list
(`one_tensor`), an op's own deadline (`deadline_of`) and reduction (`reduction_of`, remembered
per kind) from c10d's options, what goes back to torch (`handed_back`, `CommlibWork`), and the
copies back into a caller's non-contiguous tensors (`restaged`, `copy_back`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from commlib.communicator import Work
from commlib.ops import PremulSum, Reduction, to_reduction


class CommlibWork(dist.Work):
    """A c10d `Work` over one or more commlib `Work`s; `wait` is theirs (deadline and all)."""

    def __init__(self, works: list[Work], result: list[torch.Tensor], finish: Callable[[], None] | None = None) -> None:
        super().__init__()
        self._works = works
        self._result = result
        self._finish = finish  # copies out of a staged buffer, run once after completion

    def restaged(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The op ran on contiguous `copies` of the caller's tensors (`restaged`):
        hand back the caller's tensors, each filled from its copy once the op completes."""
        assert self._finish is None  # only ops without a staging of their own are restaged
        originals = {id(copy): original for original, copy in copies}
        self._result = [originals.get(id(t), t) for t in self._result]
        self._finish = functools.partial(copy_back, copies)

    def wait(self, timeout: timedelta | None = None) -> bool:
        # c10d spells "no timeout" as timedelta(0): the op's own deadline applies then.
        limit = timeout if timeout else None
        for work in self._works:
            work.wait(limit)
        if self._finish is not None:
            self._finish()
            self._finish = None
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return self.is_completed()

    def result(self) -> list[torch.Tensor]:
        return self._result

    def get_future(self) -> torch.futures.Future:
        self.wait()
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(self._result)
        return future


def copy_back(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for original, copy in copies:
        original.copy_(copy)


def strided(tensors: list[torch.Tensor]) -> bool:
    """Whether any of `tensors` is not contiguous (`restaged` then takes the call)."""
    return not all(t.is_contiguous() for t in tensors)


_NO_TIMEOUT = timedelta(0)  # c10d's options say "unset" with a negative timeout


def deadline_of(opts: Any) -> float | None:
    """An op's own timeout from c10d's options; None (the communicator's default) when unset."""
    timeout = getattr(opts, "timeout", None)
    if isinstance(timeout, timedelta) and timeout > _NO_TIMEOUT:
        return timeout.total_seconds()
    return None


# A memo, not a registry: c10d reduction -> commlib reduction, filled as reductions are met.
_REDUCTIONS: dict[Any, Reduction] = {}


def reduction_of(opts: Any) -> Reduction:
    """`to_reduction(opts.reduceOp)`, remembered per kind of reduction.

    A c10d `ReduceOp` hashes and compares by its kind alone (reading `.op` would cost more
    than the lookup), so PREMUL_SUM, whose factor varies, is never remembered.
    """
    op = opts.reduceOp
    reduction = _REDUCTIONS.get(op)
    if reduction is None:
        reduction = to_reduction(op)
        if not isinstance(reduction, PremulSum):
            _REDUCTIONS[op] = reduction
    return reduction


def handed_back(
    async_op: bool, works: list[Work | None], result: list[torch.Tensor], finish: Any = None
) -> CommlibWork | None:
    """What a collective method returns to c10d: a Work when the caller asked for one.

    c10d's Python functions say whether they will wait at once (`opts.asyncOp`, False for
    `async_op=False`) and take None as "the backend completed it" (torch's convention for
    backends that complete synchronously). So a synchronous call is issued to the
    Communicator as one, completes on its sync path, and costs no c10d `Work`, no commlib
    `Work` and no extra wait layer; it is also recorded as what it was, a synchronous call.
    Callers that leave asyncOp at its default (True; torch's C++ callers do) get a Work.
    """
    if async_op:
        return CommlibWork(works, result, finish)  # type: ignore[arg-type]
    if finish is not None:
        finish()
    return None


def one_tensor(tensors: list[Any], what: str) -> Any:
    if len(tensors) != 1:
        raise ValueError(
            f"commlib process group {what}: expected one tensor (one device per process); found {len(tensors)}"
        )
    return tensors[0]


def restaged(
    method: Callable[..., CommlibWork | None], args: tuple[Any, ...], writes: tuple[int, ...]
) -> CommlibWork | None:
    """`method(*args)` with a contiguous copy in place of every tensor that is not contiguous.

    The copies in the arguments at `writes` (the op's outputs) are copied back into the
    caller's tensors once the op completes: before a synchronous call returns, else when
    its Work is waited on. A rare path: the methods take it only for such tensors.
    """
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def staged(value: Any, written: bool) -> Any:
        if isinstance(value, torch.Tensor):
            if value.is_contiguous():
                return value
            copy = value.contiguous()
            if written:
                copies.append((value, copy))
            return copy
        if isinstance(value, list):
            return [staged(v, written) for v in value]
        return value

    work = method(*(staged(arg, i in writes) for i, arg in enumerate(args)))
    if work is None:
        copy_back(copies)
    else:
        work.restaged(copies)
    return work
