"""Checkpoints a kill can never corrupt: staging, a hash marker, and an atomic rename.

This module owns the checkpoint directory of the reference trainer:

    {ckpt_dir}/
      step000010/                 a complete checkpoint (the state after step 10)
        .metadata, __R_0.distcp   torch.distributed.checkpoint (DCP): {"model", "optim"}
        trainer.json              rank 0: step, lineage config
        rng/rank{R}.pt            each rank's RNG states (torch CPU; CUDA when present)
        COMPLETE.json             the marker: {"format", "step", "files": {path: sha256}}
      .staging-step000020-a1/     being written by attempt 1, or torn by a kill

Saving (`Checkpointer.save`, collective): every rank writes into the staging directory,
the `on_staged` callback runs (the chaos injector's `on_checkpoint_staged`), every rank
meets at a barrier, then rank 0 hashes every file into the marker and renames staging to
`stepNNNNNN` (the commit), and a second barrier makes the commit visible to all ranks
before they go on; then the `on_committed` callback runs (the injector's
`on_checkpoint_committed`). A checkpoint is therefore complete on every rank or not a checkpoint.

Loading (`Checkpointer.resume`, collective): rank 0 removes stale staging directories,
walks `stepNNNNNN` directories newest first and takes the first whose marker is valid and
whose files all match their hashes; each one passed over is logged as `ckpt.skipped` with
the reason. Rank 0 broadcasts its choice, so every rank loads the same step.

The checkpoint directory must be on a filesystem every rank sees (shared on multi-node).
The marker logic (`write_marker`, `verify`, `find_latest`, `clean_staging`, `prune`) is
plain file work, usable and testable without a process group.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import commlib
from chaos.files import fsync_dir, write_json_atomic

MARKER = "COMPLETE.json"
TRAINER_STATE = "trainer.json"
MARKER_FORMAT = 1
STAGING_PREFIX = ".staging-"
_STEP_DIR = re.compile(r"step(\d{6,})")


def step_dir_name(step: int) -> str:
    return f"step{step:06d}"


def staging_dir_name(step: int, attempt: int) -> str:
    return f"{STAGING_PREFIX}{step_dir_name(step)}-a{attempt}"


# -- plain file logic: no process group ----------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _files(directory: Path) -> list[str]:
    """Every regular file under `directory` but the marker, as sorted relative POSIX paths."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file() and p.name != MARKER)


def write_marker(directory: Path, step: int) -> None:
    """Hash every file of `directory` into its marker; call once all files are written."""
    files = {name: _sha256(directory / name) for name in _files(directory)}
    write_json_atomic(directory / MARKER, {"format": MARKER_FORMAT, "step": step, "files": files})


def verify(directory: Path) -> str | None:
    """Why `directory` is not a complete checkpoint, or None when it is one."""
    match = _STEP_DIR.fullmatch(directory.name)
    if match is None:
        return f"expected a directory named stepNNNNNN; found {directory.name!r}"
    try:
        marker = json.loads((directory / MARKER).read_text())
    except FileNotFoundError:
        return f"no marker {MARKER}: the checkpoint was never committed"
    except (OSError, ValueError) as exc:
        return f"marker {MARKER} unreadable: {exc}"
    if (
        not isinstance(marker, dict)
        or marker.get("format") != MARKER_FORMAT
        or not isinstance(marker.get("files"), dict)
    ):
        return f"marker {MARKER}: expected format {MARKER_FORMAT} with a files table; found {marker!r:.200}"
    if marker.get("step") != int(match.group(1)):
        return f"marker says step {marker.get('step')!r}; the directory name says {int(match.group(1))}"
    for name in (".metadata", TRAINER_STATE):
        if name not in marker["files"]:
            return f"marker lists no {name}"
    for name, expected in sorted(marker["files"].items()):
        path = directory / name
        if not path.is_file():
            return f"file {name} listed in the marker is missing"
        found = _sha256(path)
        if found != expected:
            return f"file {name}: expected sha256 {expected}; found {found}"
    return None


def checkpoint_steps(ckpt_dir: Path) -> list[int]:
    """Steps of every `stepNNNNNN` directory (complete or not), ascending."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(int(m.group(1)) for p in ckpt_dir.iterdir() if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name)))


@dataclass(frozen=True)
class Skipped:
    """A checkpoint directory passed over on the way to the latest complete one."""

    path: str
    step: int
    reason: str


def find_latest(ckpt_dir: Path) -> tuple[int | None, list[Skipped]]:
    """The newest complete checkpoint's step (None: none), and the newer ones skipped."""
    skipped: list[Skipped] = []
    for step in reversed(checkpoint_steps(ckpt_dir)):
        directory = ckpt_dir / step_dir_name(step)
        reason = verify(directory)
        if reason is None:
            return step, skipped
        skipped.append(Skipped(str(directory), step, reason))
    return None, skipped


def clean_staging(ckpt_dir: Path) -> list[str]:
    """Remove staging directories left by dead attempts; returns their names."""
    if not ckpt_dir.is_dir():
        return []
    stale = sorted(p.name for p in ckpt_dir.iterdir() if p.name.startswith(STAGING_PREFIX))
    for name in stale:
        shutil.rmtree(ckpt_dir / name, ignore_errors=True)
    return stale


def commit(staging: Path, step: int) -> Path:
    """Mark `staging` complete and rename it to its step directory (the commit point)."""
    write_marker(staging, step)
    final = staging.parent / step_dir_name(step)
    if final.exists():
        # Only an incomplete or corrupt checkpoint can sit here: resume passed over it.
        shutil.rmtree(final)
    os.rename(staging, final)
    fsync_dir(final.parent)
    return final


def prune(ckpt_dir: Path, committed: list[int], keep: int) -> list[int]:
    """Remove step directories older than the `keep` newest committed steps; returns them."""
    if len(committed) < keep:
        return []
    oldest_kept = sorted(committed)[-keep]
    doomed = [s for s in checkpoint_steps(ckpt_dir) if s < oldest_kept]
    for step in doomed:
        shutil.rmtree(ckpt_dir / step_dir_name(step), ignore_errors=True)
    return doomed


# -- the distributed protocol ----------------------------------------------------------------


@dataclass
class TrainState:
    """What a run needs besides model and optimizer to continue exactly where it stopped."""

    step: int = 0  # steps completed; the next step trains on batch_for(data, step + 1, rank)
    # In replica mode (`chaos.workload.replica`): torchft's Manager state at that step (its step count).
    manager: dict[str, int] = field(default_factory=dict)


@dataclass
class Snapshot:
    """The last good state in memory, for in-job recovery: model, optimizer, RNG and `TrainState`.

    Local tensors only (this rank's FSDP2 shards), cloned; `restore` copies them back in place,
    so the parameters FSDP2 and the optimizer hold stay the same objects and get the same bits.
    The data position is `state.step` (batches are a function of the step).
    """

    state: TrainState
    params: list[torch.Tensor]
    buffers: list[torch.Tensor]
    optim: list[dict[str, Any]]  # per parameter in the optimizer's order; {} before its first step
    rng: dict[str, torch.Tensor]

    @classmethod
    def take(cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainState) -> Snapshot:
        optim = []
        for p in _optimizer_params(optimizer):
            optim.append(
                {
                    k: _local(v).detach().clone() if isinstance(v, torch.Tensor) else v
                    for k, v in optimizer.state.get(p, {}).items()
                }
            )
        return cls(
            state=TrainState(step=state.step),
            params=[_local(p).detach().clone() for p in model.parameters()],
            buffers=[_local(b).detach().clone() for b in model.buffers()],
            optim=optim,
            rng={k: v.clone() for k, v in _rng_state().items()},
        )

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainState:
        """Put this snapshot back into `model` and `optimizer` (in place) and the RNG; returns its state."""
        params, buffers = list(model.parameters()), list(model.buffers())
        if len(params) != len(self.params) or len(buffers) != len(self.buffers):
            raise RuntimeError(
                f"snapshot restore: expected {len(self.params)} parameters and {len(self.buffers)} "
                f"buffers as when it was taken; found {len(params)} and {len(buffers)}"
            )
        with torch.no_grad():
            for live, saved in zip([*params, *buffers], [*self.params, *self.buffers], strict=True):
                _local(live).copy_(saved)
            for i, (p, saved_state) in enumerate(zip(_optimizer_params(optimizer), self.optim, strict=True)):
                if not saved_state:
                    optimizer.state.pop(p, None)
                    continue
                live_state = optimizer.state.get(p)
                if not live_state or live_state.keys() != saved_state.keys():
                    raise RuntimeError(
                        f"snapshot restore: expected optimizer state {sorted(saved_state)} for "
                        f"parameter {i}; found {sorted(live_state or {})}"
                    )
                for k, v in saved_state.items():
                    if isinstance(v, torch.Tensor):
                        _local(live_state[k]).copy_(v)
                    else:
                        live_state[k] = v
        _set_rng_state(self.rng)
        return TrainState(step=self.state.step)


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class CheckpointMismatch(ValueError):
    """The checkpoint to resume from was written by a run with a different config."""


class Checkpointer:
    """Saves and resumes model, optimizer, RNG and `TrainState` in `directory`; collective.

    `lineage` is the part of the run's config that determines its numbers (model, data,
    seed, optimizer, world size); resuming from a checkpoint written under another lineage
    raises `CheckpointMismatch` instead of silently training a different run.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        comm: commlib.Communicator,
        *,
        attempt: int,
        lineage: dict[str, Any],
        keep: int = 2,
        on_staged: Callable[[int], None] | None = None,
        on_committed: Callable[[int, Path], None] | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"Checkpointer: expected keep >= 1; found {keep} on rank {comm.rank}")
        if not dist.is_initialized():
            raise RuntimeError(
                f"Checkpointer: torch.distributed.checkpoint needs a torch.distributed process "
                f"group; found none on rank {comm.rank} (backend {comm.backend!r})"
            )
        self.directory = Path(directory)
        self.comm = comm
        self.attempt = attempt
        self.lineage = json.loads(json.dumps(lineage))  # compared with its JSON round trip on resume
        self.keep = keep
        self.on_staged = on_staged
        self.on_committed = on_committed
        self._committed: list[int] = []

    def resume(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainState:
        """Load the latest complete checkpoint into model and optimizer; a fresh state if none."""
        choice = torch.tensor(
            [self._choose() if self.comm.rank == 0 else 0], dtype=torch.int64, device=self.comm.device
        )
        self.comm.broadcast(choice, root=0)
        step = int(choice.item())
        if step < 0:
            return TrainState()
        directory = self.directory / step_dir_name(step)
        saved = json.loads((directory / TRAINER_STATE).read_text())
        self._check_lineage(saved["lineage"], directory)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state_dict = {"model": model_sd, "optim": optim_sd}
        dcp.load(state_dict, checkpoint_id=directory)
        set_state_dict(model, optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"])
        _set_rng_state(torch.load(directory / "rng" / f"rank{self.comm.rank}.pt", weights_only=True))
        self._committed = [step]
        state = TrainState(step=saved["step"], manager=saved.get("manager", {}))
        commlib.get_logger().info("ckpt.resume", step=step, path=str(directory))
        return state

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainState) -> None:
        """Write the checkpoint of `state.step`; returns once it is committed on every rank."""
        log = commlib.get_logger()
        start = time.perf_counter()
        staging = self.directory / staging_dir_name(state.step, self.attempt)
        log.info("ckpt.start", step=state.step, path=str(staging))
        (staging / "rng").mkdir(parents=True, exist_ok=True)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=staging)
        torch.save(_rng_state(), staging / "rng" / f"rank{self.comm.rank}.pt")
        if self.comm.rank == 0:
            write_json_atomic(
                staging / TRAINER_STATE,
                {"step": state.step, "manager": state.manager, "lineage": self.lineage},
            )
        if self.on_staged is not None:
            self.on_staged(state.step)
        # Every collective of the save has ended well on its device (GPU engines fail them
        # asynchronously): a rank that cannot say so raises before the commit.
        commlib.check(wait=True)
        self.comm.barrier()  # every rank's files are in staging
        final = self.directory / step_dir_name(state.step)
        if self.comm.rank == 0:
            commit(staging, state.step)
            self._committed.append(state.step)
            for old in prune(self.directory, self._committed, self.keep):
                log.info("ckpt.pruned", step=old)
        self.comm.barrier()  # the commit is visible before any rank moves on
        log.info("ckpt.end", step=state.step, path=str(final), duration_s=time.perf_counter() - start)
        if self.on_committed is not None:
            self.on_committed(state.step, final)

    def discard_staging(self) -> None:
        """After an in-job recovery: rank 0 removes staging left by the failed save; every rank waits for it."""
        if self.comm.rank == 0:
            for name in clean_staging(self.directory):
                commlib.get_logger().info("ckpt.staging_removed", path=str(self.directory / name))
        self.comm.barrier()

    def _choose(self) -> int:
        """Rank 0: clean staging and pick the newest complete step (-1: none)."""
        log = commlib.get_logger()
        for name in clean_staging(self.directory):
            log.info("ckpt.staging_removed", path=str(self.directory / name))
        step, skipped = find_latest(self.directory)
        for s in skipped:
            log.warning("ckpt.skipped", step=s.step, path=s.path, reason=s.reason)
        return -1 if step is None else step

    def _check_lineage(self, saved: dict[str, Any], directory: Path) -> None:
        differing = lineage_differences(saved, self.lineage)
        if differing:
            raise CheckpointMismatch(
                f"resume on rank {self.comm.rank}: expected {directory} to come from a run "
                f"with this config; found {'; '.join(differing)}"
            )


def lineage_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """'key: checkpoint X, this run Y' for every top-level key on which the two configs differ."""
    return [
        f"{k}: checkpoint {saved.get(k)!r}, this run {current.get(k)!r}"
        for k in sorted(saved.keys() | current.keys())
        if saved.get(k) != current.get(k)
    ]


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
