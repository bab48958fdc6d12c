"""A user's plain DDP training loop, run by chaos unmodified: it imports neither chaos nor
commlib, and `--backend` is the one word a team changes to run it over commlib.

    torchrun --nproc-per-node 2 tests/chaos/ddp_trainer.py --backend commlib --steps 10

A small model with a FlexAttention block and a fused LinearCrossEntropyLoss head (`user_model`)
under DistributedDataParallel, AdamW, each rank's batch drawn from a seed of the step. Rank 0 saves model, optimizer and step every `--ckpt-every` steps (`torch.save` to a
temporary name, then a rename) into `checkpoints/` of its working directory; every start
resumes from it. SIGTERM (a preemption) stops every rank after the step in progress, with a
checkpoint of it: the flag rides on one all_reduce per step, and the job exits 143 so torchrun
starts it again.
"""

import argparse
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from user_model import UserModel

EXIT_PREEMPTED = 143


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="gloo")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--ckpt-every", type=int, default=2)
    p.add_argument("--timeout", type=float, default=30.0)
    args = p.parse_args()
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(UserModel())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    checkpoint = Path("checkpoints") / "latest.pt"
    done = 0
    if checkpoint.exists():
        saved = torch.load(checkpoint, weights_only=True)
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        done = saved["step"]
    preempted = []
    signal.signal(signal.SIGTERM, lambda signum, frame: preempted.append(signum))
    for step in range(done + 1, args.steps + 1):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        stop = torch.tensor([1.0 if preempted else 0.0])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if rank == 0 and (step % args.ckpt_every == 0 or stop.item()):
            checkpoint.parent.mkdir(exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                       checkpoint.with_suffix(".tmp"))
            os.replace(checkpoint.with_suffix(".tmp"), checkpoint)
        dist.barrier()
        if stop.item():
            return EXIT_PREEMPTED
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
