"""In-job recovery end to end on the reference trainer, verified bitwise against the
fault-free reference, in one grouped run of 2 ranks under torchrun:

- ``raise`` in a step (rank 1, step 3), ``corrupt`` (NaN into a collective, rank 0, step 4)
  and ``delay`` past the deadline (rank 0, step 5) leave every process alive (the raising
  rank's abort reaches its blocked peer through the store, well before the peer's
  deadline): the job recovers in-job (new communicators under the same groups, rolled back
  to the in-memory snapshot of the step before), in the same processes;
- ``kill`` (rank 1, step 7) leaves a process gone: the job recovers through torchrun's
  restart and the DCP resume.

The final comparison holds only if all four recoveries were exact.
"""

import json

import chaos
from commlib.observe.events import read_events


def test_in_job_for_live_ranks_restart_for_a_dead_one_all_bitwise(tmp_path, tiny_args, deadline_s, reference_dir,
                                                                 leftovers):
    run_dir = tmp_path / "run"
    report = chaos.run(["raise:rank=1,step=3", "corrupt:rank=0,step=4", "delay:rank=0,step=5",
                                 "kill:rank=1,step=7"], run_dir, tiny_args,
                       reference_dir=reference_dir, png=False)
    assert report.passed, report.summary()
    assert report.bitwise_verified
    assert {"job_completed", "faults_injected", "recovered", "losses_bitwise", "steps_exact",
            "state_bitwise"} <= set(report.checks)
    assert leftovers(run_dir) == []
    raised, corrupted, delayed, killed = report.faults
    assert [(f.type, f.recovery) for f in report.faults] == [("raise", "in_job"), ("corrupt", "in_job"),
                                                              ("delay", "in_job"), ("kill", "restart")], \
        report.summary()

    # In-job: same processes (no restart between the first three faults), epochs 1 to 3,
    # rolled back to the step before the fault, fast once detected.
    assert (raised.epoch, raised.resumed_from, raised.restart_after_s) == (1, 2, None)
    assert (corrupted.epoch, corrupted.resumed_from, corrupted.restart_after_s) == (2, 3, None)
    assert (delayed.epoch, delayed.resumed_from, delayed.restart_after_s) == (3, 4, None)
    assert delayed.detected_by["event"] == "collective.timeout"
    assert corrupted.detected_by["event"] == "train.failed_in_step"
    for f in (raised, corrupted, delayed):
        assert f.attempt == 0 and f.steps_reexecuted == 0
        assert f.in_job_recovery_s is not None and f.in_job_recovery_s < 2.0
    # the delayed rank itself sleeps DELAY_MARGIN_S past the deadline before it can join
    assert delayed.detection_to_step_s < 5.0
    assert raised.detection_to_step_s < 5.0
    # The raising rank announced its abort: its peer, blocked in a collective, learned of it
    # from the store instead of waiting out its deadline.
    assert raised.detected_by["event"] == "peer.failure" and raised.detected_after_s < deadline_s, raised

    # Restart: a new attempt, resumed from the checkpoint at step 6.
    assert (killed.attempt, killed.resumed_from) == (0, 6) and killed.restart_after_s is not None
    assert report.restarts == 1

    # The PIDs of attempt 0 did not change across the two in-job recoveries.
    for rank in (0, 1):
        events = list(read_events(run_dir / "logs" / f"rank{rank}.jsonl"))
        steps = [e for e in events if e.get("event") == "train.step" and e["attempt"] == 0]
        assert len({e["pid"] for e in steps}) == 1
        metrics = [e for e in events if e.get("event") == "train.metrics" and e["attempt"] == 0]
        assert [e["epoch"] for e in metrics if e["step"] in (3, 4, 5, 6)] == [1, 2, 3, 3]
        # The probe numbered the steps run again after each rollback as the optimizer counts them.
        assert [e["step"] for e in steps] == [1, 2, 3, 4, 5, 6]
        recoveries = [e for e in events if e.get("event") == "recovery.in_job"]
        assert [e["epoch"] for e in recoveries] == [1, 2, 3]
        assert all(e["pid"] == steps[0]["pid"] for e in recoveries)

    faults = {f["type"]: f for f in json.loads((run_dir / "report.json").read_text())["faults"]}
    assert [faults[k]["recovery"] for k in ("raise", "corrupt", "delay", "kill")] == \
        ["in_job", "in_job", "in_job", "restart"]
