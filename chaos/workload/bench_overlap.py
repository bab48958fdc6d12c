"""A/B benchmark of the sharding modes on the reference model and data.

    torchrun --standalone --nproc-per-node 2 -m chaos.workload.bench_overlap [--modes single,dual,native] [--steps 20]

Each mode's sharded model (same seed) and AdamW are built once, warmed up, and then the
modes take turns, one step each, in an order rotated every round (A B C, B C A, ...), so
load drifts on a shared machine hit every mode alike. A barrier outside the measured
region lines the ranks up before each step; a step's time is the slowest rank's. Only
model, data and optimizer come from `chaos.workload`; this is not the chaos trainer.

Per mode it prints the median step time and its ratio to the first mode, the overlap and
exposed communication that `fsdp_overlap.timeline` computes from this run's commlib logs
(medians over ranks and steps), the RSS growth from building the mode's model and running
its warm-up steps, and the communicators the mode created. It ends by checking that every
mode's parameters are bitwise equal.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

import commlib
from chaos.workload.data import DataConfig, batch_for
from chaos.workload.model import ModelConfig, Transformer, build_block_mask, set_deterministic
from fsdp_overlap import timeline
from fsdp_overlap.shard import Mode, Sharded, shard


@dataclass
class Run:
    mode: Mode
    sharded: Sharded
    optimizer: torch.optim.Optimizer
    rss_delta: int
    step_s: list[float]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m chaos.workload.bench_overlap",
        description="A/B step time, overlap and memory of fsdp_overlap's modes",
    )
    p.add_argument("--modes", default="single,dual,native", help="comma-separated, the first is the baseline")
    p.add_argument("--steps", type=int, default=20, help="measured steps per mode")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps per mode")
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--no-async-prefetch", dest="async_prefetch", action="store_false")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--mlp-hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=2, help="per rank")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads per rank (0: cores / local ranks)")
    p.add_argument("--log-dir", default=None, help="default: runs/bench_overlap/<torchrun run id>")
    args = p.parse_args(argv)
    args.modes = [Mode(m) for m in args.modes.split(",")]
    if len(set(args.modes)) != len(args.modes) or args.steps < 1 or args.warmup < 1:
        p.error("expected distinct modes, --steps >= 1 and --warmup >= 1")
    return args


def _log_dir(arg: str | None) -> Path:
    if arg is not None:
        return Path(arg)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id or run_id == "none":
        raise SystemExit(
            "chaos.workload.bench_overlap: expected --log-dir, or torchrun's TORCHELASTIC_RUN_ID "
            "(e.g. with --standalone) to name one; found neither"
        )
    return Path("runs/bench_overlap") / run_id


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    log_dir = _log_dir(args.log_dir)
    comm = commlib.init(log_dir=log_dir)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", comm.size))
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local))
    set_deterministic()
    cfg = ModelConfig(
        vocab=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        seq_len=args.seq_len,
        mlp_hidden=args.mlp_hidden,
        window=min(64, args.seq_len),
    )
    data = DataConfig(vocab=cfg.vocab, seq_len=cfg.seq_len, batch_size=args.batch)
    mask = build_block_mask(cfg, None, comm.device)
    process = psutil.Process()

    def step(run: Run, index: int) -> None:
        batch = batch_for(data, index, comm.rank).to(comm.device)
        run.sharded.model(batch.tokens, batch.targets, mask).backward()
        run.optimizer.step()
        run.optimizer.zero_grad()

    def build(mode: Mode) -> Run:
        """The mode's model (same seed for all), sharded, with AdamW, after its warm-up steps."""
        model = Transformer(cfg, seed=0, device=comm.device)
        sharded = shard(model, comm, mode=mode, prefetch=args.prefetch, async_prefetch=args.async_prefetch)
        run = Run(mode, sharded, torch.optim.AdamW(model.parameters(), lr=1e-3), 0, [])
        for i in range(args.warmup):
            step(run, i)
        return run

    # A throwaway plain-FSDP model first, kept alive to the end: FlexAttention's compile and
    # every one-off allocation of FSDP and AdamW land here, not in the first measured mode's
    # RSS delta, and no measured mode reuses its freed memory.
    warm = build(Mode.PLAIN)
    runs: list[Run] = []
    for mode in args.modes:
        rss = process.memory_info().rss
        run = build(mode)
        run.rss_delta = process.memory_info().rss - rss
        runs.append(run)

    for r in range(args.steps):
        index = args.warmup + r
        for run in runs[r % len(runs) :] + runs[: r % len(runs)]:
            comm.barrier()
            with commlib.context(step=index, label=run.mode.value):
                start = time.perf_counter()
                step(run, index)
                run.step_s.append(time.perf_counter() - start)

    # The slowest rank's time per step, and the RSS deltas of every rank.
    times = torch.tensor([run.step_s for run in runs], dtype=torch.float64)
    comm.all_reduce(times, commlib.ReduceOp.MAX)
    rss = torch.tensor([run.rss_delta for run in runs], dtype=torch.float64)
    comm.all_reduce(rss, commlib.ReduceOp.MAX)
    equal = all(
        torch.equal(a.to_local(), b.to_local())
        for run in runs[1:]
        for a, b in zip(runs[0].sharded.model.parameters(), run.sharded.model.parameters(), strict=True)
    )
    flag = torch.tensor([int(equal)])
    comm.all_reduce(flag, commlib.ReduceOp.MIN)
    comm.barrier()  # every rank's log is complete before rank 0 reads them
    if comm.rank == 0:
        print(_report(args, cfg, comm, runs, times, rss, bool(flag.item()), log_dir))
    comm.barrier()
    del warm
    comm.finalize()


def _report(
    args: argparse.Namespace,
    cfg: ModelConfig,
    comm: commlib.Communicator,
    runs: list[Run],
    times: torch.Tensor,
    rss: torch.Tensor,
    equal: bool,
    log_dir: Path,
) -> str:
    summaries = {s.label: s for s in timeline.summarize(timeline.analyze(log_dir))}
    medians = [statistics.median(times[i].tolist()) for i in range(len(runs))]
    lines = [
        f"chaos.workload.bench_overlap: {comm.size} ranks ({comm.backend}), {torch.get_num_threads()} threads/rank, "
        f"{args.steps} measured + {args.warmup} warm-up steps per mode, prefetch={args.prefetch}, "
        f"async_prefetch={args.async_prefetch}",
        f"model: {cfg}",
        f"logs: {log_dir}",
        "",
        f"{'mode':<7} {'step ms':>8} {'ratio':>6} {'AG ms':>7} {'RS ms':>7} {'overlap ms':>10} {'min ms':>7} "
        f"{'ovl/RS':>6} {'exposed ms':>10} {'RSS MiB':>8} {'extra MiB':>9} {'comms':>5}",
    ]
    for i, run in enumerate(runs):
        s = summaries.get(run.mode.value)
        comm_cols = (
            f"{s.all_gather_s * 1e3:7.2f} {s.reduce_scatter_s * 1e3:7.2f} {s.overlap_s * 1e3:10.2f} "
            f"{s.overlap_min_s * 1e3:7.2f} {s.overlap_fraction:6.0%} {s.exposed_s * 1e3:10.2f}"
            if s
            else f"{'-':>7} {'-':>7} {'-':>10} {'-':>7} {'-':>6} {'-':>10}"
        )
        lines.append(
            f"{run.mode.value:<7} {medians[i] * 1e3:8.1f} {medians[i] / medians[0]:6.3f} {comm_cols} "
            f"{rss[i].item() / 2**20:8.1f} {(rss[i] - rss[0]).item() / 2**20:9.1f} "
            f"{run.sharded.communicators_created:5d}"
        )
    lines += [
        "",
        "step ms: median of the slowest rank's step; ratio: to the first mode. AG/RS/overlap/exposed: medians per "
        "rank-step from the commlib logs (modes whose collectives bypass commlib show '-'); overlap counts an async "
        "op's flight until its wait returned, 'min' only flights known to be running (fsdp_overlap.timeline); "
        "ovl/RS: summed overlap / summed RS. RSS: growth from building the mode and its warm-up steps (max over "
        "ranks); extra: minus the first mode's.",
        f"parameters bitwise equal across modes after the run: {'yes' if equal else 'NO'}",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter teardown: torch's C++ teardown now and then aborts a finished rank
    # (SIGABRT, see chaos/workload/train.py), which torchrun would report as a failure.
    os._exit(0)
