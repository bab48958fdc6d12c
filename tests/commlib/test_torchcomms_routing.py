"""commlib's c10d backend over a process group that torch itself built on torchcomms.

With ``TORCH_DISTRIBUTED_USE_TORCHCOMMS=1`` (torch.distributed.config.use_torchcomms),
torch 2.13 builds every process group's backend as torchcomms'
``_BackendWrapper(new_comm(...))``. The stand-in provides that wrapper only when
``TORCHCOMMS_STANDIN_BACKEND_WRAPPER=1`` (see tests/torchcomms_standin/README.md), so these
tests set both variables for the spawned ranks: the pytest process imported torch long ago,
and torch decides at import time. The routed test first proves the routing happened (the
default group's CPU backend is the stand-in's wrapper and its TorchComm sees every op), so it
cannot pass through plain gloo by accident.
"""

from __future__ import annotations

import importlib
import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import commlib
from commlib import testing

# Not `from conftest import STANDIN`: spawned ranks re-import this module, and with tests/ on
# sys.path ahead of tests/commlib (as when tests/test_*.py run in the same session) `conftest`
# is tests/conftest.py there.
STANDIN = Path(__file__).resolve().parents[1] / "torchcomms_standin"
ROUTE_ENV = "TORCH_DISTRIBUTED_USE_TORCHCOMMS"
OPT_IN_ENV = "TORCHCOMMS_STANDIN_BACKEND_WRAPPER"
CPU = torch.device("cpu")
# torch 2.13 builds a routed subgroup with the parent's TorchComm.split; 2.14 with a new_comm of
# its own, so the world communicator sees no split there.
SPLITS_ON_WORLD = {"split": 2} if torch.__version__ < (2, 14) else {}


@pytest.fixture
def standin_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(STANDIN))  # spawned ranks copy the parent's sys.path
    monkeypatch.setenv(ROUTE_ENV, "1")


@pytest.fixture
def routed(standin_on_path: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(OPT_IN_ENV, "1")


def _op_counter(torch_comm: Any) -> Counter[str]:
    """Count the ops a stand-in TorchComm runs, by name."""
    seen: Counter[str] = Counter()
    torch_comm.register_pre_hook(lambda op_name, op_id, args: seen.update([op_name.name]))
    return seen


def _world_wrapper() -> tuple[str, str, Any]:
    """What torch made the default group's CPU backend: (its class, its module, its TorchComm)."""
    from torch.distributed import distributed_c10d as c10d

    assert c10d._use_torchcomms_enabled(), "torch did not enable torchcomms routing"
    backend = dist.group.WORLD._get_backend(CPU)
    return type(backend).__qualname__, type(backend).__module__, backend.get_comm()


def _ops_and_split(comm: commlib.Communicator) -> dict[str, object]:
    import torchcomms
    from torchcomms.hooks import FlightRecorderHook

    kind, module, world_tc = _world_wrapper()
    assert torchcomms._IS_TEST_STANDIN
    seen = _op_counter(world_tc)
    r, n = comm.rank, comm.size
    out: dict[str, object] = {"kind": (kind, module), "backend": comm.backend}

    t = torch.full((2,), float(r + 1))
    comm.all_reduce(t)
    out["all_reduce"] = t.tolist()
    avg = torch.full((2,), float(r + 1))
    comm.all_reduce(avg, commlib.ReduceOp.AVG, async_op=True).wait()
    out["avg"] = avg.tolist()
    b = torch.full((3,), float(r))
    comm.broadcast(b, root=1)
    out["broadcast"] = b.tolist()
    gathered = torch.empty(2 * n)
    comm.all_gather_single(gathered, torch.full((2,), float(r)), async_op=True).wait()
    out["all_gather_single"] = gathered.tolist()
    shard, rs_input = torch.empty(1), torch.arange(float(n)) + r
    comm.reduce_scatter_single(shard, rs_input, async_op=True).wait()
    out["reduce_scatter_single"] = (shard.tolist(), rs_input.tolist())
    at_root = [torch.empty(1) for _ in range(n)] if r == 0 else []
    comm.gather(at_root, torch.tensor([10.0 + r]), root=0)  # torch passes [[]] off the root
    out["gather"] = [x.item() for x in at_root]
    p2p = torch.tensor([float(r)])
    if r == 0:
        comm.send(torch.tensor([42.0]), dst=1)
    else:
        comm.recv(p2p, src=0)
    out["p2p"] = p2p.item()
    comm.barrier(async_op=True).wait()

    # Splits go through torchcomms too: new_group -> split_group -> TorchComm.split. The
    # split that leaves a rank out comes last: torch names a routed group after the number of
    # groups its process holds, which then differs between ranks (see the stand-in README).
    known = list(dist.distributed_c10d._world.comms)
    pair = comm.split([0, 1], "pair")
    (pair_tc,) = [c for c in dist.distributed_c10d._world.comms if c not in known]
    pair_seen = _op_counter(pair_tc)
    solo = comm.split([1], "solo")  # rank 0 takes torch's non-member path: split([])
    s = torch.full((1,), float(r + 1))
    pair.all_reduce(s, async_op=True).wait()
    out["split"] = {"solo_member": solo is not None, "pair_size": pair.size, "pair_sum": s.item(),
                    "pair_ops": dict(pair_seen),
                    "children": len(dist.distributed_c10d._world.comms) - len(known)}
    out["world_ops"] = dict(seen)
    # torch registered a FlightRecorderHook on each communicator; hooks share one recorder,
    # dumped in torch's flight-recorder format.
    entries = json.loads(FlightRecorderHook().dump_json())["entries"]
    out["recorded"] = dict(Counter(e["profiling_name"].removeprefix("gloo:") for e in entries
                                   if e["process_group"][0] == world_tc.get_name()))
    return out


def _rank1_stops_joining(comm: commlib.Communicator) -> dict[str, object]:
    """Run last: the timed-out world communicator is dead afterwards."""
    if comm.rank == 1:
        time.sleep(2.5)  # skips the next collective and outlives the peer's deadline
        return {}
    start = time.monotonic()
    with pytest.raises(commlib.CollectiveTimeout) as info:
        comm.all_reduce(torch.ones(2), timeout=1.0)
    error = info.value
    return {"elapsed": time.monotonic() - start, "missing": error.missing_ranks, "op": error.op,
            "message": str(error)}


def _routed_session(comm: commlib.Communicator) -> dict[str, object]:
    out = _ops_and_split(comm)
    out["deadline"] = _rank1_stops_joining(comm)
    return out


def test_c10d_backend_over_torchcomms_backed_process_group(routed: None) -> None:
    # One spawn for the whole session: ops, splits, then a deadline (rank 1 stops joining).
    r0, r1 = testing.run(_routed_session, 2, backend="gloo", timeout=120)
    assert r0["kind"] == r1["kind"] == ("_BackendWrapper", "torchcomms._comms")
    assert r0["backend"] == "gloo"  # torch still calls the group "gloo"; torchcomms runs it
    for r, out in enumerate((r0, r1)):
        assert out["all_reduce"] == [3.0, 3.0]
        assert out["avg"] == [1.5, 1.5]
        assert out["broadcast"] == [1.0, 1.0, 1.0]
        assert out["all_gather_single"] == [0.0, 0.0, 1.0, 1.0]
        # torchcomms' gloo overwrites the input; commlib hands it a copy
        assert out["reduce_scatter_single"] == ([1.0 + 2 * r], [float(r), float(r + 1)])
        assert out["p2p"] == (0.0 if r == 0 else 42.0)
        assert out["world_ops"] == {"all_reduce": 2, "broadcast": 1, "all_gather_single": 1,
                                    "reduce_scatter_single": 1, "gather": 1,
                                    "send" if r == 0 else "recv": 1, "barrier": 1, **SPLITS_ON_WORLD}
        assert out["recorded"] == out["world_ops"]
        assert out["split"] == {"solo_member": r == 1, "pair_size": 2, "pair_sum": 3.0,
                                "pair_ops": {"all_reduce": 1}, "children": 1 + r}
    assert r0["gather"] == [10.0, 11.0] and r1["gather"] == []
    deadline = r0["deadline"]
    assert 1.0 <= deadline["elapsed"] < 1.0 + 1.0, deadline
    assert (deadline["missing"], deadline["op"]) == ([1], "all_reduce")
    # send/recv are numbered per peer, not in the collective sequence: seven collectives before.
    assert ("all_reduce #8 on 'world' timed out after 1.0 s on rank 0: rank 1 never started it "
            "(last reported finishing barrier #7)") in deadline["message"]


def _unrouted_world(comm: commlib.Communicator) -> tuple[str, str, float]:
    from torch.distributed import distributed_c10d as c10d

    try:
        importlib.import_module("torchcomms._comms")
        probe = "importable"
    except ImportError as exc:
        probe = str(exc)
    t = torch.ones(1)
    comm.all_reduce(t)
    world = f"{c10d._use_torchcomms_enabled()}:{type(dist.group.WORLD._get_backend(CPU)).__name__}"
    return probe, world, t.item()


def test_without_a_backend_wrapper_torch_does_not_route(standin_on_path: None,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # The plain stand-in (no opt-in) refuses to import torchcomms._comms (its _BackendWrapper):
    # torch's import-time probe fails, so the flag is inert and c10d stays on gloo.
    monkeypatch.delenv(OPT_IN_ENV, raising=False)
    assert os.environ[ROUTE_ENV] == "1"
    ((probe, world, total),) = testing.run(_unrouted_world, 1, backend="gloo")
    assert f"only importable with {OPT_IN_ENV}=1" in probe
    assert (world, total) == ("False:ProcessGroupGloo", 1.0)
