"""Every op, sync and async, on 2 and 3 ranks, float32 / bfloat16 / int64, against expectations."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import commlib

DTYPES = [torch.float32, torch.bfloat16, torch.int64]


def _value(rank: int, n: int, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
    return (torch.arange(n) + 10 * rank + offset + 1).to(dtype)


def _run_all_ops(comm: commlib.Communicator, async_op: bool) -> dict[str, object]:
    """Issue every op for every dtype; return what each produced on this rank."""
    r, n = comm.rank, comm.size
    out: dict[str, object] = {}
    pending: list[commlib.Work] = []

    def issue(work: commlib.Work | None) -> None:
        if async_op:
            assert isinstance(work, commlib.Work)
            pending.append(work)
        else:
            assert work is None

    for dtype in DTYPES:
        d = str(dtype)
        ops = [commlib.ReduceOp.SUM, commlib.ReduceOp.MAX, commlib.ReduceOp.MIN, commlib.ReduceOp.PRODUCT]
        ops += [commlib.ReduceOp.AVG, commlib.premul_sum(0.5)] if dtype.is_floating_point else [commlib.ReduceOp.BAND]
        for op in ops:
            t = _value(r, 4, dtype)
            issue(comm.all_reduce(t, op, async_op=async_op))
            out[f"all_reduce/{op}/{d}"] = t
        t = _value(r, 4, dtype)
        issue(comm.broadcast(t, n - 1, async_op=async_op))
        out[f"broadcast/{d}"] = t
        t = _value(r, 4, dtype)
        issue(comm.reduce(t, 1, commlib.ReduceOp.SUM, async_op=async_op))
        out[f"reduce/{d}"] = t
        lst = [torch.zeros(3, dtype=dtype) for _ in range(n)]
        issue(comm.all_gather(lst, _value(r, 3, dtype), async_op=async_op))
        out[f"all_gather/{d}"] = lst
        o = torch.zeros(3 * n, dtype=dtype)
        issue(comm.all_gather_single(o, _value(r, 3, dtype), async_op=async_op))
        out[f"all_gather_single/{d}"] = o
        o = torch.zeros(2, dtype=dtype)
        issue(comm.reduce_scatter(o, [_value(r, 2, dtype, 100 * i) for i in range(n)], async_op=async_op))
        out[f"reduce_scatter/{d}"] = o
        o = torch.zeros(2, dtype=dtype)
        issue(comm.reduce_scatter_single(o, _value(r, 2 * n, dtype), async_op=async_op))
        out[f"reduce_scatter_single/{d}"] = o
        o = torch.zeros(2 * n, dtype=dtype)
        issue(comm.all_to_all_single(o, _value(r, 2 * n, dtype), async_op=async_op))
        out[f"all_to_all_single/{d}"] = o
        lst = [torch.zeros(2, dtype=dtype) for _ in range(n)] if r == 0 else None
        issue(comm.gather(lst, _value(r, 2, dtype), 0, async_op=async_op))
        out[f"gather/{d}"] = lst
        o = torch.zeros(2, dtype=dtype)
        issue(comm.scatter(o, [_value(0, 2, dtype, 100 * i) for i in range(n)] if r == 0 else None, 0,
                           async_op=async_op))
        out[f"scatter/{d}"] = o
        # A ring: even ranks send first, so a synchronous run cannot deadlock.
        got = torch.zeros(2, dtype=dtype)
        for step in (0, 1):
            if (r % 2 == 0) == (step == 0):
                issue(comm.send(_value(r, 2, dtype), (r + 1) % n, async_op=async_op))
            else:
                issue(comm.recv(got, (r - 1) % n, async_op=async_op))
        out[f"sendrecv/{d}"] = got
    issue(comm.barrier(async_op=async_op))
    for w in pending:
        w.wait()
        assert w.is_completed()
    out["seq"] = comm.seq
    return out


def _run_sync_then_async(comm: commlib.Communicator) -> list[dict[str, object]]:
    return [_run_all_ops(comm, False), _run_all_ops(comm, True)]


def _expected(rank: int, n: int, dtype: torch.dtype) -> dict[str, object]:
    vals = [_value(q, 4, dtype) for q in range(n)]
    d = str(dtype)
    exp: dict[str, object] = {
        f"all_reduce/sum/{d}": sum(vals[1:], vals[0].clone()),
        f"all_reduce/max/{d}": torch.stack(vals).amax(0),
        f"all_reduce/min/{d}": torch.stack(vals).amin(0),
        f"all_reduce/product/{d}": torch.stack(vals).prod(0).to(dtype),
        f"broadcast/{d}": vals[n - 1],
        f"reduce/{d}": sum(vals[1:], vals[0].clone()) if rank == 1 else None,  # non-roots: undefined
        f"all_gather/{d}": [_value(q, 3, dtype) for q in range(n)],
        f"all_gather_single/{d}": torch.cat([_value(q, 3, dtype) for q in range(n)]),
        f"reduce_scatter/{d}": sum(_value(q, 2, dtype, 100 * rank) for q in range(n)).to(dtype),
        f"reduce_scatter_single/{d}": sum(_value(q, 2 * n, dtype)[2 * rank:2 * rank + 2] for q in range(n)).to(dtype),
        f"all_to_all_single/{d}": torch.cat([_value(q, 2 * n, dtype)[2 * rank:2 * rank + 2] for q in range(n)]),
        f"gather/{d}": [_value(q, 2, dtype) for q in range(n)] if rank == 0 else None,
        f"scatter/{d}": _value(0, 2, dtype, 100 * rank),
        f"sendrecv/{d}": _value((rank - 1) % n, 2, dtype),
    }
    if dtype.is_floating_point:
        total = torch.stack([v.float() for v in vals]).sum(0)
        exp[f"all_reduce/avg/{d}"] = (total / n).to(dtype)
        exp[f"all_reduce/premul_sum(0.5)/{d}"] = (total * 0.5).to(dtype)
    else:
        band = vals[0].clone()
        for v in vals[1:]:
            band &= v
        exp[f"all_reduce/band/{d}"] = band
    return exp


def _same(got: object, want: object) -> bool:
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))
    return isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_op_sync_and_async(ranks: Callable[..., list], world_size: int) -> None:
    """Every op, sync and async, gives the expected result for every dtype, in one sequence."""
    def check(results: list[dict[str, object]]) -> None:
        for rank, got in enumerate(results):
            for dtype in DTYPES:
                for key, want in _expected(rank, world_size, dtype).items():
                    if want is None:
                        continue
                    assert _same(got[key], want), f"rank {rank} {key}: got {got[key]}, want {want}"

    per_rank = ranks(_run_sync_then_async, world_size, timeout=120)
    sync, asyn = [r[0] for r in per_rank], [r[1] for r in per_rank]
    check(sync)
    check(asyn)
    # One sequence number per op, the same on every rank; the async pass numbers on from the sync one.
    assert len({r["seq"] for r in sync}) == 1 and len({r["seq"] for r in asyn}) == 1
    assert asyn[0]["seq"] == 2 * sync[0]["seq"]
