"""The results file of a training run: what the chaos verifier compares between runs.

Public: the reference trainer calls `write_results` at the end of a run, and so can any
user's own trainer that wants its runs verified. The file (JSON, written atomically by
rank 0) holds:

    format         1
    steps          the number of steps the run trained
    losses         every step's loss in step order, as plain JSON numbers (null if not finite)
    losses_hex     the same losses as `float.hex()` strings: exact, NaN and inf included
    state_digest   {"total": sha256, "tensors": {name: sha256}} over the full (unsharded)
                   model and optimizer state ("model.<fqn>", "optim.state.<fqn>.<key>",
                   "optim.param_groups")
    ...            the caller's `extra` keys; the reference trainer adds `history` (a
                   {"step", "attempt"} record per step applied) and `config`

Python's `json` writes the shortest repr of a float, which reads back to the same float,
so `losses` is exact for finite values too; `read_results` decodes `losses_hex` anyway.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from chaos.files import write_json_atomic

FORMAT = 1
_RESERVED = ("format", "steps", "losses", "losses_hex", "state_digest")


def _tensor_sha256(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    digest = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _value_sha256(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return _tensor_sha256(value)
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=repr).encode()).hexdigest()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def state_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """sha256 of every tensor of the full model and optimizer state, and of all of them.

    Collective when the model is sharded (FSDP2): every rank calls it; the full state is
    gathered to rank 0 only, which returns the digest, and every other rank returns None.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=options)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=options)
    if _rank() != 0:
        return None
    tensors = {f"model.{fqn}": _tensor_sha256(t) for fqn, t in model_sd.items()}
    for fqn, per_param in optim_sd["state"].items():
        for key, value in per_param.items():
            tensors[f"optim.state.{fqn}.{key}"] = _value_sha256(value)
    tensors["optim.param_groups"] = _value_sha256(optim_sd["param_groups"])
    total = hashlib.sha256("".join(f"{name} {h}\n" for name, h in sorted(tensors.items())).encode())
    return {"total": total.hexdigest(), "tensors": dict(sorted(tensors.items()))}


def write_results(
    path: str | os.PathLike[str],
    *,
    losses: list[float],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: int,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write the results file; see the module docstring for its keys.

    Call it on every rank (the state digest is collective); only rank 0 writes. The file
    appears at `path` complete or not at all.
    """
    rank = _rank()
    losses = [float(x) for x in losses]
    if len(losses) != steps:
        raise ValueError(f"write_results on rank {rank}: expected one loss per step ({steps}); found {len(losses)}")
    clashing = sorted(set(extra or {}) & set(_RESERVED))
    if clashing:
        raise ValueError(f"write_results on rank {rank}: expected extra keys other than {_RESERVED}; found {clashing}")
    digest = state_digest(model, optimizer)
    if digest is None:
        return
    results = {
        "format": FORMAT,
        "steps": steps,
        "losses": [x if math.isfinite(x) else None for x in losses],
        "losses_hex": [x.hex() for x in losses],
        "state_digest": digest,
        **(extra or {}),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, results)


def read_results(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The results file as a dict, with `losses` decoded exactly from `losses_hex`."""
    results = json.loads(Path(path).read_text())
    if not isinstance(results, dict) or results.get("format") != FORMAT:
        found = results.get("format") if isinstance(results, dict) else type(results).__name__
        raise ValueError(f"read_results: expected a results file of format {FORMAT} in {path}; found {found!r}")
    results["losses"] = [float.fromhex(x) for x in results["losses_hex"]]
    return results
