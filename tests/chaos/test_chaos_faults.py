"""Every fault type end to end on the reference trainer through torchrun restarts
(`--no-in-job-recovery`), verified bitwise against the fault-free reference: on 2 ranks,
grouped by how the job finds out (a process dies; a collective times out; the rank itself errs).

Elsewhere, so that the suite pays for each launch once: a kill on either of two nodes and a
hang across nodes (tests/chaos/test_multinode.py, tests/chaos/test_slurm.py); survivors of 3
and 4 ranks naming the one rank that is gone (tests/commlib/test_who_is_named.py).

A group's faults fire one after the other, each at a step after a checkpoint, so every
one of them costs the job a restart and a resume; the final bitwise comparison holds
only if every one of those recoveries was exact. Each firing is checked on its own too.
"""

import chaos
from chaos.plan import Ledger
from commlib.observe.events import read_events


def _run(tmp_path, faults, tiny_args, reference_dir, leftovers, **kwargs):
    # The restart path on purpose: in-job recovery (the trainer's default for faults that leave
    # every process alive) has its own tests in test_in_job_recovery.py.
    run_dir = tmp_path / "run"
    report = chaos.run(faults, run_dir, (*tiny_args, "--no-in-job-recovery"), reference_dir=reference_dir,
                       **kwargs)
    assert report.passed, report.summary()
    assert report.bitwise_verified
    assert {"job_completed", "faults_injected", "recovered", "losses_bitwise", "steps_exact",
            "state_bitwise"} <= set(report.checks)
    assert leftovers(run_dir) == []
    for f in report.faults:
        assert f.detected_after_s is not None and f.first_step_after_s is not None, f
        assert f.restart_after_s is not None and f.resumed_from is not None, f
    return report, run_dir


def test_process_deaths_recover_bitwise(tmp_path, tiny_args, reference_dir, leftovers):
    report, run_dir = _run(tmp_path, ["kill:rank=1,step=3", "segfault:rank=0,step=5", "exit:rank=1,step=7,code=7"],
                           tiny_args, reference_dir, leftovers)
    assert [(f.type, f.rank, f.resumed_from) for f in report.faults] == \
        [("kill", 1, 2), ("segfault", 0, 4), ("exit", 1, 6)]
    kill = report.faults[0]
    assert kill.detected_after_s < 1.0
    assert (run_dir / "report.png").stat().st_size > 10_000


def test_timeouts_name_the_faulted_rank_and_recover_bitwise(tmp_path, tiny_args, deadline_s, reference_dir,
                                                            leftovers):
    # The second delay holds one of DCP's own collectives (the trainer's save at step 4 runs
    # torch.distributed through commlib's backend): its deadline and typed error hold there too.
    report, run_dir = _run(tmp_path, ["hang:rank=1,step=3", "delay:rank=1,step=4,phase=checkpoint",
                                      "delay:rank=0,step=6,op=all_gather_single"], tiny_args,
                           reference_dir, leftovers, png=False)
    assert [(f.type, f.rank) for f in report.faults] == [("hang", 1), ("delay", 1), ("delay", 0)]
    assert report.checks["diagnosis_names_faulted_rank"]
    for f in report.faults:
        assert f.rank in f.diagnosis["culprits"]
        assert f.detected_by["event"] == "collective.timeout"
        assert deadline_s - 0.5 < f.detected_after_s < deadline_s + 5.0
    hang, in_checkpoint, _ = report.faults
    assert hang.released_after_s >= hang.detected_after_s  # held until a survivor reported it
    assert (in_checkpoint.resumed_from, in_checkpoint.detected_by["rank"]) == (2, 0)
    [firing] = [f for f in Ledger(run_dir / "chaos_state").firings() if f.index == 1]
    assert firing.detail["phase"] == "checkpoint"
    # The survivor left through the trainer's typed-error exit, not as a bare engine error.
    [error] = [e for e in read_events(run_dir / "logs" / "rank0.jsonl")
               if e.get("event") == "train.error" and e["attempt"] == firing.attempt]
    assert (error["exit_code"], error["error_type"], error["missing_ranks"]) == (3, "CollectiveTimeout", [1]), error


def test_in_rank_errors_recover_bitwise(tmp_path, tiny_args, reference_dir, leftovers):
    report, _ = _run(tmp_path, ["raise:rank=1,step=3", "corrupt:rank=0,step=5",
                                "kill_during_checkpoint:rank=1,step=6"], tiny_args, reference_dir, leftovers,
                     png=False)
    raised, corrupt, torn = report.faults
    assert (raised.type, raised.resumed_from) == ("raise", 2)
    assert (corrupt.type, corrupt.detected_by["error_type"], corrupt.resumed_from) == ("corrupt", "NonFiniteError", 4)
    assert report.checks["torn_checkpoint_not_loaded"]
    assert (torn.type, torn.checkpoint_step, torn.resumed_from) == ("kill_during_checkpoint", 6, 4)
