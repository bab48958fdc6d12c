"""In-job recovery (commlib.recovery) on real processes over gloo: the group objects stay,
the engines under them are new, collectives work again, and every bound holds."""

import os
import time

import pytest
import torch
import torch.distributed as dist

import commlib
from commlib.process_group import commlib_groups
from commlib.testing import run


def _fail_one_collective(comm, straggle_s: float) -> BaseException | None:
    """Rank 1 straggles past rank 0's 1 s deadline: rank 0 times out, rank 1 then finds the engine gone."""
    for c in (commlib.current(g) for g in commlib_groups()):
        c.set_timeout(1.0)
    try:
        if comm.rank == 1:
            time.sleep(straggle_s)
        dist.all_reduce(torch.ones(4))
    except commlib.CommError as exc:
        return exc
    return None


def _recover_after_timeout(comm):
    sub = dist.new_group([0, 1])
    world = dist.group.WORLD
    old = (commlib.current(), commlib.current(sub))
    pid = os.getpid()
    error = _fail_one_collective(comm, 2.0)
    recovery = commlib.Recovery(commlib.RecoveryPolicy(join_timeout_s=20))
    done = recovery.recover(error)
    t = torch.full((4,), float(comm.rank + 1))
    dist.all_reduce(t)  # torch.distributed's own path, through the very same group object
    s = torch.full((2,), float(comm.rank + 1))
    dist.all_reduce(s, group=sub)
    new = (commlib.current(), commlib.current(sub))
    return {"error": type(error).__name__ if error else None, "epoch": done.epoch, "groups": done.groups,
            "same_groups": dist.group.WORLD is world and commlib_groups()[0] is world,
            "new_comms": old[0] is not new[0] and old[1] is not new[1], "old_dead": old[0]._dead is not None,
            "sum": t.tolist(), "sub": s.tolist(), "pid_same": os.getpid() == pid, "total_s": done.total_s,
            "seq": new[0].seq}


def test_recover_after_a_timeout_keeps_the_groups_and_rebuilds_the_engines():
    results = run(_recover_after_timeout, world_size=2, timeout=90)
    for r in results:
        assert r["error"] is not None  # both ranks saw the failure
        assert (r["epoch"], r["groups"]) == (1, 2)
        assert r["same_groups"] and r["new_comms"] and r["old_dead"] and r["pid_same"]
        assert r["sum"] == [3.0] * 4 and r["sub"] == [3.0] * 2
        assert r["total_s"] < 20


def _recover_twice_then_limit(comm):
    recovery = commlib.Recovery(commlib.RecoveryPolicy(join_timeout_s=20, max_recoveries=2))
    epochs = [recovery.recover(RuntimeError(f"test failure {i}")).epoch for i in range(2)]
    t = torch.ones(1)
    dist.all_reduce(t)
    try:
        recovery.recover(RuntimeError("one too many"))
    except commlib.RecoveryFailed as exc:
        return epochs, t.item(), exc.reason, str(exc)
    return epochs, t.item(), None, None


def test_repeated_recoveries_stop_at_the_limit_with_a_clear_error():
    for epochs, total, reason, message in run(_recover_twice_then_limit, world_size=2, timeout=90):
        assert epochs == [1, 2] and total == 2.0
        assert reason == "limit"
        assert "expected at most 2 in-job recoveries" in message


def _one_rank_never_joins(comm):
    if comm.rank == 1:
        time.sleep(6.0)  # alive, but does not join within rank 0's join deadline
        return None
    start = time.monotonic()
    try:
        commlib.Recovery(commlib.RecoveryPolicy(join_timeout_s=2.0)).recover(RuntimeError("test"))
    except commlib.RecoveryFailed as exc:
        return exc.reason, exc.missing_ranks, time.monotonic() - start, str(exc)
    return None


def test_a_rank_that_does_not_join_in_time_fails_the_recovery_in_bounds():
    reason, missing, waited, message = run(_one_rank_never_joins, world_size=2, timeout=90)[0]
    assert (reason, missing) == ("join_timeout", [1])
    assert 2.0 <= waited < 6.0
    assert "ranks [1] did not" in message


def test_policy_is_validated():
    with pytest.raises(ValueError, match="join_timeout_s > 0"):
        commlib.RecoveryPolicy(join_timeout_s=0)
    with pytest.raises(ValueError, match="max_recoveries"):
        commlib.RecoveryPolicy(max_recoveries=-1)
