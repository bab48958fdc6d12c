"""Per-step communication timeline from commlib's per-rank logs (or flight-recorder dumps).

For each process and training step (the `step` field of `commlib.context`) and, when
several runs share a log, each `label` (another context field, e.g. the bench's mode):

- ``all_gather_s`` / ``reduce_scatter_s``: length of the union of the intervals during
  which an all-gather (``all_gather``, ``all_gather_single``) / a reduce-scatter
  (``reduce_scatter``, ``reduce_scatter_single``) was in flight;
- ``overlap_s``: length of (union of all-gather intervals) ∩ (union of reduce-scatter
  intervals): time both kinds were in flight at once; ``overlap_fraction`` is
  ``overlap_s / reduce_scatter_s``, the share of reduce-scatter time that had an
  all-gather beside it;
- ``overlap_min_s``: the same intersection counting only flights known to be in
  progress (see below): a lower bound, equal to ``overlap_s`` when nothing is uncertain;
- ``comm_s``: length of the union of every collective's interval (any op);
- ``exposed_s``: length of the union of the intervals during which the training thread
  was blocked on a collective (any op): the whole interval of a synchronous collective,
  and for an asynchronous one only its wait (the ``wait_s`` commlib puts in an async
  collective's ``collective.end``). An async collective without it (a flight-recorder
  dump, say) is counted as blocking for its whole interval, and ``exposed_upper_bound``
  says so.

An interval runs from ``collective.start`` to ``collective.end``. commlib records the end
of an async collective when its wait returns, so an async interval is "issued until seen
complete". When the op was still running as its wait began (``collective.end`` says
``done_before_wait: false``), that is its real flight, give or take the wake-up; when it
had already finished, or nothing says, its data arrived at some unknown point of
the interval, so ``all_gather_s``, ``reduce_scatter_s`` and ``overlap_s`` are upper
bounds and ``overlap_min_s`` leaves such an op out. ``exposed_s`` counts only blocked
time and has neither problem.

Only completed collectives count; events without a ``step`` are ignored. Times are each
host's monotonic clock, so intervals are compared within a process only. The logs are read
through commlib's log model (`commlib.observe.run_logs`), which matches each start with its end.

    python -m fsdp_overlap.timeline LOGDIR [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from commlib.observe.dumps import dump_calls, flight_dumps
from commlib.observe.run_logs import Call, LogDirError, RunLogs, build, load

ALL_GATHER_OPS = frozenset({"all_gather", "all_gather_single"})
REDUCE_SCATTER_OPS = frozenset({"reduce_scatter", "reduce_scatter_single"})

Span = tuple[int, int]  # [start, end) in monotonic ns


@dataclass(frozen=True)
class Record:
    """One completed collective as seen by one process."""

    rank: int
    pid: int | None
    attempt: int
    step: int
    label: str | None
    comm: str
    op: str
    seq: int
    start_ns: int
    end_ns: int
    async_op: bool
    wait_ns: int | None = None  # time the thread was blocked waiting for an async op
    done_before_wait: bool | None = None  # the async op had finished before its wait began

    @property
    def certain(self) -> bool:
        """Whether [start_ns, end_ns] is known to be the op's real flight."""
        return not self.async_op or self.done_before_wait is False


@dataclass(frozen=True)
class StepTimeline:
    rank: int
    attempt: int
    step: int
    label: str | None
    collectives: int
    all_gather_s: float
    reduce_scatter_s: float
    overlap_s: float
    overlap_min_s: float
    comm_s: float
    exposed_s: float
    exposed_upper_bound: bool

    @property
    def overlap_fraction(self) -> float:
        return self.overlap_s / self.reduce_scatter_s if self.reduce_scatter_s else 0.0


# -- interval arithmetic -----------------------------------------------------------------
def union(spans: Iterable[Span]) -> list[Span]:
    """Disjoint, sorted spans covering exactly the given ones."""
    merged: list[Span] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def intersect(a: list[Span], b: list[Span]) -> list[Span]:
    """Intersection of two disjoint sorted span lists."""
    out: list[Span] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def length(spans: list[Span]) -> int:
    return sum(end - start for start, end in spans)


# -- one step ----------------------------------------------------------------------------
def step_timeline(records: list[Record]) -> StepTimeline:
    """The timeline of one process's step (all records share rank, pid, attempt, step, label)."""
    first = records[0]
    ag = union((r.start_ns, r.end_ns) for r in records if r.op in ALL_GATHER_OPS)
    rs = union((r.start_ns, r.end_ns) for r in records if r.op in REDUCE_SCATTER_OPS)
    ag_min = union((r.start_ns, r.end_ns) for r in records if r.op in ALL_GATHER_OPS and r.certain)
    rs_min = union((r.start_ns, r.end_ns) for r in records if r.op in REDUCE_SCATTER_OPS and r.certain)
    blocked: list[Span] = []
    upper_bound = False
    for r in records:
        if not r.async_op:
            blocked.append((r.start_ns, r.end_ns))
        elif r.wait_ns is not None:
            blocked.append((max(r.start_ns, r.end_ns - r.wait_ns), r.end_ns))
        else:
            blocked.append((r.start_ns, r.end_ns))
            upper_bound = True
    return StepTimeline(
        rank=first.rank,
        attempt=first.attempt,
        step=first.step,
        label=first.label,
        collectives=len(records),
        all_gather_s=length(ag) / 1e9,
        reduce_scatter_s=length(rs) / 1e9,
        overlap_s=length(intersect(ag, rs)) / 1e9,
        overlap_min_s=length(intersect(ag_min, rs_min)) / 1e9,
        comm_s=length(union((r.start_ns, r.end_ns) for r in records)) / 1e9,
        exposed_s=length(union(blocked)) / 1e9,
        exposed_upper_bound=upper_bound,
    )


def timelines(records: Iterable[Record]) -> list[StepTimeline]:
    """Group records by (label, process, step) and compute each step's timeline."""
    groups: dict[tuple[Any, ...], list[Record]] = defaultdict(list)
    for r in records:
        groups[(r.label or "", r.rank, r.attempt, r.pid, r.step)].append(r)
    return [step_timeline(groups[k]) for k in sorted(groups)]


# -- readers: the log model ---------------------------------------------------------------
def records(run: RunLogs) -> list[Record]:
    """Completed collectives inside a step, as the ranks logged them (a flight-recorder entry the
    logs lack is left out: it has no wait time)."""
    return [_record(c, attempt) for attempt, c in run.calls() if c.source == "log" and _counted(c)]


def records_from_events(events: Iterable[dict[str, Any]]) -> list[Record]:
    """Completed collectives inside a step from commlib log events already read."""
    return records(build(events))


def records_from_flight(dumps: Iterable[dict[str, Any]]) -> list[Record]:
    """Completed collectives inside a step from flight-recorder dumps (deduplicated across dumps).

    Dumps carry no wait times, no label and no attempt, and their `rank` is the communicator's
    rank (the global rank for communicators split over all ranks in order, as fsdp_overlap's are).
    """
    seen: dict[tuple[Any, ...], Record] = {}
    for dump in dumps:
        for c in dump_calls(dump):
            if _counted(c):
                seen[(c.pid, c.comm, c.seq, c.peer, c.tag)] = _record(c, attempt=0)
    return list(seen.values())


def _counted(c: Call) -> bool:
    return c.status == "ok" and c.step is not None and c.start_mono_ns is not None and c.end_mono_ns is not None


def _record(c: Call, attempt: int) -> Record:
    return Record(
        rank=c.rank,
        pid=c.pid,
        attempt=attempt,
        step=c.step,
        label=c.label,
        comm=c.comm,
        op=c.op,
        seq=c.seq,
        start_ns=c.start_mono_ns,
        end_ns=c.end_mono_ns,
        async_op=c.async_op,
        wait_ns=round(c.wait_s * 1e9) if c.wait_s is not None else None,
        done_before_wait=c.done_before_wait,
    )


def analyze(logdir: str | Path) -> list[StepTimeline]:
    """Per-step timelines from `logdir`'s ``rank*.jsonl`` logs, else its flight-recorder dumps."""
    directory = Path(logdir)
    if not directory.is_dir():
        raise FileNotFoundError(f"fsdp_overlap.timeline: expected a log directory; found no directory {directory}")
    try:
        run = load(directory)
    except LogDirError:  # no rank logs: the flight-recorder dumps, if any
        dumps = [data for _, data in flight_dumps(directory)]
        if not dumps:
            raise FileNotFoundError(
                f"fsdp_overlap.timeline: expected rank*.jsonl logs or flight_rank*.json dumps "
                f"in {directory}; found neither"
            ) from None
        return timelines(records_from_flight(dumps))
    return timelines(records(run))


# -- summary and CLI ---------------------------------------------------------------------
@dataclass(frozen=True)
class Summary:
    """Medians over every (rank, step) of one label; the fraction is over summed times."""

    label: str | None
    steps: int
    all_gather_s: float
    reduce_scatter_s: float
    overlap_s: float
    overlap_min_s: float
    overlap_fraction: float
    exposed_s: float
    exposed_upper_bound: bool


def summarize(steps: list[StepTimeline]) -> list[Summary]:
    by_label: dict[str | None, list[StepTimeline]] = defaultdict(list)
    for t in steps:
        by_label[t.label].append(t)
    out = []
    for label, ts in sorted(by_label.items(), key=lambda kv: kv[0] or ""):
        rs_total = sum(t.reduce_scatter_s for t in ts)
        out.append(
            Summary(
                label=label,
                steps=len(ts),
                all_gather_s=statistics.median(t.all_gather_s for t in ts),
                reduce_scatter_s=statistics.median(t.reduce_scatter_s for t in ts),
                overlap_s=statistics.median(t.overlap_s for t in ts),
                overlap_min_s=statistics.median(t.overlap_min_s for t in ts),
                overlap_fraction=sum(t.overlap_s for t in ts) / rs_total if rs_total else 0.0,
                exposed_s=statistics.median(t.exposed_s for t in ts),
                exposed_upper_bound=any(t.exposed_upper_bound for t in ts),
            )
        )
    return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:9.2f}"


def render(steps: list[StepTimeline]) -> str:
    head = (
        f"{'label':>8} {'rank':>4} {'step':>5} {'n':>4} {'AG ms':>9} {'RS ms':>9} {'overlap ms':>10} "
        f"{'(min)':>9} {'ovl/RS':>6} {'comm ms':>9} {'exposed ms':>10}"
    )
    lines = [head]
    for t in steps:
        lines.append(
            f"{t.label or '-':>8} {t.rank:>4} {t.step:>5} {t.collectives:>4} {_ms(t.all_gather_s)} "
            f"{_ms(t.reduce_scatter_s)} {_ms(t.overlap_s):>10} {_ms(t.overlap_min_s)} "
            f"{t.overlap_fraction:6.2f} {_ms(t.comm_s)} "
            f"{_ms(t.exposed_s):>10}{' *' if t.exposed_upper_bound else ''}"
        )
    lines.append("")
    lines.append("medians per label (overlap/RS over summed times):")
    for s in summarize(steps):
        lines.append(
            f"{s.label or '-':>8} steps={s.steps} AG={s.all_gather_s * 1e3:.2f} ms "
            f"RS={s.reduce_scatter_s * 1e3:.2f} ms overlap={s.overlap_s * 1e3:.2f} ms "
            f"(at least {s.overlap_min_s * 1e3:.2f} ms; {s.overlap_fraction:.0%} of RS) "
            f"exposed={s.exposed_s * 1e3:.2f} ms"
            f"{' (upper bound)' if s.exposed_upper_bound else ''}"
        )
    if any(t.exposed_upper_bound for t in steps):
        lines.append("* an async collective had no wait_s: its whole flight counted as exposed")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp_overlap.timeline", description=__doc__.split("\n")[0])
    parser.add_argument("logdir")
    parser.add_argument("--json", action="store_true", help="one JSON object per step instead of a table")
    args = parser.parse_args(argv)
    steps = analyze(args.logdir)
    if args.json:
        for t in steps:
            print(json.dumps({**asdict(t), "overlap_fraction": t.overlap_fraction}))
    else:
        print(render(steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
