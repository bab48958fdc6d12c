"""For rank functions of `commlib.testing.run(fn, backend=None)`: the one-word change itself.

`init_commlib` makes torch.distributed's default group with `backend="commlib"`, as an
unmodified trainer does, on the store `testing.run` started (its environment names it),
instead of through `commlib.init`.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist


def init_commlib(timeout_s: float) -> int:
    """`init_process_group("commlib", timeout=timeout_s)` on this rank; returns the rank."""
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), size, is_master=False)
    dist.init_process_group("commlib", store=store, rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s))
    return rank
