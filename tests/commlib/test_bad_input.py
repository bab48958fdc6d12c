"""Bad input is rejected locally, before any rank blocks, with what was expected and found."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest
import torch

import commlib


def _reject_everything(comm: commlib.Communicator) -> dict[str, str]:
    """Each bad call on this rank alone: if any of them blocked, the run would time out."""
    n = comm.size
    f = torch.zeros(4)
    cases = {
        "all_gather_single size": lambda: comm.all_gather_single(torch.zeros(3 * n), torch.zeros(2)),
        "reduce_scatter_single divisible": lambda: comm.reduce_scatter_single(torch.zeros(1), torch.zeros(2 * n + 1)),
        # The right number of elements in a shape no engine takes (gloo would refuse it at launch).
        "all_gather_single shape": lambda: comm.all_gather_single(torch.zeros(6, n), torch.zeros(6)),
        "reduce_scatter_single shape": lambda: comm.reduce_scatter_single(torch.zeros(6), torch.zeros(n, 6)),
        "dtype mismatch": lambda: comm.all_gather_single(torch.zeros(2 * n, dtype=torch.int64), torch.zeros(2)),
        "non-contiguous": lambda: comm.all_reduce(torch.zeros(4, 4).t()),
        "device": lambda: comm.all_reduce(torch.zeros(4, device="meta")),
        "root range": lambda: comm.broadcast(f, n),
        "negative root": lambda: comm.reduce(f, -1),
        "dst range": lambda: comm.send(f, n + 3),
        "src self": lambda: comm.recv(f, comm.rank),
        "op dtype": lambda: comm.all_reduce(torch.zeros(4), commlib.ReduceOp.BAND),
        "avg int": lambda: comm.all_reduce(torch.zeros(4, dtype=torch.int64), commlib.ReduceOp.AVG),
        "op type": lambda: comm.all_reduce(f, "sum"),
        "timeout zero": lambda: comm.all_reduce(f, timeout=0),
        "timeout negative timedelta": lambda: comm.barrier(timeout=timedelta(seconds=-1)),
        "async_op type": lambda: comm.barrier(async_op=1),
        "list length": lambda: comm.all_gather([torch.zeros(2)] * (n + 1), torch.zeros(2)),
        "not a tensor": lambda: comm.all_reduce([1, 2]),
    }
    errors: dict[str, str] = {}
    for name, bad in cases.items():
        try:
            bad()
        except (TypeError, ValueError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
        else:
            errors[name] = "accepted"
    # Nothing above consumed a sequence number or reached the peer: this still lines up.
    t = torch.ones(2)
    comm.all_reduce(t)
    errors["seq after"] = str(comm.seq)
    errors["sum after"] = str(t.tolist())
    comm.abort()
    try:
        comm.all_reduce(t)
    except commlib.CommAborted as exc:
        errors["after abort"] = str(exc)
    return errors


def test_bad_input_rejected_locally(ranks: Callable[..., list]) -> None:
    """Each bad call is refused on its own rank, saying what it expected; no number is spent."""
    results = ranks(_reject_everything, 2, timeout=60)
    for rank, errors in enumerate(results):
        for name, message in errors.items():
            assert message != "accepted", f"rank {rank} accepted {name}"
        assert f"rank {rank}" in errors["all_gather_single size"]
        assert "expected output of shape (4,) (2 x input (2,)" in errors["all_gather_single size"]
        assert "found (6,)" in errors["all_gather_single size"]
        assert "expected input of shape (2,)" in errors["reduce_scatter_single divisible"]
        assert "expected output of shape (12,)" in errors["all_gather_single shape"]
        assert "found (6, 2)" in errors["all_gather_single shape"]
        assert "expected input of shape (12,)" in errors["reduce_scatter_single shape"]
        assert errors["dtype mismatch"].startswith("TypeError") and "torch.int64" in errors["dtype mismatch"]
        assert "contiguous" in errors["non-contiguous"]
        assert "meta" in errors["device"]
        assert "expected root in [0, 2); found 2" in errors["root range"]
        assert "found -1" in errors["negative root"]
        assert "src" in errors["src self"]
        assert "integer or bool dtype" in errors["op dtype"]
        assert "floating dtype" in errors["avg int"]
        assert "positive" in errors["timeout zero"] and "positive" in errors["timeout negative timedelta"]
        assert errors["async_op type"].startswith("TypeError")
        assert "hold 2 tensors (one per rank); found 3" in errors["list length"]
        assert errors["seq after"] == "1" and errors["sum after"] == "[2.0, 2.0]"
        assert "aborted" in errors["after abort"]


GOOD_CALLS = 50


def _bad_after_good(comm: commlib.Communicator) -> dict[str, list[str]]:
    """Each bad call once on a fresh communicator, then again after GOOD_CALLS good calls of
    the same op: the second time it meets a validation cache that holds the good signature."""
    n, f = comm.size, torch.zeros(4)
    peer = (comm.rank + 1) % n
    cases = {  # name: (a good call, a bad call like it)
        "non-contiguous": (lambda: comm.all_reduce(torch.zeros(4, 4)), lambda: comm.all_reduce(torch.zeros(4, 4).t())),
        "dtype for the op": (lambda: comm.all_reduce(torch.zeros(4, dtype=torch.int64), commlib.ReduceOp.BAND),
                             lambda: comm.all_reduce(torch.zeros(4), commlib.ReduceOp.BAND)),
        "op as a string": (lambda: comm.all_reduce(f, commlib.ReduceOp.SUM), lambda: comm.all_reduce(f, "sum")),
        "root as a bool": (lambda: comm.broadcast(f, 1), lambda: comm.broadcast(f, True)),
        "root range": (lambda: comm.broadcast(f, 0), lambda: comm.broadcast(f, n)),
        "device": (lambda: comm.all_reduce(f), lambda: comm.all_reduce(torch.zeros(4, device="meta"))),
        "gather size": (lambda: comm.all_gather_single(torch.zeros(2 * n), torch.zeros(2)),
                        lambda: comm.all_gather_single(torch.zeros(2 * n + 1), torch.zeros(2))),
        "gather dtype": (lambda: comm.all_gather_single(torch.zeros(2 * n), torch.zeros(2)),
                         lambda: comm.all_gather_single(torch.zeros(2 * n, dtype=torch.int64), torch.zeros(2))),
        "not a tensor": (lambda: comm.all_reduce(f), lambda: comm.all_reduce([1.0, 2.0])),
        "src self": (lambda: comm.recv(f, peer) if comm.rank else comm.send(f, peer),
                     lambda: comm.recv(f, comm.rank)),
    }

    def message(bad: object) -> str:
        try:
            bad()  # type: ignore[operator]
        except (TypeError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return "accepted"

    fresh = {name: message(bad) for name, (_, bad) in cases.items()}
    for good, _ in cases.values():
        for _ in range(GOOD_CALLS):
            good()
    return {name: [fresh[name], message(bad)] for name, (_, bad) in cases.items()}


def test_a_bad_call_after_many_good_ones_is_rejected_with_the_same_message(
    ranks: Callable[..., list],
) -> None:
    """A bad call after many good ones of its op meets the validation cache and is refused alike."""
    for rank, results in enumerate(ranks(_bad_after_good, 2, timeout=120)):
        for name, (fresh, after_good) in results.items():
            assert fresh != "accepted", f"rank {rank} accepted {name}"
            assert after_good == fresh, (
                f"rank {rank}, {name}: expected the message of a fresh communicator after {GOOD_CALLS} good "
                f"calls; found {after_good!r} instead of {fresh!r}")


def _finalize_then_call(comm: commlib.Communicator) -> str:
    comm.barrier()
    comm.finalize()
    with pytest.raises(commlib.CommAborted, match="finalized"):
        comm.all_reduce(torch.ones(1))
    return "ok"


def test_calls_after_finalize_raise(ranks: Callable[..., list]) -> None:
    """A call on a finalized communicator raises CommAborted."""
    assert ranks(_finalize_then_call, 2) == ["ok", "ok"]


@pytest.mark.contract
def test_init_rejects_bad_arguments() -> None:
    """commlib.init refuses an unknown backend and a deadline that is not positive."""
    with pytest.raises(ValueError, match="expected backend in"):
        commlib.init("mpi", rank=0, world_size=1)
    with pytest.raises(ValueError, match="positive"):
        commlib.init("gloo", rank=0, world_size=1, timeout=-1)
