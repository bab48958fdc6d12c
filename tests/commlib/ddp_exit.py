"""One rank of `test_exit.py`: DDP's Reducer, the last holder of a commlib group, freed with the
GIL held while a worker thread of the group's gloo engine still holds an op and its tensor."""

import gc
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  (before the group: imported after it, it holds the group for good)
from torch import nn

started = time.monotonic()
rank = int(os.environ["RANK"])
store = dist.TCPStore("127.0.0.1", int(os.environ["STORE_PORT"]), 2, is_master=False)
dist.init_process_group("commlib", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
model = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
model(torch.ones(1, 2)).sum().backward()
engine = dist.group.WORLD._get_backend(torch.device("cpu"))
if rank == 1:
    time.sleep(3)  # rank 0's op waits this long for it, on a worker thread of rank 0's engine
work = engine.allreduce([torch.ones(1)])
if rank == 1:
    work.wait()
del work, engine  # rank 0: only its engine's worker holds the op and its tensor now
dist.destroy_process_group()
reducer = model.reducer
del model
gc.collect()  # the group's Python object is gone (it sat in reference cycles); the Reducer holds it in C++
sys.setswitchinterval(60)  # this thread keeps the GIL unless it blocks, as a busy interpreter may
del reducer  # frees the group and, in c10d, the engine registered in it, with the GIL held
sys.setswitchinterval(0.005)
print(f"rank {rank} freed its model after {time.monotonic() - started:.1f} s", flush=True)
