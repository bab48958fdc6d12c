"""Tests of the test-only torchcomms stand-in in tests/torchcomms_standin.

Most API-surface checks run in this process on a one-rank communicator. Values, split, stores,
timeouts, CUDA-like waits, dropped works and a killed peer need real peers: one spawned two-rank
run (gloo on loopback) does all of them, because every spawned process pays for importing torch.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import itertools
import json
import multiprocessing
import os
import queue
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

_STANDIN_PATH = str(Path(__file__).resolve().parent / "torchcomms_standin")
if _STANDIN_PATH not in sys.path:
    sys.path.insert(0, _STANDIN_PATH)

import torchcomms  # noqa: E402
from torchcomms import OpName, ReduceOp  # noqa: E402
from torchcomms._comm import NONBLOCKING_WAIT_ENV  # noqa: E402

CPU = torch.device("cpu")
_ENV_KEYS = (
    "TORCHCOMM_RANK",
    "TORCHCOMM_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHCOMM_TIMEOUT_SECONDS",
    "TORCHCOMM_ABORT_ON_ERROR",
)

# ---- a small private multi-process helper (commlib.testing.run will replace it) ------------

Worker = Callable[[int, int, int], dict[str, Any]]


def _child_main(
    worker: Worker, rank: int, size: int, port: int, results: Any, die_after_report: bool
) -> None:
    for key in _ENV_KEYS:
        os.environ.pop(key, None)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHCOMM_TIMEOUT_SECONDS="45",  # the default of communicators made without a timeout
    )
    try:
        results.put((rank, "ok", worker(rank, size, port)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    results.close()
    results.join_thread()
    if die_after_report:
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(0)  # skip interpreter teardown (gloo groups, stores): nothing left to flush


def _run_ranks(
    worker: Worker, size: int, *, timeout_s: float = 240.0, killed: frozenset[int] = frozenset()
) -> dict[int, dict[str, Any]]:
    """Run ``worker(rank, size, store_port)`` in ``size`` spawned processes; return results.

    The test process serves the TCPStore at MASTER_ADDR:MASTER_PORT. Ranks in ``killed``
    SIGKILL themselves after reporting. Children are always reaped, never left hanging.
    """
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_child_main,
            args=(worker, rank, size, store.port, results, rank in killed),
            daemon=True,
        )
        for rank in range(size)
    ]
    deadline = time.monotonic() + timeout_s
    outcome: dict[int, tuple[str, Any]] = {}
    try:
        for p in procs:
            p.start()
        while len(outcome) < size and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue.Empty:
                if all(p.exitcode is not None for p in procs) and results.empty():
                    break
                continue
            outcome[rank] = (status, value)
        for p in procs:
            p.join(max(0.1, min(10.0, deadline - time.monotonic())))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        results.close()
    problems = [
        f"rank {r}: no result (exit code {procs[r].exitcode})"
        for r in range(size)
        if r not in outcome
    ]
    problems += [f"rank {r} raised:\n{v}" for r, (s, v) in sorted(outcome.items()) if s != "ok"]
    if problems:
        pytest.fail("\n".join(problems))
    return {rank: value for rank, (_, value) in outcome.items()}


# ---- the two-rank scenario ----------------------------------------------------------------


@contextlib.contextmanager
def _section(res: dict[str, Any], name: str) -> Iterator[None]:
    """Record a section's exception instead of losing the other sections' results."""
    try:
        yield
    except Exception:
        res[f"{name}!error"] = traceback.format_exc()


def _err(exc: BaseException) -> tuple[str, str]:
    return type(exc).__name__, str(exc)


def _failure(call: Callable[[], object], start: float | None = None) -> tuple[Any, ...] | None:
    """None when ``call()`` returns; else its error and the seconds since ``start`` (default:
    since the call)."""
    start = time.monotonic() if start is None else start
    try:
        call()
    except Exception as exc:
        return (*_err(exc), time.monotonic() - start)
    return None


def _ops_values(
    c: torchcomms.TorchComm, rank: int, dtype: torch.dtype, async_op: bool
) -> dict[str, Any]:
    """Every op once; the caller checks the values. Non-root list arguments are empty."""
    out: dict[str, Any] = {}
    completed: list[bool] = []

    def run(work: torchcomms.TorchWork) -> None:
        work.wait()
        completed.append(work.is_completed())

    def full(n: int, v: float) -> torch.Tensor:
        return torch.full((n,), v, dtype=dtype)

    for name in ("SUM", "MAX", "MIN", "PRODUCT"):
        t = full(4, rank + 1)
        run(c.all_reduce(t, getattr(ReduceOp, name), async_op))
        out[f"all_reduce_{name}"] = t.tolist()
    if not dtype.is_floating_point:
        for name in ("BAND", "BOR", "BXOR"):
            t = full(2, 3 if rank == 0 else 5)
            run(c.all_reduce(t, getattr(ReduceOp, name), async_op))
            out[f"all_reduce_{name}"] = t.tolist()
    t = full(3, 10 * (rank + 1))
    run(c.broadcast(t, 1, async_op))
    out["broadcast"] = t.tolist()
    t = full(3, rank + 1)
    run(c.reduce(t, 0, ReduceOp.SUM, async_op))
    if rank == 0:
        out["reduce"] = t.tolist()
    outs = [torch.zeros(2, dtype=dtype) for _ in range(2)]
    run(c.all_gather(outs, full(2, rank), async_op))
    out["all_gather"] = [o.tolist() for o in outs]
    o = torch.zeros(2, 2, dtype=dtype)
    run(c.all_gather_single(o, full(2, rank + 1), async_op))
    out["all_gather_single"] = o.tolist()
    o = torch.zeros(2, dtype=dtype)
    run(c.reduce_scatter(o, [full(2, 10 * rank + i) for i in range(2)], ReduceOp.SUM, async_op))
    out["reduce_scatter"] = o.tolist()
    inp, o = torch.arange(4, dtype=dtype) + 10 * rank, torch.zeros(2, dtype=dtype)
    run(c.reduce_scatter_single(o, inp, ReduceOp.SUM, async_op))
    out["reduce_scatter_single"] = o.tolist()
    out["reduce_scatter_single_input"] = inp.tolist()
    inp, o = torch.arange(4, dtype=dtype) + 100 * rank, torch.zeros(4, dtype=dtype)
    run(c.all_to_all_single(o, inp, async_op))
    out["all_to_all_single"] = o.tolist()
    run(c.barrier(async_op))
    o = torch.zeros(3, dtype=dtype)
    run(c.scatter(o, [full(3, 7 + i) for i in range(2)] if rank == 0 else [], 0, async_op))
    out["scatter"] = o.tolist()
    outs = [torch.zeros(3, dtype=dtype) for _ in range(2)] if rank == 1 else []
    run(c.gather(outs, full(3, rank), 1, async_op))
    if rank == 1:
        out["gather"] = [x.tolist() for x in outs]
    o = torch.zeros(2, 3, dtype=dtype)
    run(c.gather_single(o, full(3, rank + 5), 0, async_op))
    if rank == 0:
        out["gather_single"] = o.tolist()
    for src in (0, 1):
        t = torch.arange(3, dtype=dtype) + 50 * src if rank == src else torch.zeros(3, dtype=dtype)
        run(c.send(t, 1 - src, async_op) if rank == src else c.recv(t, src, async_op))
        if rank != src:
            out["recv"] = t.tolist()
    out["is_completed_after_wait"] = all(completed)
    return out


def _split_outcome(comm: torchcomms.TorchComm, ranks: list[int], name: str) -> Any:
    """(name, rank, size) of the child, with a one-rank all-reduce proving it works, or the
    error and how long it took (the split waits at most 1 s)."""
    start = time.monotonic()
    try:
        child = comm.split(ranks, name, timeout=timedelta(seconds=1))
    except RuntimeError as exc:
        return (*_err(exc), time.monotonic() - start)
    assert child is not None
    t = torch.ones(1)
    child.all_reduce(t, ReduceOp.SUM, False)
    return child.get_name(), child.get_rank(), child.get_size(), t.item()


def _two_rank_worker(rank: int, size: int, port: int) -> dict[str, Any]:
    res: dict[str, Any] = {}
    raw = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    long = timedelta(seconds=60)
    comm = torchcomms.new_comm(
        "gloo",
        CPU,
        name="main",
        store=dist.PrefixStore("main", raw),
        hints={"persistent_store": "true"},
        timeout=long,
    )
    res["identity"] = (comm.get_rank(), comm.get_size(), comm.get_name(), comm.get_backend())

    with _section(res, "values"):
        for dtype in (torch.float32, torch.int64):
            for async_op in (False, True):
                res[f"values/{dtype}/{async_op}"] = _ops_values(comm, rank, dtype, async_op)

    with _section(res, "reductions"):
        t = torch.full((2,), float(rank + 1))
        comm.all_reduce(t, ReduceOp.AVG, False)
        res["avg_float"] = t.tolist()
        t = torch.full((2,), -1 if rank == 0 else -4, dtype=torch.int64)
        comm.all_reduce(t, ReduceOp.AVG, True).wait()
        res["avg_int_trunc"] = t.tolist()
        t = torch.full((2,), float(rank + 1))
        comm.reduce(t, 0, ReduceOp.AVG, False)
        res["reduce_avg"] = t.tolist() if rank == 0 else None
        inp, o = torch.arange(4.0) + 10 * rank, torch.zeros(2)
        comm.reduce_scatter_single(o, inp, ReduceOp.AVG, False)
        res["rs_avg"] = o.tolist()
        t = torch.full((2,), float(rank + 1))
        comm.all_reduce(t, ReduceOp.PREMUL_SUM(0.5), False)
        res["premul_float"] = t.tolist()
        t = torch.full((2,), float(rank + 1))
        comm.all_reduce(t, ReduceOp.PREMUL_SUM(torch.tensor(2.0)), True).wait()
        res["premul_tensor"] = t.tolist()
        inp, o = torch.arange(4.0) + 10 * rank, torch.zeros(2)
        comm.reduce_scatter_single(o, inp, ReduceOp.PREMUL_SUM(3.0), False)
        res["rs_premul"] = (o.tolist(), inp.tolist())
        inputs, o = [torch.full((2,), 10.0 * rank + i) for i in range(2)], torch.zeros(2)
        comm.reduce_scatter(o, inputs, ReduceOp.PREMUL_SUM(2.0), True).wait()
        res["rs_list_premul"] = (o.tolist(), [x.tolist() for x in inputs])

    with _section(res, "all_to_all"):
        inp = torch.tensor([0, 1, 2]) if rank == 0 else torch.tensor([10, 11, 12, 13])
        o = torch.zeros(4 if rank == 0 else 3, dtype=torch.int64)
        in_splits, out_splits = ([1, 2], [1, 3]) if rank == 0 else ([3, 1], [2, 1])
        comm.all_to_all_v_single(o, inp, out_splits, in_splits, False)
        res["all_to_all_v_single"] = o.tolist()
        outs = [torch.zeros(2) for _ in range(2)]
        comm.all_to_all(outs, [torch.full((2,), 10.0 * rank + j) for j in range(2)], True).wait()
        res["all_to_all"] = [x.tolist() for x in outs]

    with _section(res, "split"):
        seen: list[tuple[OpName, int, list[int], str]] = []

        def on_split(name: OpName, op_id: int, args: Any) -> None:
            if isinstance(args, torchcomms.SplitPreHookArgs):
                seen.append((name, op_id, list(args.ranks), args.name))

        handle = comm.register_pre_hook(on_split)
        rev = comm.split([1, 0], "rev")
        assert rev is not None
        t = torch.full((1,), float(rev.get_rank()))
        rev.all_reduce(t, ReduceOp.SUM, False)
        res["split_rev"] = (rev.get_name(), rev.get_rank(), rev.get_size(), t.tolist())
        res["split_timeout"] = (rev.get_options().timeout, comm.get_options().timeout)
        solo = comm.split([] if rank == 0 else [1], "solo")
        if solo is not None:
            t = torch.ones(1)
            solo.all_reduce(t, ReduceOp.SUM, False)
            res["split_solo"] = (solo.get_name(), solo.get_rank(), solo.get_size(), t.tolist())
        else:
            res["split_solo"] = None
        # rank 0's split([]) left its split counter behind: the ranks now meet under other keys
        res["split_after_solo"] = _split_outcome(comm, [0, 1], "after_solo")
        # a split of rank 0 alone advances its counter, and the ranks meet again
        if rank == 0:
            comm.split([0], "catch_up")
        res["split_aligned"] = _split_outcome(comm, [0, 1], "aligned")
        # different lists: rank 1 alone gets a 1-rank communicator, rank 0 waits it out
        res["split_mismatch"] = _split_outcome(comm, [0, 1] if rank == 0 else [1], "mismatch")
        try:
            comm.split([1 - rank], "without_me")
            res["split_without_me"] = None
        except RuntimeError as exc:
            res["split_without_me"] = str(exc)
        t = torch.ones(1)
        comm.all_reduce(t, ReduceOp.SUM, False)
        res["parent_after_split_errors"] = t.tolist()
        handle.remove()
        res["split_hooks"] = [(n.name, names) for n, _, _, names in seen]
        res["split_hook_ids_increase"] = all(a[1] < b[1] for a, b in itertools.pairwise(seen))

    with _section(res, "stream_ordered"):
        os.environ[NONBLOCKING_WAIT_ENV] = "1"
        try:
            stream = torchcomms.new_comm("gloo", CPU, name="stream", store=raw, timeout=long)
        finally:
            del os.environ[NONBLOCKING_WAIT_ENV]
        if rank == 1:
            time.sleep(1.0)
        t = torch.full((2,), float(rank + 1))
        start = time.monotonic()
        work = stream.all_reduce(t, ReduceOp.SUM, False)  # a sync op is only enqueued too
        issued = time.monotonic() - start
        work.wait()
        waited, done_at_wait = time.monotonic() - start, work.is_completed()
        while not work.is_completed():
            time.sleep(0.001)
        completed = time.monotonic() - start
        try:
            work.wait_blocking()
            blocking = None
        except RuntimeError as exc:
            blocking = str(exc)
        got = torch.zeros(1)
        if rank == 1:
            time.sleep(0.5)
            stream.send(torch.tensor([42.0]), 0, True).wait()
        else:
            received = stream.recv(got, 1, True)
            while not received.is_completed():  # completes without wait(), as on CUDA
                time.sleep(0.001)
        res["stream_ordered"] = (issued, waited, done_at_wait, completed, t.tolist(), blocking,
                                 got.tolist())

    with _section(res, "stores"):
        # Two communicators on one store without persistent_store (needs MASTER_ADDR), and
        # one with no store at all (MASTER_ADDR:MASTER_PORT, served by the test process).
        a = torchcomms.new_comm("gloo", CPU, name="shared_a", store=raw, timeout=long)
        b = torchcomms.new_comm("gloo", CPU, name="shared_b", store=raw, timeout=long)
        n = torchcomms.new_comm("gloo", CPU, name="from_env", timeout=long)
        ta, tb, tn = torch.full((2,), 1.0 + rank), torch.full((2,), 10.0 + 10 * rank), torch.ones(2)
        wa = a.all_reduce(ta, ReduceOp.SUM, True)
        b.all_reduce(tb, ReduceOp.SUM, False)
        n.all_reduce(tn, ReduceOp.MAX, False)
        wa.wait()
        res["stores"] = (ta.tolist(), tb.tolist(), tn.tolist(), a.get_name(), b.get_name())

    # Failure scenarios: rank 0 acts, rank 1 stays away (alive) until rank 0 is done.
    sync_comm = torchcomms.new_comm("gloo", CPU, name="t_sync", store=raw, timeout=long)
    async_comm = torchcomms.new_comm("gloo", CPU, name="t_async", store=raw, timeout=long)
    p2p_comm = torchcomms.new_comm("gloo", CPU, name="t_p2p", store=raw, timeout=long)
    kill_comm = torchcomms.new_comm("gloo", CPU, name="t_kill", store=raw, timeout=long)
    drop_comm = torchcomms.new_comm("gloo", CPU, name="t_drop", store=raw, timeout=long)
    one_second = timedelta(seconds=1)
    if rank == 0:
        with _section(res, "timeout_sync"):
            hooks: list[str] = []
            sync_comm.register_abort_hook(lambda: hooks.append("sync"))
            res["timeout_sync"] = _failure(lambda: sync_comm.all_reduce(
                torch.ones(2), ReduceOp.SUM, False, timeout=one_second))
            res["timeout_sync_hooks"] = list(hooks)
            res["timeout_sync_next"] = _failure(lambda: sync_comm.barrier(False))
            res["timeout_sync_aborted"] = sync_comm.is_aborted()
        with _section(res, "timeout_async"):
            hooks = []
            async_comm.register_abort_hook(lambda: hooks.append("async"))
            start = time.monotonic()
            work = async_comm.all_reduce(torch.ones(2), ReduceOp.SUM, True, timeout=one_second)
            res["timeout_async_issued"] = time.monotonic() - start
            res["timeout_async"] = _failure(work.wait, start)
            res["timeout_async_hooks"] = list(hooks)
            next_work = async_comm.all_reduce(torch.ones(2), ReduceOp.SUM, True)
            res["timeout_async_next"] = _failure(next_work.wait)
            res["timeout_async_aborted"] = async_comm.is_aborted()
        with _section(res, "timeout_p2p"):
            hooks = []
            p2p_comm.register_abort_hook(lambda: hooks.append("p2p"))
            res["timeout_p2p"] = _failure(lambda: p2p_comm.recv(
                torch.zeros(2), 1, False, timeout=one_second))
            res["timeout_p2p_hooks"] = list(hooks)
        with _section(res, "drop_unfinished"):
            work = drop_comm.all_reduce(torch.ones(2), ReduceOp.SUM, True, timeout=one_second)
            start = time.monotonic()
            del work  # blocks until the op times out, as torchcomms' gloo joins its thread
            res["drop_unfinished"] = time.monotonic() - start
        raw.set("rank0_timeouts_done", "1")
        with _section(res, "peer_killed"):
            # Rank 1 reports, then SIGKILLs itself; this op must fail, not hang.
            res["peer_killed"] = _failure(lambda: kill_comm.all_reduce(
                torch.ones(2), ReduceOp.SUM, False, timeout=long))
    else:
        raw.wait(["rank0_timeouts_done"], timedelta(seconds=120))
    return res


@pytest.fixture(scope="module")
def two_ranks(once: Callable[[str, Callable[[Path], Any]], tuple[Path, Any]]) -> dict[int, dict[str, Any]]:
    return once("standin-two-ranks", lambda _: _run_ranks(_two_rank_worker, 2, killed=frozenset({1})))[1]


def _no_errors(res: dict[str, Any], *sections: str) -> None:
    for name in sections:
        assert f"{name}!error" not in res, res[f"{name}!error"]


def _expected_values(rank: int, dtype: torch.dtype) -> dict[str, Any]:
    def cast(x: Any) -> Any:
        if isinstance(x, list):
            return [cast(v) for v in x]
        return float(x) if dtype.is_floating_point else int(x)

    exp: dict[str, Any] = {
        "all_reduce_SUM": [3] * 4,
        "all_reduce_MAX": [2] * 4,
        "all_reduce_MIN": [1] * 4,
        "all_reduce_PRODUCT": [2] * 4,
        "broadcast": [20] * 3,
        "all_gather": [[0, 0], [1, 1]],
        "all_gather_single": [[1, 1], [2, 2]],
        "reduce_scatter": [10 + 2 * rank] * 2,
        "reduce_scatter_single": [[10, 12], [14, 16]][rank],
        "reduce_scatter_single_input": [10, 12, 14, 16],  # gloo overwrites it: the full sum
        "all_to_all_single": [[0, 1, 100, 101], [2, 3, 102, 103]][rank],
        "scatter": [7 + rank] * 3,
        "recv": [[50, 51, 52], [0, 1, 2]][rank],
    }
    if not dtype.is_floating_point:
        exp.update(all_reduce_BAND=[1, 1], all_reduce_BOR=[7, 7], all_reduce_BXOR=[6, 6])
    if rank == 0:
        exp.update(reduce=[3] * 3, gather_single=[[5] * 3, [6] * 3])
    else:
        exp.update(gather=[[0] * 3, [1] * 3])
    out = {k: cast(v) for k, v in exp.items()}
    out["is_completed_after_wait"] = True
    return out


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=["float32", "int64"])
def test_every_op_gives_the_right_values(
    two_ranks: dict[int, dict[str, Any]], dtype: torch.dtype, async_op: bool
) -> None:
    for rank, res in two_ranks.items():
        _no_errors(res, "values")
        assert res["identity"] == (rank, 2, "main", "gloo")
        assert res[f"values/{dtype}/{async_op}"] == _expected_values(rank, dtype), f"rank {rank}"


def test_avg_and_premul_sum(two_ranks: dict[int, dict[str, Any]]) -> None:
    for rank, res in two_ranks.items():
        _no_errors(res, "reductions")
        assert res["avg_float"] == [1.5, 1.5]
        assert res["avg_int_trunc"] == [-2, -2]  # -5 / 2 truncates toward zero
        assert res["reduce_avg"] == ([1.5, 1.5] if rank == 0 else None)
        assert res["rs_avg"] == [[5.0, 6.0], [7.0, 8.0]][rank]
        assert res["premul_float"] == [1.5, 1.5]
        assert res["premul_tensor"] == [6.0, 6.0]
        # reduce_scatter_single reduces its input in place (scaled, summed); the list variant
        # reduces a copy
        assert res["rs_premul"] == ([[30.0, 36.0], [42.0, 48.0]][rank], [30.0, 36.0, 42.0, 48.0])
        inputs_list = [[10.0 * rank + i] * 2 for i in range(2)]
        assert res["rs_list_premul"] == ([20.0 + 4 * rank] * 2, inputs_list)


def test_all_to_all_variants(two_ranks: dict[int, dict[str, Any]]) -> None:
    for rank, res in two_ranks.items():
        _no_errors(res, "all_to_all")
        assert res["all_to_all_v_single"] == [[0, 10, 11, 12], [1, 2, 13]][rank]
        assert res["all_to_all"] == [[float(rank)] * 2, [10.0 + rank] * 2]


def test_split_renumbers_and_excludes(two_ranks: dict[int, dict[str, Any]]) -> None:
    for rank, res in two_ranks.items():
        _no_errors(res, "split")
        assert res["split_rev"] == ("rev_0", 1 - rank, 2, [1.0])
        # a child's timeout is its own (the environment's default), not the parent's
        assert res["split_timeout"] == (timedelta(seconds=45), timedelta(seconds=60))
        assert res["split_solo"] == (None if rank == 0 else ("solo_1", 0, 1, [1.0]))
        kind, message, elapsed = res["split_after_solo"]
        assert kind == "RuntimeError" and "wait timeout" in message, message
        assert 0.9 <= elapsed < 5.0, elapsed
        assert res["split_aligned"] == ("aligned_0", rank, 2, 2.0)
        if rank == 0:
            kind, message, elapsed = res["split_mismatch"]
            assert kind == "RuntimeError" and "wait timeout" in message, message
            assert 0.9 <= elapsed < 5.0, elapsed
        else:
            assert res["split_mismatch"] == ("mismatch_1", 0, 1, 1.0)
        assert f"Current rank {rank} is not included" in res["split_without_me"]
        assert res["parent_after_split_errors"] == [2.0]
        assert res["split_hooks"] == [
            ("split", "rev"),
            ("split", "solo"),
            ("split", "after_solo"),
            *([("split", "catch_up")] if rank == 0 else []),
            ("split", "aligned"),
            ("split", "mismatch"),
            ("split", "without_me"),
        ]
        assert res["split_hook_ids_increase"]


def test_stream_ordered_wait_does_not_block(two_ranks: dict[int, dict[str, Any]]) -> None:
    # TORCHCOMMS_STANDIN_NONBLOCKING_WAIT=1: rank 1 joins 1 s late; rank 0's wait() (of a
    # sync op, even) returns at once and is_completed() says when the op really ended.
    for res in two_ranks.values():
        _no_errors(res, "stream_ordered")
    issued, waited, done_at_wait, completed, value, blocking, got = two_ranks[0]["stream_ordered"]
    assert issued < 0.5 and waited < 0.5 and done_at_wait is False, (issued, waited)
    assert 0.9 <= completed < 5.0, completed
    assert value == [3.0, 3.0] and got == [42.0]
    assert blocking is not None and "waitBlocking not implemented" in blocking


def test_dropping_an_unfinished_work_blocks(two_ranks: dict[int, dict[str, Any]]) -> None:
    res = two_ranks[0]
    _no_errors(res, "drop_unfinished")
    assert 0.8 <= res["drop_unfinished"] < 3.0, res["drop_unfinished"]


def test_two_comms_on_one_store_and_no_store(two_ranks: dict[int, dict[str, Any]]) -> None:
    for res in two_ranks.values():
        _no_errors(res, "stores")
        assert res["stores"] == ([3.0, 3.0], [30.0, 30.0], [1.0, 1.0], "shared_a", "shared_b")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_timeout_kills_the_communicator(two_ranks: dict[int, dict[str, Any]], mode: str) -> None:
    # sync: the call raises and the abort hooks run; async: the call returns before the
    # timeout, wait() raises, and no abort hook runs.
    res = two_ranks[0]
    _no_errors(res, f"timeout_{mode}")
    kind, message, elapsed = res[f"timeout_{mode}"]
    assert kind == "RuntimeError"
    assert "Timed out waiting" in message and "for recv operation" in message
    # 1 s timeout; generous upper bound for a loaded 2-core machine
    assert 0.9 <= elapsed < 3.0, elapsed
    if mode == "async":
        assert res["timeout_async_issued"] < 0.9, res["timeout_async_issued"]
    assert res[f"timeout_{mode}_hooks"] == (["sync"] if mode == "sync" else [])
    kind, message, _ = res[f"timeout_{mode}_next"]
    assert kind == "RuntimeError" and "Application timeout caused pair closure" in message
    assert res[f"timeout_{mode}_aborted"] is False


def test_p2p_timeout(two_ranks: dict[int, dict[str, Any]]) -> None:
    res = two_ranks[0]
    _no_errors(res, "timeout_p2p")
    kind, message, elapsed = res["timeout_p2p"]
    assert kind == "RuntimeError" and "Timed out waiting" in message
    assert 0.9 <= elapsed < 3.0, elapsed
    assert res["timeout_p2p_hooks"] == []


def test_killed_peer_surfaces_as_runtime_error(two_ranks: dict[int, dict[str, Any]]) -> None:
    res = two_ranks[0]
    _no_errors(res, "peer_killed")
    kind, message, elapsed = res["peer_killed"]
    assert kind == "RuntimeError"
    assert "closed by peer" in message or "reset by peer" in message, message
    assert elapsed < 30, elapsed


# ---- in-process checks on a one-rank communicator ----------------------------------------


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for key in _ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    return monkeypatch


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _solo(store: dist.Store, name: str = "solo", **kwargs: Any) -> torchcomms.TorchComm:
    return torchcomms.new_comm(
        "gloo",
        CPU,
        name=name,
        store=dist.PrefixStore(name, store),
        hints={"persistent_store": "true"},
        **kwargs,
    )


@pytest.fixture
def comm(env: pytest.MonkeyPatch, store: dist.TCPStore) -> torchcomms.TorchComm:
    return _solo(store)


def test_is_the_standin_and_torch_ignores_it() -> None:
    from torch.distributed import distributed_c10d

    assert torchcomms._IS_TEST_STANDIN is True
    assert distributed_c10d._TORCHCOMM_AVAILABLE is False
    assert not (Path(_STANDIN_PATH) / "__init__.py").exists()
    # torch 2.13 probes torchcomms._comms._BackendWrapper; without the opt-in it is refused
    with pytest.raises(ImportError, match="only importable with TORCHCOMMS_STANDIN_BACKEND"):
        importlib.import_module("torchcomms._comms")
    # torch 2.14+ imports is_backend_built
    assert torchcomms.is_backend_built("gloo") and not torchcomms.is_backend_built("nccl")


def test_reduce_op_api() -> None:
    for kind in torchcomms.RedOpType.__members__.values():
        if kind != torchcomms.RedOpType.PREMUL_SUM:
            assert getattr(ReduceOp, kind.name).type == kind
    assert ReduceOp.PREMUL_SUM(0.25).type == torchcomms.RedOpType.PREMUL_SUM
    assert ReduceOp.PREMUL_SUM(torch.tensor(2.0)).type == torchcomms.RedOpType.PREMUL_SUM
    with pytest.raises(TypeError):
        ReduceOp.PREMUL_SUM("2")
    with pytest.raises(TypeError):
        ReduceOp(torchcomms.RedOpType.PREMUL_SUM)


def test_signatures_follow_the_binding() -> None:
    ops = {
        "send": ["tensor", "dst"],
        "recv": ["tensor", "src"],
        "broadcast": ["tensor", "root"],
        "all_reduce": ["tensor", "op"],
        "reduce": ["tensor", "root", "op"],
        "all_gather": ["tensor_list", "tensor"],
        "all_gather_v": ["tensor_list", "tensor"],
        "all_gather_single": ["output", "input"],
        "reduce_scatter": ["output", "input_list", "op"],
        "reduce_scatter_v": ["output", "input_list", "op"],
        "reduce_scatter_single": ["output", "input", "op"],
        "all_to_all_single": ["output", "input"],
        "all_to_all_v_single": ["output", "input", "output_split_sizes", "input_split_sizes"],
        "all_to_all": ["output_tensor_list", "input_tensor_list"],
        "barrier": [],
        "scatter": ["output_tensor", "input_tensor_list", "root"],
        "gather": ["output_tensor_list", "input_tensor", "root"],
        "gather_single": ["output", "input", "root"],
    }
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    for name, before in ops.items():
        params = list(inspect.signature(getattr(torchcomms.TorchComm, name)).parameters.values())
        assert [p.name for p in params] == ["self", *before, "async_op", "hints", "timeout"], name
        assert all(p.kind is positional for p in params), name
        assert all(p.default is inspect.Parameter.empty for p in params[:-2]), name
        assert params[-2].default is None and params[-1].default is None, name
    split = inspect.signature(torchcomms.TorchComm.split).parameters
    assert list(split) == ["self", "ranks", "name", "hints", "timeout"]
    new_comm = inspect.signature(torchcomms.new_comm).parameters
    assert list(new_comm) == ["backend", "device", "name", "abort_process_on_timeout_or_error",
                              "timeout", "high_priority_stream", "store", "enable_reconfigure",
                              "hints"]
    assert all(p.kind is positional for p in new_comm.values())
    assert new_comm["name"].default is inspect.Parameter.empty


def test_enums_compare_by_value_not_identity(comm: torchcomms.TorchComm) -> None:
    # pybind11 enums: each value crossing the binding is a new object; `is` does not hold.
    seen: list[Any] = []
    comm.register_pre_hook(lambda name, op_id, args: seen.append(name))
    comm.barrier(False)
    (name,) = seen
    assert name == OpName.barrier and name is not OpName.barrier and name != OpName.split
    assert ReduceOp.SUM.type == torchcomms.RedOpType.SUM
    assert ReduceOp.SUM.type is not torchcomms.RedOpType.SUM
    assert OpName.send != torchcomms.RedOpType.SUM  # both 0: different enums never compare equal
    assert {OpName.barrier: 1}[name] == 1
    with pytest.raises(TypeError):
        iter(torchcomms.RedOpType)  # type: ignore[call-overload]
    assert list(torchcomms.RedOpType.__members__)[:2] == ["SUM", "PRODUCT"]


def test_call_conventions_are_enforced(comm: torchcomms.TorchComm) -> None:
    t = torch.ones(2)
    with pytest.raises(TypeError, match="async_op"):
        comm.all_reduce(t, ReduceOp.SUM)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="async_op"):
        comm.barrier()  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="async_op"):
        comm.all_reduce(t, ReduceOp.SUM, "false")  # type: ignore[arg-type]
    # the binding converts like pybind11's bool: 1 and 2.5 are async, 0 and None sync
    for loose, is_async in ((1, True), (2.5, True), (0, False), (None, False)):
        work = comm.all_reduce(t, ReduceOp.SUM, loose)  # type: ignore[arg-type]
        work.wait()
        if is_async:
            with pytest.raises(RuntimeError, match="waitBlocking not implemented"):
                work.wait_blocking()
        else:
            work.wait_blocking()
    c10d_sum = dist.ReduceOp(dist.ReduceOp.SUM)
    for bad_op in (dist.ReduceOp.SUM, c10d_sum, "sum", torchcomms.RedOpType.SUM):
        with pytest.raises(TypeError, match=r"torchcomms\.ReduceOp"):
            comm.all_reduce(t, bad_op, False)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="timeout"):
        comm.all_reduce(t, ReduceOp.SUM, False, timeout=5)  # type: ignore[arg-type]
    comm.all_reduce(t, ReduceOp.SUM, False, timeout=5.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="hints"):
        comm.all_reduce(t, ReduceOp.SUM, False, hints={"a": 1})  # type: ignore[dict-item]
    # keywords and positional hints/timeout are accepted, as by the binding
    comm.all_reduce(tensor=t, op=ReduceOp.SUM, async_op=False).wait()
    comm.all_reduce(t, ReduceOp.SUM, True, {"k": "v"}, timedelta(seconds=5)).wait()
    comm.barrier(async_op=True, timeout=timedelta(seconds=5)).wait()
    assert t.tolist() == [1.0, 1.0]


def test_validation_matches_gloo(comm: torchcomms.TorchComm) -> None:
    with pytest.raises(RuntimeError, match=r"root must be in range \[0, 1\), but got 1"):
        comm.broadcast(torch.ones(2), 1, False)
    with pytest.raises(RuntimeError, match="dst must be in range"):
        comm.send(torch.ones(2), 3, False)
    with pytest.raises(RuntimeError, match="Cannot send to self"):
        comm.send(torch.ones(2), 0, False)
    with pytest.raises(RuntimeError, match="contiguous"):
        comm.all_reduce(torch.ones(4, 4).t(), ReduceOp.SUM, False)
    with pytest.raises(RuntimeError, match="tensor_list size"):
        comm.all_gather([torch.zeros(2), torch.zeros(2)], torch.ones(2), False)
    with pytest.raises(RuntimeError, match="all_gather_single"):
        comm.all_gather_single(torch.zeros(3), torch.ones(2), False)
    with pytest.raises(RuntimeError, match="Sum of input_split_sizes must equal input tensor"):
        comm.all_to_all_v_single(torch.zeros(2), torch.ones(2), [2], [1], False)
    # rejected calls leave the communicator usable
    t = torch.ones(2)
    comm.all_reduce(t, ReduceOp.SUM, False)
    assert t.tolist() == [1.0, 1.0]


def test_new_comm_arguments_and_environment(env: pytest.MonkeyPatch, store: dist.TCPStore) -> None:
    with pytest.raises(RuntimeError, match="only emulates the 'gloo' backend"):
        torchcomms.new_comm("nccl", CPU, name="x")
    with pytest.raises(TypeError, match="device"):
        torchcomms.new_comm("gloo", "cpu", name="x")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="CPU only"):
        torchcomms.new_comm("gloo", torch.device("meta"), name="x")
    with pytest.raises(TypeError, match="name"):
        torchcomms.new_comm("gloo", CPU)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        torchcomms.new_comm("gloo", CPU, "x", name="x")  # type: ignore[misc]
    with pytest.raises(NotImplementedError):
        torchcomms.new_comm("gloo", CPU, name="x", enable_reconfigure=True)
    # a store without persistent_store, or no store, needs MASTER_ADDR
    with pytest.raises(RuntimeError, match="MASTER_ADDR env is not set"):
        torchcomms.new_comm("gloo", CPU, name="x", store=store)
    with pytest.raises(RuntimeError, match="MASTER_ADDR env is not set"):
        torchcomms.new_comm("gloo", CPU, name="x")
    env.delenv("RANK")
    env.delenv("WORLD_SIZE")
    with pytest.raises(RuntimeError, match="rank and world size"):
        _solo(store, "no_env")
    # TORCHCOMM_RANK/TORCHCOMM_SIZE win over RANK/WORLD_SIZE
    env.setenv("RANK", "3")
    env.setenv("WORLD_SIZE", "8")
    env.setenv("TORCHCOMM_RANK", "0")
    env.setenv("TORCHCOMM_SIZE", "1")
    env.setenv("TORCHCOMM_TIMEOUT_SECONDS", "42")
    c = _solo(store, "from_torchcomm_env")
    assert (c.get_rank(), c.get_size(), c.get_name()) == (0, 1, "from_torchcomm_env")
    assert c.get_device() == CPU
    assert c.get_options().timeout == timedelta(seconds=42)
    explicit = _solo(store, "explicit", timeout=timedelta(seconds=7))
    assert explicit.get_options().timeout == timedelta(seconds=7)
    # as the binding: name may be positional, and a float timeout is seconds
    positional = torchcomms.new_comm("gloo", CPU, "positional", None, 7.5,
                                     store=dist.PrefixStore("positional", store),
                                     hints={"persistent_store": "true"})
    assert positional.get_name() == "positional"
    assert positional.get_options().timeout == timedelta(seconds=7.5)


def test_store_rules(env: pytest.MonkeyPatch, store: dist.TCPStore) -> None:
    shared = dist.PrefixStore("shared", store)
    persistent = {"persistent_store": "true"}
    torchcomms.new_comm("gloo", CPU, name="one", store=shared, hints=persistent)
    with pytest.raises(RuntimeError, match="detected multiple communicators on same store"):
        torchcomms.new_comm("gloo", CPU, name="two", store=shared, hints=persistent)
    env.setenv("MASTER_ADDR", "127.0.0.1")
    first = torchcomms.new_comm("gloo", CPU, name="dup", store=store)
    other = torchcomms.new_comm("gloo", CPU, name="other", store=store)
    again = torchcomms.new_comm("gloo", CPU, name="dup", store=store)  # torchcomms accepts it
    for c in (first, other, again):
        t = torch.ones(1)
        c.all_reduce(t, ReduceOp.SUM, False)
        assert t.tolist() == [1.0]


def test_finalize(comm: torchcomms.TorchComm) -> None:
    comm.finalize()
    for call in (
        lambda: comm.all_reduce(torch.ones(1), ReduceOp.SUM, False),
        lambda: comm.barrier(True),
        lambda: comm.broadcast(torch.ones(1), 0, False),
    ):
        with pytest.raises(RuntimeError, match="not initialized"):
            call()
    with pytest.raises(RuntimeError, match="already finalized"):
        comm.finalize()
    assert (comm.get_rank(), comm.get_size(), comm.get_backend()) == (0, 1, "gloo")
    # torchcomms' gloo split does not check: a finalized parent still gives a usable child
    late = comm.split([0], "late")
    assert late is not None
    t = torch.ones(1)
    late.all_reduce(t, ReduceOp.SUM, False)
    assert t.tolist() == [1.0]


def test_gloo_has_no_abort_or_set_timeout(comm: torchcomms.TorchComm) -> None:
    with pytest.raises(RuntimeError, match="abort not implemented"):
        comm.abort()
    assert comm.is_abort_supported() is False
    assert comm.is_aborted() is False
    with pytest.raises(RuntimeError, match="setTimeout not implemented"):
        comm.set_timeout(timedelta(seconds=5))
    t = torch.ones(1)
    comm.all_reduce(t, ReduceOp.SUM, False)  # still usable
    assert t.tolist() == [1.0]


def test_work_semantics(comm: torchcomms.TorchComm) -> None:
    sync_work = comm.barrier(False)
    assert sync_work.is_completed()
    sync_work.wait()
    sync_work.wait_blocking()
    async_work = comm.all_reduce(torch.ones(2), ReduceOp.SUM, True)
    async_work.wait()
    async_work.wait()
    assert async_work.is_completed()
    with pytest.raises(RuntimeError, match="waitBlocking not implemented"):
        async_work.wait_blocking()
    with pytest.raises(TypeError):
        torchcomms.TorchWork()
    with pytest.raises(TypeError):
        torchcomms.TorchComm()


def test_hooks(comm: torchcomms.TorchComm) -> None:
    pre: list[tuple[OpName, int, Any]] = []
    post: list[tuple[int, Any]] = []
    pre_handle = comm.register_pre_hook(lambda name, op_id, args: pre.append((name, op_id, args)))
    post_handle = comm.register_post_hook(lambda op_id, args: post.append((op_id, args)))
    t, out = torch.ones(2), torch.zeros(2)
    comm.all_reduce(t, ReduceOp.SUM, False)
    comm.broadcast(t, 0, True).wait()
    comm.all_gather_single(out, t, False)
    comm.gather([out], t, 0, False)
    comm.barrier(True).wait()
    assert [p[0] for p in pre] == [
        OpName.all_reduce,
        OpName.broadcast,
        OpName.all_gather_single,
        OpName.gather,
        OpName.barrier,
    ]
    ids = [p[1] for p in pre]
    assert ids == sorted(set(ids)) and [p[0] for p in post] == ids
    ar, bc, ags, ga, bar = (p[2] for p in pre)
    assert ar.tensor is t and ar.async_op is False
    assert bc.tensor is t and bc.root == 0 and bc.async_op is True
    assert ags.input is t and ags.output is out
    assert ga.input is t and ga.output[0] is out and ga.root == 0
    assert bar.async_op is True
    assert all(isinstance(p[1], torchcomms.CollectivePostHookArgs) for p in post)
    # a failing op runs the pre-hook (consuming an op id) but not the post-hook
    with pytest.raises(RuntimeError):
        comm.gather([], t, 0, False)  # root needs one output per rank
    assert len(pre) == 6 and len(post) == 5
    pre_handle.remove()
    pre_handle.remove()  # idempotent
    post_handle.remove()
    comm.barrier(False)
    assert len(pre) == 6 and len(post) == 5
    # split and finalize
    comm.register_pre_hook(lambda name, op_id, args: pre.append((name, op_id, args)))
    comm.register_post_hook(lambda op_id, args: post.append((op_id, args)))
    child = comm.split([0], "child")
    assert child is not None and child.get_name() == "child_0"
    assert pre[-1][0] == OpName.split and pre[-1][2].ranks == [0] and pre[-1][2].name == "child"
    assert isinstance(post[-1][1], torchcomms.SplitPostHookArgs) and post[-1][0] == pre[-1][1]
    posts = len(post)
    assert comm.split([], "nobody") is None
    assert pre[-1][0] == OpName.split and pre[-1][2].ranks == []
    assert len(post) == posts  # no post-hook when split returns None
    comm.finalize()
    assert pre[-1][:2] == (OpName.finalize, 2**64 - 1)
    assert isinstance(pre[-1][2], torchcomms.FinalizePreHookArgs)
    assert post[-1][0] == 2**64 - 1 and isinstance(post[-1][1], torchcomms.FinalizePostHookArgs)


def test_flight_recorder_hook_dumps_torch_format(comm: torchcomms.TorchComm) -> None:
    from torchcomms.hooks import FlightRecorderHook

    hook = FlightRecorderHook(max_entries=8, isolated=True)
    assert json.loads(hook.dump_json()) == {"version": "2.10", "comm_lib_version": "",
                                            "pg_config": {}, "pg_status": {}}  # no entries key
    hook.register_with_comm(comm)
    t, out = torch.ones(2), torch.zeros(2)
    comm.all_reduce(t, ReduceOp.SUM, False)
    work = comm.all_gather_single(out, t, True)
    work.wait()
    comm.split([0], "child")
    comm.finalize()  # not recorded
    dump = json.loads(hook.dump_json())
    assert sorted(dump) == ["comm_lib_version", "entries", "pg_config", "pg_status", "version"]
    assert dump["pg_config"] == {"solo": {"name": "solo", "desc": "gloo", "ranks": "[0]"}}
    entries = dump["entries"]
    assert [e["profiling_name"] for e in entries] == ["gloo:all_reduce", "gloo:all_gather_single",
                                                       "gloo:split"]
    first = entries[0]
    assert (first["process_group"], first["pg_id"], first["record_id"], first["state"]) == (
        ["solo", "gloo"], 0, 0, "scheduled")
    assert (first["input_sizes"], first["input_dtypes"], first["output_sizes"]) == (
        [[2]], ["Float"], [[2]])
    assert entries[1]["output_sizes"] == [[2]] and entries[2]["input_sizes"] == []
    assert all(e["retired"] for e in entries) and hook.size() == 3
    assert "entries" not in json.loads(hook.dump_json(include_completed=False))


def test_abort_hook_handle_and_errors(comm: torchcomms.TorchComm) -> None:
    calls: list[int] = []
    handle = comm.register_abort_hook(lambda: calls.append(1))
    handle.remove()
    with pytest.raises(TypeError):
        comm.register_pre_hook("not callable")  # type: ignore[arg-type]
    # validation errors are not op failures: no abort hook
    comm.register_abort_hook(lambda: calls.append(2))
    with pytest.raises(RuntimeError):
        comm.broadcast(torch.ones(1), 5, False)
    assert calls == []


def test_split_local_validation(comm: torchcomms.TorchComm) -> None:
    with pytest.raises(RuntimeError, match="Invalid rank 1"):
        comm.split([1], "bad")
    with pytest.raises(RuntimeError, match="Duplicate ranks"):
        comm.split([0, 0], "dup")
    with pytest.raises(TypeError):
        comm.split([0], None)  # type: ignore[arg-type]


def test_not_emulated_ops_say_so(comm: torchcomms.TorchComm) -> None:
    t = torch.ones(1)
    with pytest.raises(NotImplementedError, match="not emulated by the torchcomms stand-in"):
        comm.all_gather_v([t], t, False)
    with pytest.raises(NotImplementedError, match="not emulated by the torchcomms stand-in"):
        comm.reduce_scatter_v(t, [t], ReduceOp.SUM, False)
    with pytest.raises(NotImplementedError, match="not emulated by the torchcomms stand-in"):
        comm.reconfigure(0, ["handle"])
    with pytest.raises(NotImplementedError, match="not emulated by the torchcomms stand-in"):
        comm.batch_op_create()
