"""What only the torchcomms backend does: finding torchcomms, what it is handed, and where
torchcomms' engines differ (gloo's reduce-scatter and split), that commlib still means one
thing. (On CUDA the backend is stream-ordered; that path is commlib's own, tested on the
emulated device of test_stream_ordered.py.)

The shared Communicator suite runs against both backends through the `backend` fixture;
these tests pin the choices specific to torchcomms.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path

import pytest
import torch

import commlib
from commlib import testing
from commlib.backends import torchcomms as tc_backend

# Not imported from conftest: spawned ranks re-import this module, and there `conftest`
# can resolve to tests/conftest.py.
STANDIN = Path(__file__).resolve().parents[1] / "torchcomms_standin"


def test_missing_torchcomms_is_a_clear_error_only_when_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchcomms", None)  # what `import torchcomms` sees when absent
    assert "cannot be imported" in tc_backend.available()
    with pytest.raises(commlib.CommError, match="expected a usable torchcomms.*pip install torchcomms"):
        commlib.init("torchcomms", rank=0, world_size=1, store=torch.distributed.HashStore())


def test_empty_placeholder_package_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    placeholder = type(sys)("torchcomms")  # PyPI's torchcomms: a module with nothing in it
    monkeypatch.setitem(sys.modules, "torchcomms", placeholder)
    assert "placeholder" in tc_backend.available()


def _which_backend(comm: commlib.Communicator) -> str:
    return comm.backend


def test_auto_falls_back_quietly_without_torchcomms(monkeypatch: pytest.MonkeyPatch) -> None:
    # Other tests in this worker may have put the stand-in on sys.path; the ranks copy it.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "torchcomms_standin" not in p])
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert testing.run(_which_backend, 2, backend="auto") == ["gloo", "gloo"]


def test_auto_picks_torchcomms_when_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(STANDIN))
    assert testing.run(_which_backend, 2, backend="auto") == ["torchcomms:gloo", "torchcomms:gloo"]


def _premul_and_avg(comm: commlib.Communicator) -> list[list[float]]:
    a = torch.full((2,), float(comm.rank + 1))
    comm.all_reduce(a, commlib.premul_sum(2.0))
    b = torch.full((2,), float(comm.rank + 1))
    comm.reduce_scatter_single(torch.zeros(1), torch.arange(2.0), commlib.ReduceOp.AVG)
    comm.all_reduce(b, commlib.ReduceOp.AVG)
    return [a.tolist(), b.tolist()]


def test_premul_sum_and_avg_map_to_native_reductions(backend: str) -> None:
    results = testing.run(_premul_and_avg, 2, backend=backend)
    assert results == [[[6.0, 6.0], [1.5, 1.5]]] * 2


def _second_communicator_and_split(comm: commlib.Communicator, backend: str) -> list[float]:
    store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    second = commlib.init(backend, rank=comm.rank, world_size=comm.size, store=store, name="second")
    sub = comm.split([0, 1], "sub")
    values = []
    for c in (comm, second, sub):
        t = torch.ones(1)
        c.all_reduce(t)
        values.append(t.item())
    return values


def test_two_communicators_and_a_split_share_one_store(backend: str) -> None:
    # torchcomms allows one communicator per persistent store (the stand-in enforces it):
    # each commlib communicator must bring its own prefix.
    assert testing.run(_second_communicator_and_split, 2, backend=backend, args=(backend,)) == [[2.0] * 3] * 2


# -- what torchcomms' gloo does differently, made to mean one thing ------------------------


def _short_wait_then_drop(comm: commlib.Communicator) -> float | None:
    if comm.rank == 1:
        time.sleep(3.0)  # never joins
        return None
    start = time.monotonic()
    work = comm.all_reduce(torch.ones(2), async_op=True, timeout=2.0)
    try:
        work.wait(timeout=0.3)
    except commlib.WaitTimeout:
        pass
    del work
    gc.collect()
    return time.monotonic() - start


def test_a_wait_that_gives_up_returns_on_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # Dropping a TorchWork whose op still runs blocks until the op's own timeout (2 s here):
    # neither the 0.3 s wait (which leaves the op running) nor dropping its Work may pay for that.
    monkeypatch.syspath_prepend(str(STANDIN))
    elapsed, _ = testing.run(_short_wait_then_drop, 2, backend="torchcomms", timeout=60)
    assert 0.3 <= elapsed < 1.0, elapsed


def _reduce_scatter_inputs(comm: commlib.Communicator) -> list[tuple[list[float], list[float]]]:
    out = []
    for op in (commlib.ReduceOp.SUM, commlib.ReduceOp.AVG, commlib.premul_sum(2.0)):
        for async_op in (False, True):
            shard, source = torch.empty(2), torch.arange(4.0) + comm.rank
            work = comm.reduce_scatter_single(shard, source, op, async_op=async_op)
            if work is not None:
                work.wait()
            out.append((shard.tolist(), source.tolist()))
    return out


def test_reduce_scatter_single_leaves_its_input_alone(backend: str) -> None:
    # torchcomms' gloo all-reduces the input in place; commlib's API must not.
    for rank, results in enumerate(testing.run(_reduce_scatter_inputs, 2, backend=backend)):
        sums = [[1.0, 3.0], [5.0, 7.0]][rank]
        expected = [sums] * 2 + [[s / 2 for s in sums]] * 2 + [[s * 2 for s in sums]] * 2
        assert [shard for shard, _ in results] == expected
        assert all(source == [rank + i for i in (0.0, 1.0, 2.0, 3.0)] for _, source in results)


def _split_without_rank_0_then_split_all(comm: commlib.Communicator) -> tuple[bool, float]:
    one = comm.split([1], "one")
    both = comm.split([0, 1], "both", timeout=3.0)
    assert both is not None
    t = torch.ones(1)
    both.all_reduce(t)
    return one is not None, t.item()


def test_a_split_that_leaves_a_rank_out_keeps_later_splits_working(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # torchcomms' gloo does not count a split([]) of a non-member: the next split of the same
    # parent would wait for that rank under other store keys until it timed out.
    monkeypatch.syspath_prepend(str(STANDIN))
    results = testing.run(_split_without_rank_0_then_split_all, 2, backend="torchcomms", timeout=60)
    assert results == [(False, 2.0), (True, 2.0)]


def _environment_around_init(comm: commlib.Communicator) -> dict[str, object]:
    keys = ("TORCHCOMM_RANK", "TORCHCOMM_SIZE")
    after_init = [os.environ.get(k) for k in keys]
    # a value the process had before is put back, and torchcomms still got commlib's
    os.environ.update(TORCHCOMM_RANK="5", TORCHCOMM_SIZE="9")
    store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                       is_master=False)
    second = commlib.init("torchcomms", rank=comm.rank, world_size=comm.size, store=store,
                          name="second")
    return {"after_init": after_init, "after_second": [os.environ.get(k) for k in keys],
            "second": (second.rank, second.size)}


def test_rank_and_size_stay_out_of_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(STANDIN))
    for rank, out in enumerate(testing.run(_environment_around_init, 2, backend="torchcomms")):
        assert out == {"after_init": [None, None], "after_second": ["5", "9"], "second": (rank, 2)}
