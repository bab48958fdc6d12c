"""A user's trainer that checkpoints with `torch.save`, run by chaos unmodified (it imports
neither chaos nor commlib), whose resume can be made wrong on purpose: the proof must catch it.

    torchrun --nproc-per-node 2 tests/chaos/torch_save_trainer.py --backend commlib --steps 10

Every rank holds the whole model (a FlexAttention block with dropout and a fused
LinearCrossEntropyLoss head, `user_model`; Adam); gradients are averaged
with `dist.all_reduce`, so the ranks stay equal. Each rank's batch comes from a seed of the
step; dropout draws from torch's global RNG. Rank 0 saves model, optimizer, step and RNG state
every `--ckpt-every` steps into `checkpoints/step{N}.pt` of its working directory (to a
temporary name, then renamed); every start resumes from the newest. SIGTERM (a preemption)
stops every rank after the step in progress with a checkpoint of it; the job exits 143.

``RESUME_BUG`` (read from the environment, so that every mode shares one fault-free reference:
a run that never resumes is the same in each) breaks the resume, and only the resume:

- ``none``: restore everything (the correct trainer);
- ``skip``: go on one step after the checkpoint's, so that step is never trained;
- ``stale``: load the checkpoint before the newest, but go on from the newest's step;
- ``rng``: restore all but the RNG state, so dropout draws other masks than an uninterrupted run.
"""

import argparse
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from user_model import UserModel

EXIT_PREEMPTED = 143


def checkpoints(directory: Path) -> list[Path]:
    return sorted(directory.glob("step*.pt"), key=lambda p: int(p.stem.removeprefix("step")))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="gloo")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--ckpt-every", type=int, default=2)
    p.add_argument("--timeout", type=float, default=30.0)
    args = p.parse_args()
    bug = os.environ.get("RESUME_BUG", "none")
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = UserModel(dropout=0.2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    directory = Path("checkpoints")
    done = 0
    found = checkpoints(directory)
    if found:
        saved = torch.load(found[-2 if bug == "stale" and len(found) > 1 else -1], weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        if bug != "rng":
            torch.set_rng_state(saved["rng"])
        done = int(found[-1].stem.removeprefix("step")) + (1 if bug == "skip" else 0)
    preempted = []
    signal.signal(signal.SIGTERM, lambda signum, frame: preempted.append(signum))
    for step in range(done + 1, args.steps + 1):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        loss = model(x, y)
        loss.backward()
        for param in model.parameters():
            dist.all_reduce(param.grad)
            param.grad /= world
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        stop = torch.tensor([1.0 if preempted else 0.0])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if rank == 0 and (step % args.ckpt_every == 0 or stop.item()):
            directory.mkdir(exist_ok=True)
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state()}
            torch.save(state, directory / f".step{step}.pt.tmp")
            os.replace(directory / f".step{step}.pt.tmp", directory / f"step{step}.pt")
        dist.barrier()
        if stop.item():
            return EXIT_PREEMPTED
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
