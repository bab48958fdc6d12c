"""Compiled FlexAttention vs scaled_dot_product_attention with the equivalent dense mask, CPU inference.

Masks are the workload's (chaos.workload.model.build_block_mask): causal, sliding window
256, and 8 equal packed documents; fp32, batch 1, 4 heads, head dim 64, no grad. The flex
kernel is the model's compiled_flex_attention(); SDPA gets the boolean mask that
model.dense_mask evaluates from the same mask_mod.

Per (mask, S), two fresh processes share a new, empty TORCHINDUCTOR_CACHE_DIR:
  cold  first call of the compiled kernel with the empty cache (full compile)
  warm  first call in a new process once that cache is filled (what a restarted rank
        pays), then the steady state: interleaved repeats of flex and SDPA, medians.

Usage: .venv/bin/python scripts/bench_attention.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

BATCH, HEADS, HEAD_DIM = 1, 4, 64
WINDOW, DOCUMENTS = 256, 8
TIME_BUDGET_S = 2.0  # per implementation, for the steady-state repeats
MIN_REPEATS, MAX_REPEATS = 3, 20


def run_child(mask: str, seq_len: int, steady: bool) -> dict:
    """First-call time (and, if steady, steady-state timings) in this fresh process."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask

    from chaos.workload.model import (
        ModelConfig,
        build_block_mask,
        compiled_flex_attention,
        dense_mask,
    )

    cfg = ModelConfig(seq_len=seq_len, mask=mask, window=WINDOW)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(BATCH, HEADS, seq_len, HEAD_DIM, generator=gen) for _ in range(3))
    doc_ids = (torch.arange(seq_len) * DOCUMENTS // seq_len).expand(BATCH, seq_len)

    block_mask = build_block_mask(cfg, doc_ids, "cpu")
    # Timed again from the same mask_mod: the first build in a process pays seconds of
    # one-time setup, and build_block_mask caches the causal and sliding masks.
    start = time.perf_counter()
    create_block_mask(block_mask.mask_mod, block_mask.shape[0], None, seq_len, seq_len, device="cpu")
    mask_ms = (time.perf_counter() - start) * 1e3
    flex = compiled_flex_attention()
    with torch.no_grad():
        start = time.perf_counter()
        out = flex(q, k, v, block_mask=block_mask)
        first_s = time.perf_counter() - start
        result = {"mask_ms": mask_ms, "first_s": first_s}
        if not steady:
            return result

        dense = dense_mask(block_mask)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
        result["max_diff"] = (out - ref).abs().max().item()
        runs = {
            "flex": lambda: flex(q, k, v, block_mask=block_mask),
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense),
        }
        wall: dict[str, list[float]] = {name: [] for name in runs}
        cpu: dict[str, list[float]] = {name: [] for name in runs}
        # Interleaved, so load changes on a shared machine hit both implementations alike.
        while len(wall["flex"]) < MAX_REPEATS and (
            len(wall["flex"]) < MIN_REPEATS or sum(wall["flex"]) + sum(wall["sdpa"]) < 2 * TIME_BUDGET_S
        ):
            for name, fn in runs.items():
                start, start_cpu = time.perf_counter(), time.process_time()
                fn()
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
    for name in runs:
        result[f"{name}_ms"] = statistics.median(wall[name]) * 1e3
        result[f"{name}_cpu_ms"] = statistics.median(cpu[name]) * 1e3
    return result


def spawn(mask: str, seq_len: int, steady: bool, cache_dir: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps([mask, seq_len, steady])],
        capture_output=True, text=True, env=env, check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="S=1024 only")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(*json.loads(args.child))))
        return

    import torch

    lengths = (1024,) if args.quick else (1024, 2048, 4096)
    print(f"FlexAttention (compiled) vs SDPA + dense bool mask, CPU inference, fp32, "
          f"B={BATCH} H={HEADS} D={HEAD_DIM}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}. Load average at start: {os.getloadavg()[0]:.1f}.")
    print("speedup = SDPA median / flex median (>1: flex faster), by wall and by process CPU time.\n")
    print("| mask | S | create_block_mask ms | cold first call s | warm first call s | flex ms | SDPA ms "
          "| speedup (wall) | speedup (cpu) | max abs diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    masks = {"causal": "causal", "sliding": f"sliding {WINDOW}", "document": f"{DOCUMENTS} documents"}
    for seq_len in lengths:
        for mask, label in masks.items():
            with tempfile.TemporaryDirectory() as cache_dir:
                cold = spawn(mask, seq_len, False, cache_dir)
                warm = spawn(mask, seq_len, True, cache_dir)
            print(f"| {label} | {seq_len} | {warm['mask_ms']:.1f} | {cold['first_s']:.1f} "
                  f"| {warm['first_s']:.1f} | {warm['flex_ms']:.1f} | {warm['sdpa_ms']:.1f} "
                  f"| {warm['sdpa_ms'] / warm['flex_ms']:.2f}x "
                  f"| {warm['sdpa_cpu_ms'] / warm['flex_cpu_ms']:.2f}x | {warm['max_diff']:.1e} |",
                  flush=True)
    print(f"\nLoad average at end: {os.getloadavg()[0]:.1f}.")


if __name__ == "__main__":
    main()
