"""Recovery benchmark: how fast a 2-rank job notices a fault, and how fast it is training again, in-job vs restart.

    python scripts/bench_recovery.py --runs 5
    python scripts/bench_recovery.py --runs 1 --faults delay,raise     # a quick look
    python scripts/bench_recovery.py --soak 20 --seed 0                # one soak run of 20 faults

For each fault of rank 1 at step 6 (checkpoints every 5 steps), each run of the reference
trainer measures, on the same run:

- detection: fault to the first typed error on a survivor (for ``corrupt``, on any rank) or
  the torchrun agent acting on the dead worker, whichever comes first;
- detection to the next completed step: the recovery itself (in-job: abort, epoch join,
  rebuild, rollback; restart: torchrun restart, re-import, compile, checkpoint load) plus
  one step;
- fault to the first completed step after it, and cold start (launch to the first step);
- how it recovered (`recovery` of the chaos report: "in_job" or "restart"), whether the
  PIDs stayed the same, and whether the run is bitwise equal to the fault-free reference
  (losses, model and optimizer state; the reference is computed once under `<out>/reference`).

Faults that leave every process alive (``delay``, ``raise``, ``corrupt``, ``hang``) run
twice in the same invocation: with the trainer's default in-job recovery and with
``--no-in-job-recovery`` (the restart path), so the two are measured side by side on the
same machine and load. ``kill`` has only the restart path.

Targets: in-job rows recovered in-job in every run, PIDs unchanged, bitwise, detection to
next step at most 1.0 s; kill detected under 1 s; hang detected within the deadline + 0.5 s. It prints
medians as a markdown table and writes every run's figures to `<out>/bench_recovery.json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import chaos

IN_JOB_FAULTS = ("delay", "raise", "corrupt", "hang")
ALL_FAULTS = ("kill", *IN_JOB_FAULTS)


def measure(kind: str, path: str, run: int, out: Path, deadline: float) -> dict[str, object] | None:
    """One run's figures, or None (with the reason printed) when it did not recover."""
    args = ["--steps", "8", "--ckpt-every", "5", "--timeout", str(deadline)]
    if path == "restart" and kind != "kill":
        args.append("--no-in-job-recovery")
    report = chaos.run([f"{kind}:rank=1,step=6"], out / f"{kind}-{path}-{run}", args, png=False,
                       reference_dir=out / "reference", timeout_s=900)
    if not report.passed or len(report.faults) != 1:
        print(f"{kind} ({path}) run {run} did not recover:\n{report.summary()}", file=sys.stderr)
        return None
    [fault] = report.faults
    return {"recovery": fault.recovery, "pids_unchanged": fault.restart_after_s is None and report.restarts == 0,
            "bitwise": report.bitwise_verified,
            "detected_after_s": fault.detected_after_s, "detected_by": (fault.detected_by or {}).get("event"),
            "detection_to_step_s": fault.detection_to_step_s, "in_job_recovery_s": fault.in_job_recovery_s,
            "first_step_after_s": fault.first_step_after_s, "cold_start_s": report.cold_start_s,
            "restarts": report.restarts}


def soak(n: int, seed: int, out: Path) -> int:
    """One soak run (`chaos.soak`): its verdict, and recovery per fault kind (median and max)."""
    from chaos.soak import soak_plan, soak_trainer_args

    report = chaos.run(soak_plan(n, seed, 2), out / f"soak{n}-seed{seed}", soak_trainer_args(n),
                       reference_dir=out / "reference", timeout_s=1800)
    print(f"soak: {n} faults, seed {seed}, 2 ranks: {'PASSED' if report.passed else 'FAILED'}, bitwise "
          f"{'verified' if report.bitwise_verified else 'NOT verified'}, {report.restarts} restarts, "
          f"{report.duration_s:.0f} s in all\n")
    print("| fault | count | recovered as | detection (median / max) | fault -> next step (median / max) |")
    print("| --- | ---: | --- | ---: | ---: |")
    kinds = sorted({f.type for f in report.faults})
    for kind in kinds:
        faults = [f for f in report.faults if f.type == kind]
        detect = sorted(f.detected_after_s for f in faults if f.detected_after_s is not None)
        after = sorted(f.first_step_after_s for f in faults if f.first_step_after_s is not None)

        def mm(values: list[float]) -> str:
            return f"{statistics.median(values):.2f} / {max(values):.2f} s" if values else "-"

        paths = "/".join(sorted({str(f.recovery) for f in faults}))
        print(f"| {kind} | {len(faults)} | {paths} | {mm(detect)} | {mm(after)} |")
    if not report.passed:
        print(report.summary(), file=sys.stderr)
    return 0 if report.passed and report.bitwise_verified else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--deadline", type=float, default=5.0, help="the trainer's collective deadline (--timeout)")
    p.add_argument("--faults", default=",".join(ALL_FAULTS), help=f"comma-separated, of {ALL_FAULTS}")
    p.add_argument("--out", default="runs/bench_recovery")
    p.add_argument("--soak", type=int, default=None, metavar="N", help="instead: one soak run of N faults")
    p.add_argument("--seed", type=int, default=0, help="the soak's seed")
    args = p.parse_args()
    if args.soak is not None:
        return soak(args.soak, args.seed, Path(args.out))
    kinds = [k for k in args.faults.split(",") if k]
    unknown = [k for k in kinds if k not in ALL_FAULTS]
    if unknown:
        p.error(f"expected --faults among {ALL_FAULTS}; found {unknown}")
    out = Path(args.out)
    cases = [(k, path) for k in kinds for path in (("in_job", "restart") if k in IN_JOB_FAULTS else ("restart",))]
    results = {f"{k}/{path}": [measure(k, path, i, out, args.deadline) for i in range(args.runs)]
               for k, path in cases}
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_recovery.json").write_text(json.dumps(results, indent=2) + "\n")

    print(f"{args.runs} runs each, 2 ranks, deadline {args.deadline:g} s; medians over the runs that recovered\n")
    print("| fault | asked | recovered | recovered as | PIDs unchanged | bitwise | detection | detected by | "
          "detection -> next step | fault -> first step | cold start | targets |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    ok = True
    for (kind, path), all_runs in zip(cases, results.values()):
        runs = [r for r in all_runs if r is not None]
        if not runs:
            print(f"| {kind} | {path} | 0/{len(all_runs)} | | | | | | | | | MISSED |")
            ok = False
            continue

        def med(key: str) -> float:
            values = [float(r[key]) for r in runs if r[key] is not None]  # type: ignore[arg-type]
            return statistics.median(values) if values else float("nan")

        as_ = "/".join(sorted({str(r["recovery"]) for r in runs}))
        same = sum(bool(r["pids_unchanged"]) for r in runs)
        bitwise = sum(bool(r["bitwise"]) for r in runs)
        ok &= bitwise == len(all_runs)
        by = "/".join(sorted({str(r["detected_by"]) for r in runs}))
        detect, to_step = med("detected_after_s"), med("detection_to_step_s")
        targets = []
        if path == "in_job":
            in_job = sum(r["recovery"] == "in_job" for r in runs)
            met = in_job == len(all_runs) and same == len(all_runs) and bitwise == len(all_runs) and to_step <= 1.0
            targets.append(f"in-job {in_job}/{len(all_runs)}, detection -> step <= 1.0 s: "
                           f"{'met' if met else 'MISSED'}")
            ok &= met
        elif kind in ("kill", "hang"):
            limit = 1.0 if kind == "kill" else args.deadline + 0.5
            met = detect < limit and len(runs) == len(all_runs)
            targets.append(f"detection < {limit:g} s: {'met' if met else 'MISSED'}")
            ok &= met
        print(f"| {kind} | {path} | {len(runs)}/{len(all_runs)} | {as_} | {same}/{len(runs)} | {bitwise}/{len(runs)} | "
              f"{detect:.2f} s | {by} | "
              f"{to_step:.2f} s | {med('first_step_after_s'):.2f} s | {med('cold_start_s'):.2f} s | "
              f"{'; '.join(targets) or '-'} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
