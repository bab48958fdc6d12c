"""A process that trained with DDP over commlib's process group exits."""

import os
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

SCRIPT = Path(__file__).with_name("ddp_exit.py")


def test_a_group_freed_by_ddps_reducer_mid_op_does_not_hang_the_rank(tmp_path):
    """The group's gloo engine is not destroyed when DDP's Reducer frees the group with the GIL
    held: c10d's destructor would join a worker that needs the GIL to finish its op."""
    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    env = {**os.environ, "STORE_PORT": str(store.port), "COMMLIB_LOG_DIR": str(tmp_path / "logs")}
    ranks = [subprocess.Popen([sys.executable, str(SCRIPT)], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = []
    for r, proc in enumerate(ranks):
        try:
            outs.append(proc.communicate(timeout=60)[0])
        except subprocess.TimeoutExpired:
            for p in ranks:
                p.kill()
            raise AssertionError(f"rank {r} still running 60 s after its start: hung freeing DDP's Reducer "
                                 f"(c10d's ProcessGroupGloo destructor joining a worker that waits for the GIL)")
    for r, (proc, out) in enumerate(zip(ranks, outs)):
        assert proc.returncode == 0 and f"rank {r} freed its model" in out, out[-3000:]
