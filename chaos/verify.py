"""Verification: the fault-free reference, the bitwise comparison, and recovery timings.

- `ensure_reference` runs the job without faults once per configuration and caches it
  under ``{root}/{key}/`` (`reference_key`: trainer, its arguments, world size, backend,
  torch version, the trainer's source files and every ``.py`` file of commlib,
  fsdp_overlap and chaos, so that no code change is verified against a reference the old
  code computed); concurrent callers (parallel tests) wait on a file lock instead of
  computing it twice.
- `compare` holds a faulted run's results file against the reference's: every step's
  loss bitwise equal (compared as ``float.hex``), every step exactly once in the final
  history (same steps in the same order as the reference, none missing, none doubled),
  final model and optimizer state digests equal.
- `analyze` measures each firing from the ranks' logs (commlib's log model, `read_logs`:
  read once, for these timings and the doctor's diagnosis), the harness's journal, the
  torchrun agents' logs and the ledger, all on the wall clock of this machine: detection
  (fault to the first typed error on a survivor -- for ``corrupt`` on any rank, since the
  corrupted rank itself only finds out through the finite check -- or to the torchrun
  agent acting on the failed worker, whichever comes first), restart (fault to the first
  line of a process started after it), first completed step after the fault, the
  checkpoint step resumed from, and the steps executed again; how the job recovered
  (``recovery``: "restart" when processes started after the fault, "in_job" when the same
  processes logged ``recovery.in_job``, so one attempt may hold several faults); and
  attaches the doctor's diagnosis of the attempt the fault broke.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from chaos.harness import RECOVERY_ONLY_FLAGS, TYPED_ERRORS, Job, JobOutcome, journal, run_job, trainer_deadline
from chaos.plan import FaultType, Ledger, PartitionOutcome, Plan, TriggerKind, partition_outcome
from chaos.report import FaultResult, Report
from chaos.results import read_results
from commlib.observe.model import LogDirError, RunLogs, load

RESULTS = "results.json"


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
    data = {"trainer": job.trainer, "trainer_args": args, "world_size": job.world_size,
            "backend": job.backend, "torch": torch.__version__, "sources": _trainer_digest(job),
            "libraries": sources_digest(roots)}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def package_dirs(names: Sequence[str] = KEYED_PACKAGES) -> list[Path]:
    """The directory of each package in `names`, as this interpreter imports it."""
    dirs = []
    for name in names:
        spec = importlib.util.find_spec(name)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        if not locations:
            raise ReferenceRunError(f"reference_key: expected {name!r} to be an importable package; "
                                    f"found {'a module' if spec is not None else 'nothing'}")
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


def ensure_reference(job: Job, root: str | os.PathLike[str], *, timeout_s: float = 600.0,
                     progress: Callable[[str], None] | None = None) -> Path:
    """The directory of the cached fault-free run of `job` (with its results file), run if missing."""
    root = Path(root).absolute()
    key = reference_key(job)
    final = root / key
    with locked(root / f"{key}.lock"):
        if (final / RESULTS).is_file():
            return final
        work = root / f"{key}.tmp-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        if job.rdzv_endpoint is not None:  # its nodes run it together (chaos.multinode), or it failed
            raise ReferenceRunError(f"the fault-free reference of this multi-node job is not in {final}: its "
                                    f"nodes' run of it failed (see {root}/{key}.tmp-*)")
        shown = None if progress is None else (lambda line: progress(f"fault-free reference: {line}"))
        outcome = run_job(job, Plan(), work, timeout_s=timeout_s, progress=shown, inject=False)
        if not outcome.ok or not (work / RESULTS).is_file():
            why = "timed out" if outcome.timed_out else f"agents exited {outcome.exit_codes}"
            results = "with" if (work / RESULTS).is_file() else "without"
            raise ReferenceRunError(f"the fault-free reference run {why} {results} a results file; "
                                 f"see {work}/torchrun0.log and {work}/logs{_why_failed(work)}")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(work, final)
    return final


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


@dataclass
class Comparison:
    checks: dict[str, bool] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        """Whether the two runs are the same run: every check ran held, and none found a problem."""
        return bool(self.checks) and all(self.checks.values()) and not self.problems


def compare(faulted: dict[str, Any], reference: dict[str, Any]) -> Comparison:
    """Bitwise comparison of two results files (as `chaos.results.read_results` returns them)."""
    out = Comparison()
    got = [x.hex() for x in faulted["losses"]]
    want = [x.hex() for x in reference["losses"]]
    differing = [i for i in range(min(len(got), len(want))) if got[i] != want[i]]
    out.checks["losses_bitwise"] = len(got) == len(want) and not differing
    if len(got) != len(want):
        out.problems.append(f"losses: expected {len(want)} steps as in the reference; found {len(got)}")
    if differing:
        i = differing[0]
        out.problems.append(f"losses: {len(differing)} step(s) differ from the reference, first at index {i}: "
                            f"expected {float.fromhex(want[i])!r}; found {float.fromhex(got[i])!r}")

    want_steps = _history_steps(reference) or list(range(1, int(reference["steps"]) + 1))
    got_steps = _history_steps(faulted)
    if got_steps is None and _history_steps(reference) is not None:
        out.checks["history_exact"] = False
        out.problems.append("history: expected a history of the steps applied, as the reference has; found none")
    elif got_steps is not None:
        out.checks["history_exact"] = got_steps == want_steps
        if got_steps != want_steps:
            doubled = sorted({s for s in got_steps if got_steps.count(s) > 1})
            missing = sorted(set(want_steps) - set(got_steps))
            expected = f"steps {want_steps[0]}..{want_steps[-1]}" if want_steps else "no steps"
            out.problems.append(f"history: expected {expected} once each, in order; found doubled {doubled}, "
                                f"missing {missing}" + ("" if doubled or missing else f", order {got_steps}"))

    got_digest, want_digest = faulted["state_digest"], reference["state_digest"]
    out.checks["state_bitwise"] = got_digest["total"] == want_digest["total"]
    if not out.checks["state_bitwise"]:
        names = sorted(k for k in want_digest["tensors"].keys() | got_digest["tensors"].keys()
                       if want_digest["tensors"].get(k) != got_digest["tensors"].get(k))
        out.problems.append(f"state: expected the reference's final model and optimizer state; "
                            f"{len(names)} tensor(s) differ: {names[:5]}")
    return out


def _history_steps(results: dict[str, Any]) -> list[int] | None:
    history = results.get("history")
    if not isinstance(history, list):
        return None
    return [int(h["step"]) for h in history]


# torchrun's agent logs (glog style, local time) the moment it acts on a failed worker.
_AGENT_LINE = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6}) +\d+ [^\]]*\] "
                         r"(?:failed \(exitcode: (-?\d+)\) local_rank: (\d+)|Sending process (\d+) closing signal)")


def agent_detections(run_dir: Path, year: int) -> list[tuple[int, int, str]]:
    """(wall clock ns, node, line) of every line where a torchrun agent reacted to a failed worker.

    A survivor busy computing when a peer dies may be stopped by the agent before it
    reaches a collective that would fail, so the agent's reaction counts as detection too.
    """
    out = []
    for path in sorted(run_dir.glob("torchrun*.log")):
        node = int(path.stem.removeprefix("torchrun") or 0)
        for line in path.read_text(errors="replace").splitlines():
            m = _AGENT_LINE.match(line)
            if m:
                month, day, hh, mm, ss, us = (int(x) for x in m.groups()[:6])
                when = datetime.datetime(year, month, day, hh, mm, ss, us).timestamp()
                out.append((int(when * 1e9), node, line.split("] ", 1)[1][:200]))
    return sorted(out)


def read_logs(run_dir: str | os.PathLike[str]) -> RunLogs | None:
    """The ranks' logs of a run as commlib's log model, read once for the timings and the
    doctor alike; None when no rank logged."""
    try:
        return load(Path(run_dir) / "logs")
    except LogDirError:
        return None


def analyze(run_dir: str | os.PathLike[str], outcome: JobOutcome,
            logs: RunLogs | None) -> tuple[list[FaultResult], list[dict[str, Any]]]:
    """Every firing of the run with its recovery timings, and the step timeline of the run
    (one entry per completed step execution on the lowest rank: t, step, loss, attempt).
    `logs`: the run's `read_logs`."""
    run_dir = Path(run_dir)
    events = logs.events() if logs is not None else []
    procs = _first_events(events)
    steps = [e for e in events if e.get("event") == "train.step"]
    lowest = min((int(e["rank"]) for e in steps), default=0)
    lead = [e for e in steps if e.get("rank") == lowest]
    notes = journal(run_dir)
    releases = {(n["index"], n["target_pid"]): n for n in notes if n.get("event") == "chaos.release"}
    launches = [n["ts_ns"] for n in notes if n.get("event") == "harness.launch"]
    checkpoints = [e for e in events if e.get("event") == "ckpt.end"]
    in_job = [e for e in events if e.get("event") == "recovery.in_job"]
    rollbacks = [e for e in events if e.get("event") == "train.rolled_back"]
    recovery_starts = [e for e in events if e.get("event") == "recovery.start"]
    fallbacks = [e for e in events if e.get("event") == "train.recovery_fallback"]
    start = outcome.start_ns
    agents = agent_detections(run_dir, datetime.datetime.fromtimestamp(start / 1e9).year)

    results = []
    firings = Ledger(run_dir / "chaos_state").firings()
    for k, f in enumerate(firings):
        # The processes of the attempt this fault caused: started after it, before the next fault.
        until = firings[k + 1].ts_ns if k + 1 < len(firings) else float("inf")
        new = {p for p, first_ns in procs.items() if f.ts_ns < first_ns < until}
        old = {p for p, first_ns in procs.items() if first_ns < f.ts_ns}
        pid, host = f.detail.get("pid"), f.detail.get("host")
        r = FaultResult(type=f.type, index=f.index, firing=f.n, rank=f.rank, step=f.step, attempt=f.attempt,
                        pid=pid, node=f.detail.get("node"), injected_at=(f.ts_ns - start) / 1e9,
                        injected_ts_ns=f.ts_ns)
        if f.type in (FaultType.KILL_DURING_CHECKPOINT.value, FaultType.CORRUPT_CHECKPOINT.value):
            r.checkpoint_step = f.detail.get("checkpoint_step")
        if FaultType(f.type).slurm:
            r.host = host
            relaunch = min((ts for ts in launches if ts > f.ts_ns), default=None)
            r.requeued_after_s = None if relaunch is None else (relaunch - f.ts_ns) / 1e9
        if f.type == FaultType.NODE_LOSS.value:
            r.lost_ranks = sorted({int(e["rank"]) for e in events if e.get("host") == host
                                   and e.get("attempt") == f.attempt and isinstance(e.get("rank"), int)})
            r.last_checkpoint = max((int(e["step"]) for e in checkpoints if e["ts_ns"] < f.ts_ns), default=0)
        release = releases.get((f.index, pid))
        end_ns = f.ts_ns
        if release is not None:
            r.released_after_s = (release["ts_ns"] - f.ts_ns) / 1e9
            end_ns = release["ts_ns"]
        # A detection is the latest earlier fault's: one nobody noticed (a survived partition, a
        # straggler) must not take a later fault's. Faults fired at one step of one attempt share it.
        detect_until = next((g.ts_ns for g in firings[k + 1:]
                             if g.step is None or (g.attempt, g.step) != (f.attempt, f.step)), float("inf"))
        survivors_only = f.type != FaultType.CORRUPT.value
        detection = next((e for e in events if e.get("event") in TYPED_ERRORS and f.ts_ns <= e["ts_ns"] < detect_until
                          and procs[_who(e)] < f.ts_ns
                          and not (survivors_only and e["pid"] == pid and host in (None, e.get("host")))),
                         None)
        agent = next((a for a in agents if f.ts_ns <= a[0] < detect_until), None)
        if detection is not None and (agent is None or detection["ts_ns"] <= agent[0]):
            r.detected_after_s = (detection["ts_ns"] - f.ts_ns) / 1e9
            r.detected_by = {"rank": detection.get("rank"), "event": detection.get("event"),
                             "error_type": detection.get("error_type")}
        elif agent is not None:
            r.detected_after_s = (agent[0] - f.ts_ns) / 1e9
            r.detected_by = {"node": agent[1], "event": "torchrun.agent", "line": agent[2]}
        recovered = next((e for e in in_job if f.ts_ns <= e["ts_ns"] < until and _who(e) in old), None)
        fallback = next((e for e in fallbacks if f.ts_ns <= e["ts_ns"] < until), None)
        if new:
            r.recovery = "restart"
            r.restart_after_s = (min(procs[p] for p in new) - f.ts_ns) / 1e9
            after = [e for e in lead if _who(e) in new]
            resume = next((e for e in events if _who(e) in new and e.get("event") == "ckpt.resume"), None)
            r.resumed_from = int(resume["step"]) if resume is not None else (0 if after else None)
            r.fallback_reason = fallback.get("reason") if fallback is not None else None
            again = {int(e["step"]) for e in lead if _who(e) in new}
        else:
            after = [e for e in lead if e["ts_ns"] > end_ns]
            if recovered is not None:
                r.recovery, r.epoch = "in_job", int(recovered["epoch"])
                backs = [e for e in rollbacks if e.get("epoch") == r.epoch and _who(e) in old
                         and f.ts_ns <= e["ts_ns"] < until]
                starts = [e for e in recovery_starts if e.get("epoch") == r.epoch and _who(e) in old
                          and f.ts_ns <= e["ts_ns"] < until]
                if backs:
                    # From the last rank entering recovery (once every rank knows) to the last one rolled back.
                    if starts:
                        r.in_job_recovery_s = (max(e["ts_ns"] for e in backs) - max(e["ts_ns"] for e in starts)) / 1e9
                    r.resumed_from = int(backs[0]["restored_step"])
            again = {int(e["step"]) for e in lead if f.ts_ns < e["ts_ns"] < until}
        if after:
            r.first_step_after_s = (after[0]["ts_ns"] - f.ts_ns) / 1e9
            if r.detected_after_s is not None:
                r.detection_to_step_s = r.first_step_after_s - r.detected_after_s
        # Steps completed before the fault that ran again after it (successor attempt or rollback).
        done = {int(e["step"]) for e in lead if _who(e) in old and e["ts_ns"] < f.ts_ns}
        r.steps_reexecuted = len(again & done)
        results.append(r)

    timeline = [{"t": (e["ts_ns"] - start) / 1e9, "step": int(e["step"]), "loss": e.get("loss"),
                 "attempt": int(e.get("attempt", 0)), "epoch": int(e.get("epoch", 0))} for e in lead]
    return results, timeline


def _who(event: dict[str, Any]) -> tuple[Any, Any]:
    """The process that logged `event`: (host, pid), since nodes in PID namespaces of their own
    (the local Slurm cluster's, containers) reuse pids."""
    return event.get("host"), event.get("pid")


def _first_events(events: list[dict[str, Any]]) -> dict[tuple[Any, Any], int]:
    """Every process that logged (`_who`), with the wall clock of its first event."""
    first: dict[tuple[Any, Any], int] = {}
    for e in events:  # in time order
        first.setdefault(_who(e), e["ts_ns"])
    return first


def diagnose(run_dir: str | os.PathLike[str],
             logs: RunLogs | None = None) -> tuple[list[dict[str, Any]], str | None]:
    """The doctor's findings per attempt, as dicts (from `logs` when they were read already); or
    an empty list and why there are none."""
    try:
        from commlib.observe.doctor import analyze as doctor_analyze
    except ImportError as exc:
        return [], f"the doctor (commlib.observe.doctor) is not available: {exc}"
    try:
        found = doctor_analyze(logs if logs is not None else load(Path(run_dir) / "logs")).to_dict()
    except Exception as exc:  # a report without a diagnosis beats no report
        return [], f"the doctor failed on {run_dir}/logs: {type(exc).__name__}: {exc}"
    return list(found.get("attempts", [])), None


def names_rank(finding: dict[str, Any] | None, rank: int) -> bool:
    """Whether a doctor finding blames `rank`: among the culprits of its headline problem, or of
    one of its timeouts or hangs (an attempt that recovered in-job holds several faults, and the
    headline is the first of them)."""
    if not finding:
        return False
    return rank in (finding.get("culprits") or []) or any(
        p.get("kind") in ("timeout", "hang") and rank in (p.get("ranks") or []) for p in finding.get("problems", []))


def names_straggler(finding: dict[str, Any] | None, rank: int) -> bool:
    """Whether a doctor finding has a straggler problem that names `rank`."""
    return bool(finding) and any(p.get("kind") == "straggler" and rank in (p.get("ranks") or [])
                                 for p in finding.get("problems", []))


def load_results(directory: Path) -> dict[str, Any] | None:
    path = directory / RESULTS
    return read_results(path) if path.is_file() else None


@dataclass(frozen=True)
class _FaultCheck:
    """A check that holds for every fault of some kinds: `holds(fault)`; `found(fault)` says how it did not."""

    name: str
    kinds: frozenset[str]
    holds: Callable[[FaultResult], bool]
    expected: str
    found: Callable[[FaultResult], str]
    doctor: bool = False  # its verdict rests on the doctor's diagnosis


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
    return (f.detected_after_s is not None and (lifted is None or f.detected_after_s <= lifted)
            and deadline is not None and (lifted is None or lifted >= deadline))


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
    return (f"partition of rank {f.rank}'s node at step {f.step} ({lifted}): detected after {f.detected_after_s:.2f} s "
            f"({by.get('event')} on rank {by.get('rank')}), deadline {_timeout_deadline(f)}, recovery {f.recovery}")


def _resumed_before_checkpoint(f: FaultResult) -> bool:
    return f.checkpoint_step is not None and f.resumed_from is not None and f.resumed_from < f.checkpoint_step


_FAULT_CHECKS = (
    _FaultCheck("torn_checkpoint_not_loaded", frozenset({FaultType.KILL_DURING_CHECKPOINT.value}),
                _resumed_before_checkpoint, "each restart to resume from a checkpoint before the torn one",
                lambda f: f"torn {f.checkpoint_step}, resumed {f.resumed_from}"),
    _FaultCheck("corrupt_checkpoint_not_loaded", frozenset({FaultType.CORRUPT_CHECKPOINT.value}),
                _resumed_before_checkpoint, "each restart to resume from a checkpoint before the corrupted one",
                lambda f: f"corrupted {f.checkpoint_step}, resumed {f.resumed_from}"),
    # Stopped after a checkpoint of its last step, resumed from it: no step lost or run twice.
    _FaultCheck("preempted_cleanly",
                frozenset({FaultType.SIGTERM.value, FaultType.PREEMPT.value, FaultType.TIME_LIMIT.value}),
                lambda f: f.resumed_from is not None and f.step is not None and f.resumed_from >= f.step
                and f.steps_reexecuted == 0,
                "each job stopped by SIGTERM (itself, a preemption, a time-limit notice) to resume from the step "
                "it stopped after, re-executing none",
                lambda f: f"{f.type} at step {f.step}: resumed from {f.resumed_from}, "
                          f"{f.steps_reexecuted} step(s) re-executed"),
    _FaultCheck("requeued", frozenset({FaultType.PREEMPT.value, FaultType.TIME_LIMIT.value, FaultType.NODE_LOSS.value}),
                lambda f: f.requeued_after_s is not None,
                "Slurm to run the job again after each preempt, time_limit and node_loss",
                lambda f: f"{f.type} at step {f.step}: no launch of the job after it"),
    # Whatever the node held since its last checkpoint is gone: that checkpoint, no older one.
    _FaultCheck("lost_node_resumed", frozenset({FaultType.NODE_LOSS.value}),
                lambda f: f.resumed_from is not None and f.resumed_from == f.last_checkpoint,
                "the job to resume from the last checkpoint committed before each lost node",
                lambda f: f"node {f.host} lost at step {f.step}: resumed from {f.resumed_from}, last checkpoint "
                          f"{f.last_checkpoint}"),
    _FaultCheck("lost_node_named", frozenset({FaultType.NODE_LOSS.value}),
                lambda f: bool(f.lost_ranks) and all(names_rank(f.diagnosis, r) for r in f.lost_ranks or []),
                "the doctor to name every rank of each lost node",
                lambda f: f"node {f.host} (ranks {f.lost_ranks}) lost at step {f.step}: the doctor's findings of "
                          f"attempt {f.attempt} name {(f.diagnosis or {}).get('culprits')}", doctor=True),
    # The failed save left the older state the one to go on from (snapshot or checkpoint).
    _FaultCheck("disk_full_rolled_back", frozenset({FaultType.DISK_FULL.value}),
                lambda f: f.resumed_from is not None and f.step is not None and f.resumed_from < f.step,
                "the job to go on from the state before the failed save",
                lambda f: f"disk full at step {f.step}: resumed from {f.resumed_from}"),
    _FaultCheck("straggler_named", frozenset({FaultType.STRAGGLER.value}),
                lambda f: names_straggler(f.diagnosis, f.rank), "the doctor to name the straggler rank",
                lambda f: f"straggler rank {f.rank} (attempt {f.attempt}) unnamed", doctor=True),
    _FaultCheck("diagnosis_names_faulted_rank",
                frozenset({FaultType.HANG.value, FaultType.DELAY.value, FaultType.GIL.value}),
                lambda f: names_rank(f.diagnosis, f.rank), "the doctor to name the faulted rank",
                lambda f: f"{f.type} rank {f.rank} (attempt {f.attempt}) unnamed", doctor=True),
    # Latency and loss under the deadline: TCP retransmits, every collective completes in time.
    _FaultCheck("net_fault_survived", frozenset({FaultType.NET_DELAY.value, FaultType.NET_LOSS.value}),
                _survived, "the job to ride out each net_delay and net_loss with no error, recovery or restart",
                lambda f: f"{f.type} of rank {f.rank}'s node at step {f.step}: detected after {f.detected_after_s} s "
                          f"by {f.detected_by}, recovery {f.recovery}"),
    _FaultCheck("short_partition_survived", frozenset({FaultType.PARTITION.value}),
                _short_partition_survived,
                "each partition shorter than the deadline survived with no error, recovery or restart (a failure "
                "only while the node was cut off, past the deadline)", _partition_found, doctor=True),
    # Past the deadline: the side that timed out names the cut-off rank.
    _FaultCheck("long_partition_named", frozenset({FaultType.PARTITION.value}),
                _long_partition_named,
                "each partition past the deadline detected, and the doctor to name the cut-off rank of each "
                "partition the job detected", _partition_found,
                doctor=True),
)


def verify(job: Job, plan: Plan, outcome: JobOutcome, *, reference_root: str | os.PathLike[str] | None,
           timeout_s: float = 600.0, progress: Callable[[str], None] | None = None,
           reference: Path | None = None) -> Report:
    """Every check of a finished run, as a `Report` (not yet written to disk).

    `reference_root` None skips the reference (and so the bitwise checks). `reference`: the
    cached reference already chosen (a multi-node job's nodes ran or found it: `chaos.multinode`).
    """
    run_dir = outcome.run_dir
    logs = read_logs(run_dir)
    faults, timeline = analyze(run_dir, outcome, logs)
    attempts, diagnosis_error = diagnose(run_dir, logs)
    by_attempt = {a.get("attempt"): a for a in attempts}
    deadline_s = trainer_deadline(job)
    for f in faults:
        f.diagnosis = by_attempt.get(f.attempt)
        duration_s = plan.faults[f.index].duration_s
        if f.type == FaultType.PARTITION.value and deadline_s is not None and duration_s is not None:
            f.expected = partition_outcome(duration_s, deadline_s)

    checks: dict[str, bool] = {"job_completed": outcome.ok}
    problems: list[str] = []
    if not outcome.ok:
        why = "timed out" if outcome.timed_out else "was interrupted" if outcome.interrupted else \
            f"agents exited with {outcome.exit_codes}"
        problems.append(f"job_completed: expected every torchrun agent to exit 0; the job {why} "
                        f"(see {run_dir}/torchrun0.log)")
    fired = {f.index for f in faults}
    unfired = [f"faults[{i}] {flt.describe()}" for i, flt in enumerate(plan.faults)
               if i not in fired and flt.trigger.kind is not TriggerKind.P]
    if plan.faults:
        checks["faults_injected"] = not unfired
        if unfired:
            problems.append(f"faults_injected: expected every planned fault to fire; never fired: {unfired}")
    if faults:
        stuck = [f for f in faults if f.first_step_after_s is None]
        checks["recovered"] = not stuck
        if stuck:
            problems.append("recovered: expected a completed step after every fault; none after "
                            + ", ".join(f"{f.type} rank {f.rank} at t={f.injected_at:.1f} s" for f in stuck))
    doctor_note = f"; {diagnosis_error}" if diagnosis_error else ""
    for check in _FAULT_CHECKS:
        chosen = [f for f in faults if f.type in check.kinds]
        if not chosen:
            continue
        failing = [f for f in chosen if not check.holds(f)]
        checks[check.name] = not failing
        if failing:
            problems.append(f"{check.name}: expected {check.expected}; found "
                            + ", ".join(check.found(f) for f in failing) + (doctor_note if check.doctor else ""))

    mine = load_results(run_dir)
    reference_dir: Path | None = None
    reference_losses: list[float] = []
    reason = None
    if mine is None:
        reason = (f"the job did not finish, so it wrote no results file ({run_dir / RESULTS})" if not outcome.ok else
                  f"the trainer wrote no results file ({run_dir / RESULTS}); write one with "
                  f"chaos.results.write_results (pass --results {{run_dir}}/{RESULTS})")
    elif reference_root is None:
        reason = "no reference run was asked for"
    else:
        try:
            reference_dir = reference or ensure_reference(job, reference_root, timeout_s=timeout_s,
                                                          progress=progress)
        except ReferenceRunError as exc:
            reason = str(exc)
            checks["reference_run"] = False
            problems.append(f"reference_run: {exc}")
        else:
            reference = load_results(reference_dir)
            assert reference is not None
            reference_losses = list(reference["losses"])
            comparison = compare(mine, reference)
            checks.update(comparison.checks)
            problems += comparison.problems

    notes = []
    if outcome.restarts > len(faults):
        notes.append(f"{outcome.restarts - len(faults)} restart(s) beyond the {len(faults)} injected fault(s): "
                     f"attempts that failed on their own (see {run_dir}/torchrun*.log)")
    return Report(passed=all(checks.values()), checks=checks, bitwise_verified=reason is None, run_dir=str(run_dir),
                  faults=faults, bitwise_reason=reason, problems=problems, notes=notes, attempts=attempts,
                  diagnosis_error=diagnosis_error, reference_dir=str(reference_dir) if reference_dir else None,
                  job=job.to_dict(), plan=plan.to_dict(), exit_codes=outcome.exit_codes, timed_out=outcome.timed_out,
                  duration_s=(outcome.end_ns - outcome.start_ns) / 1e9, cold_start_s=outcome.cold_start_s,
                  steps_done=max((t["step"] for t in timeline), default=0), restarts=outcome.restarts,
                  timeline=timeline,
                  reference_losses=reference_losses)
