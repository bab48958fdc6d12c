"""commlib over an engine that behaves as c10d's NCCL engine really does, on CPU: the settings
traps and engine calls the GPU path must survive (../shared/reviews/gpu-path-2026-12-06.md).

The emulated engine (emulated_device.py) reads c10d's settings when it is constructed, legacy
aliases included, initialises NCCL at every eager connect, completes its verdicts from its own
watchdog thread, and blocks a blocking communicator's init without end. Each test pins a
behaviour that holds on a GPU as well; scripts/gpu_check.sh checks the same on one.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import commlib
from commlib import testing
from commlib.backends import nccl
from commlib.backends.c10d import C10dBackend
from commlib.engines import main_cuda_device
from commlib.store_thread import STORE_ANSWER_S

from emulated_device import EmulatedNccl, device, init, raised

CPU = torch.device("cpu")


def _async_ops_under(env: dict[str, str]) -> dict[str, object]:
    os.environ.update(env)  # as a trainer's environment would have them, before the group is built
    comm = init()
    t = torch.ones(4)
    for _ in range(3):
        comm.all_reduce(t, async_op=True, timeout=1.0).wait()
    error = raised(lambda: commlib.check(wait=True, timeout=5.0))
    time.sleep(1.5)  # past the ops' deadlines: a verdict that never came would fail them now
    return {"error": error or raised(commlib.check), "value": t.tolist()}


@pytest.mark.parametrize("alias", ["NCCL_BLOCKING_WAIT", "TORCH_NCCL_BLOCKING_WAIT"])
def test_blocking_wait_under_either_name_never_stops_the_engines_verdicts(alias: str) -> None:
    """With blocking wait c10d starts no watchdog, so no verdict would ever come and every async
    op would time out on a healthy job: the TORCH_ name is set to 0 while the engine is built."""
    for r in testing.run(_async_ops_under, 2, backend=None, timeout=60, args=({alias: "1"},)):
        assert r["error"] is None and r["value"] == [8.0] * 4, r


def _a_peer_dies_under_desync_debug() -> dict[str, object]:
    os.environ["NCCL_DESYNC_DEBUG"] = "1"  # c10d: mode 3, which terminates at the first NCCL error
    comm = init()
    t = torch.ones(64)
    comm.all_reduce(t)
    device().synchronize()
    if comm.rank == 1:
        time.sleep(0.3)
        os._exit(0)
    comm.all_reduce(t, timeout=30.0)
    start, error = time.monotonic(), None
    while error is None and time.monotonic() - start < 15:
        error = raised(commlib.check)
        time.sleep(0.01)
    return {"error": error, "alive": True}


def test_desync_debug_under_its_legacy_name_never_terminates_the_process() -> None:
    """The survivor of a dead peer lives on to raise the PeerFailure (mode 3 would terminate it)."""
    r0, _ = testing.run(_a_peer_dies_under_desync_debug, 2, backend=None, timeout=60, allow_dead_ranks=True)
    assert r0 is not None and r0["alive"], r0
    assert r0["error"]["type"] == "PeerFailure" and r0["error"]["failed_ranks"] == [1], r0


def test_the_torch_names_win_over_their_aliases_while_an_engine_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside: DETAIL lowered, both TORCH_ names "0"; after: everything as the user had it."""
    monkeypatch.setenv("NCCL_DESYNC_DEBUG", "1")
    monkeypatch.setenv("NCCL_BLOCKING_WAIT", "1")
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    monkeypatch.setenv("TORCH_NCCL_DESYNC_DEBUG", "1")
    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        with nccl._settings_held_off() as held:
            inside = (dist.get_debug_level(), os.environ["TORCH_NCCL_DESYNC_DEBUG"],
                      os.environ["TORCH_NCCL_BLOCKING_WAIT"])
        after = (dist.get_debug_level(), os.environ["TORCH_NCCL_DESYNC_DEBUG"],
                 os.environ.get("TORCH_NCCL_BLOCKING_WAIT"))
    finally:
        dist.set_debug_level(level)
    assert inside == (dist.DebugLevel.INFO, "0", "0")
    assert after == (dist.DebugLevel.DETAIL, "1", None)
    assert sorted(held) == ["NCCL_BLOCKING_WAIT", "NCCL_DESYNC_DEBUG", "TORCH_DISTRIBUTED_DEBUG",
                            "TORCH_NCCL_DESYNC_DEBUG"]
    assert nccl.NCCL_ENV["NCCL_RUNTIME_CONNECT"] == "0" and nccl.NCCL_ENV["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"] == "0"


def _creation_with_a_dead_peer() -> dict[str, object]:
    if int(os.environ["RANK"]) == 1:
        os._exit(0)  # never creates its engine
    start = time.monotonic()
    try:
        init(timeout_s=2.0)
    except Exception as exc:
        return {"s": time.monotonic() - start, "error": f"{type(exc).__name__}: {exc}"}
    return {"s": time.monotonic() - start, "error": None}


def test_creating_an_engine_ends_within_its_deadline_when_a_peer_never_connects() -> None:
    """ncclCommInitRank of a nonblocking communicator, under the creation's deadline: aborted at
    2 s, where a blocking one would wait for the dead peer for good."""
    r0, _ = testing.run(_creation_with_a_dead_peer, 2, backend=None, timeout=60, allow_dead_ranks=True)
    assert r0["error"] is not None and "expected every rank to connect within 2 s" in r0["error"], r0
    assert r0["s"] < 2.0 + 1.5, r0


def _first_op_with_lazy_connections() -> dict[str, object]:
    os.environ["NCCL_RUNTIME_CONNECT"] = "1"  # the user's own: NCCL connects inside the first op
    comm = init()
    if comm.rank == 1:
        os._exit(0)  # gone before the first collective
    start = time.monotonic()
    outcome = raised(lambda: comm.all_reduce(torch.ones(4), timeout=1.0))
    while outcome is None and time.monotonic() - start < 15:
        outcome = raised(commlib.check)
        time.sleep(0.01)
    return {"s": time.monotonic() - start, "error": outcome}


def test_a_launch_that_blocks_on_its_peers_is_timed_from_its_issue() -> None:
    """The op is handed to the deadline thread before its launch: a launch stuck in NCCL's lazy
    connection to a dead peer ends at the deadline with the typed error."""
    r0, _ = testing.run(_first_op_with_lazy_connections, 2, backend=None, timeout=60, allow_dead_ranks=True)
    assert r0["error"]["type"] == "CollectiveTimeout", r0
    # The deadline, and at most STORE_ANSWER_S while the error is worded: under the full suite's
    # load the store once took longer than that to answer the board's read.
    assert r0["s"] < 1.0 + STORE_ANSWER_S + 1.0, r0


def _rebuilt_many_times() -> dict[str, object]:
    from commlib._torch_backend import register

    register()
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, is_master=False)
    dist.init_process_group("commlib", store=store, rank=rank, world_size=size, timeout=timedelta(seconds=30))
    group = dist.group.WORLD
    live = []
    for epoch in range(1, 51):
        group.rebuild_communicators(epoch)
        live.append(group._get_backend(CPU) is group.communicator().engine)
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=7), group)
    t = torch.ones(2)
    dist.all_reduce(t)
    return {"live": live, "deadline": group.communicator().timeout, "value": t.tolist(),
            "type": str(group._get_backend_name())}


def test_fifty_rebuilds_keep_the_live_engine_where_torch_looks_for_it() -> None:
    """c10d keeps the first backend of a type for good: `group._get_backend` answers with the
    live engine, through every rebuild, and the group stays of its own backend type."""
    for r in testing.run(_rebuilt_many_times, 2, backend=None, timeout=120):
        assert r["live"] == [True] * 50, r
        assert r["deadline"] == 7.0 and r["value"] == [2.0, 2.0], r


def _eager_connect_as_c10d_does() -> dict[str, object]:
    """What `init_process_group(device_id=...)` does once the group is made:
    `pg._get_backend(device_id).eager_connect_single_device(device_id)`."""
    counted: list[int] = []
    gloo = dist.ProcessGroupGloo
    own = gloo.eager_connect_single_device
    gloo.eager_connect_single_device = lambda engine, device: counted.append(1) or own(engine, device)
    from commlib._torch_backend import register

    register()
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, is_master=False)
    dist.init_process_group("commlib", store=store, rank=rank, world_size=size, timeout=timedelta(seconds=30))
    group = dist.group.WORLD
    group._get_backend(CPU).eager_connect_single_device(CPU)
    elsewhere = None
    try:
        group._get_backend(CPU).eager_connect_single_device(torch.device("cuda", 3))
    except ValueError as exc:
        elsewhere = str(exc)
    return {"connects": len(counted), "elsewhere": elsewhere}


def test_an_eager_connect_of_an_engine_commlib_connected_does_nothing_and_elsewhere_refuses() -> None:
    """c10d's eager connect would initialise a second NCCL communicator and leak it: on
    commlib's engine it does nothing on its own device and raises on another one."""
    for r in testing.run(_eager_connect_as_c10d_does, 2, backend=None, timeout=60):
        assert r["connects"] == 0, r
        assert "expected device_id cpu" in r["elsewhere"] and "found cuda:3" in r["elsewhere"], r


def _device_calls() -> dict[str, object]:
    comm = init()
    events, t, n = comm._backend.events, torch.ones(4), 50

    def burst() -> tuple[float, float]:
        before = events.calls["mark"]
        for _ in range(n):
            comm.all_reduce(t)
        sync = events.calls["mark"] - before
        for _ in range(n):
            comm.all_reduce(t, async_op=True).wait()
        commlib.check(wait=True)
        return sync / n, (events.calls["mark"] - before - sync) / n

    sync, async_ = burst()
    return {"sync": sync, "async": async_, "inits": EmulatedNccl.inits}


def test_the_hot_paths_device_calls_per_op_are_counted() -> None:
    """A synchronous op records one event after it (c10d hands back no work); an asynchronous
    one none (its end is c10d's verdict); the engine was initialised once."""
    for r in testing.run(_device_calls, 2, backend=None, timeout=60):
        assert r["sync"] == 1.0 and r["async"] == 0.0, r
        assert r["inits"] == 1, r


def _watched_on_device_one_while_capturing() -> dict[str, object]:
    comm = init(index=1)
    gpu, t = device(), torch.ones(4)
    for _ in range(3):
        comm.all_reduce(t, async_op=True).wait()
        comm.all_reduce(t)
    commlib.check(wait=True)
    gpu.busy(1.0)
    queued = comm.all_reduce(torch.ones(4))  # its end is queried by the deadline thread during the capture
    with gpu.capture():
        captured = comm.all_reduce(torch.ones(4), async_op=True)
        captured.wait()
        time.sleep(0.3)  # the deadline thread's passes
        during = raised(commlib.check)
        broken_inside = gpu.capture_broken
    del queued
    commlib.check(wait=True)
    return {"contexts": sorted(gpu.contexts), "broken": broken_inside, "check": during}


def test_events_are_read_on_the_communicators_device_and_never_break_a_capture() -> None:
    """As c10d's watchdog: a device guard and the thread-local capture mode around queries."""
    for r in testing.run(_watched_on_device_one_while_capturing, 2, backend=None, timeout=60):
        assert r["contexts"] == [1], r
        assert not r["broken"] and r["check"] is None, r


def _raw_timeout_set(how: str) -> dict[str, object]:
    comm = init()
    group = dist.group.WORLD
    one_s = timedelta(seconds=1)
    if how == "group":
        group.set_timeout(one_s)
    else:
        dist.distributed_c10d._set_pg_timeout(one_s, group)
    engine_timeout = group._get_backend(CPU).options._timeout.total_seconds()
    t = torch.ones(4)
    comm.all_reduce(t, async_op=True).wait()
    comm.all_reduce(t)
    error = raised(lambda: commlib.check(wait=True))
    return {"deadline": comm.timeout, "engine_timeout": engine_timeout, "error": error, "value": t.tolist()}


@pytest.mark.parametrize("how", ["group", "_set_pg_timeout"])
def test_a_deadline_set_later_never_reaches_the_engine_raw(how: str) -> None:
    """c10d times every op out from its enqueue with the group's timeout, which set_timeout
    overwrites: the engine keeps commlib's far longer one, the deadline is commlib's."""
    for r in testing.run(_raw_timeout_set, 2, backend=None, timeout=60, args=(how,)):
        assert r["deadline"] == 1.0, r
        assert r["engine_timeout"] >= 3600, r
        assert r["error"] is None and r["value"] == [4.0] * 4, r


def test_the_engines_device_is_the_one_asked_for_and_no_other_is_served() -> None:
    """LOCAL_RANK, the device asked for, the current one: in that order; no other is served."""
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

