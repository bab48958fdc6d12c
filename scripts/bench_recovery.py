"""Recovery benchmark: how fast a 2-rank job notices a kill or a hang, and how fast it is training again.

    python scripts/bench_recovery.py --runs 5

For `kill` and `hang` of rank 1 at step 6 (checkpoints every 5 steps, so the first step
after the fault is the interrupted step itself), each run of the reference trainer
measures, on the same run:

- detection: fault to the first typed error on a survivor or the torchrun agent acting
  on the dead worker, whichever comes first;
- fault to the first completed step after it (detection + restart + checkpoint load + step);
- cold start: torchrun launch to the first completed step of the run (the plain cost of
  starting the job from scratch).

It prints medians and the targets (kill detected under 1 s; hang within the deadline +
0.5 s; fault to first step at most 1.5x the cold start) as a markdown table, and writes
every run's figures to `<out>/bench_recovery.json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import chaos


def measure(kind: str, run: int, out: Path, deadline: float) -> dict[str, float | str | None] | None:
    """One run's figures, or None (with the reason printed) when it did not recover."""
    args = ["--steps", "8", "--ckpt-every", "5", "--timeout", str(deadline)]
    report = chaos.run([f"{kind}:rank=1,step=6"], out / f"{kind}-{run}", args, verify=False, png=False,
                       timeout_s=900)
    if not report.passed or len(report.faults) != 1:
        print(f"{kind} run {run} did not recover:\n{report.summary()}", file=sys.stderr)
        return None
    [fault] = report.faults
    return {"detected_after_s": fault.detected_after_s, "detected_by": (fault.detected_by or {}).get("event"),
            "first_step_after_s": fault.first_step_after_s, "cold_start_s": report.cold_start_s,
            "restarts": report.restarts}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--deadline", type=float, default=5.0, help="the trainer's collective deadline (--timeout)")
    p.add_argument("--out", default="runs/bench_recovery")
    args = p.parse_args()
    out = Path(args.out)
    results = {kind: [measure(kind, i, out, args.deadline) for i in range(args.runs)] for kind in ("kill", "hang")}
    (out / "bench_recovery.json").write_text(json.dumps(results, indent=2) + "\n")

    print(f"{args.runs} runs each, 2 ranks, deadline {args.deadline:g} s; medians over the runs that recovered\n")
    print("| fault | recovered | detection | detected by | fault -> first step | cold start -> first step | ratio | "
          "targets |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    ok = True
    for kind, all_runs in results.items():
        runs = [r for r in all_runs if r is not None]
        if not runs:
            print(f"| {kind} | 0/{len(all_runs)} | | | | | | MISSED |")
            ok = False
            continue
        detect = statistics.median(r["detected_after_s"] for r in runs)
        first = statistics.median(r["first_step_after_s"] for r in runs)
        cold = statistics.median(r["cold_start_s"] for r in runs)
        by = "/".join(sorted({str(r["detected_by"]) for r in runs}))
        limit = 1.0 if kind == "kill" else args.deadline + 0.5
        met_detect, met_ratio = detect < limit, first <= 1.5 * cold
        ok &= met_detect and met_ratio
        ok &= len(runs) == len(all_runs)
        print(f"| {kind} | {len(runs)}/{len(all_runs)} | {detect:.2f} s | {by} | {first:.2f} s | {cold:.2f} s | "
              f"{first / cold:.2f}x | "
              f"detection < {limit:g} s: {'met' if met_detect else 'MISSED'}; "
              f"ratio <= 1.5x: {'met' if met_ratio else 'MISSED'} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
