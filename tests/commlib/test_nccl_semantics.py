"""commlib over an engine that behaves as c10d's NCCL engine really does (issue #31), on CPU.

The emulated engine (emulated_device.py) models what ProcessGroupNCCL's source says and the
GPU path must survive: a barrier whose wait blocks the CPU, an abort that holds the engine's
lock while the device drains, event queries that open contexts and break graph captures, a
timeout that counts from the enqueue and that `set_timeout` overwrites, send/recv on the
collective stream of an eagerly initialised engine, c10d's synchronous path. Each test pins
the behaviour that holds on a GPU as well; scripts/gpu_check.sh checks the same on one.
"""

from __future__ import annotations

import gc
import os
import time
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import commlib
from commlib import testing
from commlib.backends import nccl
from commlib.backends.c10d import C10dBackend
from commlib.engines import main_cuda_device

from emulated_device import device, init, raised

CPU = torch.device("cpu")


def _barrier_with_a_late_peer(async_op: bool) -> dict[str, object]:
    comm = init()
    comm.barrier()  # on time: a rendezvous that returns
    if comm.rank == 1:
        time.sleep(2.5)  # misses the next one, then leaves
        return {}
    start = time.monotonic()
    if async_op:
        work = comm.barrier(async_op=True, timeout=1.0)
        issue_s = time.monotonic() - start
        error = raised(work.wait)
    else:
        issue_s, error = None, raised(lambda: comm.barrier(timeout=1.0))
    return {"issue_s": issue_s, "s": time.monotonic() - start, "error": error, "engine": comm._backend.launched}


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_a_barrier_never_blocks_the_cpu_past_its_deadline(async_op: bool) -> None:
    # c10d's NCCL barrier blocks the CPU in a stream synchronize, without any deadline: commlib
    # launches an all_reduce of one element instead, and waits for it under the watchdog.
    r0, _ = testing.run(_barrier_with_a_late_peer, 2, backend=None, timeout=40, args=(async_op,))
    assert r0["error"]["type"] == "CollectiveTimeout" and r0["error"]["missing_ranks"] == [1], r0
    assert r0["error"]["op"] == "barrier", r0
    assert r0["s"] < 1.0 + 0.5, r0
    assert "barrier" not in r0["engine"], r0
    if async_op:
        assert r0["issue_s"] < 0.2, r0


def _expiry_while_the_device_drains() -> dict[str, object]:
    comm = init()
    t = torch.ones(4)
    comm.all_reduce(t)
    device().synchronize()
    if comm.rank == 1:
        time.sleep(6.0)  # never joins #2
        return {}
    out = torch.ones(1 << 16)
    alive = weakref.ref(out)
    start = time.monotonic()
    comm.all_reduce(out, timeout=1.0)  # its peer never comes
    device().busy(3.0)  # queued behind it: the engine's abort holds its lock until this has run
    del out
    error = None
    while error is None and time.monotonic() - start < 15:
        error = raised(commlib.check)
        time.sleep(0.01)
    detected_s = time.monotonic() - start
    gc.collect()
    return {"detected_s": detected_s, "error": error, "kept": alive() is not None,
            "flight": [e.state for e in comm.recorder.entries()]}


def test_a_timeout_never_freezes_the_caller_behind_the_engines_abort() -> None:
    # The engine's abort holds its lock until the device has drained (NCCLComm::abort), and
    # c10d's is_completed() takes that lock: commlib never asks it, so neither the watchdog's
    # thread nor the caller's check() waits for the drain; and the failed op keeps its tensors
    # while the device may still write them.
    r0, _ = testing.run(_expiry_while_the_device_drains, 2, backend=None, timeout=60)
    assert r0["error"]["type"] == "CollectiveTimeout", r0
    assert r0["detected_s"] < 1.0 + 0.5, r0
    assert r0["kept"], r0
    assert r0["flight"] == ["completed", "timed_out"], r0


def _watched_on_device_one_while_capturing() -> dict[str, object]:
    comm = init(index=1)
    gpu, t = device(), torch.ones(4)
    for _ in range(3):
        comm.all_reduce(t, async_op=True).wait()
        comm.all_reduce(t)
    commlib.check(wait=True)
    gpu.busy(1.0)
    queued = comm.all_reduce(torch.ones(4), async_op=True)  # queried by the watchdog during the capture
    with gpu.capture():
        captured = comm.all_reduce(torch.ones(4), async_op=True)
        captured.wait()
        time.sleep(0.3)  # the watchdog's passes
        during = raised(commlib.check)
        broken_inside = gpu.capture_broken
    queued.wait()
    commlib.check(wait=True)
    return {"contexts": sorted(gpu.contexts), "broken": broken_inside, "check": during,
            "states": [e.state for e in comm.recorder.entries()]}


def test_events_are_read_on_the_communicators_device_and_never_break_a_capture() -> None:
    # c10d's watchdog queries under a device guard and a thread-local capture mode: a rank on
    # device 1 opens no context on device 0, and a graph captured meanwhile stays valid.
    for r in testing.run(_watched_on_device_one_while_capturing, 2, backend=None, timeout=60):
        assert r["contexts"] == [1], r
        assert not r["broken"] and r["check"] is None, r
        assert r["states"] == ["completed"] * 8, r


def _raw_timeout_set(how: str) -> dict[str, object]:
    comm = init()
    group = dist.group.WORLD
    one_s = timedelta(seconds=1)
    if how == "group":
        group.set_timeout(one_s)
    else:
        dist.distributed_c10d._set_pg_timeout(one_s, group)
    engine_timeout = group._get_backend(CPU).options._timeout.total_seconds()
    device().busy(2.5)  # the op waits behind it: c10d's timeout would count this from the enqueue
    t = torch.ones(4)
    comm.all_reduce(t, async_op=True).wait()
    comm.all_reduce(t)
    error = raised(lambda: commlib.check(wait=True))
    return {"deadline": comm.timeout, "engine_timeout": engine_timeout, "error": error, "value": t.tolist()}


@pytest.mark.parametrize("how", ["group", "_set_pg_timeout"])
def test_a_deadline_set_later_never_reaches_the_engine_raw(how: str) -> None:
    # ProcessGroupNCCL ignores per-op timeouts and times every op out from its enqueue with the
    # group's timeout, which set_timeout overwrites: the engine keeps commlib's engine timeout.
    for r in testing.run(_raw_timeout_set, 2, backend=None, timeout=60, args=(how,)):
        assert r["deadline"] == 1.0, r
        assert r["engine_timeout"] >= 3600, r
        assert r["error"] is None and r["value"] == [4.0] * 4, r


def _send_behind_a_collective() -> dict[str, object]:
    comm = init(eager=True)
    t = torch.full((4,), 7.0)
    if comm.rank == 1:
        time.sleep(2.0)  # late for the all_reduce, within its deadline
        comm.all_reduce(t, timeout=10.0)
        comm.recv(t, 0)
        commlib.check(wait=True)
        return {"value": t.tolist()}
    comm.all_reduce(t, async_op=True, timeout=10.0)
    comm.send(t, 1, async_op=True, timeout=1.0)  # on the same stream, behind the all_reduce
    return {"error": raised(lambda: commlib.check(wait=True))}


def test_a_send_queued_behind_a_collective_on_its_stream_has_not_started() -> None:
    # An eagerly initialised NCCL engine runs send/recv on its collective stream: the send's
    # deadline counts from when that stream reaches it, not from when the caller's did.
    r0, r1 = testing.run(_send_behind_a_collective, 2, backend=None, timeout=60)
    assert r0["error"] is None, r0
    assert r1["value"] == [14.0] * 4


def test_the_engines_device_is_the_one_asked_for_and_no_other_is_served() -> None:
    current = lambda: 0  # noqa: E731 - the device a trainer may still have left current
    assert main_cuda_device("cuda:3", 1, 8, current) == torch.device("cuda", 3)
    assert main_cuda_device(None, 5, 8, current) == torch.device("cuda", 5)  # torchrun's LOCAL_RANK
    assert main_cuda_device(None, -1, 8, current) == torch.device("cuda", 0)
    assert main_cuda_device(None, 9, 8, current) == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="expected a CUDA device for its CUDA engine; found cpu"):
        main_cuda_device("cpu", 0, 8, current)
    engine = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=5))
    backend = C10dBackend(engine, torch.device("cuda", 1), dist.HashStore(), owned=True, name="nccl")
    assert "serves tensors on cuda:1" in backend.supports(torch.device("cuda", 0), None)
    assert backend.supports(torch.device("cuda", 1), None) is None


def _rebuilt_twice() -> dict[str, object]:
    from commlib._torch_backend import register

    register()
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, is_master=False)
    dist.init_process_group("commlib", store=store, rank=rank, world_size=size, timeout=timedelta(seconds=30))
    group = dist.group.WORLD
    registered = []
    for epoch in (1, 2):
        group.rebuild_communicators(epoch)
        registered.append(group._get_backend(CPU) is group.communicator()._backend.engine)
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=7), group)
    t = torch.ones(2)
    dist.all_reduce(t)
    return {"registered": registered, "deadline": group.communicator().timeout, "value": t.tolist()}


def test_a_rebuilt_group_registers_its_live_engine() -> None:
    # c10d keeps the first backend of a type for good: the rebuilt engines are registered under
    # types the group has not used, so torch's callers reach the engine commlib runs on.
    for r in testing.run(_rebuilt_twice, 2, backend=None, timeout=60):
        assert r["registered"] == [True, True], r
        assert r["deadline"] == 7.0 and r["value"] == [2.0, 2.0], r


def _device_calls() -> dict[str, object]:
    comm = init()
    rt, t, n = comm._backend.runtime, torch.ones(4), 50

    def burst() -> tuple[float, float]:
        before = rt.calls["mark"]
        for _ in range(n):
            comm.all_reduce(t)
        sync = rt.calls["mark"] - before
        for _ in range(n):
            comm.all_reduce(t, async_op=True).wait()
        commlib.check(wait=True)
        return sync / n, (rt.calls["mark"] - before - sync) / n

    burst()  # fills the pool
    created = rt.created
    sync, async_ = burst()
    return {"sync": sync, "async": async_, "created": rt.created - created}


def test_the_hot_paths_device_calls_per_op_are_counted() -> None:
    # A synchronous op takes c10d's synchronous path: its start and its end are the only device
    # calls (no stream wait, no work to order); an asynchronous one marks its start alone, its
    # end being the engine's verdict. Events go back to the pool once their op has ended.
    for r in testing.run(_device_calls, 2, backend=None, timeout=60):
        assert r["sync"] == 2.0 and r["async"] == 1.0, r
        assert r["created"] <= 10, r  # the second burst's 150 marks come from the pool (a few more may be in flight)


def test_settings_that_would_undo_commlibs_decisions_are_held_off_while_an_engine_is_built(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_NCCL_DESYNC_DEBUG", "1")
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        with nccl._settings_held_off() as held:
            inside = (dist.get_debug_level(), os.environ["TORCH_NCCL_DESYNC_DEBUG"],
                      os.environ["TORCH_NCCL_BLOCKING_WAIT"])
        after = (dist.get_debug_level(), os.environ["TORCH_NCCL_DESYNC_DEBUG"], os.environ["TORCH_NCCL_BLOCKING_WAIT"])
    finally:
        dist.set_debug_level(level)
    assert inside == (dist.DebugLevel.INFO, "0", "0")
    assert after == (dist.DebugLevel.DETAIL, "1", "1")
    assert sorted(held) == ["TORCH_DISTRIBUTED_DEBUG", "TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_DESYNC_DEBUG"]
    assert nccl.NCCL_ENV["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"] == "0"
