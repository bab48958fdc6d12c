"""Healing benchmark: a restarted replica group's join to its first committed step, torchft's
HTTPTransport against its PGTransport, in the same invocation.

    python scripts/bench_heal.py                                  # one run of each, about 100 MB of state
    python scripts/bench_heal.py --runs 3 --replica-pg commlib    # over commlib's group

Two replica groups of one rank (`chaos.replicas`, the reference trainer in replica mode, the
lighthouse on loopback), a model whose state (parameters and AdamW's two moments) is about
``--state-mb``; group 1 is killed at step 5, its torchrun restarts it, and it heals from group 0
with ``--heal-transport`` (`chaos.workload.replica`): ``http`` (torchft's default: a server in the
sending rank, the state fetched over HTTP) or ``pg`` (the state sent over the process group
between the groups, ``--replica-pg``: torchft's own gloo group by default). Durable checkpoints are
off (``--ckpt-every 0``): the restarted group heals from its peer only.

Per run it reads the restarted process's log: its join (``replica.join``, its first quorum asked
for), the heal (``replica.heal``: the state in place, and its size) and its first committed step;
the proof's ``in_step`` check says whether the healed state was bitwise the peer's. It prints a
markdown table of medians, the ratio of the two transports' join-to-commit times, and writes every
run's figures to ``<out>/bench_heal.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from chaos.plan import Plan, parse_shorthand
from chaos.replica_proof import prove, read_record
from chaos.replicas import PGS, TRANSPORTS, ReplicaJob, run_replicas

FAULT = "kill:rank=1,step=5"
STEPS = ("--steps", "10", "--min-step-s", "0.2", "--finish-together-s", "600", "--ckpt-every", "0")
SHAPE = ("--layers", "2", "--heads", "4", "--vocab", "8192", "--seq-len", "64", "--batch-size", "1")


def model_args(state_mb: float) -> tuple[str, ...]:
    """The trainer's model arguments whose state is closest to `state_mb` (parameters x 3, fp32)."""
    from chaos.workload.arguments import check_args, configs
    from chaos.workload.model import Transformer

    def size(dim: int) -> float:
        model = Transformer(configs(check_args([*SHAPE, "--dim", str(dim)]))[0])
        return 3 * sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6

    sizes = {32: size(32)}
    while sizes[max(sizes)] < state_mb:
        sizes[max(sizes) + 32] = size(max(sizes) + 32)
    dim = min(sizes, key=lambda d: abs(sizes[d] - state_mb))
    return (*SHAPE, "--dim", str(dim))


def measure(transport: str, pg: str, model: tuple[str, ...], deadline: float, run_dir: Path) -> dict[str, object]:
    job = ReplicaJob(
        replicas=2,
        replica_pg=pg,
        heal_transport=transport,
        trainer_args=(*model, *STEPS, "--timeout", str(deadline), "--manager-timeout", str(deadline)),
    )
    outcome = run_replicas(job, Plan((parse_shorthand(FAULT),)), run_dir, timeout_s=900)
    record = read_record(run_dir)
    proof = prove(run_dir, replay=False)
    proof.write()
    joins = [j for j in record.joins if j["replica"] == 1 and j["attempt"] > 0]
    join = joins[-1]["ts_ns"] if joins else None
    heals = [h for h in record.heals if h["replica"] == 1 and join is not None and h["ts_ns"] > join]
    commits = [c.ts_ns for c in record.commits if c.replica == 1 and join is not None and c.ts_ns > join]
    return {
        "transport": transport,
        "pg": pg,
        "ok": outcome.ok,
        "join_to_heal_s": (heals[0]["ts_ns"] - join) / 1e9 if heals and join else None,
        "join_to_commit_s": (min(commits) - join) / 1e9 if commits and join else None,
        "healed_mb": heals[0]["bytes"] / 1e6 if heals and heals[0].get("bytes") else None,
        "bitwise": proof.check("in_step").passed,
        "run_dir": str(run_dir),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--state-mb", type=float, default=100.0, help="the model and optimizer state to heal")
    p.add_argument("--replica-pg", choices=PGS, default="torchft-gloo", help="the process group between the groups")
    p.add_argument("--deadline", type=float, default=30.0, help="collective deadline and torchft's own timeout, s")
    p.add_argument("--out", default="runs/bench_heal")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = model_args(args.state_mb)
    rows = []
    for run in range(args.runs):
        for transport in TRANSPORTS:
            row = measure(transport, args.replica_pg, model, args.deadline, out / f"run{run}-{transport}")
            print(json.dumps(row), flush=True)
            rows.append(row)
    (out / "bench_heal.json").write_text(json.dumps({"model": model, "rows": rows}, indent=1) + "\n")
    medians = {t: _median([r for r in rows if r["transport"] == t], "join_to_commit_s") for t in TRANSPORTS}
    print(f"\n{args.runs} run(s), process group {args.replica_pg}, model {' '.join(model)}, medians:\n")
    print("| transport | state healed | join -> state in place | join -> first commit | bitwise |")
    print("|---|---|---|---|---|")
    for t in TRANSPORTS:
        mine = [r for r in rows if r["transport"] == t]
        healed = _median(mine, "healed_mb")
        print(
            f"| {t} | {'-' if healed is None else f'{healed:.0f} MB'} | {_s(_median(mine, 'join_to_heal_s'))} | "
            f"{_s(medians[t])} | {'yes' if all(r['bitwise'] for r in mine) else 'no'} |"
        )
    if medians["http"] and medians["pg"]:
        print(f"\npg / http, join to first commit: {medians['pg'] / medians['http']:.2f}")
    return 0 if all(r["ok"] and r["bitwise"] for r in rows) else 1


def _median(rows: list[dict[str, object]], key: str) -> float | None:
    values = [float(r[key]) for r in rows if r.get(key) is not None]  # type: ignore[arg-type]
    return statistics.median(values) if values else None


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


if __name__ == "__main__":
    raise SystemExit(main())
