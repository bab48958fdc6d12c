"""A trainer written the way a user writes one against torch.distributed; run by torchrun.

    torchrun --nproc-per-node 4 tests/commlib/user_trainer.py --backend commlib --out DIR

Its only commlib-specific input is `--backend` (the one word a team changes): FSDP2 over a
2-D DeviceMesh (HSDP: replicate x shard) when the world has 4 ranks, plain FSDP2 on 2, or
DDP with `--ddp`; a DCP save and load of model and optimizer in the middle; the loss
history shared with `all_gather_object`; `dist.barrier`. Rank 0 writes `result.json`:
every step's loss (as float.hex, so equality is bitwise), a digest of the final model and
optimizer state, and how many operations each gloo engine ran (`_get_sequence_number_for_group`),
which the test compares with commlib's logs and with a plain gloo run. `--stop-before-save`
makes one rank sleep past the deadline right before the DCP save.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel


def model_and_optimizer(args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer, list[dist.ProcessGroup]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    world = dist.get_world_size()
    if args.ddp:
        model = DistributedDataParallel(model, bucket_cap_mb=0.001)  # several buckets, several all-reduces
        groups = [dist.group.WORLD]
    else:
        mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) if world == 4
                else init_device_mesh("cpu", (world,)))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        groups = [dist.group.WORLD, *mesh.get_all_groups()]
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), groups


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    h = hashlib.sha256()
    for key, value in sorted(_flatten({"model": model_sd, "optim": optim_sd}).items()):
        if isinstance(value, torch.Tensor):
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            h.update(key.encode() + value.detach().contiguous().numpy().tobytes())
        else:
            h.update(f"{key}={value!r}".encode())
    return h.hexdigest()


def _flatten(tree: object, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict):
        out: dict[str, object] = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    if isinstance(tree, (list, tuple)):
        return _flatten(dict(enumerate(tree)), prefix)
    return {prefix: tree}


def engine_ops(groups: list[dist.ProcessGroup]) -> dict[str, int]:
    """Operations each group's CPU engine ran (gloo counts every collective and send/recv)."""
    seen: dict[str, int] = {}
    for g in groups:
        seen[g.group_name] = g._get_backend(torch.device("cpu"))._get_sequence_number_for_group()
    return seen


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="gloo")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--ddp", action="store_true")
    p.add_argument("--stop-before-save", type=int, default=None, help="this rank sleeps past the deadline there")
    args = p.parse_args()
    out = Path(args.out)
    dist.init_process_group(backend=args.backend, timeout=timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    model, optimizer, groups = model_and_optimizer(args)
    ops_before = engine_ops(groups)
    losses: list[float] = []
    try:
        for step in range(1, args.steps + 1):
            x, y = batch(step, rank)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean, op=dist.ReduceOp.SUM)
            losses.append((mean / dist.get_world_size()).item())
            if step == args.steps // 2:
                if args.stop_before_save == rank:
                    time.sleep(args.timeout + 5)
                model_sd, optim_sd = get_state_dict(model, optimizer)
                dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(out / "ckpt"))
                model_sd, optim_sd = get_state_dict(model, optimizer)
                state = {"model": model_sd, "optim": optim_sd}
                dcp.load(state, checkpoint_id=str(out / "ckpt"))
                set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        histories: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(histories, [v.hex() for v in losses])
        dist.barrier()
        final = digest(model, optimizer)
    except Exception as exc:
        (out / f"error{rank}.json").write_text(json.dumps(_describe(exc)))
        raise
    if rank == 0:
        result = {"losses": histories[0], "same_on_every_rank": all(h == histories[0] for h in histories),
                  "digest": final, "engine_ops": engine_ops(groups), "engine_ops_before_training": ops_before,
                  "groups": [g.group_name for g in groups]}
        (out / "result.json").write_text(json.dumps(result))
    return 0


def _describe(exc: BaseException) -> dict[str, object]:
    """The error and its causes, as the test needs them (types and commlib fields)."""
    chain = []
    seen = exc
    while seen is not None and len(chain) < 10:
        fields = seen.fields() if hasattr(seen, "fields") else {}
        chain.append({"type": type(seen).__name__, "message": str(seen)[:2000],
                      "fields": {k: v for k, v in fields.items() if isinstance(v, (int, float, str, list, type(None)))}})
        seen = seen.__cause__ or seen.__context__
    return {"chain": chain}


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # skip teardown of groups whose peers may be gone
