"""The report of a chaos run: `Report`, and its three renderings.

- `Report.summary()`: the text printed on the terminal;
- ``report.json`` (`Report.to_dict`): ``passed``, ``checks`` (name -> bool, only the
  checks that ran), ``bitwise_verified`` and, when false, ``bitwise_reason``, ``faults``
  (one entry per firing: ``type``, ``rank``, ``injected_at``, ``detected_after_s``,
  ``first_step_after_s``, ``recovery`` ("in_job" or "restart"), ``diagnosis`` and more), the
  doctor's findings per attempt, the job, the plan, and the step timeline;
- ``report.png``: loss per step of the reference and of the faulted run (every execution,
  re-executed steps included, coloured by attempt), and the faulted run's progress on a
  time axis with faults, detections, restarts, first steps after them and the checkpoint
  each restart resumed from.
"""

from __future__ import annotations

import json
import math
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class FaultResult:
    """One firing of one fault, and how the job recovered from it. Times in seconds."""

    type: str
    index: int  # the fault's position in the plan
    firing: int  # the n-th firing of that fault
    rank: int
    step: int | None
    attempt: int
    pid: int | None
    node: int | None  # the agent (node) the faulted process ran under, for external faults
    injected_at: float  # since the job was launched
    injected_ts_ns: int
    detected_after_s: float | None = None
    detected_by: dict[str, Any] | None = None  # rank, event, error_type of the first typed error
    restart_after_s: float | None = None
    first_step_after_s: float | None = None
    resumed_from: int | None = None  # the checkpoint step the next attempt loaded (0: none)
    steps_reexecuted: int | None = None
    released_after_s: float | None = None  # hang: when the stopped rank was let go
    checkpoint_step: int | None = None  # kill_during_checkpoint: the checkpoint it tore
    diagnosis: dict[str, Any] | None = None  # the doctor's finding for the attempt it broke
    # How the job recovered: "in_job" (same processes, new communicators under the same
    # groups, rolled back to an in-memory snapshot) or "restart" (torchrun restarted the
    # job, DCP resume); None when it did not recover. For "in_job", `resumed_from` is the
    # step rolled back to and `restart_after_s` stays None.
    recovery: str | None = None
    epoch: int | None = None  # in_job: the recovery epoch the job went on in
    in_job_recovery_s: float | None = None  # in_job: last rank entering recovery to last rank rolled back
    detection_to_step_s: float | None = None  # detection to the first completed step after the fault
    fallback_reason: str | None = None  # restart after an in-job recovery failed: why it failed
    # partition: what it must do against the job's deadline, "survived" or "detected"
    # (`chaos.plan.partition_outcome`); None where the deadline is not known
    expected: str | None = None
    host: str | None = None  # preempt, time_limit, node_loss: the node whose harness fired it
    requeued_after_s: float | None = None  # the same: to the job's next launch (Slurm ran it again)
    lost_ranks: list[int] | None = None  # node_loss: the ranks the node held in the attempt it broke
    last_checkpoint: int | None = None  # node_loss: the last checkpoint committed before it (0: none)
    verdicts: dict[str, bool] = field(default_factory=dict)  # the checks about this firing


@dataclass
class Report:
    passed: bool
    checks: dict[str, bool]
    bitwise_verified: bool
    run_dir: str
    faults: list[FaultResult] = field(default_factory=list)
    bitwise_reason: str | None = None  # why the bitwise check could not run
    problems: list[str] = field(default_factory=list)  # what each failed check found
    notes: list[str] = field(default_factory=list)  # worth knowing, though no check failed on it
    evidence: dict[str, str] = field(default_factory=dict)  # check -> what its verdict rests on
    attempts: list[dict[str, Any]] = field(default_factory=list)  # the doctor's findings
    diagnosis_error: str | None = None
    reference_dir: str | None = None
    job: dict[str, Any] = field(default_factory=dict)
    backend: str | None = None  # what the ranks' default process group ran over, as recorded
    step_source: str | None = None  # "optimizer" (its own step count) or "count" (each process's)
    # How both runs were made to compute the same bits (`chaos.verify`).
    reproducibility: dict[str, str] = field(default_factory=dict)
    plan: dict[str, Any] = field(default_factory=dict)
    exit_codes: list[int | None] = field(default_factory=list)
    timed_out: bool = False
    duration_s: float = 0.0
    cold_start_s: float | None = None  # launch to the first completed step
    steps_done: int = 0
    restarts: int = 0
    timeline: list[dict[str, Any]] = field(default_factory=list)  # completed step executions
    reference_losses: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def load(cls, path: str | Path) -> Report | None:
        """The report a run wrote (``report.json``), or None where there is none yet."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            return None
        data["faults"] = [FaultResult(**f) for f in data.get("faults", [])]
        return cls(**data)

    def write(self, run_dir: str | Path | None = None, png: bool = True) -> None:
        """``report.json`` (and ``report.png``) in the run directory."""
        directory = Path(run_dir or self.run_dir)
        (directory / "report.json").write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n")
        if png:
            plot(self, directory / "report.png")

    def summary(self) -> str:
        verdict = "PASSED" if self.passed else "FAILED"
        held = sum(self.checks.values())
        job = self.job
        backend = self.backend or job.get("backend")
        lines = [
            f"chaos run {self.run_dir}: {verdict} ({held}/{len(self.checks)} checks held)",
            f"  job: {job.get('trainer')} on {job.get('world_size')} ranks ({backend}), "
            f"{self.steps_done} steps, {self.restarts} restart{'' if self.restarts == 1 else 's'}, "
            f"{self.duration_s:.1f} s"
            + (f", cold start to first step {self.cold_start_s:.1f} s" if self.cold_start_s else ""),
        ]
        if self.timed_out:
            lines.append("  the harness's timeout expired: the job was stopped")
        lines.append(f"  faults ({len(self.faults)} fired):")
        later = sorted(f.injected_ts_ns for f in self.faults)
        for f in self.faults:
            lines += _wrapped(_describe(f), "    ", "      ")
            for name, ok in f.verdicts.items():
                lines.append(f"      [{'ok' if ok else 'FAILED'}] {name}")
            problem = _problem_of(f, next((t for t in later if t > f.injected_ts_ns), None))
            if problem is not None:
                lines += _wrapped(
                    f"doctor, attempt {f.attempt}: {problem.get('kind')} {problem.get('ranks')}: "
                    f"{problem.get('message', '')}",
                    "      ",
                    "        ",
                )
        if self.diagnosis_error:
            lines += _wrapped(f"doctor: {self.diagnosis_error}", "  ", "    ")
        lines.append("  checks:")
        for name, ok in self.checks.items():
            lines.append(f"    [{'ok' if ok else 'FAILED'}] {name}")
            if name in self.evidence:
                lines += _wrapped(f"evidence: {self.evidence[name]}", "        ", "        ")
        for p in self.problems:
            lines += _wrapped(f"- {p}", "    ", "      ")
        for n in self.notes:
            lines += _wrapped(f"note: {n}", "  ", "    ")
        if self.reproducibility:
            made = ", ".join(f"{k}={v}" for k, v in self.reproducibility.items() if k.isupper())
            lines += _wrapped(
                f"reproducible numbers: {made}; {self.reproducibility.get('deterministic_algorithms')}", "  ", "    "
            )
        if not self.bitwise_verified:
            lines += [
                "  " + "!" * 78,
                *_wrapped(f"!! BITWISE CHECK NOT PERFORMED: {self.bitwise_reason}", "  ", "  !!   "),
                "  !! `passed` covers only the checks above; recovery was NOT proven bitwise-exact.",
                "  " + "!" * 78,
            ]
        written = [Path(self.run_dir) / name for name in ("report.json", "report.png")]
        lines.append(f"  report: {', '.join(str(p) for p in written if p.is_file()) or 'not written yet'}")
        return "\n".join(lines)


SUMMARY_WIDTH = 120  # a summary line wraps at a word boundary past this


def _wrapped(text: str, first: str, later: str) -> list[str]:
    """`text` as lines of at most `SUMMARY_WIDTH` columns, its own line breaks kept (a longer
    word stands alone, never cut)."""
    lines: list[str] = []
    for paragraph in text.splitlines() or [""]:
        lines += textwrap.wrap(
            paragraph,
            SUMMARY_WIDTH,
            initial_indent=later if lines else first,
            subsequent_indent=later,
            break_long_words=False,
            break_on_hyphens=False,
        ) or [(later if lines else first).rstrip()]
    return lines


PROBLEM_LEAD_S = 1.0  # a problem may show this long before its fault's firing was noted


def _problem_of(f: FaultResult, next_fault_ns: int | None) -> dict[str, Any] | None:
    """The doctor's problem about this firing: of its attempt's problems (an attempt may hold
    several faults), the first that showed from its firing to the next one, preferring one that
    names the faulted rank; None where none did (a fault no collective saw: a corrupted input
    the trainer caught)."""
    since, until = f.injected_ts_ns - PROBLEM_LEAD_S * 1e9, next_fault_ns if next_fault_ns is not None else math.inf
    timed = sorted(
        (p for p in (f.diagnosis or {}).get("problems") or [] if since <= (p.get("ts_ns") or since) < until),
        key=lambda p: p.get("ts_ns") or since,
    )
    named = [p for p in timed if f.rank in (p.get("ranks") or [])]
    return (named or timed or [None])[0]


def _describe(f: FaultResult) -> str:
    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f} s"

    where = f" at step {f.step}" if f.step is not None else ""
    detected = s(f.detected_after_s)
    if f.detected_by:
        detected += f" ({f.detected_by.get('event')} on rank {f.detected_by.get('rank')})"
    extra = f", released after {s(f.released_after_s)}" if f.released_after_s is not None else ""
    if f.requeued_after_s is not None:
        extra += f", requeued after {s(f.requeued_after_s)}"
    if f.lost_ranks is not None:
        extra += f", node {f.host} held ranks {f.lost_ranks}"
    if f.checkpoint_step is not None:
        extra += f", tore checkpoint {f.checkpoint_step}"
    if f.recovery == "in_job":
        how = f"recovered in-job (epoch {f.epoch}, {s(f.in_job_recovery_s)}), rolled back to step {f.resumed_from}"
    else:
        how = f"restart {s(f.restart_after_s)}, resumed from {f.resumed_from}"
        if f.fallback_reason:
            how += f" (in-job recovery failed: {f.fallback_reason})"
    return (
        f"{f.type} rank {f.rank}{where} (attempt {f.attempt}, t={f.injected_at:.1f} s): detected {detected}, "
        f"{how}, first step after {s(f.first_step_after_s)} (detection to step {s(f.detection_to_step_s)}), "
        f"{f.steps_reexecuted} step(s) re-executed{extra}"
    )


LABEL_GAP = 1 / 40  # of the time axis: faults injected closer than this share one label (a rotated label is ~1/80 wide)


def fault_labels(faults: list[FaultResult], span_s: float) -> list[tuple[float, str]]:
    """Where the timeline writes each fault's name: one label per run of faults injected
    within `LABEL_GAP` of the axis of each other (a soak's faults come seconds apart, and
    labels drawn on top of each other could not be read), at the first one's time."""
    labels: list[tuple[float, list[str]]] = []
    for f in sorted(faults, key=lambda f: f.injected_at):
        name = f"{f.type} r{f.rank}"
        if labels and f.injected_at - labels[-1][0] < LABEL_GAP * span_s:
            labels[-1][1].append(name)
        else:
            labels.append((f.injected_at, [name]))
    return [(x, ", ".join(names)) for x, names in labels]


def plot(report: Report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_time) = plt.subplots(2, 1, figsize=(13, 8))
    attempts = sorted({t["attempt"] for t in report.timeline})
    colors = plt.get_cmap("tab10")
    if report.reference_losses:
        ax_loss.plot(
            range(1, len(report.reference_losses) + 1),
            report.reference_losses,
            color="black",
            lw=1.5,
            label="reference (fault-free)",
        )
    for a in attempts:
        pts = [t for t in report.timeline if t["attempt"] == a and t["loss"] is not None]
        ax_loss.scatter(
            [t["step"] for t in pts],
            [t["loss"] for t in pts],
            s=22,
            color=colors(a % 10),
            label=f"faulted run, attempt {a}",
            zorder=3,
        )
        ax_time.plot(
            [t["t"] for t in pts], [t["step"] for t in pts], "o-", ms=3, color=colors(a % 10), label=f"attempt {a}"
        )
    for f in report.faults:
        if f.step is not None:
            ax_loss.axvline(f.step, color="red", ls=":", lw=1)
        if f.resumed_from is not None:
            ax_loss.axvline(f.resumed_from + 0.5, color="green", ls="--", lw=1)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("loss per step, lowest rank (red: a fault's step, green: the step a recovery resumed from)")
    if ax_loss.get_legend_handles_labels()[0]:
        ax_loss.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # outside: a soak's attempts are many

    marks = (
        ("fault", "injected", "red", "-"),
        ("detected", "detected_after_s", "orange", "--"),
        ("restart", "restart_after_s", "blue", ":"),
        ("first step", "first_step_after_s", "green", "-."),
    )
    labelled: set[str] = set()
    for f in report.faults:
        for label, attr, color, style in marks:
            offset = 0.0 if attr == "injected" else getattr(f, attr)
            if offset is None:
                continue
            ax_time.axvline(
                f.injected_at + offset, color=color, ls=style, lw=1.2, label=label if label not in labelled else None
            )
            labelled.add(label)
        if f.resumed_from is not None and f.restart_after_s is not None:
            ax_time.plot(
                [f.injected_at + f.restart_after_s],
                [f.resumed_from],
                marker=">",
                color="green",
                ms=8,
                label="resumed from" if "resumed" not in labelled else None,
            )
            labelled.add("resumed")
    x_min, x_max = ax_time.get_xlim()
    for x, text in fault_labels(report.faults, x_max - x_min):
        ax_time.annotate(text, (x, ax_time.get_ylim()[1]), rotation=90, va="top", ha="right", fontsize=8, color="red")
    ax_time.set_xlabel("seconds since launch")
    ax_time.set_ylabel("step completed")
    ax_time.set_title("faulted run over time")
    if ax_time.get_legend_handles_labels()[0]:
        ax_time.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    job = report.job
    fig.suptitle(
        f"chaos run: {'PASSED' if report.passed else 'FAILED'}: {job.get('trainer')} on {job.get('world_size')} "
        f"ranks ({report.backend or job.get('backend')}), {report.steps_done} steps, {report.restarts} restarts"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
