"""Checkpoints: the marker protocol on plain files, and skipping bad checkpoints under torchrun."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from test_train import torchrun_train  # the one launcher of the trainer in tests

from chaos.comparison import read_steps
from chaos.workload.checkpoint import (
    MARKER,
    clean_staging,
    commit,
    find_latest,
    lineage_differences,
    prune,
    staging_dir_name,
    step_dir_name,
    verify,
)
from commlib.observe.events import read_events


def _staged(ckpt_dir: Path, step: int, attempt: int = 0) -> Path:
    """A staging directory holding what a save writes: DCP files, trainer state, RNG files."""
    staging = ckpt_dir / staging_dir_name(step, attempt)
    (staging / "rng").mkdir(parents=True)
    (staging / ".metadata").write_bytes(b"metadata %d" % step)
    (staging / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
    (staging / "trainer.json").write_text(json.dumps({"step": step}))
    (staging / "rng" / "rank0.pt").write_bytes(b"rng")
    return staging


def _flip_byte(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_commit_makes_a_verified_checkpoint(tmp_path: Path) -> None:
    final = commit(_staged(tmp_path, 5), 5)
    assert final == tmp_path / "step000005"
    assert verify(final) is None
    marker = json.loads((final / MARKER).read_text())
    assert marker["step"] == 5
    assert sorted(marker["files"]) == [".metadata", "__0_0.distcp", "rng/rank0.pt", "trainer.json"]
    assert not any(p.name.startswith(".staging-") for p in tmp_path.iterdir())
    assert find_latest(tmp_path) == (5, [])


@pytest.mark.parametrize("damage, reason", [
    (lambda d: _flip_byte(d / "__0_0.distcp"), "file __0_0.distcp: expected sha256"),
    (lambda d: (d / MARKER).unlink(), "no marker"),
    (lambda d: (d / "rng" / "rank0.pt").unlink(), "file rng/rank0.pt listed in the marker is missing"),
    (lambda d: (d / MARKER).write_text('{"format": 1, "ste'), "unreadable"),
    (lambda d: (d / "trainer.json").write_text("{}"), "file trainer.json: expected sha256"),
])
def test_damaged_checkpoint_is_skipped_for_the_previous_one(tmp_path: Path, damage, reason: str) -> None:
    commit(_staged(tmp_path, 5), 5)
    newest = commit(_staged(tmp_path, 10), 10)
    damage(newest)
    assert reason in verify(newest)
    step, skipped = find_latest(tmp_path)
    assert step == 5
    assert [(s.step, s.path) for s in skipped] == [(10, str(newest))]
    assert reason in skipped[0].reason


def test_marker_must_name_its_own_step(tmp_path: Path) -> None:
    shutil.move(commit(_staged(tmp_path, 5), 5), tmp_path / step_dir_name(7))
    assert "marker says step 5; the directory name says 7" in verify(tmp_path / step_dir_name(7))


def test_no_checkpoint_at_all(tmp_path: Path) -> None:
    assert find_latest(tmp_path / "absent") == (None, [])
    _staged(tmp_path, 3)  # a torn save is never a checkpoint
    assert find_latest(tmp_path) == (None, [])


def test_clean_staging_removes_only_staging(tmp_path: Path) -> None:
    commit(_staged(tmp_path, 5), 5)
    _staged(tmp_path, 10, attempt=0)
    _staged(tmp_path, 10, attempt=1)
    assert clean_staging(tmp_path) == [".staging-step000010-a0", ".staging-step000010-a1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step000005"]


def test_commit_replaces_a_broken_checkpoint_of_the_same_step(tmp_path: Path) -> None:
    broken = commit(_staged(tmp_path, 10), 10)
    (broken / MARKER).unlink()
    assert verify(commit(_staged(tmp_path, 10, attempt=1), 10)) is None


def test_prune_keeps_the_newest_committed(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        commit(_staged(tmp_path, step), step)
    _staged(tmp_path, 8)
    shutil.move(tmp_path / staging_dir_name(8, 0), tmp_path / step_dir_name(8))  # newer, uncommitted
    assert prune(tmp_path, [6], keep=2) == []
    assert prune(tmp_path, [4, 6], keep=2) == [2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step000004", "step000006", "step000008"]


def test_lineage_differences_name_each_key() -> None:
    current = {"model": {"dim": 16}, "lr": 0.001, "world_size": 2}
    assert lineage_differences(json.loads(json.dumps(current)), current) == []
    assert lineage_differences({"model": {"dim": 32}, "lr": 0.001}, current) == [
        "model: checkpoint {'dim': 32}, this run {'dim': 16}", "world_size: checkpoint None, this run 2"]


def test_torchrun_resume_skips_torn_and_corrupt_checkpoints(tmp_path: Path) -> None:
    """Checkpoints at steps 1 and 2; then step 2 gets a flipped byte, a step 3 without marker
    and a torn staging dir appear. The rerun must skip 3 and 2, remove the staging dir,
    resume from 1, and recompute step 2 bitwise as the first run did."""
    ckpt, logs = tmp_path / "ckpt", tmp_path / "second" / "logs"
    for run in ("first", "second"):
        (tmp_path / run).mkdir()
    torchrun_train(tmp_path / "first", "--steps", "2", "--ckpt-every", "1", "--ckpt-dir", ckpt,
                   "--log-dir", tmp_path / "first" / "logs")
    shutil.copytree(ckpt / step_dir_name(2), ckpt / step_dir_name(3))
    (ckpt / step_dir_name(3) / MARKER).unlink()
    _flip_byte(ckpt / step_dir_name(2) / "__1_0.distcp")
    shutil.copytree(ckpt / step_dir_name(1), ckpt / staging_dir_name(4, 0))

    torchrun_train(tmp_path / "second", "--steps", "3", "--ckpt-every", "0", "--ckpt-dir", ckpt, "--log-dir", logs)

    events = list(read_events(logs / "rank0.jsonl"))
    skipped = [(e["step"], e["reason"]) for e in events if e["event"] == "ckpt.skipped"]
    assert [step for step, _ in skipped] == [3, 2]
    assert "no marker" in skipped[0][1] and "file __1_0.distcp: expected sha256" in skipped[1][1]
    for rank in (0, 1):
        resumed = [e["step"] for e in read_events(logs / f"rank{rank}.jsonl") if e["event"] == "ckpt.resume"]
        assert resumed == [1]
    assert [e["path"] for e in events if e["event"] == "ckpt.staging_removed"] == [
        str(ckpt / staging_dir_name(4, 0))]
    assert not (ckpt / staging_dir_name(4, 0)).exists()
    # Step 2 computed again from checkpoint 1 is step 2 of the first run, bitwise, on every rank.
    first, second = read_steps(tmp_path / "first"), read_steps(tmp_path / "second")
    for rank in (0, 1):
        assert [r.step for r in second.records[(rank, 0)]] == [2, 3]
        assert second.records[(rank, 0)][0] == dataclasses.replace(first.records[(rank, 0)][1],
                                                                  pid=second.records[(rank, 0)][0].pid)
