"""The proof of a replica run (`chaos.replicas`): nothing lost, bitwise, read from the groups' logs.

`prove(run_dir)` reads every rank's ``train.step`` (a committed step: its members, quorum,
loss and the digest of the rank's state after it), ``train.failed_in_step`` (a step torchft
discarded), ``replica.heal``, ``replica.resume`` (a durable checkpoint loaded), ``replica.start``
and ``train.done`` events, cuts the commits into segments where the groups went back to a
durable checkpoint (`history`: a rollback, once every group that held a newer state was gone),
replays the recorded segments (`chaos.replicas.run_replay`: one group, every member's gradient
in turn, the same shards and the same order of the sum, back to the checkpoint's step at each
rollback) and checks:

- ``finished``: every rank of every group ended holding the state committed at the last step;
- ``survivors_never_restarted``: a group no fault targeted ran one process per rank from
  start to end (attempt 0, one pid) and never healed;
- ``survivors_every_step_once``: such a group committed every step exactly once, in order;
- ``no_step_committed_twice``: no rank of any group, restarted ones included, committed a
  step twice (a restart that went on behind where it died would), but after a rollback;
- ``in_step``: at every committed step of a segment, every group that committed it holds
  bitwise the same state (the digests of each rank's shards) and agrees on the members and the
  quorum; and a group that healed, or resumed from a checkpoint, took bitwise the state the
  groups committed at that step;
- ``members_committed``: a group that committed a step was a member of it;
- ``every_commit_applied``: every committed step changed the state of the rank that committed
  it (the optimizer's step count does, at least): a step committed but never applied is named;
- ``replay``: the whole trajectory is bitwise the replay's: at every step each rank's digest,
  and each member's loss.

`ReplicaProof` holds the checks (each with what it found), the segments and rollbacks (the
report's first line says each: "the latest state was lost with group 0 at step 13; resumed
from the checkpoint of step 10"), the faults with the time they cost (`fault_costs`), commlib's
doctor on the groups' logs (the quorum changes, each lost group and its ranks,
`commlib.observe.replicas`), and renders ``replica_report.json`` and ``report.png`` (the members
of each committed step, each group's commits over time).
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
    joins: list[dict[str, Any]] = field(default_factory=list)  # a process's first quorum asked for
    resumes: list[dict[str, Any]] = field(default_factory=list)  # a process's resume from a durable checkpoint
    done: list[dict[str, Any]] = field(default_factory=list)  # a process's end (the digest of its state then)


@dataclass
class Segment:
    """The committed steps of the run from one state on: the first from step 0, each later one from
    the durable checkpoint the groups resumed from once every group that held a newer state was gone."""

    start: int
    steps: dict[int, list[int]] = field(default_factory=dict)  # step -> its members (its first commit's record)
    first_ns: dict[int, int] = field(default_factory=dict)  # step -> when it was first committed

    def to_dict(self) -> dict[str, Any]:
        return {"from": self.start, "steps": {str(k): v for k, v in sorted(self.steps.items())}}


@dataclass(frozen=True)
class Rollback:
    """The run went back to a durable checkpoint: the newest state was lost with the groups that held it."""

    lost_step: int  # the newest committed step
    lost_with: list[int]  # the groups that had committed it
    to_step: int  # the checkpoint's step
    checkpoint_of: int | None  # the group whose checkpoint it was (None: there was none, step 0)
    ts_ns: int  # the first commit from the checkpoint

    def says(self) -> str:
        groups = " and ".join(str(r) for r in self.lost_with)
        resumed = f"the checkpoint of step {self.to_step}" if self.to_step else "the initial state (no checkpoint yet)"
        return (
            f"the latest state was lost with group{'s' if len(self.lost_with) > 1 else ''} {groups} at step "
            f"{self.lost_step}; resumed from {resumed}"
        )


@dataclass
class History:
    """The run's segments and rollbacks, and the segment of every commit (by its index in the record)."""

    segments: list[Segment]
    rollbacks: list[Rollback]
    segment_of: dict[Commit, int]


def history(record: Record) -> History:
    """The commits in time order, cut where the groups went on from a durable checkpoint behind the
    newest committed step: a process that resumed from the checkpoint of step c (``replica.resume``)
    and commits step c + 1 as its next step, not healed since, after the current segment had committed
    past c before it resumed, starts a new segment from c. (Processes resumed in one wave, before the
    segment they start committed anything, join it.)"""
    taken: dict[tuple[int, int, int], list[dict[str, Any]]] = defaultdict(list)  # a process's heals and resumes
    for e in sorted(record.heals + record.resumes, key=lambda e: e["ts_ns"]):
        taken[(e["replica"], e["rank"], e["pid"])].append(e)
    segments, rollbacks = [Segment(0)], []
    segment_of: dict[Commit, int] = {}
    last_commit: dict[tuple[int, int, int], int] = {}  # a process -> when it last committed
    for c in sorted(record.commits, key=lambda c: c.ts_ns):
        process = (c.replica, c.rank, c.pid)
        since = last_commit.get(process, 0)
        last_commit[process] = c.ts_ns
        # The state this process went on from, if it took one since its last commit and that was a resume.
        before = [e for e in taken[process] if since < e["ts_ns"] < c.ts_ns]
        resume = before[-1] if before and "to_step" not in before[-1] else None
        current = segments[-1]
        if resume is not None and c.step == resume["step"] + 1:
            past = [s for s, ts in current.first_ns.items() if s > resume["step"] and ts < resume["ts_ns"]]
            if past:
                lost = max(current.steps)
                lost_with = sorted(
                    {o.replica for o, k in segment_of.items() if k == len(segments) - 1 and o.step == lost}
                )
                source = next(
                    (
                        r["from_replica"]
                        for r in record.resumes
                        if (r["replica"], r["attempt"]) == (c.replica, resume["attempt"])
                        and r.get("from_replica") is not None
                    ),
                    None,
                )
                rollbacks.append(Rollback(lost, lost_with, resume["step"], source, c.ts_ns))
                segments.append(Segment(resume["step"]))
                current = segments[-1]
        current.steps.setdefault(c.step, list(c.replicas))
        current.first_ns.setdefault(c.step, c.ts_ns)
        segment_of[c] = len(segments) - 1
    return History(segments, rollbacks, segment_of)


@dataclass
class Check:
    name: str
    passed: bool
    found: str  # what it saw: the first problems, or what held


@dataclass
class ReplicaProof:
    run_dir: str
    checks: list[Check]
    segments: list[Segment]
    rollbacks: list[Rollback]
    faults: list[dict[str, Any]]
    replay_dir: str | None = None
    doctor: dict[str, Any] = field(default_factory=dict)  # commlib's replica rule (`commlib.observe.replicas`)
    doctor_text: str = ""

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def membership(self) -> dict[int, list[int]]:
        """step -> its members on the way to the final state (a rollback's later segment over the steps
        it committed again)."""
        return {step: members for segment in self.segments for step, members in sorted(segment.steps.items())}

    def check(self, name: str) -> Check:
        return next(c for c in self.checks if c.name == name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "run_dir": self.run_dir,
            "checks": [asdict(c) for c in self.checks],
            "membership": {str(k): v for k, v in self.membership.items()},
            "segments": [segment.to_dict() for segment in self.segments],
            "rollbacks": [{**asdict(r), "says": r.says()} for r in self.rollbacks],
            "faults": self.faults,
            "replay_dir": self.replay_dir,
            "doctor": self.doctor,
        }

    def summary(self) -> str:
        said = "".join(f"; {r.says()}" for r in self.rollbacks)
        lines = [f"replica run {self.run_dir}: {'PASSED' if self.passed else 'FAILED'}{said}"]
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
        record.heals.append({**where, "to_step": e.get("to_step"), "digest": e.get("digest"), "bytes": e.get("bytes")})
    elif name == "replica.join":
        record.joins.append({**where, "step": e.get("step")})
    elif name == "replica.start":
        record.starts.append(where)
    elif name == "replica.resume":
        record.resumes.append(
            {**where, "step": int(e["step"]), "digest": e.get("digest"), "from_replica": e.get("from_replica")}
        )
    elif name == "train.done":
        record.done.append({**where, "digest": e.get("digest")})
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
    run = history(record)
    checks = [
        finished(record, run, replicas),
        survivors_never_restarted(record, survivors),
        survivors_every_step_once(record, survivors),
        no_step_committed_twice(record, run),
        in_step(record, run),
        members_committed(record),
        every_commit_applied(record),
    ]
    replay_dir = None
    if replay:
        from chaos.replicas import run_replay

        replay_dir = run_replay(run_dir, [segment.to_dict() for segment in run.segments], timeout_s=timeout_s)
        checks.append(matches_replay(record, run, read_replay(replay_dir)))
    faults = fault_costs(run_dir, record, replicas, survivors)
    findings = analyze_replicas(run_dir / "logs")
    return ReplicaProof(
        str(run_dir),
        checks,
        run.segments,
        run.rollbacks,
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


def finished(record: Record, run: History, replicas: int) -> Check:
    """Every rank of every group ended (``train.done``, its last process) holding the final state: the
    one its rank committed at the last step after the last rollback."""
    final: dict[int, set[str]] = defaultdict(set)
    for c in record.commits:
        if c.step == record.steps and run.segment_of[c] == len(run.segments) - 1:
            final[c.rank].add(c.digest)
    ends = {}
    for d in sorted(record.done, key=lambda d: d["ts_ns"]):
        ends[(d["replica"], d["rank"])] = d
    problems = [] if final else [f"no group committed step {record.steps}"]
    for r in range(replicas):
        for k in range(record.group_size):
            end = ends.get((r, k))
            if end is None:
                problems.append(f"replica {r} rank {k} never finished")
            elif final and end["digest"] not in final[k]:
                problems.append(f"replica {r} rank {k} ended holding {_state_of(record, k, end['digest'])}")
    return _verdict(
        "finished", problems, f"every rank of {replicas} groups ended with the state of step {record.steps}"
    )


def _state_of(record: Record, rank: int, digest: str | None) -> str:
    """What state `digest` (of rank `rank`) is, for a message: the last step committed with it."""
    steps = [c.step for c in record.commits if c.rank == rank and c.digest == digest]
    steps += [r["step"] for r in record.resumes if r["rank"] == rank and r["digest"] == digest]
    return f"the state of step {steps[-1]}, not the last" if steps else "a state no group committed"


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


def no_step_committed_twice(record: Record, run: History) -> Check:
    """No rank committed a step again, but after a rollback to a durable checkpoint below it."""
    problems = []
    for (r, k), commits in _by_process(record).items():
        for before, after in itertools.pairwise(commits):
            segment = run.segment_of[after]
            rolled_back = segment > run.segment_of[before] and after.step > run.segments[segment].start
            if after.step <= before.step and not rolled_back:
                problems.append(
                    f"replica {r} rank {k} committed step {after.step} (pid {after.pid}, attempt "
                    f"{after.attempt}) after step {before.step} (pid {before.pid})"
                )
    return _verdict(
        "no_step_committed_twice",
        problems,
        "every rank's committed steps strictly increase"
        + (f" (but across {len(run.rollbacks)} rollback(s) to a durable checkpoint)" if run.rollbacks else ""),
    )


def in_step(record: Record, run: History) -> Check:
    by_step: dict[tuple[int, int, int], list[Commit]] = defaultdict(list)
    committed: dict[tuple[int, int], set[str]] = defaultdict(set)  # (step, rank) -> its digests, in any segment
    for c in record.commits:
        by_step[(run.segment_of[c], c.step, c.rank)].append(c)
        committed[(c.step, c.rank)].add(c.digest)
    # A heal or a resume first: the state it took must be one the groups committed at that step (said
    # first, as it explains the differences that follow).
    taken = [("healed to", h["to_step"], h) for h in record.heals]
    taken += [("resumed from the checkpoint of", r["step"], r) for r in record.resumes]
    problems = [
        f"replica {e['replica']} rank {e['rank']} {how} step {step} with a state unlike the groups' at that step"
        for how, step, e in taken
        if e.get("digest") and committed.get((step, e["rank"])) and e["digest"] not in committed[(step, e["rank"])]
    ]
    for (_, step, k), commits in sorted(by_step.items()):
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
        f"at each of {len({(g, s) for g, s, _ in by_step})} committed steps every group "
        f"that committed it holds bitwise the same state",
    )


def members_committed(record: Record) -> Check:
    problems = [
        f"replica {c.replica} committed step {c.step} without being a member {list(c.replicas)}"
        for c in record.commits
        if c.replica not in c.replicas
    ]
    return _verdict("members_committed", problems, "every group that committed a step was a member of it")


def read_replay(replay_dir: Path) -> dict[tuple[int, int, int], dict[str, Any]]:
    """(segment, step, rank) -> the replay's record of it."""
    out = {}
    for rank, paths in rank_segments(replay_dir / "logs").items():
        for e in read_rank(paths):
            if e.get("event") == "replay.step":
                out[(int(e.get("segment", 0)), int(e["step"]), rank)] = e
    return out


def matches_replay(record: Record, run: History, replayed: dict[tuple[int, int, int], dict[str, Any]]) -> Check:
    """Each rank's state after every committed step, and each member's loss, against the replay's;
    a problem is said once per group and rank: from which step on its loss, or its state, differs."""
    first: dict[tuple[str, int, int], int] = {}  # (what, replica, rank) -> the first step it differs at
    for c in sorted(record.commits, key=lambda c: (run.segment_of[c], c.step, c.replica, c.rank)):
        r = replayed.get((run.segment_of[c], c.step, c.rank))
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
        f"equal to the replay of the membership ({len(replayed)} replayed"
        + (f", {len(run.rollbacks)} rollback(s) included)" if run.rollbacks else ")"),
    )


def every_commit_applied(record: Record) -> Check:
    """Each committed step changed the rank's state (the optimizer's step count alone changes it): a
    group that commits a step without applying it (a skipped step) is named at that step."""
    problems = []
    before: dict[tuple[int, int, int], str] = {}  # (replica, rank, pid) -> the digest of its state now
    taken = [e for e in record.heals + record.resumes if e.get("digest")]  # a state put in place, not stepped
    events = sorted(
        [(c.ts_ns, 1, c) for c in record.commits] + [(e["ts_ns"], 0, e) for e in taken],
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
def fault_costs(run_dir: Path, record: Record, replicas: int, untouched: list[int]) -> list[dict[str, Any]]:
    """Per fault firing (the harness's and the ranks' own), for its survivors (the other groups): when a
    survivor's step first failed after it and with what error, the survivors' next commit, the time it
    cost them beyond a normal step (the median step of the groups no fault targeted, or of all where
    every one was; less any time they held before the last step for the lost group, said apart), and
    when the target group committed again."""
    fired = [e for e in journal(run_dir) if e.get("event") == "chaos.fault"] + record.faults
    periods = _step_periods(record, untouched or list(range(replicas)))
    normal = statistics.median(periods) if periods else 0.0
    t0 = min((c.ts_ns for c in record.commits), default=0)
    out = []
    for e in sorted(fired, key=lambda e: e["ts_ns"]):
        target = int(e["target_rank"])
        replica = target // record.group_size
        survivors = [r for r in range(replicas) if r != replica]
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
