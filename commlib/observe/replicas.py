"""The doctor's rule for replica groups under torchft (`commlib.replicas`): quorums, lost groups, time lost.

A run of replica groups keeps one log dir per group (``replica{R}/rank{K}.jsonl``, as
`chaos.replicas` writes them). `analyze_replicas(root)` reads, from every rank of every
group, only commlib's own events: ``replicas.quorum`` (each quorum's id and members),
``replicas.failure`` (a collective between groups that failed, and the groups it blames)
and the ends of the collectives on the quorums' communicators (`quorum_comm`). It says:

- the quorum changes: which groups left and joined, at which quorum, when;
- for every group that left: its ranks in the job, what the survivors' collective met
  (the typed error, the op, which survivor noticed first) or that it left between two
  steps (no collective failed: torchft's lighthouse dropped it when its heartbeat stopped),
  how long the survivors took to notice (how long the first to notice was in the collective
  that failed),
  the time the survivors lost (the gap between their last collective with it and their first
  in a later quorum, less their usual interval between collectives; a trainer that waits for
  the lost group on purpose, as the reference trainer's ``--finish-together-s`` does at its last
  step, has that wait counted in it), and when it was back
  in a quorum (healed by torchft from a peer), or else when it was restarted (a new process of
  the group logged: it came back, if to no quorum);
- the groups that never came back (neither in a later quorum nor restarted);
- a group that left a quorum by finalizing that quorum's communicator (``comm.finalize``: it
  ended its part, as a trainer that finished or stops on purpose does) is not lost: it left.

`python -m commlib.observe.replicas ROOT [--json]` prints it; `commlib-doctor ROOT` does for
a directory of replica groups' log dirs. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from commlib.members import quorum_of
from commlib.observe.events import rank_segments, read_rank

GROUP_DIR = re.compile(r"^replica(\d+)$")


@dataclass
class QuorumChange:
    quorum_id: int
    replicas: list[int]
    joined: list[int]
    left: list[int]
    ts_ns: int  # the first rank's record of it


@dataclass
class LostGroup:
    replica: int
    ranks: list[int]  # its ranks in the job (replica x group size + group rank)
    quorum_id: int  # the quorum it was lost from
    next_quorum_id: int
    cause: str  # the survivors' typed error, or "left between steps"
    op: str | None = None
    noticed_by: list[int] | None = None  # the first survivor to notice: [replica, group rank]
    detected_after_s: float | None = None  # the first survivor's time in the collective that failed
    time_lost_s: float | None = None  # the survivors' gap in collectives, less their usual interval
    back_in_quorum: int | None = None
    back_after_s: float | None = None  # its loss -> the first quorum it is a member of again
    restarted_after_s: float | None = None  # its loss -> a new process of it logging (where in no later quorum)


@dataclass
class LeftGroup:
    replica: int
    quorum_id: int  # the last quorum it was a member of, whose communicator its ranks finalized


@dataclass
class ReplicaFindings:
    root: str
    groups: list[int]
    quorums: list[QuorumChange] = field(default_factory=list)
    lost: list[LostGroup] = field(default_factory=list)
    left: list[LeftGroup] = field(default_factory=list)

    @property
    def never_back(self) -> list[int]:
        return sorted({g.replica for g in self.lost if g.back_in_quorum is None and g.restarted_after_s is None})

    @property
    def exit_code(self) -> int:
        """0: no group lost; 3: every lost group came back (in a later quorum, or restarted); 1: one never did."""
        return 0 if not self.lost else (1 if self.never_back else 3)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "never_back": self.never_back, "exit_code": self.exit_code}

    def render(self) -> str:
        lines = [
            f"Replica groups {self.groups} in {self.root}: {len(self.quorums)} quorums, {len(self.lost)} group(s) lost."
        ]
        same = 0  # quorums in a row with the members of the one before (torchft's ids move on a failed commit too)
        # Each quorum with the one after it (None after the last; no pair at all without a quorum).
        for q, after in zip(self.quorums, [*self.quorums[1:], None], strict=False):
            if q.joined or q.left or q is self.quorums[0]:
                change = "".join([f" +{q.joined}" if q.joined else "", f" -{q.left}" if q.left else ""])
                lines.append(f"  quorum {q.quorum_id}: replicas {q.replicas}{change}")
            else:
                same += 1
            if same and (after is None or after.joined or after.left):
                lines.append(f"    ... {same} more quorum(s) with the same members, to quorum {q.quorum_id}")
                same = 0
        for g in self.lost:
            how = g.cause + (f" in {g.op}" if g.op else "")
            noticed = f", noticed by replica {g.noticed_by[0]} rank {g.noticed_by[1]}" if g.noticed_by else ""
            if g.back_in_quorum is not None:
                back = f"back in quorum {g.back_in_quorum} after {_s(g.back_after_s)}"
            elif g.restarted_after_s is not None:
                back = f"restarted after {_s(g.restarted_after_s)}, in no later quorum"
            else:
                back = "NEVER BACK"
            lines.append(
                f"  LOST replica {g.replica} (ranks {g.ranks}) from quorum {g.quorum_id}: {how}{noticed}; "
                f"detected after {_s(g.detected_after_s)}, survivors lost {_s(g.time_lost_s)}; {back}"
            )
        lines += [
            f"  replica {g.replica} left after quorum {g.quorum_id} (its ranks finalized that quorum's communicator)"
            for g in self.left
        ]
        return "\n".join(lines)


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def group_dirs(root: str | Path) -> dict[int, Path]:
    """replica -> its log dir, for a directory of replica groups' log dirs (none otherwise)."""
    path = Path(root)
    found = (
        {int(m.group(1)): p for p in path.iterdir() if p.is_dir() and (m := GROUP_DIR.match(p.name))}
        if path.is_dir()
        else {}
    )
    return dict(sorted(found.items()))


def analyze_replicas(root: str | Path) -> ReplicaFindings:
    """The findings over every group's log dir under `root` (module docstring)."""
    quorums: dict[int, dict[str, Any]] = {}
    failures: list[dict[str, Any]] = []
    ends: list[tuple[int, int, int, int]] = []  # (ts_ns, quorum id, replica, group rank) of completed collectives
    starts: dict[tuple[int, int, str | None, Any], int] = {}  # (replica, group rank, comm, seq) -> when it started
    finalized: set[tuple[int, int]] = set()  # (replica, quorum id) of a quorum communicator its ranks finalized
    began: dict[tuple[int, Any], int] = {}  # (replica, pid) -> the process's first event
    groups = group_dirs(root)
    for replica, directory in groups.items():
        for rank, paths in rank_segments(directory).items():
            for e in read_rank(paths):
                name = e.get("event")
                began.setdefault((replica, e.get("pid")), e["ts_ns"])
                if name == "replicas.quorum":
                    q = quorums.setdefault(
                        int(e["quorum_id"]), {"replicas": e.get("replicas") or [], "ranks": set(), "ts_ns": e["ts_ns"]}
                    )
                    q["ts_ns"] = min(q["ts_ns"], e["ts_ns"])
                    q["ranks"] |= set(e.get("global_ranks") or [])
                    q["group_size"] = e.get("group_size", 1)
                elif name == "replicas.failure":
                    failures.append({**e, "replica": replica, "group_rank": rank})
                elif name == "collective.start" and quorum_of(e.get("comm")) is not None:
                    starts[(replica, rank, e["comm"], e.get("seq"))] = e["ts_ns"]
                elif name == "comm.finalize" and (qid := quorum_of(e.get("comm"))) is not None:
                    finalized.add((replica, qid))
                elif (
                    name == "collective.end"
                    and e.get("status") == "ok"
                    and (qid := quorum_of(e.get("comm"))) is not None
                ):
                    ends.append((e["ts_ns"], qid, replica, rank))
    findings = ReplicaFindings(str(root), sorted(groups))
    ordered = sorted(quorums.items())
    before: list[int] = []
    for qid, q in ordered:
        members = sorted(q["replicas"])
        findings.quorums.append(
            QuorumChange(
                qid, members, sorted(set(members) - set(before)), sorted(set(before) - set(members)), q["ts_ns"]
            )
        )
        before = members
    ends.sort()
    usual = _usual_interval(ends)
    for (prev_id, prev), (next_id, nxt) in itertools.pairwise(ordered):
        for replica in sorted(set(prev["replicas"]) - set(nxt["replicas"])):
            if (replica, prev_id) in finalized:
                findings.left.append(LeftGroup(replica, prev_id))
                continue
            lost = _lost(replica, prev_id, prev, next_id, nxt["replicas"], failures, starts, ends, usual, ordered)
            since = min((ts for ts, qid, r, _ in ends if qid == prev_id and r == replica), default=prev["ts_ns"])
            restarted = [ts for (r, _), ts in began.items() if r == replica and ts > since]
            if lost.back_in_quorum is None and restarted:
                lost.restarted_after_s = (min(restarted) - since) / 1e9
            findings.lost.append(lost)
    return findings


def _lost(
    replica: int,
    prev_id: int,
    prev: dict[str, Any],
    next_id: int,
    survivors: list[int],
    failures: list[dict[str, Any]],
    starts: dict[tuple[int, int, str | None, Any], int],
    ends: list[tuple[int, int, int, int]],
    usual: float | None,
    ordered: list[tuple[int, dict[str, Any]]],
) -> LostGroup:
    size = prev.get("group_size", 1)
    lost = LostGroup(
        replica, sorted(r for r in prev["ranks"] if r // size == replica), prev_id, next_id, "left between steps"
    )
    blamed = sorted(
        (
            f
            for f in failures
            if f.get("quorum_id") == prev_id
            and f["replica"] in survivors
            and replica in (f.get("failed_replicas") or [])
        ),
        key=lambda f: f["ts_ns"],
    )
    before = [ts for ts, qid, r, _ in ends if qid <= prev_id and r in survivors]
    last_ok = max(before) if before else None
    lost_at = blamed[0]["ts_ns"] if blamed else last_ok
    if blamed:
        first = blamed[0]
        lost.cause, lost.op, lost.noticed_by = (
            first["error_type"],
            first.get("op"),
            [first["replica"], first["group_rank"]],
        )
        # How long the survivor was in the collective that failed.
        began = starts.get((first["replica"], first["group_rank"], first.get("comm"), first.get("seq")))
        if began is not None:
            lost.detected_after_s = (first["ts_ns"] - began) / 1e9
    resumed = [ts for ts, qid, r, _ in ends if qid >= next_id and r in survivors]
    if last_ok is not None and resumed:
        gap = (min(resumed) - last_ok) / 1e9
        lost.time_lost_s = max(0.0, gap - (usual or 0.0))
    back = next(((qid, q) for qid, q in ordered if qid > prev_id and replica in q["replicas"]), None)
    if back is not None:
        lost.back_in_quorum = back[0]
        if lost_at is not None:
            lost.back_after_s = (back[1]["ts_ns"] - lost_at) / 1e9
    return lost


def _usual_interval(ends: list[tuple[int, int, int, int]]) -> float | None:
    """The median time between one rank's consecutive completed collectives between groups."""
    by_rank: dict[tuple[int, int], list[int]] = {}
    for ts, _, replica, rank in ends:
        by_rank.setdefault((replica, rank), []).append(ts)
    gaps = [(b - a) / 1e9 for times in by_rank.values() for a, b in itertools.pairwise(times)]
    return statistics.median(gaps) if gaps else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m commlib.observe.replicas", description=__doc__.split("\n")[0])
    parser.add_argument("root", help="a directory of replica groups' log dirs (replica0/, replica1/, ...)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not group_dirs(args.root):
        print(f"replicas doctor: expected replica<N>/ log dirs in {args.root}; found none", file=sys.stderr)
        return 2
    findings = analyze_replicas(args.root)
    print(json.dumps(findings.to_dict(), indent=1) if args.json else findings.render())
    return findings.exit_code


if __name__ == "__main__":
    sys.exit(main())
