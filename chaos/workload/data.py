"""Deterministic synthetic training data for the reference trainer.

This module owns ``DataConfig``, ``Batch`` and ``batch_for``. A batch is a pure function
of ``(seed, step, rank)``: it is drawn from a local ``torch.Generator`` seeded from that
triple (never the global RNG), so any rank can regenerate any step's batch exactly and a
resumed run consumes exactly the batches a fault-free run would.

Each row packs documents of geometric length (mean ``mean_doc_len``). A document is an
arithmetic progression ``start, start + stride, ...`` modulo ``min(vocab, ALPHABET)``
with a stride in 1..4 and 10% of its tokens replaced by random ones. The small alphabet
makes the token frequencies learnable within a few steps and the progression makes the
next token predictable from the previous two, so the loss visibly falls within ~30 steps.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

ALPHABET = 512
MAX_STRIDE = 4
NOISE = 0.1


@dataclass(frozen=True)
class DataConfig:
    """What ``batch_for`` generates; ``batch_size`` is per rank."""

    seed: int = 0
    vocab: int = 8192
    seq_len: int = 256
    batch_size: int = 2
    mean_doc_len: int = 64

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"DataConfig.seed: expected an int >= 0, found {self.seed!r}")
        for name in ("vocab", "seq_len", "batch_size", "mean_doc_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DataConfig.{name}: expected a positive int, found {value!r}")
        if self.vocab < 2:
            raise ValueError(f"DataConfig.vocab: expected >= 2, found {self.vocab}")


@dataclass(frozen=True)
class Batch:
    """One rank's batch. ``targets[:, i]`` is the token after ``tokens[:, i]``."""

    tokens: torch.Tensor  # LongTensor [B, S]
    targets: torch.Tensor  # LongTensor [B, S]
    doc_ids: torch.Tensor  # LongTensor [B, S], document index per position, 0-based per row

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.tokens.to(device), self.targets.to(device), self.doc_ids.to(device))


def _generator(seed: int, step: int, rank: int) -> torch.Generator:
    # A hash rather than arithmetic mixing: (seed, step, rank) triples never alias, and the
    # value does not depend on the Python process (unlike hash()).
    digest = hashlib.blake2b(f"{seed}:{step}:{rank}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def batch_for(cfg: DataConfig, step: int, rank: int) -> Batch:
    """The batch that ``rank`` trains on at ``step``; a pure function of (cfg, step, rank)."""
    if step < 0 or rank < 0:
        raise ValueError(f"batch_for: expected step >= 0 and rank >= 0, found step={step} rank={rank}")
    gen = _generator(cfg.seed, step, rank)
    rows, length = cfg.batch_size, cfg.seq_len + 1  # one extra position for the last target
    alphabet = min(cfg.vocab, ALPHABET)

    # A document starts at each position with probability 1/mean_doc_len (row starts are
    # always document 0), so document lengths are geometric with mean mean_doc_len.
    starts = torch.rand(rows, length, generator=gen) < 1.0 / cfg.mean_doc_len
    starts[:, 0] = True
    doc_ids = starts.long().cumsum(dim=1) - 1
    positions = torch.arange(length).expand(rows, length)
    doc_start = torch.where(starts, positions, 0).cummax(dim=1).values
    offset = positions - doc_start

    # Per-document progression parameters, indexed by document id (at most `length` docs).
    first = torch.randint(0, alphabet, (rows, length), generator=gen).gather(1, doc_ids)
    stride = torch.randint(1, MAX_STRIDE + 1, (rows, length), generator=gen).gather(1, doc_ids)
    stream = (first + stride * offset) % alphabet
    noisy = torch.rand(rows, length, generator=gen) < NOISE
    stream = torch.where(noisy, torch.randint(0, alphabet, (rows, length), generator=gen), stream)

    return Batch(
        tokens=stream[:, :-1].contiguous(),
        targets=stream[:, 1:].contiguous(),
        doc_ids=doc_ids[:, :-1].contiguous(),
    )
