"""Communicators give back what they took: a finalized split leaves no socket behind."""

from __future__ import annotations

import gc
import time

import psutil
import torch

import commlib
from commlib import testing


def _connections_after_splits(comm: commlib.Communicator, rounds: int) -> list[int]:
    me = psutil.Process()
    counts = []
    for r in range(rounds):
        for i in range(3):
            sub = comm.split([0, 1], f"round{r}.{i}")
            assert sub is not None
            sub.all_reduce(torch.ones(1))
            sub.finalize()
            del sub
        comm.barrier()
        time.sleep(0.2)  # the board's publisher thread drops its last look at closed boards
        gc.collect()
        counts.append(len(me.net_connections()))
    return counts


def test_finalized_splits_release_their_engines(backend: str) -> None:
    # Each split is an engine of its own (gloo: a TCP pair per peer, plus the board's store
    # client): six of them that were never shut down would leave six or more sockets open.
    for counts in testing.run(_connections_after_splits, 2, backend=backend, args=(3,)):
        assert counts[-1] <= counts[0], counts
