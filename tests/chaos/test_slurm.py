"""chaos on a real Slurm cluster: the local cluster in namespaces (`chaos.slurm.cluster`), one
sbatch job that is preempted, runs out of time and loses a node (real sbatch, real requeues,
real namespaces; root only), and the same one-harness-per-node form without Slurm.

The cluster (three nodes: two for the job, a spare) is brought up once for the module; where
it cannot be (not root, no packages and no apt-get), the tests fail saying why. The packages
are installed when missing. One job holds the three whole-job events in turn, each stopping
a different launch of it, so the cost of starting the job is paid once per event and once
for the verdict:

- ``preempt:step=2``: a job in the ``urgent`` partition takes the job's nodes; Slurm sends the
  ``--signal`` notice, the batch step passes it on as SIGTERM, every rank stops after step 2
  with a checkpoint of it, and the job requeues itself;
- ``time_limit:step=4``: the job's time limit is lowered; Slurm's notice comes at its next
  check, and the same stop and requeue follow, with the time limit given back;
- ``node_loss:rank=1,step=6``: the node of rank 1 loses power (links cut, every process
  SIGKILLed); Slurm declares it down, requeues the job onto the spare, and it resumes from the
  last checkpoint.
"""

import json
import os
import subprocess
import sys

import pytest

from chaos.plan import Ledger, Plan
from chaos.slurm.batch import timings
from chaos.slurm.cluster import Cluster, install_packages, sweep
from commlib.observe.log import attempt_number, read_events

NPROC = 1  # ranks per node: two nodes give the world size of the tiny reference (tests/chaos/conftest.py)
JOB_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    install_packages()
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
    env = {"TORCHELASTIC_MAX_RESTARTS": "4"}
    first = [attempt_number({**env, "TORCHELASTIC_RESTART_COUNT": str(r)}) for r in range(5)]
    requeued = [attempt_number({**env, "TORCHELASTIC_RESTART_COUNT": str(r), "SLURM_RESTART_COUNT": "1"})
                for r in range(5)]
    assert first == [0, 1, 2, 3, 4] and requeued == [5, 6, 7, 8, 9]
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


def test_preemption_time_limit_and_a_lost_node_in_one_requeued_job(cluster, tmp_path, tiny_args, reference_dir,
                                                                   leftovers):
    run_dir = tmp_path / "run"
    done = _sbatch(cluster, run_dir, ["preempt:step=2", "time_limit:step=4", "node_loss:rank=1,step=6"], tiny_args,
                   reference_dir)
    report = json.loads((run_dir / "report.json").read_text())
    assert done.returncode == 0 and report["passed"], done.stdout + done.stderr
    assert report["bitwise_verified"], report["bitwise_reason"]
    assert {"preempted_cleanly", "requeued", "lost_node_resumed", "lost_node_named", "losses_bitwise",
            "history_exact", "state_bitwise"} <= set(report["checks"])
    preempt, time_limit, lost = report["faults"]

    # Each whole-job stop: every rank stopped after the very step, checkpointed, and Slurm ran
    # the job again, which resumed from that step.
    for stop, step in ((preempt, 2), (time_limit, 4)):
        assert (stop["step"], stop["resumed_from"], stop["steps_reexecuted"]) == (step, step, 0), stop
    preempted = [e for e in read_events(run_dir / "logs" / "rank0.jsonl") if e["event"] == "train.preempted"]
    assert [e["step"] for e in preempted] == [2, 4]
    # The notice (SIGUSR1 to the batch step) came before each stop; the batch step requeued.
    batch = list(read_events(run_dir / "batch.jsonl"))
    assert [(e["requeue"], e["signal"]) for e in batch if e["event"] == "batch.notice"] == [(0, "SIGUSR1"),
                                                                                          (1, "SIGUSR1")]
    assert [e["requeue"] for e in batch if e["event"] == "batch.requeue" and e["exit"] == 0] == [0, 1]
    [lowered] = [f for f in Ledger(run_dir / "chaos_state").firings() if f.type == "time_limit"]
    assert lowered.detail["limit_min"] < (lowered.detail["limit_before_min"] or float("inf"))
    restored = [e["minutes"] for e in batch if e["event"] == "batch.time_limit_restored"]
    assert restored == [lowered.detail["limit_before_min"] or 0]  # 0: unlimited

    # The lost node: its ranks named by the doctor, the job requeued onto the spare, resumed
    # from the last checkpoint before the loss.
    assert lost["lost_ranks"] == [1] and lost["resumed_from"] == lost["last_checkpoint"] == 4, lost
    starts = [e for e in batch if e["event"] == "batch.start"]
    assert [e["requeue"] for e in starts] == [0, 1, 2, 3]
    assert lost["host"] not in _hostnames(cluster, starts[-1]["nodes"])
    assert {s.name: s.state for s in cluster.node_states()}[lost["host"]].startswith("down")

    # One attempt numbering across the launches: each requeue's torchrun counts on from where
    # the launches before it could have got (torchrun's --max-restarts + 1 each).
    per_launch = Plan.from_dict(json.loads((run_dir / "plan.json").read_text())).restarts + 1
    launches = [n * per_launch for n in range(4)]
    assert sorted({e["first_attempt"] for e in read_events(run_dir / "harness0.jsonl")
                   if e["event"] == "harness.launch"}) == launches
    logged = {e["attempt"] for r in range(2) for e in read_events(run_dir / "logs" / f"rank{r}.jsonl")}
    assert set(launches) <= logged and max(logged) < launches[-1] + per_launch, (logged, launches)
    assert [f.attempt for f in Ledger(run_dir / "chaos_state").firings()] == launches[:3]
    assert leftovers(run_dir) == []
    print("slurm timings:", json.dumps(timings(run_dir)))


def _hostnames(cluster, nodelist):
    return cluster.run(["scontrol", "show", "hostnames", nodelist]).stdout.split()


def test_one_harness_per_node_without_slurm(tmp_path, tiny_args, reference_dir, leftovers):
    """Two harnesses on this machine, one per node, one run directory: the fault fires once,
    on the node holding its rank; one verdict, bitwise."""
    from chaos.harness import free_port

    run_dir = tmp_path / "run"
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [subprocess.Popen([sys.executable, "-m", "chaos", "run", "--nnodes", "2", "--nproc-per-node", str(NPROC),
                               "--node-rank", str(n), "--rdzv-endpoint", endpoint, "--rdzv-id", "two-harnesses",
                               "--run-dir", str(run_dir), "--reference-dir", str(reference_dir), "--no-png",
                               "--fault", "sigterm:rank=1,step=3", "--", *tiny_args],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in range(2)]
    outs = [p.communicate(timeout=JOB_TIMEOUT_S)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs
    assert "node 1's part of the job is done" in outs[1] and "PASSED" in outs[0]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["passed"] and report["bitwise_verified"], outs[0]
    [fault] = report["faults"]
    assert (fault["resumed_from"], fault["steps_reexecuted"]) == (3, 0)
    # Fired once, by the harness whose node ran rank 1.
    fired = {n: [e for e in read_events(run_dir / f"harness{n}.jsonl") if e["event"] == "chaos.fault"]
             for n in range(2)}
    assert sorted(len(v) for v in fired.values()) == [0, 1], fired
    assert len(Ledger(run_dir / "chaos_state").firings()) == 1
    assert leftovers(run_dir) == []
