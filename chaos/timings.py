"""What each firing did to the job, measured from what the run left behind.

`analyze` reads the ranks' logs (commlib's log model, `read_logs`: read once, for these
timings and the doctor's diagnosis), the harness's journal, the torchrun agents' logs and
the ledger, all on the wall clock of this machine, and gives per firing: detection (fault
to the first typed error on a survivor -- for ``corrupt`` on any rank, since the corrupted
rank itself only finds out through the finite check -- or to the torchrun agent acting on
the failed worker, whichever comes first), restart (fault to the first line of a process
started after it), first completed step after the fault, the step resumed from (the first
step the ranks started after it, ``chaos.step`` of the step probe, minus one: the step of the
checkpoint loaded, or of the state rolled back to), and the steps executed again; and how the
job recovered (``recovery``: "restart" when processes started after the fault, "in_job" when
the same processes logged ``recovery.in_job``, so one attempt may hold several faults).
`diagnose` gives the doctor's findings per attempt, which `chaos.verify` attaches to the
firings and judges.
"""

from __future__ import annotations

import datetime
import os
import re
from pathlib import Path
from typing import Any

from chaos.external import TYPED_ERRORS
from chaos.fault import FaultType
from chaos.harness import JobOutcome, journal
from chaos.ledger import Ledger
from chaos.report import FaultResult
from commlib.observe.run_logs import LogDirError, RunLogs, load

# torchrun's agent logs (glog style, local time) the moment it acts on a failed worker.
_AGENT_LINE = re.compile(
    r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6}) +\d+ [^\]]*\] "
    r"(?:failed \(exitcode: (-?\d+)\) local_rank: (\d+)|Sending process (\d+) closing signal)"
)


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


def analyze(
    run_dir: str | os.PathLike[str], outcome: JobOutcome, logs: RunLogs | None
) -> tuple[list[FaultResult], list[dict[str, Any]]]:
    """Every firing of the run with its recovery timings, and the step timeline of the run
    (one entry per completed step execution on the lowest rank: t, step, loss, attempt).
    `logs`: the run's `read_logs`."""
    run_dir = Path(run_dir)
    events = logs.events() if logs is not None else []
    procs = _first_events(events)
    # The first optimizer's steps (a trainer may have several, each stepping every step).
    steps = [e for e in events if e.get("event") == "train.step" and e.get("opt", 0) == 0]
    lowest = min((int(e["rank"]) for e in steps), default=0)
    lead = [e for e in steps if e.get("rank") == lowest]
    starts = [e for e in events if e.get("event") == "chaos.step"]
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
        r = FaultResult(
            type=f.type,
            index=f.index,
            firing=f.n,
            rank=f.rank,
            step=f.step,
            attempt=f.attempt,
            pid=pid,
            node=f.detail.get("node"),
            injected_at=(f.ts_ns - start) / 1e9,
            injected_ts_ns=f.ts_ns,
        )
        if f.type in (FaultType.KILL_DURING_CHECKPOINT.value, FaultType.CORRUPT_CHECKPOINT.value):
            r.checkpoint_step = f.detail.get("checkpoint_step")
        if FaultType(f.type).slurm:
            r.host = host
            relaunch = min((ts for ts in launches if ts > f.ts_ns), default=None)
            r.requeued_after_s = None if relaunch is None else (relaunch - f.ts_ns) / 1e9
        if f.type == FaultType.NODE_LOSS.value:
            r.lost_ranks = sorted(
                {
                    int(e["rank"])
                    for e in events
                    if e.get("host") == host and e.get("attempt") == f.attempt and isinstance(e.get("rank"), int)
                }
            )
            r.last_checkpoint = max((int(e["step"]) for e in checkpoints if e["ts_ns"] < f.ts_ns), default=0)
        release = releases.get((f.index, pid))
        end_ns = f.ts_ns
        if release is not None:
            r.released_after_s = (release["ts_ns"] - f.ts_ns) / 1e9
            end_ns = release["ts_ns"]
        # A detection is the latest earlier fault's: one nobody noticed (a survived partition, a
        # straggler) must not take a later fault's. Faults fired at one step of one attempt share it.
        detect_until = next(
            (g.ts_ns for g in firings[k + 1 :] if g.step is None or (g.attempt, g.step) != (f.attempt, f.step)),
            float("inf"),
        )
        survivors_only = f.type != FaultType.CORRUPT.value
        detection = next(
            (
                e
                for e in events
                if e.get("event") in TYPED_ERRORS
                and f.ts_ns <= e["ts_ns"] < detect_until
                and procs[_who(e)] < f.ts_ns
                and not (survivors_only and e["pid"] == pid and host in (None, e.get("host")))
            ),
            None,
        )
        agent = next((a for a in agents if f.ts_ns <= a[0] < detect_until), None)
        if detection is not None and (agent is None or detection["ts_ns"] <= agent[0]):
            r.detected_after_s = (detection["ts_ns"] - f.ts_ns) / 1e9
            r.detected_by = {
                "rank": detection.get("rank"),
                "event": detection.get("event"),
                "error_type": detection.get("error_type"),
            }
        elif agent is not None:
            r.detected_after_s = (agent[0] - f.ts_ns) / 1e9
            r.detected_by = {"node": agent[1], "event": "torchrun.agent", "line": agent[2]}
        recovered = next((e for e in in_job if f.ts_ns <= e["ts_ns"] < until and _who(e) in old), None)
        fallback = next((e for e in fallbacks if f.ts_ns <= e["ts_ns"] < until), None)
        if new:
            r.recovery = "restart"
            r.restart_after_s = (min(procs[p] for p in new) - f.ts_ns) / 1e9
            after = [e for e in lead if _who(e) in new]
            started = next((e for e in starts if _who(e) in new), None)
            r.resumed_from = int(started["step"]) - 1 if started is not None else None
            r.fallback_reason = fallback.get("reason") if fallback is not None else None
            again = {int(e["step"]) for e in lead if _who(e) in new}
        else:
            after = [e for e in lead if e["ts_ns"] > end_ns]
            if recovered is not None:
                r.recovery, r.epoch = "in_job", int(recovered["epoch"])
                backs = [
                    e
                    for e in rollbacks
                    if e.get("epoch") == r.epoch and _who(e) in old and f.ts_ns <= e["ts_ns"] < until
                ]
                entered = [
                    e
                    for e in recovery_starts
                    if e.get("epoch") == r.epoch and _who(e) in old and f.ts_ns <= e["ts_ns"] < until
                ]
                if backs and entered:
                    # From the last rank entering recovery (once every rank knows) to the last one rolled back.
                    r.in_job_recovery_s = (max(e["ts_ns"] for e in backs) - max(e["ts_ns"] for e in entered)) / 1e9
                started = next((e for e in starts if _who(e) in old and recovered["ts_ns"] <= e["ts_ns"] < until), None)
                r.resumed_from = int(started["step"]) - 1 if started is not None else None
            again = {int(e["step"]) for e in lead if f.ts_ns < e["ts_ns"] < until}
        if after:
            r.first_step_after_s = (after[0]["ts_ns"] - f.ts_ns) / 1e9
            if r.detected_after_s is not None:
                r.detection_to_step_s = r.first_step_after_s - r.detected_after_s
        # Steps completed before the fault that ran again after it (successor attempt or rollback).
        done = {int(e["step"]) for e in lead if _who(e) in old and e["ts_ns"] < f.ts_ns}
        r.steps_reexecuted = len(again & done)
        results.append(r)

    timeline = [
        {
            "t": (e["ts_ns"] - start) / 1e9,
            "step": int(e["step"]),
            "loss": e.get("loss"),
            "attempt": int(e.get("attempt", 0)),
        }
        for e in lead
    ]
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


def diagnose(run_dir: str | os.PathLike[str], logs: RunLogs | None = None) -> tuple[list[dict[str, Any]], str | None]:
    """The doctor's findings per attempt, as dicts (from `logs` when they were read already); or
    an empty list and why there are none."""
    try:
        from commlib.observe.diagnosis import analyze as doctor_analyze
    except ImportError as exc:
        return [], f"the doctor (commlib.observe.diagnosis) is not available: {exc}"
    try:
        found = doctor_analyze(logs if logs is not None else load(Path(run_dir) / "logs")).to_dict()
    except Exception as exc:  # a report without a diagnosis beats no report
        return [], f"the doctor failed on {run_dir}/logs: {type(exc).__name__}: {exc}"
    return list(found.get("attempts", [])), None
