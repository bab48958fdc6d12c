"""Faults large jobs see that no collective deadline catches, on the reference trainer
(2 ranks, in-job recovery on):

- ``straggler``: rank 1 sleeps before every collective from step 2 on. The job finishes,
  bitwise equal to the fault-free run, and the doctor names rank 1 with the lag it caused;
- ``corrupt_checkpoint``: rank 0 flips bytes in the checkpoint of step 4 just after its
  commit, then dies. The restarted job refuses that checkpoint (its hash) and loads step 2;
- ``sigterm``: rank 0 gets a preemption notice at step 6. Every rank stops after that step
  with a checkpoint of it and exits 5; the restarted job resumes from it, re-running nothing.

One run holds all three (a straggler stays slow across restarts); the final bitwise
comparison holds only if the older checkpoint was the one loaded and no step was lost.

- ``disk_full``: the checkpoint directory (a small tmpfs the harness mounts: this needs root,
  and fails here otherwise) fills up at step 4, whose save fails on every rank; the job rolls
  back in-job, the space comes back, the save is redone, bitwise;
- ``gil``: rank 1 sleeps in C holding the GIL past the deadline. Rank 0 times out naming it
  with a stale heartbeat, sends it SIGUSR2, and its faulthandler (no GIL needed) writes its
  stack, which the doctor shows; then the job recovers in-job, bitwise.
"""

from chaos.plan import Ledger
from commlib.observe.events import read_events

STRAGGLER_MS = 40


def test_straggler_corrupted_checkpoint_and_preemption(passing_run):
    report, run_dir = passing_run([f"straggler:rank=1,ms={STRAGGLER_MS},step=2", "corrupt_checkpoint:step=4",
                                   "sigterm:rank=0,step=6"],
                                  {"straggler_named", "corrupt_checkpoint_not_loaded", "preempted_cleanly",
                                   "losses_bitwise", "steps_exact", "state_bitwise"})
    slow, corrupted, preempted = report.faults
    assert report.restarts == 2

    # The straggler: no failure, named by the doctor with the lag it caused.
    [finding] = [p for p in slow.diagnosis["problems"] if p["kind"] == "straggler"]
    assert finding["ranks"] == [1]
    # Of the straggle's order (a wait near 0 without it); the waiting rank's own step, slowed by
    # the full suite's load, takes a share of it (31.7 ms of 40 seen once).
    assert finding["details"]["waited_p50_s"] >= 0.5 * STRAGGLER_MS / 1000, finding
    assert "rank 1 is a straggler" in finding["message"]

    # The corrupted checkpoint: refused by its hash on resume; the one before it loaded.
    assert (corrupted.rank, corrupted.checkpoint_step, corrupted.resumed_from) == (0, 4, 2)
    assert corrupted.recovery == "restart"
    [firing] = [f for f in Ledger(run_dir / "chaos_state").firings() if f.type == "corrupt_checkpoint"]
    events = list(read_events(run_dir / "logs" / "rank0.jsonl"))
    [skipped] = [e for e in events if e["event"] == "ckpt.skipped"]
    assert skipped["step"] == 4 and "expected sha256" in skipped["reason"], skipped
    assert "step000004" in firing.detail["file"], firing.detail

    # The preemption: every rank stopped after step 6 (checkpointed), the job resumed from it.
    assert (preempted.recovery, preempted.resumed_from, preempted.steps_reexecuted) == ("restart", 6, 0)
    for rank in (0, 1):
        stops = [e for e in read_events(run_dir / "logs" / f"rank{rank}.jsonl") if e["event"] == "train.preempted"]
        assert [(e["step"], e["ranks"], e["checkpointed"]) for e in stops] == [(6, [0], True)], stops


def test_a_rank_stuck_holding_the_gil_is_named_with_its_stack(passing_run, deadline_s):
    report, run_dir = passing_run(["gil:rank=1,step=3"], {"diagnosis_names_faulted_rank"})
    assert report.checks["diagnosis_names_faulted_rank"]
    [stuck] = report.faults
    assert (stuck.recovery, stuck.detected_by["event"], stuck.detected_by["rank"]) == ("in_job", "collective.timeout", 0)
    assert deadline_s - 0.5 < stuck.detected_after_s < deadline_s + 5.0
    [timeout] = [p for p in stuck.diagnosis["problems"] if p["kind"] == "timeout"]
    assert timeout["ranks"] == [1], timeout
    # Alive but stuck: its heartbeat (a Python thread) stopped with the GIL held.
    rank0 = list(read_events(run_dir / "logs" / "rank0.jsonl"))
    [error] = [e for e in rank0 if e["event"] == "collective.timeout"]
    assert error["stale_ranks"] == [1] and "no heartbeat" in error["error"], error
    assert [e["ranks"] for e in rank0 if e["event"] == "comm.asked_for_stacks"] == [[1]]
    # Where: the innermost frame faulthandler wrote, shown by the doctor.
    [where] = [p for p in stuck.diagnosis["positions"] if p["rank"] == 1]
    assert where["stack"] and "in _hold_gil" in where["stack"][-1], where
    assert "called from File" in timeout["message"] and "_hold_gil" in timeout["message"]


def test_a_full_disk_fails_the_save_cleanly_and_the_job_goes_on(passing_run):
    report, run_dir = passing_run(["disk_full:step=4"], {"disk_full_rolled_back"})
    assert report.checks["disk_full_rolled_back"]
    [full] = report.faults
    assert (full.recovery, full.resumed_from) == ("in_job", 3), full
    events = [e for r in (0, 1) for e in read_events(run_dir / "logs" / f"rank{r}.jsonl")]
    failed = [e for e in events if e["event"] == "train.failed_in_step" and e["step"] == 4]
    assert failed and any("No space left on device" in e["error"] or "CheckpointException" in e["error_type"]
                          for e in failed), failed
    ends = [e["step"] for e in events if e["event"] == "ckpt.end" and e["rank"] == 0]
    assert ends.count(4) == 1, ends  # redone once the space came back
