"""What only the torchcomms backend does: finding torchcomms, and what it is handed.

The shared Communicator suite runs against both backends through the `backend` fixture;
these tests pin the choices specific to torchcomms.
"""

from __future__ import annotations

import sys
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
    import os

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
