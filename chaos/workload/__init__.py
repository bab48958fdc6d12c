"""The reference training workload every chaos test and benchmark runs.

- `model`: the transformer (FlexAttention with block masks, fused chunked head + loss).
- `data`: deterministic synthetic batches, a pure function of (seed, step, rank).
- `checkpoint`: DCP checkpoints committed by a hash marker and an atomic rename.
- `train`: the trainer, `torchrun ... -m chaos.workload.train`.
"""
