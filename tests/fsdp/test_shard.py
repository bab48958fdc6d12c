"""fsdp_overlap.shard: exact numerics across modes, every FSDP collective through commlib, bad input.

Spawning ranks is the expensive part, so everything that runs on 2 gloo ranks shares one
job (`test_two_ranks`), and the 4-rank numerics are a second. Every mode is built
from the same seed in the same processes, so modes see identical thread counts and data.
"""

from __future__ import annotations

import inspect
import os
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

import commlib
from commlib import testing
from fsdp_overlap import _fsdp_internals
from fsdp_overlap.comms import FSDPWork
from fsdp_overlap.shard import shard

STANDIN = Path(__file__).resolve().parents[1] / "torchcomms_standin"
MODES = ["plain", "single", "dual", "native"]
TWO_RANK_STEPS = 3


# -- the reference model in every mode ------------------------------------------------------
def _train_every_mode(comm: commlib.Communicator, steps: int) -> dict:
    from chaos.workload.data import DataConfig, batch_for
    from chaos.workload.model import ModelConfig, Transformer, build_block_mask, set_deterministic

    set_deterministic()
    cfg = ModelConfig(vocab=256, dim=32, n_layers=2, n_heads=2, seq_len=64, mlp_hidden=64, loss_batch_chunk=64)
    data = DataConfig(vocab=cfg.vocab, seq_len=cfg.seq_len, batch_size=2)
    mask = build_block_mask(cfg, None, "cpu")
    calls: Counter = Counter()  # (mode, communicator, op, async_op) of every commlib collective
    current = [""]
    handle = commlib.register_pre_hook(lambda call: calls.update([(current[0], call.comm, call.op.value,
                                                                    call.async_op)]))
    results = {}
    for mode in MODES:
        current[0] = mode
        model = Transformer(cfg, seed=0)
        sharded = shard(model, comm, mode=mode, prefetch=1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, grads = [], []
        for step in range(steps):
            batch = batch_for(data, step, comm.rank)
            loss = model(batch.tokens, batch.targets, mask)
            loss.backward()
            losses.append(loss.detach().clone())
            grads = [p.grad.to_local().clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
        results[mode] = {"losses": losses, "grads": grads,
                         "params": [p.to_local().detach().clone() for p in model.parameters()],
                         "created": ([c.name for c in sharded.created], sharded.native_groups)}
    handle.remove()
    ref = results["plain"]
    return {
        "equal": {mode: {key: all(torch.equal(a, b) for a, b in zip(ref[key], r[key], strict=True))
                         for key in ("losses", "grads", "params")} for mode, r in results.items()},
        "created": {mode: r["created"] for mode, r in results.items()},
        "calls": dict(calls),
        "blocks": cfg.n_layers,
    }


def _check_every_mode(out: dict, steps: int) -> None:
    for mode in MODES:
        assert out["equal"][mode] == {"losses": True, "grads": True, "params": True}, (mode, out["equal"][mode])
    assert out["created"] == {"plain": ([], 0), "single": ([], 0), "dual": (["world.reduce_scatter"], 0),
                              "native": ([], 1)}
    calls = out["calls"]
    assert {k[2] for k in calls} == {"all_gather_single", "reduce_scatter_single"}, calls
    # Per step: all-gathers of the root (kept through backward) and of every block in forward
    # and again in backward, async where the unshard knob is set (every mode but plain); one
    # synchronous reduce-scatter per block and the root.
    all_gathers, reduce_scatters = steps * (2 * out["blocks"] + 1), steps * (out["blocks"] + 1)
    # plain and native: FSDP2's own collectives, on the commlib process group (native's
    # reduce-scatters on the second group FSDP made, a commlib group too), recorded as the
    # caller issued them: the process group completes an `async_op=False` call synchronously.
    native_group = next(k[1] for k in calls if k[0] == "native" and k[2] == "reduce_scatter_single")
    assert native_group.startswith("group"), calls
    assert calls == {
        ("plain", "world", "all_gather_single", False): all_gathers,
        ("plain", "world", "reduce_scatter_single", False): reduce_scatters,
        ("native", "world", "all_gather_single", True): all_gathers,
        ("native", native_group, "reduce_scatter_single", False): reduce_scatters,
        ("single", "world", "all_gather_single", True): all_gathers,
        ("single", "world", "reduce_scatter_single", False): reduce_scatters,
        ("dual", "world", "all_gather_single", True): all_gathers,
        ("dual", "world.reduce_scatter", "reduce_scatter_single", False): reduce_scatters,
    }


# -- a tiny model: bad input, the internal knob, the torchcomms backend ---------------------
class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 1)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x).square().mean()


def _tiny_steps(model: nn.Module, rank: int, steps: int = 2) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x).backward()
        opt.step()
        opt.zero_grad()
    return [p.to_local().detach().clone() for p in model.parameters()]


def _reject_bad_input(comm: commlib.Communicator) -> dict[str, str]:
    # Every rank gets a size-1 communicator (split is collective: every rank makes both calls).
    solo = [comm.split([r], f"solo{r}") for r in range(comm.size)][comm.rank]
    sharded = _Tiny()
    fully_shard(sharded)
    other = _Tiny()
    cases = {
        "foreign block": lambda: shard(_Tiny(), comm, blocks=[other.layers[0]]),
        "root as block": lambda: shard(other, comm, blocks=[other]),
        "single module": lambda: shard(other, comm, blocks=other.layers[0]),
        "duplicate": lambda: shard(other, comm, blocks=[other.layers[0], other.layers[0]]),
        "no layers": lambda: shard(nn.Sequential(nn.Linear(2, 2)), comm),
        "size": lambda: shard(_Tiny(), solo),
        "prefetch": lambda: shard(_Tiny(), comm, prefetch=-1),
        "prefetch bool": lambda: shard(_Tiny(), comm, prefetch=True),
        "mode": lambda: shard(_Tiny(), comm, mode="triple"),
        "already sharded": lambda: shard(sharded, comm),
        "comm": lambda: shard(_Tiny(), "world"),
        "reshard int": lambda: shard(_Tiny(), comm, reshard_after_forward=2),
    }
    errors = {}
    for name, bad in cases.items():
        try:
            bad()
            errors[name] = "accepted"
        except (TypeError, ValueError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    # No rank blocked and nothing was issued: a collective still lines up.
    t = torch.ones(1)
    comm.all_reduce(t)
    errors["seq"] = str((comm.seq, t.item()))  # splits take no sequence number
    return errors


def _check_bad_input(errors: dict[str, str], rank: int) -> None:
        accepted = [k for k, v in errors.items() if v == "accepted"]
        accepted = [k for k, v in errors.items() if v == "accepted"]
        assert not accepted, accepted
        assert errors["seq"] == "(1, 2.0)"
        assert "submodules of the model" in errors["foreign block"]
        assert "the model itself" in errors["root as block"]
        assert "distinct blocks" in errors["duplicate"]
        assert "`layers`" in errors["no layers"]
        assert "span the mesh's 2 ranks; found 1" in errors["size"]
        assert "prefetch to be an int >= 0; found -1" in errors["prefetch"]
        assert "mode in ['plain', 'single', 'dual', 'native']; found 'triple'" in errors["mode"]
        assert "not yet sharded" in errors["already sharded"] and "<root>" in errors["already sharded"]
        assert "commlib Communicator; found str" in errors["comm"]
        for name in errors.keys() - {"comm", "seq"}:
            assert f"rank {rank}:" in errors[name], (name, errors[name])


def _async_flags(comm: commlib.Communicator) -> dict:
    """(op, async_op) of FSDP's collectives, with and without the internal knob."""
    flags = {}
    for async_prefetch in (True, False):
        seen: Counter = Counter()
        handle = commlib.register_pre_hook(lambda call: seen.update([(call.op.value, call.async_op)]))
        _tiny_steps(shard(_Tiny(), comm, mode="dual", prefetch=1, async_prefetch=async_prefetch).model, comm.rank)
        handle.remove()
        flags[async_prefetch] = dict(seen)
    return flags


def _check_async_flags(flags: dict) -> None:
    # 2 steps of 3 blocks and a root: 7 all-gathers and 4 reduce-scatters a step. With the
    # knob every all-gather is asynchronous, without it none is; reduce-scatters never are.
    # This fails loudly if torch's _set_unshard_async_op stops doing what fsdp_overlap needs.
    assert flags[True] == {("all_gather_single", True): 14, ("reduce_scatter_single", False): 8}, flags
    assert flags[False] == {("all_gather_single", False): 14, ("reduce_scatter_single", False): 8}, flags


def _two_rank_job(comm: commlib.Communicator, steps: int) -> dict:
    return {"bad input": _reject_bad_input(comm), "async flags": _async_flags(comm),
            "modes": _train_every_mode(comm, steps)}


def _tiny_modes(comm: commlib.Communicator) -> dict[str, bool]:
    """Over the torchcomms engine (the stand-in), under the commlib default group."""
    assert commlib.current() is comm and comm.backend == "torchcomms:gloo"
    ref = _tiny_steps(shard(_Tiny(), comm, mode="plain").model, comm.rank)
    return {mode: all(torch.equal(a, b) for a, b in zip(ref, _tiny_steps(shard(_Tiny(), comm, mode=mode).model,
                                                                          comm.rank)))
            for mode in ("single", "dual")}


# -- tests -----------------------------------------------------------------------------------
def test_two_ranks() -> None:
    """On 2 ranks, in one job (one test, so pytest-xdist never runs the job twice): bitwise
    equal numerics of every mode on the reference model, every FSDP collective through
    commlib, bad input rejected before any collective, and the unshard knob's effect."""
    for rank, out in enumerate(testing.run(_two_rank_job, 2, timeout=420, args=(TWO_RANK_STEPS,))):
        _check_every_mode(out["modes"], TWO_RANK_STEPS)
        _check_bad_input(out["bad input"], rank)
        _check_async_flags(out["async flags"])


def test_modes_bitwise_equal_4_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every mode's losses, gradients and parameters bitwise plain FSDP2's, on 4 ranks. MKL's code
    path and thread count are fixed in the ranks' environment before torch loads (chaos's
    `REPRODUCIBLE_ENV`, which `testing.run` honours by spawning them): MKL otherwise picks them
    per call, and under load one mode's step differed from another's in its last bits."""
    from chaos.harness import REPRODUCIBLE_ENV

    for name in ("MKL_CBWR", "MKL_DYNAMIC"):
        monkeypatch.setenv(name, REPRODUCIBLE_ENV[name])
    steps = 2
    for out in testing.run(_train_every_mode, 4, timeout=600, args=(steps,)):
        _check_every_mode(out, steps)


def test_torchcomms_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(STANDIN))  # spawned ranks copy the parent's sys.path
    for equal in testing.run(_tiny_modes, 2, backend="torchcomms", timeout=120):
        assert equal == {"single": True, "dual": True}


def test_fsdp_internals_unchanged() -> None:
    """The private Comm base classes keep the shape fsdp_overlap.comms implements."""
    assert _fsdp_internals.AllGather.__abstractmethods__ == {"__call__", "allocate"}
    assert _fsdp_internals.ReduceScatter.__abstractmethods__ == {"__call__", "allocate"}
    assert list(inspect.signature(_fsdp_internals.AllGather.__call__).parameters) == \
        ["self", "output_tensor", "input_tensor", "group", "async_op"]
    assert list(inspect.signature(_fsdp_internals.ReduceScatter.__call__).parameters) == \
        ["self", "output_tensor", "input_tensor", "group", "op", "async_op"]
    assert list(inspect.signature(_fsdp_internals.AllGather.allocate).parameters) == \
        ["self", "size", "dtype", "device"]
    # FSDP waits on an async all-gather's handle only if it is a torch.distributed.Work.
    assert issubclass(FSDPWork, dist.distributed_c10d.Work)


def test_unshard_async_op_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard on the one FSDP2 internal knob (its effect is checked in test_two_ranks)."""
    assert _fsdp_internals.unshard_async_op_setter() is FSDPModule._set_unshard_async_op
    with monkeypatch.context() as m:  # a torch without the knob
        m.delattr(FSDPModule, "_set_unshard_async_op")
        with pytest.raises(_fsdp_internals.FSDPInternalsChanged, match="async_prefetch=False"):
            _fsdp_internals.unshard_async_op_setter()
