"""Faults that fail nothing by themselves, on the reference trainer (2 ranks, in-job recovery on):

- ``straggler``: rank 1 sleeps before every collective from step 2 on. The job finishes,
  bitwise equal to the fault-free run, and the doctor names rank 1 with the lag it caused;
- ``corrupt_checkpoint``: rank 0 flips bytes in the checkpoint of step 4 just after its
  commit, then dies. The restarted job refuses that checkpoint (its hash) and loads step 2.

One run holds both (a straggler stays slow across the restart); the final bitwise
comparison holds only if the older checkpoint was the one loaded.
"""

import chaos
from chaos.plan import Ledger
from commlib.observe.log import read_events

STRAGGLER_MS = 40


def test_a_straggler_is_named_and_a_corrupted_checkpoint_is_refused(tmp_path, tiny_args, reference_dir, leftovers):
    run_dir = tmp_path / "run"
    report = chaos.run([f"straggler:rank=1,ms={STRAGGLER_MS},step=2", "corrupt_checkpoint:step=4"], run_dir,
                       tiny_args, reference_dir=reference_dir, png=False)
    assert report.passed, report.summary()
    assert report.bitwise_verified
    assert {"straggler_named", "corrupt_checkpoint_not_loaded", "losses_bitwise", "state_bitwise"} <= \
        set(report.checks)
    assert leftovers(run_dir) == []
    slow, corrupted = report.faults

    # The straggler: no failure, named by the doctor with the lag it caused.
    [finding] = [p for p in slow.diagnosis["problems"] if p["kind"] == "straggler"]
    assert finding["ranks"] == [1]
    assert finding["details"]["waited_p50_s"] >= 0.8 * STRAGGLER_MS / 1000, finding
    assert "rank 1 is a straggler" in finding["message"]

    # The corrupted checkpoint: refused by its hash on resume; the one before it loaded.
    assert (corrupted.rank, corrupted.checkpoint_step, corrupted.resumed_from) == (0, 4, 2)
    assert corrupted.recovery == "restart"
    [firing] = [f for f in Ledger(run_dir / "chaos_state").firings() if f.type == "corrupt_checkpoint"]
    events = list(read_events(run_dir / "logs" / "rank0.jsonl"))
    [skipped] = [e for e in events if e["event"] == "ckpt.skipped"]
    assert skipped["step"] == 4 and "expected sha256" in skipped["reason"], skipped
    assert "step000004" in firing.detail["file"], firing.detail
