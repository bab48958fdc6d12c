"""A torchrun worker for the multi-node restart test (tests/chaos/test_multinode.py): joins the
job through commlib (``--init commlib``: `commlib.init`; ``--init torch``: torch's own
``init_process_group(backend="commlib")`` over ``env://``), all-reduces, and writes one line per
round to ``{--out}/rounds.jsonl``: its rank, its node's restart count, its attempt, the sum.

In the first round rank 1 fails while rank 0 is still busy, so that only rank 1's agent counts
a restart; rank 0's agent starts it again for the new round without counting one (torchrun's
membership change). The second round then holds ranks whose nodes' restart counts differ.
"""

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import commlib
from commlib.attempt import attempt_number

BUSY_S = 120.0  # rank 0's first round: longer than its agent takes to restart it


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--init", choices=("commlib", "torch"), required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--timeout", type=float, default=10.0)
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    if args.init == "commlib":
        all_reduce = commlib.init("gloo", timeout=args.timeout).all_reduce
    else:
        dist.init_process_group("commlib", timeout=timedelta(seconds=args.timeout))
        all_reduce = dist.all_reduce
    total = torch.full((1,), float(rank + 1))
    all_reduce(total)
    marker = args.out / f"rank{rank}.ran"
    first = not marker.exists()
    marker.touch()
    line = {"rank": rank, "restart_count": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
            "attempt": attempt_number(), "sum": total.item(), "first": first}
    with open(args.out / "rounds.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
    if first and rank == 1:
        os._exit(1)
    if first:
        time.sleep(BUSY_S)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
