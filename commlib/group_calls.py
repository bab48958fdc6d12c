"""c10d's calling convention around commlib's: what a commlib process group hands back to torch.

A c10d collective method takes tensor lists and an option object and returns a c10d `Work`
(or None for a call it completed); commlib's take single tensors and keywords and return a
commlib `Work`. The helpers here translate, once per call, beside the process group's reading
of an op's options (`CommlibProcessGroup._translated`): the one tensor of a list
(`one_tensor`), an op's reduction (`reduction_of`, looked up per kind), what goes back to
torch (`handed_back`, `CommlibWork`), and the copies back into a caller's non-contiguous
tensors (`restaged`, `copy_back`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from commlib.communicator import Work
from commlib.ops import Reduction, to_reduction


class CommlibWork(dist.Work):
    """A c10d `Work` over one or more commlib `Work`s; `wait` is theirs (deadline and all)."""

    def __init__(
        self,
        works: list[Work],
        result: list[torch.Tensor],
        finish: Callable[[], None] | None = None,
    ) -> None:
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


# c10d's `ReduceOp` hashes to its kind's number (`RedOpType`'s value, PREMUL_SUM's too), so a dict
# of the plain kinds by hash turns it into commlib's reduction without comparing two ReduceOps,
# which pybind does by trying its overloads (about 20 times the lookup). Made from the hashes
# themselves, and only where they tell every kind apart.
_PLAIN_KINDS = [k for n, k in dist.ReduceOp.RedOpType.__members__.items() if n != "PREMUL_SUM"]
_BY_HASH: dict[int, Reduction] = {hash(dist.ReduceOp(k)): to_reduction(k) for k in _PLAIN_KINDS}
if len(_BY_HASH) < len(_PLAIN_KINDS) or hash(dist._make_nccl_premul_sum(1.0)) in _BY_HASH:
    _BY_HASH.clear()


def reduction_of(opts: Any) -> Reduction:
    """`to_reduction(opts.reduceOp)`, looked up by the ReduceOp's hash for a plain kind."""
    op = opts.reduceOp
    return _BY_HASH.get(hash(op)) or to_reduction(op)


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
