"""chaos on a real Slurm cluster: the local cluster in namespaces (`chaos.slurm.cluster`), one
sbatch job that is preempted, runs out of time and loses a node, and whose ranks are killed
and hung on either node in between (real sbatch, real requeues, real namespaces; root only).
The same one-harness-per-node form without Slurm: tests/chaos/test_multinode.py.

The cluster (three nodes: two for the job, a spare) is brought up once for the module; where
it cannot be (not root, no packages), the tests fail saying why. The packages (munge, Slurm)
are installed before pytest starts, by the test command (scripts/test.sh runs
scripts/system_packages.sh), never by a test: another worker's test could run before it.

One job holds the three whole-job events in turn, each stopping a different launch of it, so
the cost of starting the job is paid once per event and once for the verdict:

- ``preempt:step=1``: a job in the ``urgent`` partition takes the job's nodes; Slurm sends the
  ``--signal`` notice, the batch step passes it on as SIGTERM, every rank stops after step 1
  with a checkpoint of it, and the job requeues itself;
- ``time_limit:step=4``: the job's time limit is lowered; Slurm's notice comes at its next
  check, and the same stop and requeue follow, with the time limit given back;
- ``node_loss:rank=1,step=7``: the node of rank 1 loses power (links cut, every process
  SIGKILLed); Slurm declares it down, requeues the job onto the spare, and it resumes from the
  last checkpoint.

After each of them, a restart inside the launch, begun on one node (torchrun counts it on that
node only; every rank agrees on the attempt all the same: `commlib.attempt`): rank 1 killed at
step 3, rank 0 killed at step 6, rank 1 hung at step 8 (on the spare); a step completes after
each fault before the next.
"""

import json
import os
import subprocess
import sys

import pytest

from chaos.plan import Ledger, Plan
from chaos.slurm.batch import timings
from chaos.slurm.cluster import Cluster, sweep
from commlib.attempt import attempt_number
from commlib.observe.events import read_events

NPROC = 1  # ranks per node: two nodes give the world size of the tiny reference (tests/chaos/conftest.py)
JOB_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(tmp_path_factory.mktemp("slurm"), nodes=3, owner=os.getpid()) as up:
        yield up
    assert up.leftovers() == []


def _sbatch(cluster, run_dir, faults, tiny_args, reference_dir):
    argv = [sys.executable, "-m", "chaos", "sbatch", "--nnodes", "2", "--nproc-per-node", str(NPROC),
            "--run-dir", str(run_dir), "--reference-dir", str(reference_dir), "--no-png",
            "--job-timeout", str(JOB_TIMEOUT_S)]
    for f in faults:
        argv += ["--fault", f]
    return cluster.run([*argv, "--", *tiny_args], check=False, timeout=4 * JOB_TIMEOUT_S)


def test_attempts_continue_across_requeues():
    """A launch has at most nodes x max restarts + 1 rounds (each spends a node's restart)."""
    env = {"TORCHELASTIC_MAX_RESTARTS": "2", "GROUP_WORLD_SIZE": "2"}
    first = [attempt_number({**env, "TORCHELASTIC_RESTART_COUNT": str(r)}) for r in range(3)]
    requeued = [attempt_number({**env, "TORCHELASTIC_RESTART_COUNT": str(r), "SLURM_RESTART_COUNT": "1"})
                for r in range(3)]
    assert first == [0, 1, 2] and requeued == [5, 6, 7]
    with pytest.raises(ValueError, match="SLURM_RESTART_COUNT to be an integer; found 'x'"):
        attempt_number({"SLURM_RESTART_COUNT": "x"})


def test_slurm_faults_are_refused_where_they_cannot_run(capsys):
    from chaos.__main__ import main as cli

    assert cli(["run", "--fault", "preempt:step=2", "--no-verify"]) == 2
    assert "faults[0].type: a preempt fault acts on a Slurm job" in capsys.readouterr().err
    assert cli(["sbatch", "--fault", "time_limit:step=2", "--notice", "30", "--nnodes", "2"]) == 2
    assert "expected a notice of at least 90 s (--notice)" in capsys.readouterr().err
    assert cli(["sbatch", "--fault", "node_loss:step=2", "--nnodes", "2"]) == 2
    assert "--fault node_loss:step=2.rank: missing" in capsys.readouterr().err
    assert cli(["sbatch", "--fault", "preempt:step=2,partition=7", "--nnodes", "2"]) == 2
    assert ".partition: expected partition to be a non-empty line" in capsys.readouterr().err


def test_a_crashed_owners_cluster_is_swept_and_down_leaves_nothing(tmp_path):
    owner = subprocess.Popen(["sleep", "600"])
    orphan = Cluster(tmp_path / "orphan", nodes=1, owner=owner.pid).up()
    assert [s.state for s in orphan.node_states()] == ["idle"]
    assert orphan.leftovers()  # its daemons, namespaces
    owner.kill()
    owner.wait()
    removed = sweep()
    assert any(orphan.ctl.netns in r for r in removed), removed
    assert orphan.leftovers() == []


def test_a_requeued_job_preempted_out_of_time_and_losing_a_node_with_restarts_in_between(cluster, tmp_path, tiny_args,
                                                                                         reference_dir, leftovers):
    run_dir = tmp_path / "run"
    # A completed step after each fault, before the next: each one's recovery is checked.
    done = _sbatch(cluster, run_dir, ["preempt:step=1", "kill:rank=1,step=3", "time_limit:step=4", "kill:rank=0,step=6",
                                      "node_loss:rank=1,step=7", "hang:rank=1,step=8,duration_s=15"], tiny_args,
                   reference_dir)
    report = json.loads((run_dir / "report.json").read_text())
    assert done.returncode == 0 and report["passed"], done.stdout + done.stderr
    assert report["bitwise_verified"], report["bitwise_reason"]
    assert {"preempted_cleanly", "requeued", "lost_node_resumed", "lost_node_named", "losses_bitwise",
            "steps_exact", "state_bitwise"} <= set(report["checks"])
    by_type = {}
    for f in report["faults"]:
        by_type.setdefault(f["type"], []).append(f)
    [preempt], [time_limit], [lost], kills, [hang] = (by_type[t] for t in ("preempt", "time_limit", "node_loss",
                                                                            "kill", "hang"))
    assert [(f["rank"], f["step"]) for f in kills] == [(1, 3), (0, 6)] and (hang["rank"], hang["step"]) == (1, 8)

    # Each whole-job stop: every rank stopped after the very step, checkpointed, and Slurm ran
    # the job again, which resumed from that step.
    for stop, step in ((preempt, 1), (time_limit, 4)):
        assert (stop["step"], stop["resumed_from"], stop["steps_reexecuted"]) == (step, step, 0), stop
    preempted = [e for e in read_events(run_dir / "logs" / "rank0.jsonl") if e["event"] == "train.preempted"]
    assert [e["step"] for e in preempted] == [1, 4]
    # The notice (SIGUSR1 to the batch step) came before each stop; the batch step requeued.
    batch = list(read_events(run_dir / "batch.jsonl"))
    assert [(e["requeue"], e["signal"]) for e in batch if e["event"] == "batch.notice"] == [(0, "SIGUSR1"),
                                                                                          (1, "SIGUSR1")]
    # Each stopped launch was requeued: by the driver, or by Slurm once a preemption's grace ran
    # out (a loaded machine's stop can outlast it; then the driver's own request fails, and
    # Slurm's SIGTERM says so at once: `chaos.slurm.batch.requeue_job`, `driver`).
    said = [(e["requeue"], e["event"], e["requeued"]) for e in batch if e["event"] in ("batch.requeue", "batch.sigterm")]
    assert {r for r, _, requeued in said if requeued} >= {0, 1}, said
    assert all(requeued for _, event, requeued in said if event == "batch.requeue"), said
    [lowered] = [f for f in Ledger(run_dir / "chaos_state").firings() if f.type == "time_limit"]
    assert lowered.detail["limit_min"] < (lowered.detail["limit_before_min"] or float("inf"))
    restored = [e["minutes"] for e in batch if e["event"] == "batch.time_limit_restored"]
    assert restored == [lowered.detail["limit_before_min"] or 0]  # 0: unlimited

    # The lost node: its ranks named by the doctor, the job requeued onto the spare, resumed
    # from the last checkpoint before the loss.
    assert lost["lost_ranks"] == [1] and lost["resumed_from"] == lost["last_checkpoint"] == 6, lost
    starts = [e for e in batch if e["event"] == "batch.start"]
    assert [e["requeue"] for e in starts] == [0, 1, 2, 3]
    assert lost["host"] not in _hostnames(cluster, starts[-1]["nodes"])
    assert {s.name: s.state for s in cluster.node_states()}[lost["host"]].startswith("down")

    # One attempt numbering across the launches: each requeue's torchrun counts on from where
    # the launches before it could have got (nodes x torchrun's --max-restarts + 1 each), and
    # inside a launch every rank agrees on each round, whichever node's restart began it.
    per_launch = 2 * Plan.from_dict(json.loads((run_dir / "plan.json").read_text())).restarts + 1
    launches = [n * per_launch for n in range(4)]
    assert sorted({e["first_attempt"] for e in read_events(run_dir / "harness0.jsonl")
                   if e["event"] == "harness.launch"}) == launches
    logged = [sorted({e["attempt"] for e in read_events(run_dir / "logs" / f"rank{r}.jsonl")}) for r in range(2)]
    rounds = [launches[0], *(n + r for n in launches[1:] for r in (0, 1))]  # a kill or a hang in each later launch
    assert logged[0] == logged[1] == rounds, (logged, launches)
    firings = {f.type: f.attempt for f in Ledger(run_dir / "chaos_state").firings() if f.type != "kill"}
    kill_attempts = [f.attempt for f in Ledger(run_dir / "chaos_state").firings() if f.type == "kill"]
    assert firings == {"preempt": launches[0], "time_limit": launches[1] + 1, "node_loss": launches[2] + 1,
                       "hang": launches[3]} and kill_attempts == [launches[1], launches[2]], (firings, kill_attempts)
    assert leftovers(run_dir) == []
    print("slurm timings:", json.dumps(timings(run_dir)))


def _hostnames(cluster, nodelist):
    return cluster.run(["scontrol", "show", "hostnames", nodelist]).stdout.split()
