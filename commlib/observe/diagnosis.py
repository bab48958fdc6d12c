"""The doctor's analyzer: what went wrong in a run, read from every rank's log and flight dumps.

`diagnose(logdir)` reads the directory into the log model (`commlib.observe.run_logs.load`)
and `analyze(run)` turns a model into a `Diagnosis`: per torchrun attempt, the findings of
the doctor's rules (`commlib.observe.blame`: who is blamed and why), over the whole run
the straggler and latency/bandwidth tables (`commlib.observe.stats`), and the log files
that could not be read (a verdict holds only for what was read). `commlib.doctor` renders
it. Nothing here imports torch (`python -m commlib.doctor` runs where only the logs are).
"""

from __future__ import annotations

import enum
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from commlib.observe.blame import attempt_finding
from commlib.observe.findings import AttemptFinding
from commlib.observe.records import DumpInfo
from commlib.observe.run_logs import RunLogs, load
from commlib.observe.stats import OpStat, StragglerStat, op_stats, stragglers


@dataclass
class Diagnosis:
    """The doctor's verdict on a whole run: a finding per attempt, the statistics, the dumps it read."""

    logdir: str
    world_size: int | None
    hosts: list[str]
    attempts: list[AttemptFinding]
    stragglers: list[StragglerStat]
    ops: list[OpStat]
    dumps: list[DumpInfo]
    job: str | None = None  # the job's id (`commlib.record.log.job_id`); None in logs that carry none
    # {"path", "why"}: rank files nothing was read from, and flight dumps and stacks files not read
    unreadable: list[dict[str, str]] = field(default_factory=list)
    skipped_lines: dict[str, int] = field(default_factory=dict)  # path -> lines not read as events, where any
    # How a verdict read the logs (`commlib.observe.verdict_from_end.ReadInfo`); None: all of them.
    read: Any = None

    @property
    def final(self) -> AttemptFinding | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def ok(self) -> bool:
        return all(a.status == "ok" for a in self.attempts)

    @property
    def exit_code(self) -> int:
        """0: no problem; 1: the final attempt has a problem; 3: the job recovered (earlier attempts
        failed and the last is ok, or the last recovered in-job from every problem it had)."""
        if self.ok:
            return 0
        return 1 if self.final is None or self.final.status not in ("ok", "recovered") else 3

    def to_dict(self) -> dict[str, Any]:
        return {**_plain(asdict(self)), "ok": self.ok, "exit_code": self.exit_code}


def _plain(obj: Any) -> Any:
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def diagnose(logdir: str | os.PathLike[str], job: str | None = None) -> Diagnosis:
    """Read `logdir` (only `job`'s logs, when given) and say what went wrong in every attempt
    (see `commlib.observe.blame`)."""
    return analyze(load(logdir, job=job))


def analyze(run: RunLogs) -> Diagnosis:
    last = max(run.attempts, default=None)
    attempts = [
        attempt_finding(att, [d for d in run.dumps if d.attempt == n], final=n == last)
        for n, att in run.attempts.items()
    ]
    hosts = sorted({rl.host for att in run.attempts.values() for rl in att.ranks.values() if rl.host})
    world = max((att.world_size or 0 for att in run.attempts.values()), default=0) or None
    return Diagnosis(
        logdir=run.logdir,
        world_size=world,
        hosts=hosts,
        attempts=attempts,
        stragglers=stragglers(run),
        ops=op_stats(run),
        dumps=run.dumps,
        job=run.job,
        unreadable=[{"path": f.path, "why": f.unreadable() or ""} for f in run.unreadable]
        + [{"path": path, "why": why} for path, why in run.skipped or ()],
        skipped_lines={f.path: f.garbled for f in run.files if f.garbled and f.events},
    )
