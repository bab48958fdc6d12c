"""``report.png`` of a replica run: who took part in each step, and each group's commits over time.

Top: one row per replica group, a mark at every committed step it was a member of (so a lost
group is a gap in its row, and a healed one comes back in it). Bottom: each group's committed
step against the time since the first commit, with the faults (vertical lines, labelled) and
the heals (triangles), the durable checkpoints loaded (purple triangles down) and the rollbacks
(dotted): the survivors' line goes on through a fault, the lost group's stops and resumes at
the survivors' step, and after a rollback every line goes on from the checkpoint's step.
Imports matplotlib (the ``report`` extra) when called.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chaos.replica_proof import Record, ReplicaProof


def plot(proof: ReplicaProof, record: Record, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    replicas = sorted({c.replica for c in record.commits} | {r for m in proof.membership.values() for r in m})
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.5), height_ratios=[1, 2])
    for r in replicas:
        steps = [s for s, members in sorted(proof.membership.items()) if r in members]
        top.scatter(steps, [r] * len(steps), marker="s", s=12, label=f"replica {r}")
    top.set_yticks(replicas, [f"replica {r}" for r in replicas])
    top.set_xlabel("committed step")
    top.set_title(f"members of each committed step ({'PASSED' if proof.passed else 'FAILED'})")

    t0 = min((c.ts_ns for c in record.commits), default=0)
    for r in replicas:
        mine = sorted((c.ts_ns, c.step) for c in record.commits if c.replica == r and c.rank == 0)
        # A gap (a lost group's absence) is left open: NaN breaks the line there.
        xs, ys = [], []
        # The second sequence is one longer: its last is no step's predecessor.
        for (t, s), (_, before) in zip(mine, [(0, None), *mine], strict=False):
            if before is not None and s != before + 1:
                xs.append(float("nan"))
                ys.append(float("nan"))
            xs.append((t - t0) / 1e9)
            ys.append(s)
        bottom.plot(xs, ys, ".-", markersize=3, label=f"replica {r}")
    for h in record.heals:
        if h["rank"] == 0 and h.get("to_step") is not None:
            bottom.scatter([(h["ts_ns"] - t0) / 1e9], [h["to_step"]], marker="^", color="black", zorder=3)
    for resume in record.resumes:
        if resume["rank"] == 0 and resume["step"]:
            bottom.scatter([(resume["ts_ns"] - t0) / 1e9], [resume["step"]], marker="v", color="purple", zorder=3)
    for rollback in proof.rollbacks:
        back = (rollback.ts_ns - t0) / 1e9
        bottom.axvline(back, color="purple", linestyle=":", linewidth=1)
        bottom.annotate(
            f"rolled back to {rollback.to_step}", (back, rollback.to_step), fontsize=7, color="purple", ha="left"
        )
    for f in proof.faults:
        at = f.get("at_s")
        if at is not None:
            bottom.axvline(at, color="red", linestyle="--", linewidth=1)
            bottom.annotate(
                f"{f['fault']} r{f['replica']}",
                (at, bottom.get_ylim()[1]),
                rotation=90,
                fontsize=7,
                va="top",
                ha="right",
                color="red",
            )
    bottom.set_xlabel("seconds since the first commit")
    bottom.set_ylabel("committed step (rank 0)")
    bottom.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
