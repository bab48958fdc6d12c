"""Verification: the fault-free reference, and the verdict of a faulted run against it.

- `ensure_reference` runs the job without faults once per configuration and caches it
  under ``{root}/{key}/`` (`reference_key`: trainer, its arguments, world size, backend,
  digest interval, torch version, the trainer's source files and every ``.py`` file of
  commlib, fsdp_overlap and chaos, so that no code change is verified against a reference
  the old code computed); concurrent callers (parallel tests) wait on a file lock instead of
  computing it twice. Its ``reference.json`` sums up what the run showed of the trainer (its
  steps, how they are counted, what it communicates over, when its last step ended).
- `check_against_reference` refuses, before the faulted run launches, a plan whose faults
  could not fire in the trainer as its fault-free run showed it: a ``step`` trigger in a
  trainer whose optimizer keeps no step count, or past its last step; an in-rank fault in a
  trainer whose collectives do not run over commlib; an ``after_s`` at or past its last step.
- `verify` gives the verdict (a `chaos.report.Report`): the job completed, every planned
  fault fired, a step completed after each, each kind of fault's own guarantee held
  (`_FAULT_CHECKS`: a torn checkpoint never loaded, a straggler named by the doctor, a
  short partition survived, ...), and the run computed what its reference did, step by step,
  bitwise. Where it did not, a second fault-free run says first whether the trainer is
  reproducible at all (``reproducible``), so that a trainer's own nondeterminism is never
  blamed on the recovery.

What it judges comes from `chaos.comparison` (the runs' step records, compared) and
`chaos.timings` (each firing's detection, restart and recovery, measured from the logs, and
the doctor's diagnosis of each attempt). The report says which evidence each check rests on.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from chaos.comparison import Comparison, Steps, compare, final_lineage, read_steps
from chaos.fault import FaultType, TriggerKind
from chaos.files import work_directory, write_json_atomic
from chaos.harness import (
    RECOVERY_ONLY_FLAGS,
    REPRODUCIBLE_ENV,
    Job,
    JobOutcome,
    check_plan,
    run_job,
    trainer_deadline,
)
from chaos.plan import PartitionOutcome, Plan, PlanError, partition_outcome
from chaos.report import FaultResult, Report
from chaos.timings import analyze, diagnose, read_logs

REFERENCE = "reference.json"  # in a completed reference's directory (`mark_reference`)
AGAIN = "again"  # in a reference's directory: the second fault-free run of it (`verify`)


class ReferenceRunError(RuntimeError):
    """The fault-free reference run itself failed: nothing can be verified against it."""


# The libraries whose code decides a run's numbers (the workload lives in chaos).
KEYED_PACKAGES = ("commlib", "fsdp_overlap", "chaos")


def reference_key(job: Job, package_roots: Sequence[Path] | None = None) -> str:
    """What determines the reference run's numbers, hashed. The launch topology is not part of it:
    the same world size must give the same numbers however it is spread over nodes; nor are
    the reference trainer's `RECOVERY_ONLY_FLAGS` (a wrong claim there fails the bitwise
    comparison of every run that shares the reference).

    `package_roots`: the package directories whose sources are hashed (default: those of
    `KEYED_PACKAGES` as imported here)."""
    roots = package_roots if package_roots is not None else package_dirs()
    args = [a for a in job.trainer_args if not (job.is_reference_trainer and a in RECOVERY_ONLY_FLAGS)]
    data = {
        "trainer": job.trainer,
        "trainer_args": args,
        "world_size": job.world_size,
        "backend": job.backend,
        "digest_every": job.digest_every,
        "torch": torch.__version__,
        "sources": _trainer_digest(job),
        "libraries": sources_digest(roots),
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def package_dirs(names: Sequence[str] = KEYED_PACKAGES) -> list[Path]:
    """The directory of each package in `names`, as this interpreter imports it."""
    dirs: list[Path] = []
    for name in names:
        spec = importlib.util.find_spec(name)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        if not locations:
            raise ReferenceRunError(
                f"reference_key: expected {name!r} to be an importable package; "
                f"found {'a module' if spec is not None else 'nothing'}"
            )
        dirs.extend(Path(loc) for loc in locations)
    return dirs


def sources_digest(roots: Sequence[Path]) -> str:
    """sha256 over every ``.py`` file under each root (recursively), named relative to the
    root's parent (``commlib/communicator.py``), so the same code in another checkout
    gives the same digest and any edit, addition, removal or rename gives another."""
    digest = hashlib.sha256()
    for root in roots:
        root = Path(root)
        for path in sorted(root.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            name = path.relative_to(root.parent).as_posix()
            data = path.read_bytes()
            digest.update(f"{name}\0{len(data)}\0".encode() + data)
    return digest.hexdigest()


def _trainer_digest(job: Job) -> str:
    """The trainer's own files (its directory's .py files), so an edited trainer is not
    compared with a stale reference."""
    if job.is_script:
        origin = Path(job.trainer)
    else:
        spec = importlib.util.find_spec(job.trainer)
        origin = Path(spec.origin) if spec is not None and spec.origin else Path(job.trainer)
    digest = hashlib.sha256()
    for path in sorted(origin.parent.glob("*.py")) if origin.exists() else []:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (created if missing) for the block: one process at a time computes a reference."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_reference(
    job: Job, root: str | os.PathLike[str], *, timeout_s: float = 600.0, progress: Callable[[str], None] | None = None
) -> Path:
    """The directory of the cached fault-free run of `job` (logs, `REFERENCE`), run if missing."""
    root = Path(root).absolute()
    key = reference_key(job)
    final = root / key
    with locked(root / f"{key}.lock"):
        if (final / REFERENCE).is_file():
            return final
        if job.rdzv_endpoint is not None:  # its nodes run it together (chaos.multinode), or it failed
            raise ReferenceRunError(
                f"the fault-free reference of this multi-node job is not in {final}: its "
                f"nodes' run of it failed (see {root}/{key}.tmp-*)"
            )
        work = work_directory(root, f"{key}.tmp-")
        fault_free_run(job, work, timeout_s=timeout_s, progress=progress, what="fault-free reference")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(work, final)
    return final


def fault_free_run(
    job: Job, run_dir: Path, *, timeout_s: float, progress: Callable[[str], None] | None, what: str
) -> JobOutcome:
    """Run `job` without faults in `run_dir` and mark it (`mark_reference`); ReferenceRunError
    where it did not complete or its ranks recorded no step."""
    shown = None if progress is None else (lambda line: progress(f"{what}: {line}"))
    outcome = run_job(job, Plan(), run_dir, timeout_s=timeout_s, progress=shown, inject=False)
    steps = read_steps(run_dir)
    if not outcome.ok or not steps.records:
        why = "timed out" if outcome.timed_out else f"agents exited {outcome.exit_codes}"
        recorded = "with" if steps.records else "without"
        raise ReferenceRunError(
            f"the {what} run {why} {recorded} an optimizer step recorded by its ranks; "
            f"see {run_dir}/torchrun0.log and {run_dir}/logs{_why_failed(run_dir)}"
        )
    mark_reference(run_dir, outcome.start_ns)
    return outcome


def mark_reference(run_dir: Path, start_ns: int) -> None:
    """`REFERENCE` in a completed fault-free run's directory: what its ranks showed of the
    trainer (`chaos.comparison.Steps`) and when its last step ended (since `start_ns`)."""
    steps = read_steps(run_dir)
    last_ns = steps.last_step_ns
    write_json_atomic(
        run_dir / REFERENCE,
        {
            "last_step": steps.last_step,
            "step_source": steps.step_source,
            "backend": steps.backend,
            "deadline_s": steps.deadline_s,
            "last_step_s": None if last_ns is None else (last_ns - start_ns) / 1e9,
        },
    )


def reference_summary(directory: Path) -> dict[str, Any]:
    """The `REFERENCE` of a completed fault-free run (`mark_reference`)."""
    summary: dict[str, Any] = json.loads((directory / REFERENCE).read_text())
    return summary


def check_against_reference(job: Job, plan: Plan, reference: Path, timeout_s: float | None = None) -> None:
    """Refuse a plan whose faults could not fire in the trainer as its fault-free run (in
    `reference`) showed it: PlanError naming the fault's field and why (module docstring)."""
    seen = reference_summary(reference)
    last_step, last_step_s = seen["last_step"], seen["last_step_s"]
    over_commlib = str(seen.get("backend") or "").startswith("commlib")
    for i, f in enumerate(plan.faults):
        kind = f.trigger.kind
        if kind is TriggerKind.STEP and seen["step_source"] != "optimizer":
            raise PlanError(
                f"faults[{i}].step",
                "expected a trainer whose optimizer keeps its own step count (Adam, AdamW and the like), "
                "from which a restarted process counts on; found one that keeps none (its fault-free run's "
                "steps were counted per process): a step trigger would count a restarted process's steps "
                "from 1 again. Use after_s or seq",
            )
        if (f.type.in_collective or kind is TriggerKind.SEQ) and not over_commlib:
            raise PlanError(
                f"faults[{i}].type",
                f"a {f.type} fault acts inside commlib's collectives; expected the trainer's default process "
                f'group on commlib\'s backend (init_process_group(backend="commlib")); found its fault-free '
                f"run on {seen.get('backend') or 'no process group'}",
            )
        if kind is TriggerKind.AFTER_S and last_step_s is not None and f.trigger.value >= last_step_s:
            raise PlanError(
                f"faults[{i}].after_s",
                f"expected a time before the trainer's last step, {last_step_s:.1f} s after its launch in its "
                f"fault-free run; found {f.trigger.value:g}, when the job would have finished",
            )
        if f.type in (FaultType.KILL_DURING_CHECKPOINT, FaultType.CORRUPT_CHECKPOINT) and not job.is_reference_trainer:
            raise PlanError(
                f"faults[{i}].type",
                f"a {f.type} fault acts at the moment a checkpoint is staged or committed, which only a "
                f"trainer that says so can show (the reference trainer's checkpointer calls "
                f"chaos.inject's on_checkpoint_staged and on_checkpoint_committed); found {job.trainer}",
            )
    check_plan(job, plan, timeout_s, steps=last_step, deadline_s=seen.get("deadline_s"))


def _why_failed(run_dir: Path) -> str:
    """What a failed run's doctor and torchrun log say, so the error stands alone (in CI the run dir is gone)."""
    attempts, _ = diagnose(run_dir)
    problems = [p["message"] for a in attempts for p in a.get("problems", [])]
    try:
        lines = [line for line in (run_dir / "torchrun0.log").read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        lines = []
    said = [f"doctor: {problems[0]}"] if problems else []
    if lines:
        said.append("torchrun0.log ends:\n    " + "\n    ".join(lines[-8:]))
    return "".join(f"\n  {s}" for s in said)


def names_rank(finding: dict[str, Any] | None, rank: int) -> bool:
    """Whether a doctor finding blames `rank`: among the culprits of its headline problem, or of
    one of its timeouts or hangs (an attempt that recovered in-job holds several faults, and the
    headline is the first of them)."""
    if not finding:
        return False
    return rank in (finding.get("culprits") or []) or any(
        p.get("kind") in ("timeout", "hang") and rank in (p.get("ranks") or []) for p in finding.get("problems", [])
    )


def names_straggler(finding: dict[str, Any] | None, rank: int) -> bool:
    """Whether a doctor finding has a straggler problem that names `rank`."""
    return finding is not None and any(
        p.get("kind") == "straggler" and rank in (p.get("ranks") or []) for p in finding.get("problems", [])
    )


@dataclass(frozen=True)
class _FaultCheck:
    """A check that holds for every fault of some kinds: `holds(fault)`; `found(fault)` says how it did not."""

    name: str
    kinds: frozenset[str]
    holds: Callable[[FaultResult], bool]
    expected: str
    found: Callable[[FaultResult], str]
    doctor: bool = False  # its verdict rests on the doctor's diagnosis

    @property
    def evidence(self) -> str:
        """What its verdict rests on, as the report says it."""
        if self.doctor:
            return "the doctor's diagnosis of the attempt each fault broke (the ranks' commlib logs)"
        return (
            "each firing's timings from the ranks' logs: the step each later attempt started from (chaos.step), "
            "the steps run again, the launches"
        )


def _survived(f: FaultResult) -> bool:
    """No typed error on any other rank, no torchrun agent acting, no in-job recovery, no restart."""
    return f.detected_after_s is None and f.recovery is None


def _timeout_deadline(f: FaultResult) -> float | None:
    """The collective deadline of the first timeout the doctor found in the fault's attempt."""
    for p in (f.diagnosis or {}).get("problems", []):
        if p.get("kind") == "timeout" and isinstance((p.get("details") or {}).get("deadline_s"), (int, float)):
            return float(p["details"]["deadline_s"])
    return None


def _short_partition_survived(f: FaultResult) -> bool:
    """A partition the job had to survive (the plan check admits only those shorter than the
    deadline with TCP's resumption, or those past it by a margin) was survived.

    Where the deadline was known (`FaultResult.expected`), that decides which kind it was.
    Otherwise (a trainer whose deadline the harness cannot read) a failure counts as the other
    kind only when it came while the node was still cut off and the partition outlasted the
    deadline of the timeout that reported it (`_timeout_deadline`): a failure after the link
    came back, or before the deadline, is the job not surviving a short partition."""
    if f.expected is not None:
        return f.expected != PartitionOutcome.SURVIVED or _survived(f)
    if _survived(f):
        return True
    lifted = f.released_after_s
    deadline = _timeout_deadline(f)
    return (
        f.detected_after_s is not None
        and (lifted is None or f.detected_after_s <= lifted)
        and deadline is not None
        and (lifted is None or lifted >= deadline)
    )


def _long_partition_named(f: FaultResult) -> bool:
    """A partition past the deadline was detected (where the deadline was known: else only the
    ones detected count), and the doctor named the cut-off rank of each detected one."""
    if f.expected == PartitionOutcome.DETECTED and f.detected_after_s is None:
        return False
    return f.detected_after_s is None or names_rank(f.diagnosis, f.rank)


def _partition_found(f: FaultResult) -> str:
    lifted = "never lifted" if f.released_after_s is None else f"lifted after {f.released_after_s:.2f} s"
    if f.detected_after_s is None:
        return f"partition of rank {f.rank}'s node at step {f.step} ({lifted}): recovered ({f.recovery}) undetected"
    by = f.detected_by or {}
    return (
        f"partition of rank {f.rank}'s node at step {f.step} ({lifted}): detected after {f.detected_after_s:.2f} s "
        f"({by.get('event')} on rank {by.get('rank')}), deadline {_timeout_deadline(f)}, recovery {f.recovery}"
    )


def _resumed_before_checkpoint(f: FaultResult) -> bool:
    return f.checkpoint_step is not None and f.resumed_from is not None and f.resumed_from < f.checkpoint_step


_FAULT_CHECKS = (
    _FaultCheck(
        "torn_checkpoint_not_loaded",
        frozenset({FaultType.KILL_DURING_CHECKPOINT.value}),
        _resumed_before_checkpoint,
        "each restart to resume from a checkpoint before the torn one",
        lambda f: f"torn {f.checkpoint_step}, resumed {f.resumed_from}",
    ),
    _FaultCheck(
        "corrupt_checkpoint_not_loaded",
        frozenset({FaultType.CORRUPT_CHECKPOINT.value}),
        _resumed_before_checkpoint,
        "each restart to resume from a checkpoint before the corrupted one",
        lambda f: f"corrupted {f.checkpoint_step}, resumed {f.resumed_from}",
    ),
    # Stopped after a checkpoint of its last step, resumed from it: no step lost or run twice.
    _FaultCheck(
        "preempted_cleanly",
        frozenset({FaultType.SIGTERM.value, FaultType.PREEMPT.value, FaultType.TIME_LIMIT.value}),
        lambda f: (
            f.resumed_from is not None and f.step is not None and f.resumed_from >= f.step and f.steps_reexecuted == 0
        ),
        "each job stopped by SIGTERM (itself, a preemption, a time-limit notice) to resume from the step "
        "it stopped after, re-executing none",
        lambda f: f"{f.type} at step {f.step}: resumed from {f.resumed_from}, {f.steps_reexecuted} step(s) re-executed",
    ),
    _FaultCheck(
        "requeued",
        frozenset({FaultType.PREEMPT.value, FaultType.TIME_LIMIT.value, FaultType.NODE_LOSS.value}),
        lambda f: f.requeued_after_s is not None,
        "Slurm to run the job again after each preempt, time_limit and node_loss",
        lambda f: f"{f.type} at step {f.step}: no launch of the job after it",
    ),
    # Whatever the node held since its last checkpoint is gone: that checkpoint, no older one.
    _FaultCheck(
        "lost_node_resumed",
        frozenset({FaultType.NODE_LOSS.value}),
        lambda f: f.resumed_from is not None and f.resumed_from == f.last_checkpoint,
        "the job to resume from the last checkpoint committed before each lost node",
        lambda f: (
            f"node {f.host} lost at step {f.step}: resumed from {f.resumed_from}, last checkpoint {f.last_checkpoint}"
        ),
    ),
    _FaultCheck(
        "lost_node_named",
        frozenset({FaultType.NODE_LOSS.value}),
        lambda f: bool(f.lost_ranks) and all(names_rank(f.diagnosis, r) for r in f.lost_ranks or []),
        "the doctor to name every rank of each lost node",
        lambda f: (
            f"node {f.host} (ranks {f.lost_ranks}) lost at step {f.step}: the doctor's findings of "
            f"attempt {f.attempt} name {(f.diagnosis or {}).get('culprits')}"
        ),
        doctor=True,
    ),
    # The failed save left the older state the one to go on from (snapshot or checkpoint).
    _FaultCheck(
        "disk_full_rolled_back",
        frozenset({FaultType.DISK_FULL.value}),
        lambda f: f.resumed_from is not None and f.step is not None and f.resumed_from < f.step,
        "the job to go on from the state before the failed save",
        lambda f: f"disk full at step {f.step}: resumed from {f.resumed_from}",
    ),
    _FaultCheck(
        "straggler_named",
        frozenset({FaultType.STRAGGLER.value}),
        lambda f: names_straggler(f.diagnosis, f.rank),
        "the doctor to name the straggler rank",
        lambda f: f"straggler rank {f.rank} (attempt {f.attempt}) unnamed",
        doctor=True,
    ),
    _FaultCheck(
        "diagnosis_names_faulted_rank",
        frozenset({FaultType.HANG.value, FaultType.DELAY.value, FaultType.GIL.value}),
        lambda f: names_rank(f.diagnosis, f.rank),
        "the doctor to name the faulted rank",
        lambda f: f"{f.type} rank {f.rank} (attempt {f.attempt}) unnamed",
        doctor=True,
    ),
    # Latency and loss under the deadline: TCP retransmits, every collective completes in time.
    _FaultCheck(
        "net_fault_survived",
        frozenset({FaultType.NET_DELAY.value, FaultType.NET_LOSS.value}),
        _survived,
        "the job to ride out each net_delay and net_loss with no error, recovery or restart",
        lambda f: (
            f"{f.type} of rank {f.rank}'s node at step {f.step}: detected after {f.detected_after_s} s "
            f"by {f.detected_by}, recovery {f.recovery}"
        ),
    ),
    _FaultCheck(
        "short_partition_survived",
        frozenset({FaultType.PARTITION.value}),
        _short_partition_survived,
        "each partition shorter than the deadline survived with no error, recovery or restart (a failure "
        "only while the node was cut off, past the deadline)",
        _partition_found,
        doctor=True,
    ),
    # Past the deadline: the side that timed out names the cut-off rank.
    _FaultCheck(
        "long_partition_named",
        frozenset({FaultType.PARTITION.value}),
        _long_partition_named,
        "each partition past the deadline detected, and the doctor to name the cut-off rank of each "
        "partition the job detected",
        _partition_found,
        doctor=True,
    ),
)


def verify(
    job: Job,
    plan: Plan,
    outcome: JobOutcome,
    *,
    reference_root: str | os.PathLike[str] | None,
    timeout_s: float = 600.0,
    progress: Callable[[str], None] | None = None,
    reference: Path | ReferenceRunError | None = None,
) -> Report:
    """Every check of a finished run, as a `Report` (not yet written to disk).

    `reference_root` None skips the reference (and so the bitwise checks). `reference`: the
    cached reference already chosen (`chaos.run` ran it first; a multi-node job's nodes ran or
    found it: `chaos.multinode`), or why it could not be run.
    """
    run_dir = outcome.run_dir
    logs = read_logs(run_dir)
    faults, timeline = analyze(run_dir, outcome, logs)
    attempts, diagnosis_error = diagnose(run_dir, logs)
    by_attempt = {a.get("attempt"): a for a in attempts}
    mine = read_steps(run_dir)
    deadline_s = trainer_deadline(job) or mine.deadline_s
    for f in faults:
        f.diagnosis = by_attempt.get(f.attempt)
        duration_s = plan.faults[f.index].duration_s
        if f.type == FaultType.PARTITION.value and deadline_s is not None and duration_s is not None:
            f.expected = partition_outcome(duration_s, deadline_s)

    checks: dict[str, bool] = {"job_completed": outcome.ok}
    evidence = {"job_completed": "the exit status of every torchrun agent"}
    problems: list[str] = []
    if not outcome.ok:
        why = (
            "timed out"
            if outcome.timed_out
            else "was interrupted"
            if outcome.interrupted
            else f"agents exited with {outcome.exit_codes}"
        )
        problems.append(
            f"job_completed: expected every torchrun agent to exit 0; the job {why} (see {run_dir}/torchrun0.log)"
        )
    fired = {f.index for f in faults}
    unfired = [
        f"faults[{i}] {flt.describe()}"
        for i, flt in enumerate(plan.faults)
        if i not in fired and flt.trigger.kind is not TriggerKind.P
    ]
    if plan.faults:
        checks["faults_injected"] = not unfired
        evidence["faults_injected"] = "the firings claimed in the run's ledger (chaos_state)"
        if unfired:
            problems.append(f"faults_injected: expected every planned fault to fire; never fired: {unfired}")
    if faults:
        stuck = [f for f in faults if f.first_step_after_s is None]
        for f in faults:
            f.verdicts["recovered"] = f.first_step_after_s is not None
        checks["recovered"] = not stuck
        evidence["recovered"] = "a train.step record (an optimizer step) after each firing"
        if stuck:
            problems.append(
                "recovered: expected a completed step after every fault; none after "
                + ", ".join(f"{f.type} rank {f.rank} at t={f.injected_at:.1f} s" for f in stuck)
            )
    doctor_note = f"; {diagnosis_error}" if diagnosis_error else ""
    for check in _FAULT_CHECKS:
        chosen = [f for f in faults if f.type in check.kinds]
        if not chosen:
            continue
        for f in chosen:
            f.verdicts[check.name] = check.holds(f)
        failing = [f for f in chosen if not f.verdicts[check.name]]
        checks[check.name] = not failing
        evidence[check.name] = check.evidence
        if failing:
            problems.append(
                f"{check.name}: expected {check.expected}; found "
                + ", ".join(check.found(f) for f in failing)
                + (doctor_note if check.doctor else "")
            )

    reference_dir: Path | None = None
    reference_losses: list[float] = []
    reason = None
    if not mine.records:
        reason = (
            "the job did not finish, and its ranks recorded no optimizer step"
            if not outcome.ok
            else "the trainer ran no optimizer step that chaos could see (torch.optim's step hooks): "
            "there is nothing to compare"
        )
    elif reference_root is None:
        reason = "no reference run was asked for"
    else:
        try:
            if isinstance(reference, ReferenceRunError):
                raise reference
            reference_dir = reference or ensure_reference(job, reference_root, timeout_s=timeout_s, progress=progress)
        except ReferenceRunError as exc:
            reason = str(exc)
            checks["reference_run"] = False
            problems.append(f"reference_run: {exc}")
        else:
            theirs = read_steps(reference_dir)
            reference_losses = _losses(theirs)
            placed = mine.step_source == "optimizer" or outcome.restarts == 0
            comparison = compare(mine, theirs, placed=placed)
            again = None if comparison.equal else _reproducible(job, reference_dir, theirs, timeout_s, progress)
            if again is not None:
                checks["reproducible"] = again.equal
                evidence["reproducible"] = "a second fault-free run of the same job, compared with the first"
                if not again.equal:
                    problems.append(
                        "reproducible: expected two fault-free runs of the trainer to compute the same steps "
                        f"bitwise; found {again.first_difference or '; '.join(again.problems)}: the differences "
                        "below may be the trainer's own, not the recovery's"
                    )
            checks.update(comparison.checks)
            problems += comparison.problems
            evidence.update(_comparison_evidence(mine, job, placed))

    notes = []
    if outcome.restarts > len(faults):
        notes.append(
            f"{outcome.restarts - len(faults)} restart(s) beyond the {len(faults)} injected fault(s): "
            f"attempts that failed on their own (see {run_dir}/torchrun*.log)"
        )
    return Report(
        passed=all(checks.values()),
        checks=checks,
        bitwise_verified=reason is None,
        run_dir=str(run_dir),
        faults=faults,
        bitwise_reason=reason,
        problems=problems,
        notes=notes,
        evidence=evidence,
        attempts=attempts,
        diagnosis_error=diagnosis_error,
        reference_dir=str(reference_dir) if reference_dir else None,
        job=job.to_dict(),
        backend=mine.backend,
        step_source=mine.step_source,
        reproducibility=_reproducibility(),
        plan=plan.to_dict(),
        exit_codes=outcome.exit_codes,
        timed_out=outcome.timed_out,
        duration_s=(outcome.end_ns - outcome.start_ns) / 1e9,
        cold_start_s=outcome.cold_start_s,
        steps_done=max((t["step"] for t in timeline), default=0),
        restarts=outcome.restarts,
        timeline=timeline,
        reference_losses=reference_losses,
    )


def _reproducible(
    job: Job, reference: Path, steps: Steps, timeout_s: float, progress: Callable[[str], None] | None
) -> Comparison | None:
    """A second fault-free run of `job` against its reference (`steps`, in `reference`): cached
    beside it (`AGAIN`), since whether a configuration is reproducible is the configuration's.
    None for a multi-node job, whose every node would have to run it."""
    if job.rdzv_endpoint is not None:
        return None
    again = reference / AGAIN
    with locked(reference.parent / f"{reference.name}.lock"):
        if not (again / REFERENCE).is_file():
            # Run in a directory of its own, published once complete, as `ensure_reference` does:
            # a failed run stays where its error says, not deleted by the next caller's retry.
            work = work_directory(reference, f"{AGAIN}.tmp-")
            try:
                fault_free_run(job, work, timeout_s=timeout_s, progress=progress, what="second fault-free run")
            except ReferenceRunError as exc:
                return Comparison({"reproducible": False}, [str(exc)])
            shutil.rmtree(again, ignore_errors=True)
            os.replace(work, again)
    return compare(read_steps(again), steps)


def _losses(steps: Steps) -> list[float]:
    """The reference's loss per step as the timeline shows the faulted run's: its lowest rank's."""
    if not steps.records:
        return []
    lineage = final_lineage(steps.records[min(steps.records)])
    return [float.fromhex(r.losses[-1]) if r.losses else float("nan") for r in lineage]


def _comparison_evidence(steps: Steps, job: Job, placed: bool) -> dict[str, str]:
    counted = (
        "numbered by the optimizer's own step count (state['step'], restored with it on resume)"
        if steps.step_source == "optimizer"
        else "numbered by each process's count of its optimizer steps"
    )
    ranks = len({rank for rank, _ in steps.records})
    every = "every step" if job.digest_every == 1 else f"every {job.digest_every} steps"
    if not placed:
        return {
            "state_bitwise": f"sha256 of each rank's parameters and optimizer state after its last step, on {ranks} "
            f"rank(s); the steps of a restarted process ({counted}) cannot be placed, so no step is compared"
        }
    return {
        "steps_exact": f"the train.step record each of {ranks} rank(s) logged after every optimizer step, {counted}: "
        "the final lineage is the steps the last state descends from",
        "losses_bitwise": "every scalar a backward ran from in each step (torch.autograd.backward), as float.hex",
        "steps_bitwise": "sha256 of the data each step drew (its outermost modules' inputs) and, "
        f"{every}, of the parameters and optimizer state after it (each rank's local shards)",
        "state_bitwise": "sha256 of each rank's parameters and optimizer state after the last step it digested",
    }


def _reproducibility() -> dict[str, str]:
    """How the ranks were made to compute the same bits in every run
    (`chaos.harness.REPRODUCIBLE_ENV`,
    `chaos.entry`), as the report records it."""
    return {
        **{name: os.environ.get(name, value) for name, value in REPRODUCIBLE_ENV.items()},
        "deterministic_algorithms": "torch.use_deterministic_algorithms(True, warn_only=True) in every rank",
    }
