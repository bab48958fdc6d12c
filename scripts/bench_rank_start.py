"""What a restarted rank pays to compile its attention from a warm inductor cache, on CPU.

Every torchrun restart after a fault starts each rank afresh, and its first attention call
compiles ``flex_attention`` again from the host's warm cache. Two of inductor's options decide
whether that also runs two child processes (the C++ preprocessor over inductor's prefix
header, and a Python that loads a probe library to prove the CPU's vector ISA):
``chaos.workload.model.compiled_flex_attention`` turns both off for its own compile.

Each round starts two fresh processes, one per variant, in alternating order, sharing one
inductor cache directory warmed by a first, untimed process of each variant:
  model     the trainer's compiled_flex_attention() (its options)
  defaults  torch.compile(flex_attention, dynamic=False), inductor's defaults
Each measures torch.compile and the first call of the compiled kernel at the trainer's
shapes (forward, as on CPU: the backward there is dense): its own CPU,
its children's CPU (what the options remove) and the wall time. The figures are medians;
the ratio is model / defaults in the same run.

Usage: .venv/bin/python scripts/bench_rank_start.py [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = ("model", "defaults")


def run_child(variant: str) -> dict[str, float]:
    """The first call's costs in this fresh process."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    from chaos.workload.model import ModelConfig, build_block_mask, compiled_flex_attention

    cfg = ModelConfig()
    block_mask = build_block_mask(cfg, None, "cpu")
    q, k, v = (torch.zeros(2, cfg.n_heads, cfg.seq_len, cfg.head_dim) for _ in range(3))

    def cpu() -> tuple[float, float]:
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime

    (own0, children0), start = cpu(), time.perf_counter()
    # torch.compile itself imports inductor (seconds, the same in both variants); timed too.
    compiled = compiled_flex_attention() if variant == "model" else torch.compile(flex_attention, dynamic=False)
    with torch.no_grad():
        compiled(q, k, v, block_mask=block_mask)
    wall = time.perf_counter() - start
    own1, children1 = cpu()
    return {"own_cpu_s": own1 - own0, "children_cpu_s": children1 - children0, "wall_s": wall}


def spawn(variant: str, cache_dir: str) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", variant],
        capture_output=True, text=True, env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir), check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(args.child)))
        return

    results: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    print(f"Load average at start: {os.getloadavg()[0]:.1f}.")
    with tempfile.TemporaryDirectory() as cache_dir:
        for variant in VARIANTS:
            spawn(variant, cache_dir)  # the cold compile, untimed: every later process finds its kernel
        for i in range(args.rounds):
            for variant in VARIANTS if i % 2 == 0 else VARIANTS[::-1]:
                results[variant].append(spawn(variant, cache_dir))
    print(f"Load average at end: {os.getloadavg()[0]:.1f}. Medians of {args.rounds} fresh processes each.\n")
    print("| variant | own CPU s | children's CPU s | CPU in all s | wall s |")
    print("|---|---:|---:|---:|---:|")
    medians = {}
    for variant, runs in results.items():
        m = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        m["all_cpu_s"] = statistics.median(r["own_cpu_s"] + r["children_cpu_s"] for r in runs)
        medians[variant] = m
        print(f"| {variant} | {m['own_cpu_s']:.2f} | {m['children_cpu_s']:.2f} | {m['all_cpu_s']:.2f} "
              f"| {m['wall_s']:.2f} |")
    model, defaults = medians["model"], medians["defaults"]
    print(f"\nmodel / defaults: CPU in all {model['all_cpu_s'] / defaults['all_cpu_s']:.2f}, "
          f"wall {model['wall_s'] / defaults['wall_s']:.2f}.")


if __name__ == "__main__":
    main()
