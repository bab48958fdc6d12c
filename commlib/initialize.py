"""`commlib.init`: build the world communicator from explicit arguments or torchrun's environment.

Choosing a backend, finding rank/size/store, configuring logs and the SIGUSR1 flight
recorder dump happen here once per process; everything per-collective is `Communicator`'s.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from commlib.backends.c10d import C10dBackend
from commlib.communicator import CHECK_CONSISTENCY_ENV, Communicator
from commlib.errors import CommError
from commlib.observe import flight
from commlib.observe import log as _log
from commlib.validation import seconds

BACKENDS = ("auto", "gloo", "nccl", "torchcomms")


def init(
    backend: str = "auto",
    *,
    rank: int | None = None,
    world_size: int | None = None,
    store: dist.Store | None = None,
    timeout: float | timedelta = 300.0,
    name: str = "world",
    device: torch.device | str | None = None,
    log_dir: str | os.PathLike[str] | None = None,
    check_consistency: bool | None = None,
    torchcomms_backend: str | None = None,
) -> Communicator:
    """The world communicator.

    Without `store`, rank, size and store come from torchrun's environment (`env://`).
    `backend`: "auto" (torchcomms when installed and usable, else torch.distributed with
    gloo for CPU and nccl for CUDA), "gloo", "nccl" or "torchcomms". `timeout` is the
    default deadline of every collective (seconds or timedelta).
    """
    if backend not in BACKENDS:
        raise ValueError(f"commlib.init: expected backend in {BACKENDS}; found {backend!r}")
    timeout_s = seconds(timeout)
    assert timeout_s is not None
    dev = _device(device)
    if check_consistency is None:
        check_consistency = os.environ.get(CHECK_CONSISTENCY_ENV, "0") == "1"
    if store is None:
        store, rank, world_size = next(dist.rendezvous("env://", rank if rank is not None else -1,
                                                       world_size if world_size is not None else -1))
        # torchrun hands every restart of the job the same agent store, with the dead
        # attempt's keys still in it: a rank that starts before its peers would read a peer's
        # stale gloo address ("Connection refused") and stale progress-board entries.
        store = dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
    if rank is None or world_size is None:
        raise ValueError(f"commlib.init: expected rank and world_size with an explicit store; "
                         f"found rank={rank}, world_size={world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"commlib.init: expected 0 <= rank < world_size; found rank={rank}, world_size={world_size}")
    _log.configure(rank, world_size, log_dir)
    flight.install_sigusr1(_log.log_dir)

    commlib_store = dist.PrefixStore(f"commlib/{name}/", store)
    if backend == "torchcomms" or (backend == "auto" and _torchcomms_usable()):
        from commlib.backends.torchcomms import TorchcommsBackend

        impl = TorchcommsBackend.create(rank=rank, size=world_size, store=store, name=name, device=dev,
                                        timeout=timedelta(seconds=timeout_s), engine=torchcomms_backend)
    else:
        pg_backend = backend if backend in ("gloo", "nccl") else ("nccl" if dev.type == "cuda" else "gloo")
        impl = C10dBackend(_world_group(pg_backend, store, rank, world_size, timeout_s), dev)
    return Communicator(impl, commlib_store, name, timeout_s, check_consistency, world_rank=rank)


def _device(device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _torchcomms_usable() -> bool:
    from commlib.backends import torchcomms as tc

    return tc.available() is None


def _world_group(pg_backend: str, store: dist.Store, rank: int, size: int, timeout_s: float) -> dist.ProcessGroup:
    """The default process group, created here unless the caller already made one."""
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, size):
            raise CommError(f"commlib.init: expected the existing default process group to have rank {rank} of "
                            f"{size}; found rank {dist.get_rank()} of {dist.get_world_size()}", rank=rank)
        return dist.group.WORLD
    dist.init_process_group(pg_backend, store=store, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))
    return dist.group.WORLD
