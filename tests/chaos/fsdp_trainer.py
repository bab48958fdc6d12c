"""A user's FSDP2 trainer, run by chaos unmodified: it imports neither chaos nor commlib, and
`--backend` is the one word a team changes to run it over commlib.

    torchrun --nproc-per-node 2 tests/chaos/fsdp_trainer.py --backend commlib --steps 10

A small model with a FlexAttention block and a fused LinearCrossEntropyLoss head (`user_model`),
each linear layer and the root sharded with `fully_shard`, AdamW with a learning-rate schedule (LambdaLR),
`--accumulate` micro-batches per optimizer step (gradient accumulation), each drawn from a
seed of the step. Every `--ckpt-every` steps it saves model, optimizer, schedule and step with
torch.distributed.checkpoint (DCP) into `checkpoints/step{N}` of its working directory; a
checkpoint counts once DCP's `.metadata` is there (DCP writes it last), and every start resumes
from the newest. SIGTERM (a preemption) stops every rank after the step in progress with a
checkpoint of it (the flag rides on one all_reduce per step); the job exits 143 so torchrun
starts it again.
"""

import argparse
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from user_model import UserModel

EXIT_PREEMPTED = 143


def newest(directory: Path) -> Path | None:
    complete = [d for d in directory.glob("step*") if (d / ".metadata").exists()]
    return max(complete, key=lambda d: int(d.name.removeprefix("step")), default=None)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="gloo")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--ckpt-every", type=int, default=2)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--timeout", type=float, default=30.0)
    args = p.parse_args()
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = UserModel()
    for layer in (model.embed, model.qkv, model.proj):
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + 0.1 * step))
    done = 0
    found = newest(Path("checkpoints"))
    if found is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optimizer": optim_sd, "schedule": schedule.state_dict(), "step": 0}
        dcp.load(state, checkpoint_id=found)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        done = state["step"]
    preempted = []
    signal.signal(signal.SIGTERM, lambda signum, frame: preempted.append(signum))
    for step in range(done + 1, args.steps + 1):
        for micro in range(args.accumulate):
            g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
            x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
            loss = model(x, y) / args.accumulate
            loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        stop = torch.tensor([1.0 if preempted else 0.0])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if step % args.ckpt_every == 0 or stop.item():
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optimizer": optim_sd, "schedule": schedule.state_dict(), "step": step}
            dcp.save(state, checkpoint_id=Path("checkpoints") / f"step{step}")
        if stop.item():
            return EXIT_PREEMPTED
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
