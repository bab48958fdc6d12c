"""The doctor on an attempt that recovered in-job: the problems stay in the report, and the
attempt is `recovered` (exit 3) only when every problem came before every rank's last
recovery; one that failed again afterwards is `failed` (exit 1)."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

import commlib
from commlib.observe.blame import Kind
from commlib.observe.diagnosis import diagnose
from commlib.process_group import commlib_groups
from commlib.testing import run


def _straggle_past_the_deadline(comm: commlib.Communicator) -> None:
    """Rank 1 straggles past rank 0's 1 s deadline: rank 0 times out, rank 1 then finds the engine gone."""
    for c in (commlib.current(g) for g in commlib_groups()):
        c.set_timeout(1.0)
    try:
        if comm.rank == 1:
            time.sleep(2.0)
        dist.all_reduce(torch.ones(4))
    except commlib.CommError as exc:
        return exc
    raise AssertionError("expected the straggled all_reduce to fail")


def _recover(comm: commlib.Communicator, fail_again: bool) -> int:
    recovery = commlib.Recovery(commlib.RecoveryPolicy(join_timeout_s=20))
    epoch = recovery.recover(_straggle_past_the_deadline(comm)).epoch
    dist.all_reduce(torch.ones(4))  # the new epoch works
    if fail_again:
        _straggle_past_the_deadline(comm)  # and breaks again, with no recovery after it
    return epoch


def test_an_attempt_that_recovered_in_job_is_recovered_and_one_that_failed_again_is_failed(tmp_path: Path) -> None:
    for fail_again, status, exit_code in ((False, "recovered", 3), (True, "failed", 1)):
        logs = tmp_path / f"fail_again_{fail_again}"
        assert run(_recover, 2, timeout=90, args=(fail_again,), log_dir=logs) == [1, 1]
        d = diagnose(logs)
        [attempt] = d.attempts
        assert (attempt.status, d.exit_code) == (status, exit_code), (fail_again, attempt)
        timeouts = [p for p in attempt.problems if p.kind is Kind.TIMEOUT]
        assert timeouts and all(p.ranks == [1] for p in timeouts), attempt.problems
        assert len(timeouts) == (2 if fail_again else 1), attempt.problems
