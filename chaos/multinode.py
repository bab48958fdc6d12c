"""One harness per node: a multi-node job whose nodes each run their own harness, sharing one
run directory (a shared file system):

    python -m chaos run --nnodes 2 --node-rank N --rdzv-endpoint HOST:PORT --rdzv-id ID --run-dir DIR ...

on each machine by hand, or as the tasks of a ``python -m chaos sbatch`` job (`chaos.slurm.batch`).

Each harness (`run_node`) runs its node's torchrun (`chaos.harness.run_job`: the rendezvous
at the endpoint, the run directory joined rather than refused), applies the plan's external
faults to the ranks of its own node only, and journals in ``harness{N}.jsonl``; the ledger in
the run directory lets a fault fire once across nodes, restarts and requeues. Then:

- the reference (`_reference`): node 0 decides in ``reference.json`` whether the cache holds
  it; if not, every node runs its part of a fault-free job of the same shape (the same
  endpoint, rendezvous id ``<ID>-reference``) into one work directory of the cache, which node
  0 moves into place once it completed;
- node 0 waits for every node's end of this launch (`wait_for_nodes`), merges what their
  journals say into one outcome (`merged_outcome`), verifies it as a one-machine run is
  verified, from the shared logs, and writes ``report.json``. The other nodes give no verdict.

A launch is told apart by the attempt number of its first ranks (`chaos.harness.first_attempt`,
in every journal line): a requeued Slurm job launches again with the same id and directory.
A harness stopped by SIGTERM (a preemption, a notice: `JobOutcome.stopped`) returns at once,
with no reference and no verdict: the job goes on in its next launch.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from chaos.comparison import read_steps
from chaos.files import write_atomic
from chaos.harness import Job, JobOutcome, first_attempt, journal_name, run_job
from chaos.plan import Plan
from chaos.report import Report
from commlib.observe.events import read_events

DECISION = "reference.json"
PEER_WAIT_S = 120.0  # after its own job ended, how long a node waits for the others' part of it


class Stopped(Exception):
    """This node's harness was stopped by SIGTERM (a preemption, a notice): no verdict in this
    launch, the job goes on in its next one."""


def run_node(
    job: Job,
    plan: Plan,
    run_dir: Path,
    *,
    reference_root: Path | None,
    png: bool = True,
    timeout_s: float = 600.0,
    progress: Callable[[str], None] | None = None,
) -> Report | None:
    """This node's part of the job, its part of the reference, and on node 0 the verdict
    (module docstring; None on the other nodes). `reference_root` None: no reference, no
    bitwise checks. Raises Stopped when SIGTERM stopped this node's harness."""
    from chaos import verify as verifier

    assert job.rdzv_endpoint is not None and job.rdzv_id is not None, "one node of a multi-node job"
    node = job.node_rank or 0
    outcome = run_job(job, plan, run_dir, timeout_s=timeout_s, progress=progress)
    if outcome.stopped:
        raise Stopped(
            f"node {node} stopped by SIGTERM (a preemption or its notice): the job stopped after a "
            f"checkpoint and goes on in its next launch, in {run_dir}"
        )
    first = first_attempt(job, plan)
    reference = None
    if reference_root is not None:
        reference = _reference(job, reference_root, run_dir, first, node, timeout_s, progress, outcome.ok)
    if node != 0:
        return None
    merged = merged_outcome(job, run_dir, wait_for_nodes(job, run_dir, first))
    report = verifier.verify(
        job, plan, merged, reference_root=reference_root, timeout_s=timeout_s, progress=progress, reference=reference
    )
    report.write(run_dir, png=png)
    return report


def _journals(job: Job, run_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """Each node's journal (`chaos.harness.journal_name`), as far as it is written."""
    out = {}
    for node in range(job.nnodes):
        path = run_dir / journal_name(replace(job, node_rank=node))
        out[node] = list(read_events(path)) if path.exists() else []
    return out


def _ends(job: Job, run_dir: Path, first: int) -> dict[int, dict[str, Any]]:
    """node -> its harness's end of the launch whose first attempt is `first`."""
    return {
        node: end
        for node, events in _journals(job, run_dir).items()
        for end in events
        if end.get("event") == "harness.end" and end.get("first_attempt") == first
    }


def wait_for_nodes(job: Job, run_dir: Path, first: int, timeout_s: float = PEER_WAIT_S) -> dict[int, dict[str, Any]]:
    """Every node's end of this launch, once all are written (or what there is after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ends = _ends(job, run_dir, first)
        if len(ends) == job.nnodes or time.monotonic() > deadline:
            return ends
        time.sleep(0.2)


def merged_outcome(job: Job, run_dir: Path, ends: dict[int, dict[str, Any]]) -> JobOutcome:
    """The whole job's outcome, from every node's journal: launched at the first launch of its
    first node, each node's agent's exit status in this launch (None for a node whose harness
    never ended it), its first completed step, and its restarts: every attempt any rank logged
    but the first (a requeue counts, and so does a torchrun restart)."""
    journals = _journals(job, run_dir)
    launches = [e for events in journals.values() for e in events if e.get("event") == "harness.launch"]
    start_ns = min((e["ts_ns"] for e in launches), default=time.time_ns())
    codes: list[int | None] = [
        (ends[n].get("exit_codes") or [None])[0] if n in ends else None for n in range(job.nnodes)
    ]
    firsts = [
        e["first_step_ns"]
        for events in journals.values()
        for e in events
        if e.get("event") == "harness.end" and isinstance(e.get("first_step_ns"), int)
    ]
    attempts = {
        e.get("attempt")
        for path in sorted((run_dir / "logs").glob("rank*.jsonl*"))
        for e in read_events(path)
        if isinstance(e.get("attempt"), int)
    }
    return JobOutcome(
        run_dir,
        start_ns,
        time.time_ns(),
        codes,
        timed_out=any(e.get("timed_out") for e in ends.values()),
        first_step_ns=min(firsts, default=None),
        restarts=max(len(attempts) - 1, 0),
    )


def _reference(
    job: Job,
    root: Path,
    run_dir: Path,
    first: int,
    node: int,
    timeout_s: float,
    progress: Callable[[str], None] | None,
    ok: bool,
) -> Path | None:
    """This node's part of the fault-free reference of the same shape, unless the cache has it
    (module docstring). Node 0 decides, and gets the cached reference's directory (None where
    there is none: the verdict says why); `ok`: its own job completed (a failed job is verified
    without a reference)."""
    from chaos.verify import REFERENCE, locked, mark_reference, reference_key

    root = Path(root).absolute()
    if node != 0:
        decision = _wait_for_decision(run_dir / DECISION, first)
        if decision is not None and decision["run"]:
            _run_reference(job, Path(decision["work"]), timeout_s, progress)
        return None
    key = reference_key(job)
    final, work = root / key, root / f"{key}.tmp-{job.rdzv_id}-{first}"
    # Held while the nodes run it, as `chaos.verify.ensure_reference` does: another run that
    # needs the same reference waits for this one instead of computing it again.
    with locked(root / f"{key}.lock"):
        decision = {
            "first_attempt": first,
            "key": key,
            "run": ok and not (final / REFERENCE).is_file(),
            "work": str(work),
        }
        write_atomic(run_dir / DECISION, json.dumps(decision) + "\n")
        if decision["run"]:
            started = _run_reference(job, work, timeout_s, progress)
            if started is not None and read_steps(work).records:
                mark_reference(work, started)
                shutil.rmtree(final, ignore_errors=True)
                os.replace(work, final)
    return final if (final / REFERENCE).is_file() else None


def _run_reference(job: Job, work: Path, timeout_s: float, progress: Callable[[str], None] | None) -> int | None:
    """This node's part of the fault-free job of the same shape, in `work`; when it was launched
    (wall clock ns) where it completed, else None."""
    shown = None if progress is None else (lambda line: progress(f"fault-free reference: {line}"))
    reference = replace(job, rdzv_id=f"{job.rdzv_id}-reference")
    outcome = run_job(reference, Plan(), work, timeout_s=timeout_s, progress=shown, inject=False)
    return outcome.start_ns if outcome.ok else None


def _wait_for_decision(path: Path, first: int, timeout_s: float = PEER_WAIT_S) -> dict[str, Any] | None:
    """Node 0's decision for this launch; None if none came (node 0's verdict then says why)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            decision = json.loads(path.read_text())
        except (OSError, ValueError):
            decision = None
        if decision is not None and decision.get("first_attempt") == first:
            return decision
        time.sleep(0.2)
    return None
