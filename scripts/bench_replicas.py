"""Replica fault tolerance benchmark: a lost replica group, commlib's group between the groups against torchft's own.

    python scripts/bench_replicas.py                       # every case, once
    python scripts/bench_replicas.py --faults kill --runs 3

Two replica groups of one rank (`chaos.replicas`), the reference trainer in replica mode,
torchft's lighthouse on loopback. For each fault of group 1 and each process group between
the groups (``commlib``: `commlib.replicas`; ``torchft-gloo``: torchft's ``ProcessGroupGloo``),
in the same invocation, on the same machine and load, with the same deadline (``--deadline``,
the commlib group's collective deadline and torchft gloo's timeout alike) and the same
lighthouse, it measures on the survivors:

- detected: the fault to the survivor's first typed error (commlib's) or failed step
  (torchft's gloo says only "Connection closed" or "timed out");
- to next commit: the fault to the survivor's next committed step (the target: <= 1 s);
- survivors restarted, steps they committed twice (targets: 0 and 0);
- rejoined: the restarted group up (its trainer started) to its first committed step, and
  whether the whole run is bitwise its replay (commlib rows only: the replay is what proves it).

Faults: ``kill`` (SIGKILL at the start of a step, after its quorum: the survivors meet the dead
peer in the step's exchange), ``exit`` (dies inside the exchange between the groups: an in-rank
fault, which acts through commlib's hooks, so commlib's group only), ``hang`` (SIGSTOP past the
deadline, then SIGKILL: torchrun restarts the group). Each runs with the
lighthouse's heartbeat timeout at ``--heartbeat-ms`` and, for ``kill``, once more at torchft's
default (5000 ms): what a group that is gone before a quorum costs the survivors is that
timeout, whatever the process group. It prints a markdown table and writes every run's figures
to ``<out>/bench_replicas.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from chaos.plan import Plan, parse_shorthand
from chaos.replica_proof import prove, read_record
from chaos.replicas import PGS, ReplicaJob, run_replicas
from commlib.errors import CommError

COMMLIB_ERRORS = {cls.__name__ for cls in (CommError, *CommError.__subclasses__())}

FAULTS = {"kill": "kill:rank=1,step=6", "exit": "exit:rank=1,step=6,phase=replicas", "hang": "hang:rank=1,step=6"}
TORCHFT_DEFAULT_HEARTBEAT_MS = 5000


def measure(fault: str, pg: str, heartbeat_ms: int, deadline: float, out: Path) -> dict[str, object]:
    run_dir = out / f"{fault}-{pg}-hb{heartbeat_ms}"
    args = ("--steps", "14", "--timeout", str(deadline), "--min-step-s", "0.2", "--finish-together-s", "600",
            "--dim", "16", "--layers", "2", "--heads", "2", "--seq-len", "64", "--vocab", "64", "--batch-size", "1")
    job = ReplicaJob(replicas=2, trainer_args=args, replica_pg=pg, heartbeat_timeout_ms=heartbeat_ms)
    outcome = run_replicas(job, Plan((parse_shorthand(FAULTS[fault]),)), run_dir, timeout_s=900)
    proof = prove(run_dir, replay=pg == "commlib")
    proof.write()
    record = read_record(run_dir)
    cost = proof.faults[0] if proof.faults else {}
    survivors_failed = [d for d in record.discarded if d["replica"] == 0]
    fired = cost.get("at_s")
    restarted = [s for s in record.starts if s["replica"] == 1 and s["attempt"] > 0]
    up = restarted[-1]["ts_ns"] if restarted else None
    rejoined = [c.ts_ns for c in record.commits if c.replica == 1 and up is not None and c.ts_ns > up]
    return {"fault": fault, "pg": pg, "heartbeat_ms": heartbeat_ms, "deadline_s": deadline, "ok": outcome.ok,
            "detected_s": cost.get("detected_after_s"), "detected_as": cost.get("detected_as"), "to_next_commit_s": cost.get("to_next_commit_s"),
            "survivor_errors": sorted({str(d["error_type"]) for d in survivors_failed}),
            "typed": all(d["error_type"] in COMMLIB_ERRORS for d in survivors_failed),
            "survivors_restarted": not proof.check("survivors_never_restarted").passed,
            "steps_committed_twice": not proof.check("no_step_committed_twice").passed,
            "rejoined_s": (min(rejoined) - up) / 1e9 if rejoined else None,
            "bitwise": proof.passed if pg == "commlib" else None, "fired_at_s": fired, "run_dir": str(run_dir)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {list(FAULTS)}")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--deadline", type=float, default=5.0, help="collective deadline / gloo timeout, seconds")
    p.add_argument("--heartbeat-ms", type=int, default=500, help="the lighthouse's heartbeat timeout")
    p.add_argument("--out", default="runs/bench_replicas")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    faults = [f for f in args.faults.split(",") if f]
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        p.error(f"expected --faults among {list(FAULTS)}; found {unknown}")
    # `exit` acts in a commlib pre-hook, which torchft's own gloo group never calls: commlib's group only.
    cases = [(f, pg, args.heartbeat_ms) for f in faults for pg in PGS if f != "exit" or pg == "commlib"]
    if "kill" in faults:
        cases += [("kill", pg, TORCHFT_DEFAULT_HEARTBEAT_MS) for pg in PGS]
    rows = []
    for run in range(args.runs):
        for fault, pg, hb in cases:
            row = measure(fault, pg, hb, args.deadline, out / f"run{run}")
            print(json.dumps(row), flush=True)
            rows.append(row)
    (out / "bench_replicas.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(f"\n{args.runs} run(s), deadline {args.deadline:g} s, medians:\n")
    print("| fault | process group | lighthouse heartbeat | detected | to next commit | survivors' errors | "
          "survivors restarted | steps committed twice | rejoined after up | bitwise |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for fault, pg, hb in cases:
        mine = [r for r in rows if (r["fault"], r["pg"], r["heartbeat_ms"]) == (fault, pg, hb)]
        print(f"| {fault} | {pg} | {hb} ms | {_median(mine, 'detected_s')} | {_median(mine, 'to_next_commit_s')} | "
              f"{', '.join(sorted({e for r in mine for e in r['survivor_errors']})) or '-'} | "
              f"{sum(bool(r['survivors_restarted']) for r in mine)} | {sum(bool(r['steps_committed_twice']) for r in mine)} | "
              f"{_median(mine, 'rejoined_s')} | {_all(mine, 'bitwise')} |")
    return 0


def _median(rows: list[dict[str, object]], key: str) -> str:
    values = [float(r[key]) for r in rows if r.get(key) is not None]  # type: ignore[arg-type]
    return f"{statistics.median(values):.2f} s" if values else "-"


def _all(rows: list[dict[str, object]], key: str) -> str:
    values = [r[key] for r in rows if r.get(key) is not None]
    return "-" if not values else ("yes" if all(values) else f"no ({values.count(False)} of {len(values)})")


if __name__ == "__main__":
    sys.exit(main())
