"""A multi-node job whose restarts begin on one node: every rank of every node agrees on its
attempt (`commlib.attempt`), so the job recovers.

torchrun advances a node's restart count only when that node's own worker failed; the other
nodes start their workers again for the new rendezvous round without counting one. So:

- plain torchrun, two agents on loopback (``--nnodes 2``), with `commlib.init` and with torch's
  own ``init_process_group(backend="commlib")``: in the first round rank 1 fails while rank 0
  is busy (tests/chaos/restart_probe.py), and only rank 1's node counts a restart. The second
  round completes, its two ranks on one attempt with their nodes' restart counts 0 and 1;
- two harnesses as two nodes (``python -m chaos run --nnodes 2 --node-rank N --rdzv-endpoint``,
  one run directory, one rank per node): rank 1 killed (only rank 1's node counts that
  restart), then rank 1 hung (stopped: rank 0 times out, and only rank 0's node counts that
  restart; rank 1's agent starts its rank again for the new round), so a restart begins on
  each node. The job recovers by restart each time and passes bitwise; each fault fired once;
  the logs, the ledger and the doctor see one attempt per round, the same on both ranks. (A
  kill of rank 0 across two harnesses is the Slurm test's.)
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from chaos.harness import RUN_DIR_ENV, free_port
from chaos.plan import Ledger
from commlib.observe.events import read_events

PROBE = str(Path(__file__).with_name("restart_probe.py"))
NPROC = 1  # ranks per node: two nodes give the world size of the tiny reference (tests/chaos/conftest.py)
# A bound on each harness's job, never waited out by a run that passes. The faulted run is four
# attempts, each starting two ranks that compile FlexAttention: 35-75 s an attempt with the
# suite's four workers on two cores, so 300 s was cut short at the fourth attempt's start.
JOB_TIMEOUT_S = 600


def _torchrun(out: Path, *args: str) -> list[subprocess.Popen]:
    """Two torchrun agents, nodes of one job on loopback, running the probe with `args`; every
    process of the job carries `out` as its CHAOS_RUN_DIR (what `leftovers` looks for)."""
    endpoint = f"127.0.0.1:{free_port()}"
    agents = []
    for n in range(2):
        with open(out / f"agent{n}.log", "wb") as log:
            agents.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                 "--max-restarts", "1", "--monitor-interval", "0.1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                 endpoint, "--rdzv-id", out.name, "--rdzv-conf", f"is_host={'true' if n == 0 else 'false'}",
                 "--local-addr", "127.0.0.1", "--log-dir", str(out / f"torchrun{n}"), PROBE, *args, "--out", str(out)],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, RUN_DIR_ENV: str(out.absolute())}))
    return agents


def test_plain_torchrun_restarts_begun_on_one_node_with_commlib_init_and_the_commlib_backend(tmp_path, leftovers):
    jobs = {}
    for init in ("commlib", "torch"):  # both jobs at once: the cost of one
        (tmp_path / init).mkdir()
        jobs[init] = _torchrun(tmp_path / init, "--init", init)
    try:
        for init, agents in jobs.items():
            out = tmp_path / init
            codes = [a.wait(timeout=JOB_TIMEOUT_S) for a in agents]
            said = "\n".join((out / f"agent{n}.log").read_text()[-3000:] for n in range(2))
            rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
            second = sorted((r["rank"], r["restart_count"], r["attempt"], r["sum"]) for r in rounds if not r["first"])
            assert codes == [0, 0] and second == [(0, 0, 1, 3.0), (1, 1, 1, 3.0)], (init, codes, rounds, said)
            assert leftovers(out) == []
    finally:
        for init in jobs:
            for pid, _ in leftovers(tmp_path / init):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def test_two_harnesses_recover_from_restarts_begun_on_either_node(tmp_path, tiny_args, reference_dir, leftovers):
    """Two harnesses on this machine, one per node, one run directory: each fault fires once;
    one verdict, bitwise."""
    run_dir = tmp_path / "run"
    endpoint = f"127.0.0.1:{free_port()}"
    faults = ["kill:rank=1,step=3", "hang:rank=1,step=5,duration_s=15"]
    nodes = [subprocess.Popen([sys.executable, "-m", "chaos", "run", "--nnodes", "2", "--nproc-per-node", str(NPROC),
                               "--node-rank", str(n), "--rdzv-endpoint", endpoint, "--rdzv-id", "two-harnesses",
                               "--run-dir", str(run_dir), "--reference-dir", str(reference_dir), "--no-png",
                               "--job-timeout", str(JOB_TIMEOUT_S), *[a for f in faults for a in ("--fault", f)],
                               "--", *tiny_args],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in range(2)]
    # Each harness bounds its faulted run and its part of the reference by --job-timeout.
    outs = [p.communicate(timeout=2 * JOB_TIMEOUT_S + 60)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs
    assert "node 1's part of the job is done" in outs[1] and "PASSED" in outs[0]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["passed"] and report["bitwise_verified"], outs[0]
    assert [(f["type"], f["rank"]) for f in report["faults"]] == [("kill", 1), ("hang", 1)]

    # Fired once each (by the harness of the node that ran the rank then: the rendezvous, not
    # --node-rank, places the ranks, round by round).
    fired = [e["index"] for n in range(2) for e in read_events(run_dir / f"harness{n}.jsonl")
             if e["event"] == "chaos.fault"]
    assert sorted(fired) == [0, 1], fired
    # One attempt per round, the same on both ranks; a fault's attempt is its round's.
    attempts = {r: sorted({e["attempt"] for e in read_events(run_dir / "logs" / f"rank{r}.jsonl")}) for r in range(2)}
    assert attempts[0] == attempts[1] == [0, 1, 2], attempts
    assert [f.attempt for f in Ledger(run_dir / "chaos_state").firings()] == [0, 1]
    assert [a["attempt"] for a in report["attempts"]] == [0, 1, 2]
    assert leftovers(run_dir) == []
