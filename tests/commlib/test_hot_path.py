"""What commlib's one path costs a trainer per op, counted where a count is the same on every
machine: the Python-level calls a synchronous all_reduce over `backend="commlib"` makes on
top of torch's own gloo group (issue 45, part 4). The stream-ordered path's one device call
per sync op is counted in test_nccl_semantics.py.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d_opts

import commlib
from commlib import testing
from commlib.group_calls import reduction_of

# The Python calls (frames) commlib adds to one synchronous 4 KiB all_reduce on the backend path:
# the process group's method, the Communicator's path, the engine backend and the records.
ADDED_CALLS_BOUND = 21


def _calls(run: Callable[[], object]) -> collections.Counter[str]:
    """The Python-level calls (sys.setprofile's 'call' events) of one `run()`, warmed up, by
    module and function."""
    for _ in range(3):
        run()
    calls: collections.Counter[str] = collections.Counter()

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "call":
            calls[f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}"] += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


def _counted() -> dict[str, object]:
    store, timeout = dist.HashStore(), timedelta(seconds=30)
    dist.init_process_group("commlib", store=store, rank=0, world_size=1, timeout=timeout)
    plain = dist.new_group(backend="gloo")
    commlib_group = dist.group.WORLD
    t = torch.ones(1024)
    try:
        # Both through an explicit group: torch's lookup of the default group is no one's cost.
        raw = _calls(lambda: dist.all_reduce(t, group=plain))
        backend = _calls(lambda: dist.all_reduce(t, group=commlib_group))
        value = t.tolist()
    finally:
        dist.destroy_process_group()
    return {"raw": raw, "backend": backend, "value": value}


def test_a_sync_all_reduce_over_the_backend_makes_few_python_calls_on_top_of_raw() -> None:
    """One `dist.all_reduce` on a 1-rank commlib group makes at most ADDED_CALLS_BOUND Python
    calls more than on a plain gloo group, and gives the same value."""
    (r,) = testing.run(_counted, 1, backend=None, timeout=60)
    raw, backend = r["raw"], r["backend"]
    assert r["value"] == [1.0] * 1024, r["value"][:4]
    added = sum(backend.values()) - sum(raw.values())
    assert added <= ADDED_CALLS_BOUND, (
        f"expected at most {ADDED_CALLS_BOUND} Python calls on top of raw's {sum(raw.values())}; "
        f"found {added}: {sorted((backend - raw).items())}"
    )


def test_every_c10d_reduction_is_read_from_its_options_as_its_own_kind() -> None:
    """`reduction_of`'s lookup by the ReduceOp's hash gives each plain kind its own commlib
    reduction, and PREMUL_SUM, never in the table, its own factor each time."""
    opts = c10d_opts.AllreduceOptions()
    for name in commlib.ReduceOp.__members__:
        if name != "PREMUL_SUM":
            opts.reduceOp = getattr(dist.ReduceOp, name)
            assert reduction_of(opts) is commlib.ReduceOp[name], name
    for factor in (0.25, 0.5):
        opts.reduceOp = dist.ReduceOp.PREMUL_SUM(factor)
        assert reduction_of(opts) == commlib.premul_sum(factor)
