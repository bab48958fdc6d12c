"""Peak memory and time of the workload's fused head+loss against nn.Linear + nn.CrossEntropyLoss.

Implementations, forward+backward on CPU:
  reference  nn.Linear(bias=False) + nn.CrossEntropyLoss (materializes [tokens, vocab] logits)
  fused      nn.LinearCrossEntropyLoss with the options the model uses (model.loss_options)
  auto       nn.LinearCrossEntropyLoss with LinearCrossEntropyOptions() (automatic chunking)

Every (configuration, implementation) runs in a fresh subprocess, one at a time, so one
run's allocator state cannot hide another's peak. Peak memory is the child's ru_maxrss
high-water mark after its first forward+backward minus its RSS just before it: the extra
memory the step needed, gradients included. Numerics: in fp32 the fused and auto losses
and gradients (input and weight) are compared with the reference's, |loss diff| and
max|grad diff| / max|grad| must both be <= 1e-4.

A child that exceeds --timeout is reported as such, and larger configurations of the same
implementation and dtype are skipped (they would be slower still). bf16 GEMMs are emulated
on CPUs without AVX512-BF16/AMX and may take minutes per configuration there.

Usage: .venv/bin/python scripts/bench_fused_loss.py [--quick] [--timeout S]
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
from dataclasses import asdict, dataclass

IMPLS = ("reference", "fused", "auto")
TOLERANCE = 1e-4
TIME_BUDGET_S = 5.0  # timed repeats after the first step stop once this much time is spent
MAX_REPEATS = 5


@dataclass(frozen=True)
class Spec:
    hidden: int
    vocab: int
    tokens: int
    dtype: str
    impl: str
    threads: int
    save_path: str | None  # fp32 only: where the child saves loss and gradients for the check


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def _build(impl: str, hidden: int, vocab: int, tokens: int, dtype_name: str):
    """(input, weight, step) for one implementation; step() returns the loss."""
    import torch
    from torch import nn

    from chaos.workload.model import ModelConfig, loss_options

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    # Everything is created in its final dtype, in place: a temporary here would raise the
    # high-water mark before the measured step and hide part of its peak.
    x = torch.randn(tokens, hidden, generator=gen, dtype=dtype).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), generator=gen)
    if impl == "reference":
        linear = nn.Linear(hidden, vocab, bias=False, dtype=dtype)
        criterion = nn.CrossEntropyLoss()
        weight = linear.weight

        def step() -> torch.Tensor:
            return criterion(linear(x), target)
    else:
        options = loss_options(ModelConfig()) if impl == "fused" else nn.LinearCrossEntropyOptions()
        head = nn.LinearCrossEntropyLoss(hidden, vocab, dtype=dtype, options=options)
        weight = head.linear.weight

        def step() -> torch.Tensor:
            return head(x, target)

    with torch.no_grad():
        weight.normal_(0.0, hidden**-0.5, generator=gen)
    return x, weight, step


def run_child(spec: Spec) -> dict:
    """One configuration in this (fresh) process; returns the measurements."""
    import torch

    torch.set_num_threads(spec.threads)
    # A tiny step first: the chunked path's first call loads ~80 MB of code and state,
    # which would otherwise be counted as the step's peak.
    _, _, warmup = _build(spec.impl, 16, 64, 16, spec.dtype)
    warmup().backward()
    x, weight, step = _build(spec.impl, spec.hidden, spec.vocab, spec.tokens, spec.dtype)

    wall, cpu = [], []
    rss_before = _rss_kib()
    for _ in range(1 + MAX_REPEATS):
        x.grad = weight.grad = None
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = step()
        loss.backward()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        if len(wall) == 1:
            peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
            if spec.save_path:
                torch.save({"loss": loss.detach(), "x": x.grad, "w": weight.grad}, spec.save_path)
        if sum(wall[1:]) >= TIME_BUDGET_S or sum(wall) >= 4 * TIME_BUDGET_S:
            break
    # The first step pays one-time costs (page faults of fresh memory); the median of the
    # repeats is the steady state when there are any.
    timed = slice(1, None) if len(wall) > 1 else slice(0, 1)
    return {
        "peak_mib": max(peak_kib, 0) / 1024,
        "wall_s": statistics.median(wall[timed]),
        "cpu_s": statistics.median(cpu[timed]),
    }


def check(ref_path: str, path: str) -> tuple[float, float]:
    """(|loss diff|, worst relative max grad diff) of a fused run against the reference."""
    import torch

    ref, got = torch.load(ref_path), torch.load(path)
    loss_diff = (ref["loss"] - got["loss"]).abs().item()
    grad_diff = max(
        ((ref[k] - got[k]).abs().max() / ref[k].abs().max()).item() for k in ("x", "w")
    )
    return loss_diff, grad_diff


def configs(quick: bool) -> list[tuple[str, int, int, int, str, int]]:
    """(label, hidden, vocab, tokens, dtype, threads) in increasing size per dtype."""
    import torch

    from chaos.workload.data import DataConfig
    from chaos.workload.model import ModelConfig

    model, data = ModelConfig(), DataConfig()
    # One thread, as each rank of a 2-rank torchrun on 2 cores runs (OMP_NUM_THREADS=1).
    trainer = ("trainer default, 1 thread:", model.dim, model.vocab, data.batch_size * data.seq_len,
               "float32", 1)
    threads = torch.get_num_threads()
    if quick:
        return [trainer, ("", 1024, 32000, 2048, "float32", threads)]
    sizes = sorted(
        ((1024, v, t) for v in (32000, 128256) for t in (2048, 8192)), key=lambda c: c[1] * c[2]
    )
    return [trainer] + [("", *s, dt, threads) for dt in ("float32", "bfloat16") for s in sizes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="trainer default + 1024/32000/2048 fp32")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per child run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(Spec(**json.loads(args.child)))))
        return

    import torch

    print(f"Fused head+loss vs nn.Linear + nn.CrossEntropyLoss, forward+backward, CPU, "
          f"{torch.get_num_threads()} threads unless noted, torch {torch.__version__}.")
    print("peak = child ru_maxrss after the first step minus its RSS before it (MiB);")
    print("wall / cpu = median wall and process CPU seconds of up to 5 repeats after the first")
    print("step; 'cpu vs ref' is the ratio of CPU seconds (includes OpenMP spin-waits).")
    print(f"Each row: a fresh process. Load average at start: {os.getloadavg()[0]:.1f}.\n")
    print("| config (hidden/vocab/tokens) | dtype | impl | peak MiB | peak vs ref | wall s | cpu s | cpu vs ref | numerics vs ref |")
    print("|---|---|---|---:|---:|---:|---:|---:|---|")
    timed_out: set[tuple[str, str]] = set()
    with tempfile.TemporaryDirectory() as tmp:
        for label, hidden, vocab, tokens, dtype, threads in configs(args.quick):
            name = f"{label + ' ' if label else ''}{hidden}/{vocab}/{tokens}"
            ref: dict | None = None
            for impl in IMPLS:
                cells = [name, dtype, impl]
                save = os.path.join(tmp, f"{impl}.pt") if dtype == "float32" else None
                spec = Spec(hidden, vocab, tokens, dtype, impl, threads, save)
                result = None
                if (impl, dtype) in timed_out:
                    cells += ["skipped (a smaller config timed out)"] + [""] * 5
                else:
                    try:
                        proc = subprocess.run(
                            [sys.executable, __file__, "--child", json.dumps(asdict(spec))],
                            capture_output=True, text=True, timeout=args.timeout, check=True,
                        )
                        result = json.loads(proc.stdout.strip().splitlines()[-1])
                    except subprocess.TimeoutExpired:
                        timed_out.add((impl, dtype))
                        cells += [f"timeout (> {args.timeout:.0f} s)"] + [""] * 5
                    except subprocess.CalledProcessError as err:
                        cells += [f"failed: {err.stderr.strip().splitlines()[-1]}"] + [""] * 5
                if result is not None:
                    if impl == "reference":
                        ref = result
                    peak_ratio = f"{result['peak_mib'] / ref['peak_mib']:.2f}x" if ref else ""
                    cpu_ratio = f"{result['cpu_s'] / ref['cpu_s']:.2f}x" if ref else ""
                    numerics = ""
                    if save and impl != "reference" and ref:
                        loss_diff, grad_diff = check(os.path.join(tmp, "reference.pt"), save)
                        ok = "ok" if max(loss_diff, grad_diff) <= TOLERANCE else "FAIL"
                        numerics = f"{ok}: loss {loss_diff:.1e}, grad {grad_diff:.1e}"
                    cells += [f"{result['peak_mib']:.0f}", peak_ratio, f"{result['wall_s']:.3f}",
                              f"{result['cpu_s']:.3f}", cpu_ratio, numerics]
                print("| " + " | ".join(cells) + " |", flush=True)
            for impl in IMPLS:
                path = os.path.join(tmp, f"{impl}.pt")
                if os.path.exists(path):
                    os.remove(path)
    print(f"\nLoad average at end: {os.getloadavg()[0]:.1f}.")


if __name__ == "__main__":
    main()
