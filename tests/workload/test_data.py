"""Synthetic data: a pure function of (seed, step, rank), next-token targets, packed documents."""

import pytest
import torch

from chaos.workload.data import ALPHABET, Batch, DataConfig, batch_for

CFG = DataConfig(seed=3, vocab=1000, seq_len=128, batch_size=4, mean_doc_len=16)


def assert_same(a: Batch, b: Batch) -> None:
    for field in ("tokens", "targets", "doc_ids"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field


def test_same_seed_step_rank_gives_bitwise_same_batch() -> None:
    assert_same(batch_for(CFG, 5, 1), batch_for(CFG, 5, 1))


def test_batch_does_not_depend_on_or_touch_the_global_rng() -> None:
    state = torch.get_rng_state()
    first = batch_for(CFG, 0, 0)
    assert torch.equal(state, torch.get_rng_state())
    torch.manual_seed(1234)
    assert_same(first, batch_for(CFG, 0, 0))


@pytest.mark.parametrize(
    ("cfg", "step", "rank"),
    [(CFG, 5, 0), (CFG, 6, 1), (DataConfig(seed=4, vocab=1000, seq_len=128, batch_size=4), 5, 1)],
)
def test_other_rank_step_or_seed_gives_other_batch(cfg: DataConfig, step: int, rank: int) -> None:
    assert not torch.equal(batch_for(cfg, step, rank).tokens, batch_for(CFG, 5, 1).tokens)


def test_shapes_dtypes_and_range() -> None:
    batch = batch_for(CFG, 0, 0)
    for tensor in (batch.tokens, batch.targets, batch.doc_ids):
        assert tensor.shape == (CFG.batch_size, CFG.seq_len)
        assert tensor.dtype == torch.long
    assert 0 <= batch.tokens.min() and batch.tokens.max() < CFG.vocab


def test_targets_are_the_next_tokens() -> None:
    batch = batch_for(CFG, 2, 0)
    assert torch.equal(batch.targets[:, :-1], batch.tokens[:, 1:])


def test_doc_ids_start_at_zero_and_step_by_at_most_one() -> None:
    doc_ids = batch_for(CFG, 1, 0).doc_ids
    assert (doc_ids[:, 0] == 0).all()
    steps = doc_ids.diff(dim=1)
    assert ((steps == 0) | (steps == 1)).all()
    assert (doc_ids[:, -1] > 0).all(), "mean_doc_len 16 over 128 positions packs several documents"


def test_mean_document_length_follows_config() -> None:
    cfg = DataConfig(seq_len=1024, batch_size=16, mean_doc_len=32)
    doc_ids = batch_for(cfg, 0, 0).doc_ids
    mean_len = doc_ids.numel() / (doc_ids[:, -1] + 1).sum().item()
    assert 24 < mean_len < 40  # documents cut by the row end are shorter; 32 is the target


def test_documents_are_mostly_arithmetic_progressions() -> None:
    batch = batch_for(DataConfig(), 0, 0)
    same_doc = batch.doc_ids[:, 2:] == batch.doc_ids[:, :-2]
    t = batch.tokens
    progression = ((t[:, 2:] - t[:, 1:-1]) - (t[:, 1:-1] - t[:, :-2])) % ALPHABET == 0
    assert progression[same_doc].float().mean() > 0.6  # 10% noise breaks up to 3 triples each


def test_batch_to_moves_every_field() -> None:
    batch = batch_for(CFG, 0, 0).to("meta")
    assert {t.device.type for t in (batch.tokens, batch.targets, batch.doc_ids)} == {"meta"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seed": -1}, r"seed: expected an int >= 0, found -1"),
        ({"vocab": 1}, r"vocab: expected >= 2, found 1"),
        ({"seq_len": 0}, r"seq_len: expected a positive int, found 0"),
        ({"batch_size": 1.5}, r"batch_size: expected a positive int, found 1.5"),
        ({"mean_doc_len": 0}, r"mean_doc_len: expected a positive int, found 0"),
    ],
)
def test_data_config_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DataConfig(**kwargs)


def test_negative_step_or_rank_is_rejected() -> None:
    with pytest.raises(ValueError, match="expected step >= 0 and rank >= 0, found step=-1 rank=0"):
        batch_for(CFG, -1, 0)
