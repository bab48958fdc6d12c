"""What a chaos rank's start costs with and without `chaos.entry`'s collector freeze, on CPU.

`chaos.entry` imports torch and commlib with Python's garbage collector off and then freezes
what they made (`gc.freeze`), so that no later collection walks those objects again: not the
trainer's imports, not inductor's compile, not the steps. Every fault a chaos run injects
restarts each rank, so this is paid at every start.

Each round starts two fresh processes, one per variant, in alternating order: one rank of the
reference trainer at the chaos tests' tiny config (8 steps, a checkpoint every 2, FlexAttention
compiled from the warm inductor cache; the soak's small model, `chaos.soak.SOAK_MODEL_ARGS`),
world size 1, in a directory of its own:
  entry       ``python -m chaos.entry -m chaos.workload.train ...``, as the harness starts a rank
  collector   the same, with ``gc.disable`` and ``gc.freeze`` made no-ops first: the collector
              runs as it would without the freeze
A first, untimed process of each variant warms the inductor cache. The figures are medians of
each process's CPU (user + system, from `os.wait4`) and wall time; the ratio is entry /
collector in the same run.

Usage: .venv/bin/python scripts/bench_rank_gc.py [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from chaos.soak import SOAK_MODEL_ARGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINER = ("-m", "chaos.workload.train", "--steps", "8", "--ckpt-every", "2", "--timeout", "10", *SOAK_MODEL_ARGS)
NO_FREEZE = "import gc; gc.disable = gc.freeze = lambda: None; from chaos.entry import main; main()"
VARIANTS = {
    "entry": ("-m", "chaos.entry", *TRAINER),
    "collector": ("-c", NO_FREEZE, *TRAINER),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_rank(variant: str) -> tuple[float, float]:
    """(CPU s, wall s) of one fresh rank of `variant`."""
    env = {
        **os.environ,
        "PYTHONPATH": ROOT,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
    }
    with tempfile.TemporaryDirectory() as work, open(os.path.join(work, "stderr"), "w+") as stderr:
        start = time.perf_counter()
        child = subprocess.Popen(
            [sys.executable, *VARIANTS[variant]], cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=stderr
        )
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - start
        code = os.waitstatus_to_exitcode(status)
        stderr.seek(0)
        if code != 0:
            raise SystemExit(f"bench_rank_gc: the {variant} rank exited {code}:\n{stderr.read()[-2000:]}")
    return usage.ru_utime + usage.ru_stime, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    for variant in VARIANTS:  # the warm inductor cache, untimed
        one_rank(variant)
    results: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
        for variant in order:
            results[variant].append(one_rank(variant))
    print(f"one reference-trainer rank, tiny config, world size 1, medians of {rounds} fresh processes:")
    print("| variant | CPU s | wall s |")
    print("|---|---:|---:|")
    medians = {}
    for variant, runs in results.items():
        cpu, wall = statistics.median(c for c, _ in runs), statistics.median(w for _, w in runs)
        medians[variant] = cpu
        print(f"| {variant} | {cpu:.2f} | {wall:.2f} |")
    saved = medians["collector"] - medians["entry"]
    print(f"entry / collector, CPU: {medians['entry'] / medians['collector']:.2f}x ({saved:.2f} s less per rank start)")


if __name__ == "__main__":
    main()
