"""A tiny torchrun trainer for the harness's own tests, run by chaos unmodified: it imports
neither chaos nor commlib (its default process group is commlib's by the backend word).

One linear layer, Adam (or SGD: `--optimizer sgd`, which keeps no step count), one all_reduce
of the gradient per step, no checkpoint: a restarted job trains from step 1 again.
``--step-time`` makes a step that long (a sleep inside it), so a test can stop the harness
while the job is busy; ``--fail-rank`` makes that rank exit 1 at step 2, in every attempt;
``--unseeded`` adds noise drawn from the OS to each input, so that no two runs compute the same.
"""

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--backend", default="commlib")
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    p.add_argument("--fail-rank", type=int, default=None, help="this rank exits 1 at step 2, in every attempt")
    p.add_argument("--unseeded", action="store_true", help="noise from the OS in every input")
    args = p.parse_args()
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    torch.manual_seed(0)
    layer = nn.Linear(4, 1, bias=False)
    make = torch.optim.Adam if args.optimizer == "adam" else torch.optim.SGD
    optimizer = make(layer.parameters(), lr=0.1)
    for step in range(1, args.steps + 1):
        if rank == args.fail_rank and step == 2:
            os._exit(1)
        x = torch.full((1, 4), float(step + rank))
        if args.unseeded:
            x += torch.rand(1, 4, generator=torch.Generator().manual_seed(int.from_bytes(os.urandom(7), "little")))
        loss = layer(x).sum()
        time.sleep(args.step_time)
        loss.backward()
        dist.all_reduce(layer.weight.grad)
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
