"""fsdp_overlap: FSDP2 whose all-gather and reduce-scatter go through commlib, on two communicators.

    sharded = fsdp_overlap.shard(model, comm, mode="dual", prefetch=1)
    ...train `model` as usual...
    python -m fsdp_overlap.timeline LOGDIR          # overlap and exposed comm per step
    torchrun --nproc-per-node 2 -m chaos.workload.bench_overlap   # single vs dual vs native

`shard` (shard.py) applies fully_shard and routes FSDP2's collectives through commlib
(comms.py); `timeline` computes overlap from commlib's log model. The A/B tool needs the
reference model, so it lives above this package: `chaos.workload.bench_overlap`. See docs/fsdp-overlap.md.
"""

from fsdp_overlap.comms import CommlibAllGather, CommlibReduceScatter, FSDPWork
from fsdp_overlap.shard import Mode, Sharded, shard

__all__ = ["CommlibAllGather", "CommlibReduceScatter", "FSDPWork", "Mode", "Sharded", "shard"]
