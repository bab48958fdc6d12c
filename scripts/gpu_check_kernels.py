"""Checks of the workload's kernels on a CUDA machine (written for torch 2.11+; cannot run on CPU).

1. attention(): on CUDA the model's route is the compiled flex_attention forward AND its own
   backward (not the CPU route's dense recompute). For each mask (causal, document,
   sliding), fp32 and bf16, the output and dq/dk/dv are compared with an fp64
   scaled_dot_product_attention on the equivalent boolean mask. Also reports whether two
   identical forward+backward runs give bitwise-equal gradients under set_deterministic().
2. The model (Transformer) forward+backward on CUDA, fused loss vs nn.Linear + cross-entropy
   -- only where torch has nn.LinearCrossEntropyLoss (2.13+); skipped otherwise.
3. Benchmark: compiled FlexAttention vs SDPA with the dense mask, forward and
   forward+backward, B=1 H=4 D=64, S in 1024/2048/4096, masks causal / sliding 256 /
   8 documents (the CPU benchmark's shapes, scripts/bench_attention.py).

Prints what it ran and what it skipped. Exit status: 0 all checks passed, 1 a check failed,
2 no CUDA device (nothing checked).

Usage: python scripts/gpu_check_kernels.py [--no-bench]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from chaos.workload import model as workload_model
from chaos.workload.model import ModelConfig, attention, build_block_mask, dense_mask, set_deterministic

TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 3e-2}  # max abs error vs fp64, unit-variance inputs
DOC_IDS = torch.tensor([[0] * 50 + [1] + [2] * 77 + [3] * 128, [0] * 255 + [1]])


def check_attention(device: torch.device) -> bool:
    cfg = ModelConfig()
    shape = (2, cfg.n_heads, cfg.seq_len, cfg.head_dim)
    ok = True
    for mask in ("causal", "document", "sliding"):
        block_mask = build_block_mask(ModelConfig(mask=mask), DOC_IDS, device)
        allowed = dense_mask(block_mask)
        for dtype in (torch.float32, torch.bfloat16):
            gen = torch.Generator(device).manual_seed(0)
            q, k, v, grad_out = (torch.randn(shape, generator=gen, device=device) for _ in range(4))

            def run(dt: torch.dtype, fn) -> list[torch.Tensor]:
                # Fresh leaves every run: `.to` of a tensor already in `dt` is that very tensor,
                # so q/k/v themselves would require grad and every later conversion of them
                # would be a non-leaf, whose .grad stays None.
                leaves = [t.detach().to(dt, copy=True).requires_grad_() for t in (q, k, v)]
                out = fn(*leaves)
                out.backward(grad_out.to(dt))
                return [out.detach()] + [t.grad for t in leaves]

            got = run(dtype, lambda *t: attention(*t, block_mask))
            again = run(dtype, lambda *t: attention(*t, block_mask))
            want = run(torch.float64, lambda *t: F.scaled_dot_product_attention(*t, attn_mask=allowed))
            errors = [(g.double() - w).abs().max().item() for g, w in zip(got, want)]
            bitwise = all(torch.equal(a, b) for a, b in zip(got, again))
            passed = max(errors) <= TOLERANCE[dtype]
            ok &= passed
            print(f"  attention {mask:8s} {str(dtype):14s} max abs err out/dq/dk/dv "
                  + "/".join(f"{e:.1e}" for e in errors)
                  + f"  {'ok' if passed else 'FAIL'}; repeat bitwise equal: {bitwise}")
    return ok


def check_route(device: torch.device) -> bool:
    """The CUDA route must call the compiled kernel and differentiate through flex itself."""
    calls = []
    compiled = workload_model.compiled_flex_attention()

    def spy(*args, **kwargs):
        calls.append(1)
        return compiled(*args, **kwargs)

    original = workload_model.compiled_flex_attention
    workload_model.compiled_flex_attention = lambda: spy
    try:
        cfg = ModelConfig()
        q = torch.randn(2, cfg.n_heads, cfg.seq_len, cfg.head_dim, device=device, requires_grad=True)
        out = attention(q, q, q, build_block_mask(cfg, None, device))
    finally:
        workload_model.compiled_flex_attention = original
    name = type(out.grad_fn).__name__
    passed = calls == [1] and "FlexAttentionCPU" not in name
    print(f"  route: compiled flex called {len(calls)}x, grad_fn {name}  {'ok' if passed else 'FAIL'}")
    return passed


def check_model(device: torch.device) -> bool:
    if not hasattr(torch.nn, "LinearCrossEntropyLoss"):
        print(f"  model: SKIPPED (torch {torch.__version__} has no nn.LinearCrossEntropyLoss)")
        return True
    cfg = ModelConfig()
    model = workload_model.Transformer(cfg, seed=0, device=device)
    captured = []
    model.head.register_forward_hook(lambda module, args, out: captured.append(args))
    tokens = torch.randint(0, cfg.vocab, (2, cfg.seq_len + 1), device=device)
    loss = model(tokens[:, :-1], tokens[:, 1:], build_block_mask(cfg, None, device))
    loss.backward()
    hidden, targets = captured[0]
    ref = F.cross_entropy(F.linear(hidden.detach(), model.head.linear.weight.detach()), targets)
    error = (loss - ref).abs().item()
    passed = error <= 1e-4 and all(p.grad is not None for p in model.parameters())
    print(f"  model: loss {loss.item():.4f}, |fused - reference| {error:.1e}  {'ok' if passed else 'FAIL'}")
    return passed


def bench(device: torch.device) -> None:
    flex = workload_model.compiled_flex_attention()
    print("\n| mask | S | dtype | first call s | flex fwd ms | SDPA fwd ms | flex fwd+bwd ms | SDPA fwd+bwd ms |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")

    def median_ms(fn, backward: bool) -> float:
        times = []
        for _ in range(25):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = fn()
            if backward:
                out.sum().backward()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times[5:])

    for seq_len in (1024, 2048, 4096):
        doc_ids = (torch.arange(seq_len) * 8 // seq_len).expand(1, seq_len)
        for mask in ("causal", "sliding", "document"):
            cfg = ModelConfig(seq_len=seq_len, mask=mask, window=256)
            block_mask = build_block_mask(cfg, doc_ids, device)
            allowed = dense_mask(block_mask)
            for dtype in (torch.float32, torch.bfloat16):
                q, k, v = (torch.randn(1, 4, seq_len, 64, device=device, dtype=dtype, requires_grad=True)
                           for _ in range(3))
                torch.cuda.synchronize()
                start = time.perf_counter()
                flex(q, k, v, block_mask=block_mask).sum().backward()
                torch.cuda.synchronize()
                first = time.perf_counter() - start
                row = [median_ms(lambda: flex(q, k, v, block_mask=block_mask), False),
                       median_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed), False),
                       median_ms(lambda: flex(q, k, v, block_mask=block_mask), True),
                       median_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed), True)]
                print(f"| {mask} | {seq_len} | {str(dtype).removeprefix('torch.')} | {first:.1f} | "
                      + " | ".join(f"{t:.2f}" for t in row) + " |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-bench", action="store_true", help="checks only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(f"gpu_check_kernels: no CUDA device (torch {torch.__version__}); nothing checked. "
              "Run it on a CUDA machine.", file=sys.stderr)
        return 2
    set_deterministic()
    device = torch.device("cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}")
    print("ran: attention route, attention vs SDPA per mask (fp32, bf16), model fused loss"
          + ("" if args.no_bench else ", attention benchmark"))
    ok = check_route(device)
    ok &= check_attention(device)
    ok &= check_model(device)
    if args.no_bench:
        print("skipped: benchmark (--no-bench)")
    else:
        # Benchmarks measure speed, not reproducibility: deterministic mode would slow SDPA.
        torch.use_deterministic_algorithms(False)
        bench(device)
    print("ALL CHECKS PASSED" if ok else "A CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
