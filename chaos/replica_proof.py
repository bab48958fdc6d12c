"""The proof of a replica run (`chaos.replicas`): nothing lost, bitwise, read from the groups' logs.

`prove(run_dir)` reads every rank's ``train.step`` (a committed step: its members, quorum,
loss and the digest of the rank's state after it), ``train.failed_in_step`` (a step torchft
discarded), ``replica.heal`` and ``replica.start`` events, replays the recorded membership (`chaos.replicas.run_replay`:
one group, every member's gradient in turn, the same shards and the same order of the sum)
and checks:

- ``finished``: every rank of every group committed the last step;
- ``survivors_never_restarted``: a group no fault targeted ran one process per rank from
  start to end (attempt 0, one pid) and never healed;
- ``survivors_every_step_once``: such a group committed every step exactly once, in order;
- ``no_step_committed_twice``: no rank of any group, restarted ones included, committed a
  step twice (a restart that resumed behind where it died would);
- ``in_step``: at every committed step, every group that committed it holds bitwise the same
  state (the digests of each rank's shards) and agrees on the members and the quorum; and a
  group that healed took bitwise the state the groups committed at the step it healed to;
- ``members_committed``: a group that committed a step was a member of it;
- ``every_commit_applied``: every committed step changed the state of the rank that committed
  it (the optimizer's step count does, at least): a step committed but never applied is named;
- ``replay``: the whole trajectory is bitwise the replay's: at every step each rank's digest,
  and each member's loss.

`ReplicaProof` holds the checks (each with what it found), the membership, the faults with
the time they cost (`fault_costs`), commlib's doctor on the groups' logs (the quorum changes,
each lost group and its ranks, `commlib.observe.replicas`), and renders ``replica_report.json``
and ``report.png`` (the members of each committed step, each group's commits over time).
"""

from __future__ import annotations

import itertools
import json
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from chaos.harness import journal
from commlib.observe.events import rank_segments, read_rank
from commlib.observe.replicas import analyze_replicas

REPORT = "replica_report.json"
PNG = "report.png"


@dataclass(frozen=True)
class Commit:
    """One committed step of one rank of one group."""

    replica: int
    rank: int
    pid: int
    attempt: int
    step: int
    replicas: tuple[int, ...]
    quorum_id: int | None
    loss_hex: str
    digest: str
    ts_ns: int


@dataclass
class Record:
    """What the groups' logs say: commits, discarded steps, heals and process starts, in log order."""

    group_size: int
    steps: int
    commits: list[Commit] = field(default_factory=list)
    discarded: list[dict[str, Any]] = field(default_factory=list)
    heals: list[dict[str, Any]] = field(default_factory=list)
    starts: list[dict[str, Any]] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)  # in-rank firings (chaos.fault in a rank's log)
    holds: list[dict[str, Any]] = field(default_factory=list)  # a group holding before the last step

    def membership(self) -> dict[int, list[int]]:
        """step -> its members, as the groups that committed it recorded them (the first record wins;
        `in_step` says whether they agree)."""
        out: dict[int, list[int]] = {}
        for c in sorted(self.commits, key=lambda c: c.step):
            out.setdefault(c.step, list(c.replicas))
        return out


@dataclass
class Check:
    name: str
    passed: bool
    found: str  # what it saw: the first problems, or what held


@dataclass
class ReplicaProof:
    run_dir: str
    checks: list[Check]
    membership: dict[int, list[int]]
    faults: list[dict[str, Any]]
    replay_dir: str | None = None
    doctor: dict[str, Any] = field(default_factory=dict)  # commlib's replica rule (`commlib.observe.replicas`)
    doctor_text: str = ""

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def check(self, name: str) -> Check:
        return next(c for c in self.checks if c.name == name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "run_dir": self.run_dir,
            "checks": [asdict(c) for c in self.checks],
            "membership": {str(k): v for k, v in self.membership.items()},
            "faults": self.faults,
            "replay_dir": self.replay_dir,
            "doctor": self.doctor,
        }

    def summary(self) -> str:
        lines = [f"replica run {self.run_dir}: {'PASSED' if self.passed else 'FAILED'}"]
        lines += [f"  [{'ok' if c.passed else 'FAIL'}] {c.name}: {c.found}" for c in self.checks]
        for f in self.faults:
            held = f", then held {_s(f['held_for_it_s'])} for it at the last step" if f.get("held_for_it_s") else ""
            lines.append(
                f"  fault {f['fault']} on replica {f['replica']} (rank {f['target_rank']}) at step "
                f"{f.get('fault_step')}: survivors' next commit after {_s(f.get('to_next_commit_s'))}, "
                f"time lost {_s(f.get('time_lost_s'))}{held}, discarded steps "
                f"{f.get('discarded_by_survivors')}"
            )
        return "\n".join(lines + ["", self.doctor_text] if self.doctor_text else lines)

    def write(self) -> None:
        """``report.json`` in the run dir (``report.png`` is `chaos.replica_plot.plot`'s)."""
        (Path(self.run_dir) / REPORT).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def read_record(run_dir: Path, logs: Path | None = None) -> Record:
    """The record of a run's groups (their log dirs under ``logs/replica{R}``)."""
    job = json.loads((run_dir / "job.json").read_text())
    group_size = int(job["group_size"])
    from chaos.replicas import ReplicaJob

    steps = ReplicaJob.from_dict(job).trainer_args_of().steps
    record = Record(group_size, steps)
    for replica_dir in sorted((logs or run_dir / "logs").glob("replica*"), key=lambda p: int(p.name[7:])):
        replica = int(replica_dir.name[7:])
        for rank, paths in rank_segments(replica_dir).items():
            for e in read_rank(paths):
                _take(record, replica, rank, e)
    return record


def _take(record: Record, replica: int, rank: int, e: dict[str, Any]) -> None:
    name = e.get("event")
    where = {
        "replica": replica,
        "rank": rank,
        "pid": e.get("pid"),
        "attempt": e.get("attempt", 0),
        "ts_ns": e.get("ts_ns"),
    }
    if name == "train.step" and "digest" in e:
        record.commits.append(
            Commit(
                replica,
                rank,
                int(e["pid"]),
                int(e.get("attempt", 0)),
                int(e["step"]),
                tuple(e["replicas"]),
                e.get("quorum_id"),
                e["loss_hex"],
                e["digest"],
                int(e["ts_ns"]),
            )
        )
    elif name == "train.failed_in_step":
        record.discarded.append({**where, "step": e.get("step"), "error_type": e.get("error_type")})
    elif name == "replica.heal":
        record.heals.append({**where, "to_step": e.get("to_step"), "digest": e.get("digest")})
    elif name == "replica.start":
        record.starts.append(where)
    elif name == "replica.holding":
        record.holds.append(where)
    elif name == "chaos.fault":
        record.faults.append({**e, "replica": replica})


# -- the checks ----------------------------------------------------------------------------
def prove(run_dir: str | Path, *, replay: bool = True, timeout_s: float = 300.0) -> ReplicaProof:
    """Check a finished replica run (module docstring); with `replay`, run the replay and compare."""
    run_dir = Path(run_dir).absolute()
    record = read_record(run_dir)
    plan = json.loads((run_dir / "plan.json").read_text())
    targeted = {int(f["rank"]) // record.group_size for f in plan["faults"]}
    replicas = int(json.loads((run_dir / "job.json").read_text())["replicas"])
    survivors = [r for r in range(replicas) if r not in targeted]
    checks = [
        finished(record, replicas),
        survivors_never_restarted(record, survivors),
        survivors_every_step_once(record, survivors),
        no_step_committed_twice(record),
        in_step(record),
        members_committed(record),
        every_commit_applied(record),
    ]
    membership = record.membership()
    replay_dir = None
    if replay:
        from chaos.replicas import run_replay

        replay_dir = run_replay(run_dir, membership, timeout_s=timeout_s)
        checks.append(matches_replay(record, read_replay(replay_dir)))
    faults = fault_costs(run_dir, record, survivors)
    findings = analyze_replicas(run_dir / "logs")
    return ReplicaProof(
        str(run_dir),
        checks,
        membership,
        faults,
        str(replay_dir) if replay_dir else None,
        findings.to_dict(),
        findings.render(),
    )


def _verdict(name: str, problems: list[str], held: str) -> Check:
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        return Check(name, False, "; ".join(problems[:5]) + more)
    return Check(name, True, held)


def _by_process(record: Record) -> dict[tuple[int, int], list[Commit]]:
    out: dict[tuple[int, int], list[Commit]] = defaultdict(list)
    for c in record.commits:
        out[(c.replica, c.rank)].append(c)
    return out


def finished(record: Record, replicas: int) -> Check:
    last = {key: max(c.step for c in commits) for key, commits in _by_process(record).items()}
    problems = [
        f"replica {r} rank {k} committed up to step {last.get((r, k))}"
        for r in range(replicas)
        for k in range(record.group_size)
        if last.get((r, k)) != record.steps
    ]
    return _verdict("finished", problems, f"every rank of {replicas} groups committed step {record.steps}")


def survivors_never_restarted(record: Record, survivors: list[int]) -> Check:
    problems = []
    for r in survivors:
        for k in range(record.group_size):
            pids = {c.pid for c in record.commits if (c.replica, c.rank) == (r, k)}
            pids |= {s["pid"] for s in record.starts if (s["replica"], s["rank"]) == (r, k)}
            attempts = {s["attempt"] for s in record.starts if (s["replica"], s["rank"]) == (r, k)}
            if len(pids) != 1 or attempts != {0}:
                problems.append(f"replica {r} rank {k} ran as processes {sorted(pids)} in attempts {sorted(attempts)}")
        heals = [h for h in record.heals if h["replica"] == r]
        if heals:
            problems.append(f"replica {r} healed (to step {heals[0]['to_step']})")
    return _verdict(
        "survivors_never_restarted",
        problems,
        f"replicas {survivors}: one process per rank from start to end, never healed",
    )


def survivors_every_step_once(record: Record, survivors: list[int]) -> Check:
    problems = []
    for (r, k), commits in _by_process(record).items():
        steps = [c.step for c in commits]
        if r in survivors and steps != list(range(1, record.steps + 1)):
            missing = sorted(set(range(1, record.steps + 1)) - set(steps))
            problems.append(
                f"replica {r} rank {k} committed {len(steps)} steps for {record.steps}"
                f"{f', missing {missing[:5]}' if missing else ''}"
            )
    return _verdict(
        "survivors_every_step_once",
        problems,
        f"replicas {survivors} committed steps 1..{record.steps}, each once, in order",
    )


def no_step_committed_twice(record: Record) -> Check:
    problems = []
    for (r, k), commits in _by_process(record).items():
        for before, after in itertools.pairwise(commits):
            if after.step <= before.step:
                problems.append(
                    f"replica {r} rank {k} committed step {after.step} (pid {after.pid}, attempt "
                    f"{after.attempt}) after step {before.step} (pid {before.pid})"
                )
    return _verdict("no_step_committed_twice", problems, "every rank's committed steps strictly increase")


def in_step(record: Record) -> Check:
    by_step: dict[tuple[int, int], list[Commit]] = defaultdict(list)
    for c in record.commits:
        by_step[(c.step, c.rank)].append(c)
    # A heal first: the state it took must be the one the groups committed at that step (said first, as it
    # explains the differences that follow).
    problems = [
        f"replica {h['replica']} rank {h['rank']} healed to step {h['to_step']} with a state unlike the "
        f"groups' at that step"
        for h in record.heals
        if h.get("digest")
        and by_step.get((h["to_step"], h["rank"]))
        and h["digest"] not in {c.digest for c in by_step[(h["to_step"], h["rank"])]}
    ]
    for (step, k), commits in sorted(by_step.items()):
        if len({c.digest for c in commits}) > 1:
            groups = defaultdict(list)
            for c in commits:
                groups[c.digest[:12]].append(c.replica)
            problems.append(f"step {step} rank {k}: replicas' states differ ({dict(groups)})")
        if len({(c.replicas, c.quorum_id) for c in commits}) > 1:
            problems.append(
                f"step {step} rank {k}: members and quorums differ "
                f"({sorted({(c.replica, c.replicas, c.quorum_id) for c in commits})})"
            )
    return _verdict(
        "in_step",
        problems,
        f"at each of {len({s for s, _ in by_step})} committed steps every group "
        f"that committed it holds bitwise the same state",
    )


def members_committed(record: Record) -> Check:
    problems = [
        f"replica {c.replica} committed step {c.step} without being a member {list(c.replicas)}"
        for c in record.commits
        if c.replica not in c.replicas
    ]
    return _verdict("members_committed", problems, "every group that committed a step was a member of it")


def read_replay(replay_dir: Path) -> dict[tuple[int, int], dict[str, Any]]:
    """(step, rank) -> the replay's record of it."""
    out = {}
    for rank, paths in rank_segments(replay_dir / "logs").items():
        for e in read_rank(paths):
            if e.get("event") == "replay.step":
                out[(int(e["step"]), rank)] = e
    return out


def matches_replay(record: Record, replayed: dict[tuple[int, int], dict[str, Any]]) -> Check:
    """Each rank's state after every committed step, and each member's loss, against the replay's;
    a problem is said once per group and rank: from which step on its loss, or its state, differs."""
    first: dict[tuple[str, int, int], int] = {}  # (what, replica, rank) -> the first step it differs at
    for c in sorted(record.commits, key=lambda c: (c.step, c.replica, c.rank)):
        r = replayed.get((c.step, c.rank))
        if r is None:
            first.setdefault(("is not replayed", c.replica, c.rank), c.step)
            continue
        if r["losses_hex"].get(str(c.replica)) != c.loss_hex:
            first.setdefault(("loss differs from the replay's", c.replica, c.rank), c.step)
        if r["digest"] != c.digest:
            first.setdefault(("state differs from the replay's", c.replica, c.rank), c.step)
    problems = [
        f"replica {r} rank {k}: {what} from step {step} on"
        for (what, r, k), step in sorted(first.items(), key=lambda item: (item[1], item[0][1:]))
    ]
    return _verdict(
        "replay",
        problems,
        f"{len(record.commits)} committed (step, replica, rank) records bitwise "
        f"equal to the replay of the membership ({len(replayed)} replayed)",
    )


def every_commit_applied(record: Record) -> Check:
    """Each committed step changed the rank's state (the optimizer's step count alone changes it): a
    group that commits a step without applying it (a skipped step) is named at that step."""
    problems = []
    before: dict[tuple[int, int, int], str] = {}  # (replica, rank, pid) -> the digest of its state now
    events = sorted(
        [(c.ts_ns, 1, c) for c in record.commits] + [(h["ts_ns"], 0, h) for h in record.heals if h.get("digest")],
        key=lambda x: x[:2],
    )
    for _, _, e in events:
        if isinstance(e, Commit):
            key = (e.replica, e.rank, e.pid)
            if before.get(key) == e.digest:
                problems.append(f"replica {e.replica} rank {e.rank} committed step {e.step} without changing its state")
            before[key] = e.digest
        else:
            before[(e["replica"], e["rank"], e["pid"])] = e["digest"]
    return _verdict("every_commit_applied", problems, "every committed step changed the state of every rank")


# -- what each fault cost ------------------------------------------------------------------
def fault_costs(run_dir: Path, record: Record, survivors: list[int]) -> list[dict[str, Any]]:
    """Per fault firing (the harness's and the ranks' own): when a survivor's step first failed after it
    and with what error, the survivors' next commit, the time it cost them beyond a normal step (less
    any time they held before the last step for the lost group, said apart), and when the target
    group committed again."""
    fired = [e for e in journal(run_dir) if e.get("event") == "chaos.fault"] + record.faults
    periods = _step_periods(record, survivors)
    normal = statistics.median(periods) if periods else 0.0
    t0 = min((c.ts_ns for c in record.commits), default=0)
    out = []
    for e in sorted(fired, key=lambda e: e["ts_ns"]):
        target = int(e["target_rank"])
        replica = target // record.group_size
        at = int(e.get("fired_ts_ns") or e["ts_ns"])
        before = [c.ts_ns for c in record.commits if c.replica in survivors and c.ts_ns <= at]
        after = [c.ts_ns for c in record.commits if c.replica in survivors and c.ts_ns > at]
        noticed = sorted(
            (d["ts_ns"], str(d.get("error_type")))
            for d in record.discarded
            if d["replica"] in survivors and d["ts_ns"] > at
        )
        back = [c for c in record.commits if c.replica == replica and c.ts_ns > at]
        discarded = len(
            {
                (d["replica"], d["step"])
                for d in record.discarded
                if d["replica"] in survivors and at < d["ts_ns"] <= (min(after) if after else at)
            }
        )
        gap = (min(after) - max(before)) / 1e9 if after and before else None
        # Survivors holding before the last step for the lost group (--finish-together-s) chose to wait:
        # that is said apart from what the fault cost them.
        held_s = _held(record, survivors, max(before), min(after)) if after and before else 0.0
        out.append(
            {
                "fault": e.get("fault"),
                "replica": replica,
                "target_rank": target,
                "fault_step": e.get("fault_step"),
                "at_s": (at - t0) / 1e9,
                "detected_after_s": (noticed[0][0] - at) / 1e9 if noticed else None,
                "detected_as": noticed[0][1] if noticed else None,
                "to_next_commit_s": (min(after) - at) / 1e9 if after else None,
                "time_lost_s": max(0.0, gap - normal - held_s) if gap is not None else None,
                "held_for_it_s": held_s,
                "discarded_by_survivors": discarded,
                "replica_back_after_s": (back[0].ts_ns - at) / 1e9 if back else None,
                "replica_back_at_step": back[0].step if back else None,
            }
        )
    return out


def _held(record: Record, survivors: list[int], start: int, end: int) -> float:
    """Seconds of [start, end] a survivor spent holding before the last step (from its `replica.holding`
    to its next commit)."""
    held = 0.0
    for h in record.holds:
        if h["replica"] not in survivors:
            continue
        resumed = min(
            (c.ts_ns for c in record.commits if c.replica == h["replica"] and c.ts_ns > h["ts_ns"]), default=end
        )
        held = max(held, (min(end, resumed) - max(start, h["ts_ns"])) / 1e9)
    return held


def _step_periods(record: Record, survivors: list[int]) -> list[float]:
    periods = []
    for (r, _), commits in _by_process(record).items():
        if r in survivors:
            periods += [(b.ts_ns - a.ts_ns) / 1e9 for a, b in itertools.pairwise(commits)]
    return periods
