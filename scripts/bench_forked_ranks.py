"""What a rank forked by `commlib.testing.run` costs, by what its fork server imported first.

`commlib.testing.run` forks each rank from multiprocessing's fork server. What the server
imported once, a rank inherits; what it did not, every rank imports again: commlib itself,
and pytest, which the test module holding the rank's function imports (this script imports
it at the top for the same reason).

Each round starts two fresh processes, one per variant, in alternating order; each starts its
own fork server and makes `--calls` calls of a 2-rank gloo job whose function does one
all_reduce:
  torch    the server imports torch only (commlib.testing's preload before the sixth session)
  preload  commlib.testing's preload as it is (torch, commlib, pytest)
Per rank, its CPU from fork to the end of its function (`getrusage`, which a fork starts
at zero); per call, the wall time in the caller. The server's own start is not counted (one
per test worker). The figures are medians; the ratio is preload / torch in the same run.

Usage: .venv/bin/python scripts/bench_forked_ranks.py [--rounds N] [--calls N]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest  # noqa: F401  (what a test module imports: see the docstring)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = ("torch", "preload")


def one_all_reduce(comm) -> float:  # type: ignore[no-untyped-def]
    import torch

    comm.all_reduce(torch.ones(4))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_child(variant: str, calls: int) -> dict[str, list[float]]:
    from commlib import testing

    if variant == "torch":
        multiprocessing.set_forkserver_preload(["torch"])
    testing.run(one_all_reduce, 2)  # starts the server: not counted
    rank_cpu, call_wall = [], []
    for _ in range(calls):
        start = time.perf_counter()
        rank_cpu += testing.run(one_all_reduce, 2)
        call_wall.append(time.perf_counter() - start)
    return {"rank_cpu_s": rank_cpu, "call_wall_s": call_wall}


def spawn(variant: str, calls: int) -> dict[str, list[float]]:
    argv = [sys.executable, __file__, "--child", variant, "--calls", str(calls)]
    proc = subprocess.run(argv, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(args.child, args.calls)))
        return

    results: dict[str, dict[str, list[float]]] = {v: {"rank_cpu_s": [], "call_wall_s": []} for v in VARIANTS}
    print(f"Load average at start: {os.getloadavg()[0]:.1f}.")
    for i in range(args.rounds):
        for variant in VARIANTS if i % 2 == 0 else VARIANTS[::-1]:
            for key, values in spawn(variant, args.calls).items():
                results[variant][key] += values
    print(f"Load average at end: {os.getloadavg()[0]:.1f}. {args.rounds} rounds of {args.calls} calls each.\n")
    print("| server imported | rank's CPU s (median) | call's wall s (median) |")
    print("|---|---:|---:|")
    medians = {v: {key: statistics.median(values) for key, values in r.items()} for v, r in results.items()}
    for variant, m in medians.items():
        print(f"| {variant} | {m['rank_cpu_s']:.3f} | {m['call_wall_s']:.3f} |")
    ratio = {key: medians["preload"][key] / medians["torch"][key] for key in ("rank_cpu_s", "call_wall_s")}
    print(f"\npreload / torch: rank's CPU {ratio['rank_cpu_s']:.2f}, call's wall {ratio['call_wall_s']:.2f}.")


if __name__ == "__main__":
    main()
