"""Replica groups under torchft, commlib's group between them: a group lost, restarted alone,
healed from a live peer, and the whole run proven bitwise against a replay of its membership.

Two real runs (torchrun per group, torchft's lighthouse on loopback, real signals):

- HSDP, 2 groups of 2 ranks, each group on a node of its own (a network namespace): group 1's
  node is cut off past the deadline at step 4 (the survivors time out and go on alone), comes
  back (the group heals from group 0 in its own processes), and is killed in the middle of
  that heal (its torchrun restarts it, and it heals again): the proof holds;
- DDP, 3 groups of 1 rank, run by a trainer whose heal is broken on purpose: groups 1 and 2
  are stopped past the deadline, let go, and heal in their own processes, one keeping its
  stale state, one skipping its first step after the heal: the proof must fail, naming both.

The network namespaces need root: where they cannot be made the run fails saying so
(`chaos.net.NetworkUnavailable`); it never skips.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from chaos.harness import journal
from chaos.net import namespaces
from chaos.plan import Plan, parse_shorthand
from chaos.replica_plot import plot
from chaos.replica_proof import PNG, REPORT, prove, read_record
from chaos.replicas import ReplicaJob, run_replicas
from chaos.workload.checkpoint import verify

HERE = Path(__file__).parent
DEADLINE_S = 3.0
# A hang or partition held this long: past the deadline, and long enough after it for the survivors to
# commit steps alone, so that the group let go is behind them and heals (in its own processes).
HELD_S = DEADLINE_S + 2.0
TINY = ("--steps", "10", "--timeout", str(DEADLINE_S), "--min-step-s", "0.05", "--finish-together-s", "300",
        "--dim", "16", "--layers", "2", "--heads", "2", "--seq-len", "64", "--vocab", "64", "--batch-size", "1")


def _plan(*faults: str) -> Plan:
    return Plan(tuple(parse_shorthand(f) for f in faults))


def test_a_lost_hsdp_group_restarts_alone_heals_and_the_run_is_its_replay_bitwise(tmp_path, leftovers):
    # One test, not three on a shared fixture: pytest-xdist would run the job once per worker.
    run_dir = tmp_path / "hsdp"
    job = ReplicaJob(replicas=2, group_size=2, trainer_args=TINY)
    plan = _plan(f"partition:rank=2,step=4,duration_s={HELD_S}", "kill_during_checkpoint:rank=3,after_s=0")
    outcome = run_replicas(job, plan, run_dir, timeout_s=900)
    proof = prove(run_dir)
    proof.write()
    plot(proof, read_record(run_dir), run_dir / PNG)
    assert outcome.ok, outcome
    assert proof.passed, proof.summary()
    assert [c.name for c in proof.checks] == ["finished", "survivors_never_restarted", "survivors_every_step_once",
                                              "no_step_committed_twice", "in_step", "members_committed",
                                              "every_commit_applied", "replay"]
    record = read_record(run_dir)
    # Group 1 healed in its own processes once its node was back, was killed in that heal and restarted
    # (once); group 0 ran one process per rank throughout.
    attempts = {r: {s["attempt"] for s in record.starts if s["replica"] == r} for r in (0, 1)}
    assert attempts == {0: {0}, 1: {0, 1}}, attempts
    heals = {(h["attempt"], h["rank"]) for h in record.heals if h["replica"] == 1}
    assert heals == {(0, 0), (0, 1), (1, 0), (1, 1)} and all(h["replica"] == 1 for h in record.heals), heals
    # Steps the lost group was out of were committed by group 0 alone, and both took part in the last.
    assert any(members == [0] for members in proof.membership.values())
    assert proof.membership[10] == [0, 1]
    assert [f["fault"] for f in proof.faults] == ["partition", "kill_during_checkpoint"]
    # Each group ran in its node's namespace (the lighthouse in one more), under the node's address as host name.
    notes = journal(run_dir)
    [made] = [n for n in notes if n["event"] == "harness.network"]
    launches = [n for n in notes if n["event"] == "harness.launch"]
    for r, launch in enumerate(launches):
        assert launch["cmd"][:4] == ["ip", "netns", "exec", made["namespaces"][r]], launch["cmd"]
        assert made["addresses"][r] in launch["cmd"], launch["cmd"]
    assert not set(made["namespaces"]) & set(namespaces())

    # Each rank of a group has a quorum communicator of its own, and of its own name (rank k's: ".shard{k}").
    for rank in (0, 1):
        quorums = [json.loads(line) for line in (run_dir / "logs/replica0" / f"rank{rank}.jsonl").open()
                   if '"replicas.quorum"' in line]
        assert quorums and all(q["comm_name"].endswith(f".shard{rank}") for q in quorums), quorums

    # The survivors' typed errors name the lost group.
    failures = [json.loads(line) for rank in (0, 1) for line in (run_dir / "logs/replica0" / f"rank{rank}.jsonl").open()
                if '"replicas.failure"' in line]
    kinds = {(f["error_type"], tuple(f["failed_replicas"] or ())) for f in failures}
    # The partition: the survivors' exchange timed out naming group 1; the kill in the heal: a peer failure
    # naming it.
    assert ("CollectiveTimeout", (1,)) in kinds, kinds
    assert ("PeerFailure", (1,)) in kinds, kinds
    # (A survivor may have been waiting in that step's exchange before the cut: from the cut to its error is
    # at most the deadline, with some slack.)
    assert proof.faults[0]["detected_after_s"] < DEADLINE_S + 2, proof.faults
    # commlib's doctor names the lost group, its ranks, and the quorums it left and came back in; the first
    # survivor to notice the cut spent the deadline in that collective.
    lost = proof.doctor["lost"]
    assert [(g["replica"], g["ranks"], g["cause"]) for g in lost] == [(1, [2, 3], "CollectiveTimeout"),
                                                                      (1, [2, 3], "PeerFailure")], lost
    assert DEADLINE_S <= lost[0]["detected_after_s"] < DEADLINE_S + 1, lost
    assert all(g["back_in_quorum"] is not None for g in lost) and proof.doctor["exit_code"] == 3

    # commlib-doctor reads the groups' log dirs the same way, and says the run recovered (exit 3).
    doctor = subprocess.run([sys.executable, "-m", "commlib.doctor", str(run_dir / "logs")], capture_output=True,
                            text=True, timeout=120)
    assert doctor.returncode == 3, doctor.stdout + doctor.stderr
    assert doctor.stdout.count("LOST replica 1 (ranks [2, 3]) from quorum") == 2, doctor.stdout

    # The report shows the members per step; nothing is left running.
    written = json.loads((run_dir / REPORT).read_text())
    assert written["passed"] and written["membership"]["10"] == [0, 1]
    assert (run_dir / PNG).stat().st_size > 10_000
    assert leftovers(run_dir) == []
    # Every torchrun (each group's, the replay's) kept its error files in the run directory,
    # not in a /tmp directory nothing removes (`chaos.job.torchrun_errors_dir`).
    assert all((run_dir / d).is_dir() for d in ("torchrun/replica0", "torchrun/replica1", "replay/torchrun"))


def test_the_proof_fails_a_group_that_healed_stale_or_skipped_a_step(tmp_path, leftovers):
    run_dir = tmp_path / "bad"
    job = ReplicaJob(replicas=3, trainer=str(HERE / "bad_heal_trainer.py"), trainer_args=TINY)
    os.environ["BAD_HEAL"] = "1:stale,2:skip"
    try:
        outcome = run_replicas(job, _plan(f"hang:rank=1,step=3,release=cont,duration_s={HELD_S}",
                                          f"hang:rank=2,step=3,release=cont,duration_s={HELD_S}"), run_dir,
                               timeout_s=900)
    finally:
        del os.environ["BAD_HEAL"]
    assert outcome.ok, outcome
    proof = prove(run_dir)
    record = read_record(run_dir)
    assert {h["replica"] for h in record.heals} == {1, 2}  # both healed, in their own processes
    failed = {c.name for c in proof.checks if not c.passed}
    assert failed == {"in_step", "replay", "every_commit_applied"}, proof.summary()
    healed = {h["replica"]: h["to_step"] for h in record.heals}
    # The stale group is named at its heal: the state it took is not the one the groups committed.
    assert proof.check("in_step").found.startswith(f"replica 1 rank 0 healed to step {healed[1]} with a state unlike "
                                                   f"the groups' at that step;"), proof.summary()
    # The skipping group is named at its first step after the heal, and only it.
    assert proof.check("every_commit_applied").found == (f"replica 2 rank 0 committed step {healed[2] + 1} without "
                                                         f"changing its state"), proof.summary()
    # The stale group's loss is off from its first step after the heal (computed on weights it should not hold),
    # while the good group's loss stays right until a bad group's gradient has reached its weights.
    problems = proof.check("replay").found
    assert f"replica 1 rank 0: loss differs from the replay's from step {healed[1] + 1} on" in problems, problems
    good = re.search(r"replica 0 rank 0: loss differs from the replay's from step (\d+) on", problems)
    assert good is None or int(good.group(1)) > min(healed.values()) + 1, problems
    assert leftovers(run_dir) == []


def test_losing_every_up_to_date_group_rolls_back_to_the_newest_checkpoint_and_the_run_goes_on(tmp_path, leftovers):
    """Group 1's first launch dies before it is ready (it joins late), then stops past the deadline; group 0,
    the only group up to date, is killed after its checkpoint of step 5: the groups go on from that
    checkpoint, the run finishes, the proof holds through the rollback (its replay too), and the report's
    first line and the doctor say what happened."""
    run_dir = tmp_path / "rollback"
    job = ReplicaJob(replicas=2, trainer_args=TINY)
    plan = _plan("exit:rank=1,seq=1,comm=world", f"hang:rank=1,step=3,release=cont,duration_s={HELD_S + 3}",
                 "kill:rank=0,step=8")
    outcome = run_replicas(job, plan, run_dir, timeout_s=400)
    proof = prove(run_dir)
    assert outcome.ok, outcome
    assert proof.passed, proof.summary()
    assert proof.summary().splitlines()[0].endswith(
        "PASSED; the latest state was lost with group 0 at step 7; resumed from the checkpoint of step 5"
    ), proof.summary()
    [rollback] = proof.rollbacks
    assert (rollback.lost_with, rollback.checkpoint_of) == ([0], 0), rollback
    assert [s.start for s in proof.segments] == [0, 5] and max(proof.segments[0].steps) == 7, proof.segments
    assert "1 rollback(s) included" in proof.check("replay").found, proof.summary()
    record = read_record(run_dir)
    # Group 1's first launch died at its first collective, before it was ready; the restart marked it ready
    # (group 0's first launch waits for that), and the two started in one quorum.
    assert [(f["fault"], f["attempt"]) for f in record.faults if f["replica"] == 1] == [("exit", 0)], record.faults
    assert {s["attempt"] for s in record.starts if s["replica"] == 1} == {1}, record.starts
    # The checkpoint the groups went on from: group 0's, copied whole into the directory of the group that
    # took it, each one complete.
    took = [r for r in record.resumes if r["step"] == 5]
    assert took and {r["from_replica"] for r in took} == {0}, record.resumes
    for r in {r["replica"] for r in took}:
        assert verify(run_dir / "ckpt" / f"replica{r}" / "step000005") is None
    # The doctor names both losses and both groups back; never NEVER BACK.
    assert proof.doctor["exit_code"] == 3 and "NEVER BACK" not in proof.doctor_text, proof.doctor_text
    assert leftovers(run_dir) == []


@pytest.mark.parametrize("argv, expected", [
    (["--fault", "kill:rank=2,step=3"], "faults[0].rank: expected an int in [0, 2)"),
    (["--replicas", "0"], "expected ReplicaJob.replicas to be an integer in [1, 64]; found 0"),
    (["--fault", "partition:rank=1,step=3,duration_s=4", "--", "--steps", "9", "--timeout", "5"],
     "faults[0].duration_s: expected a partition either survived"),
    (["--job-timeout", "nan"], "expected --job-timeout to be a finite number"),
    (["--", "--steps", "x"], "argument --steps: expected --steps to be an integer"),
])
def test_python_m_chaos_replicas_refuses_a_bad_plan_or_job_before_anything_starts(tmp_path, capsys, argv, expected):
    from chaos.__main__ import main

    assert main(["replicas", "--run-dir", str(tmp_path / "run"), *argv]) == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
