"""The compat table across torch surfaces, and commlib.dist's old and new names.

The checks in this process are in the fast lane (marked `contract`); the drop-in's default
communicator (`commlib.dist.use`, or torch's default group) is one per process, so its ranks
are processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

import commlib
import commlib.dist as cdist
from commlib import compat, testing


@pytest.mark.contract
def test_running_torch_resolves_new_names() -> None:
    assert compat.resolve("all_gather_single") is dist.all_gather_single
    assert compat.resolve("reduce_scatter_single") is dist.reduce_scatter_single


def _remove(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Make the running torch look like one without `names` (public module and c10d)."""
    for owner in (dist, dist.distributed_c10d):
        for name in names:
            monkeypatch.delattr(owner, name, raising=False)


@pytest.mark.contract
def test_older_torch_without_new_names(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch 2.9-2.12: no *_single names yet.
    _remove(monkeypatch, "all_gather_single", "reduce_scatter_single")
    assert compat.resolve("all_gather_single") is dist.all_gather_into_tensor
    assert compat.resolve("reduce_scatter_single") is dist.reduce_scatter_tensor
    all_gather_base = dist.distributed_c10d._all_gather_base
    _remove(monkeypatch, "all_gather_into_tensor")
    assert compat.resolve("all_gather_single") is all_gather_base


@pytest.mark.contract
def test_newer_torch_without_old_names(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch 2.14-2.15: gather_single and set_timeout appear; old names may be gone.
    sentinel_gather, sentinel_timeout = object(), object()
    monkeypatch.setattr(dist, "gather_single", sentinel_gather, raising=False)
    monkeypatch.setattr(dist, "set_timeout", sentinel_timeout, raising=False)
    _remove(monkeypatch, "all_gather_into_tensor", "reduce_scatter_tensor")
    assert compat.resolve("gather_single") is sentinel_gather
    assert compat.resolve("set_timeout") is sentinel_timeout
    assert compat.resolve("all_gather_single") is dist.all_gather_single


@pytest.mark.contract
def test_missing_everywhere_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _remove(monkeypatch, "gather_single", "gather_into_tensor")
    with pytest.raises(compat.CompatError, match=r"none of \['gather_single', 'gather_into_tensor'\].*2\.14"):
        compat.resolve("gather_single")


@pytest.mark.contract
def test_canonical_kwargs() -> None:
    assert compat.canonical_kwargs("broadcast", {"src": 1}) == {"root": 1}
    assert compat.canonical_kwargs("reduce", {"dst": 0, "op": "x"}) == {"root": 0, "op": "x"}
    with pytest.raises(TypeError, match="both 'src' and 'root'"):
        compat.canonical_kwargs("broadcast", {"src": 1, "root": 0})


def _old_and_new_names(comm) -> dict[str, list[float]]:
    import commlib.dist as cdist

    warnings.simplefilter("error")  # any FutureWarning from a renamed API fails the rank
    cdist.use(comm)
    r = comm.rank
    out: dict[str, list[float]] = {}
    for name in ("all_gather_single", "all_gather_into_tensor", "_all_gather_base"):
        o = torch.zeros(4)
        getattr(cdist, name)(o, torch.full((2,), float(r)))
        out[name] = o.tolist()
    for name in ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base"):
        o = torch.zeros(2)
        getattr(cdist, name)(o, torch.arange(4.0) + r, op=dist.ReduceOp.SUM)
        out[name] = o.tolist()
    t = torch.full((2,), float(r))
    cdist.broadcast(t, src=1)
    out["broadcast(src=)"] = t.tolist()
    t = torch.full((2,), float(r + 1))
    cdist.reduce(t, dst=0, op=dist.ReduceOp.MAX)
    out["reduce(dst=)"] = t.tolist() if r == 0 else []
    t = torch.ones(2)
    cdist.all_reduce(t, group=comm)
    out["all_reduce(group=)"] = t.tolist()
    w = cdist.all_gather_into_tensor(torch.zeros(4), torch.ones(2), async_op=True)
    w.wait()
    out["async"] = [float(w.is_completed())]
    return out


def test_dist_drop_in_old_and_new_names_without_warnings(backend: str) -> None:
    r0, r1 = testing.run(_old_and_new_names, 2, backend=backend)
    for out in (r0, r1):
        for name in ("all_gather_single", "all_gather_into_tensor", "_all_gather_base"):
            assert out[name] == [0.0, 0.0, 1.0, 1.0]
        assert out["broadcast(src=)"] == [1.0, 1.0]
        assert out["all_reduce(group=)"] == [2.0, 2.0]
        assert out["async"] == [1.0]
    for name in ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base"):
        assert r0[name] == [1.0, 3.0] and r1[name] == [5.0, 7.0]
    assert r0["reduce(dst=)"] == [2.0, 2.0]


@pytest.mark.contract
def test_dist_unknown_name() -> None:
    import commlib.dist as cdist

    with pytest.raises(AttributeError, match="no attribute 'all_gather_object'"):
        cdist.all_gather_object  # noqa: B018


@pytest.mark.contract
def test_dist_reductions_map_every_torch_spelling() -> None:
    import commlib
    from commlib.ops import to_reduction

    assert to_reduction(dist.ReduceOp.AVG) is commlib.ReduceOp.AVG
    assert to_reduction(dist.ReduceOp.SUM) is commlib.ReduceOp.SUM
    assert to_reduction(dist.ReduceOp(dist.ReduceOp.MAX)) is commlib.ReduceOp.MAX
    assert to_reduction(commlib.ReduceOp.MIN) is commlib.ReduceOp.MIN
    assert to_reduction(dist.ReduceOp.PREMUL_SUM(0.25)) == commlib.premul_sum(0.25)
    assert to_reduction(dist.ReduceOp.PREMUL_SUM(torch.tensor(0.5))) == commlib.premul_sum(0.5)
    with pytest.raises(TypeError, match="without a factor"):
        to_reduction(dist.ReduceOp.PREMUL_SUM)
    with pytest.raises(TypeError, match="found 'sum'"):
        to_reduction("sum")


@pytest.mark.contract
def test_backfill_adds_only_the_newer_names_this_torch_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed import _functional_collectives as funcol

    modules = {False: dist, True: funcol}
    sentinel = object()
    monkeypatch.setattr(dist, "gather_single", sentinel, raising=False)  # a newer name that exists: kept
    monkeypatch.setattr(compat, "BACKFILLED", {})
    before = {name: getattr(modules[row.functional], name, None) for name, row in compat.RENAMES.items()}
    try:
        added = compat.backfill()
        for name, row in compat.RENAMES.items():
            now = getattr(modules[row.functional], name, None)
            if before[name] is not None:
                assert now is before[name] and name not in added, name
            elif name in added:
                assert now is compat.resolve(name) and added[name] in row.old_names, name
        assert dist.gather_single is sentinel
        if before["set_timeout"] is None:  # torch 2.13: torchtitan 0.3.0's name, bound to the older one
            assert added["set_timeout"] == "_set_pg_timeout"
            assert dist.set_timeout is dist.distributed_c10d._set_pg_timeout
        assert compat.BACKFILLED == added and compat.backfill() == {}  # a second call adds nothing
    finally:
        for name in compat.BACKFILLED:
            delattr(modules[compat.RENAMES[name].functional], name)


def test_backfill_is_asked_for_where_the_backend_registers(monkeypatch: pytest.MonkeyPatch) -> None:
    from commlib import _torch_backend

    if not hasattr(dist, "set_timeout"):  # torch 2.13; this process imported it without COMMLIB_BACKFILL
        # torch registers the backend at `import torch` (its entry point): the script imports nothing else.
        probe = "import torch.distributed as dist; print(dist.set_timeout.__name__)"
        shown = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "COMMLIB_BACKFILL": "1"},
                               capture_output=True, text=True, timeout=120)
        assert shown.returncode == 0 and shown.stdout.strip() == "_set_pg_timeout", shown.stderr[-2000:]
        assert '"added":["torch.distributed.set_timeout = _set_pg_timeout"]' in shown.stderr  # logged (stderr)
    monkeypatch.setenv("COMMLIB_BACKFILL", "maybe")
    with pytest.raises(ValueError, match="expected COMMLIB_BACKFILL to be 1 or 0; found 'maybe'"):
        _torch_backend.register()


def _default_follows_the_group() -> dict[str, object]:
    import gc
    import weakref

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, is_master=False)
    comm = commlib.init("gloo", rank=rank, world_size=size, store=store, timeout=30.0)
    t = torch.ones(2)
    cdist.all_reduce(t)
    comm.abort("in-job recovery")  # as a failed step would: the group's engine is rebuilt under it
    commlib.Recovery(commlib.RecoveryPolicy(join_timeout_s=20)).recover(RuntimeError("a failed step"))
    cdist.all_reduce(t)  # goes to the rebuilt communicator
    gone = [weakref.ref(comm), weakref.ref(commlib.current())]
    del comm
    dist.destroy_process_group()
    gc.collect()
    return {"value": t.tolist(), "kept": [ref() is not None for ref in gone]}


def test_dist_follows_the_default_group_through_recovery_and_lets_it_go_after_destroy() -> None:
    for r in testing.run(_default_follows_the_group, 2, backend=None, timeout=60):
        assert r["value"] == [4.0, 4.0], r
        assert r["kept"] == [False, False], r  # nothing here holds a communicator (its sockets, its store client)
