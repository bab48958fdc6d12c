"""`commlib.init`: build the world communicator from explicit arguments or torchrun's environment.

Choosing the engine, finding rank/size/store, configuring logs and the SIGUSR1 flight
recorder dump happen here once per process; everything per-collective is `Communicator`'s.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from commlib import attempt as _attempt
from commlib.backends.c10d import C10dBackend
from commlib.communicator import Communicator
from commlib.errors import CommError
from commlib.record import flight
from commlib.record import log as _log
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
    """The world communicator, and torch.distributed's default group over it.

    Without `store`, rank, size and store come from torchrun's environment (`env://`).
    `backend` is the engine: "auto" (torchcomms when installed and usable, else gloo for
    CPU and nccl for CUDA), "gloo", "nccl" or "torchcomms". `timeout` is the default
    deadline of every collective (seconds or timedelta). `check_consistency` None: on where
    `COMMLIB_CHECK_CONSISTENCY=1` or `TORCH_DISTRIBUTED_DEBUG=DETAIL` is set
    (`commlib.engines.check_consistency`).

    Where no default group exists yet, this makes one with `backend="commlib"`
    (`commlib.process_group`), so FSDP2, DCP and every other torch.distributed caller in the
    process take commlib's path too; the communicator returned is the one under it. Where the
    caller made a default group already, the communicator wraps it (its own calls get
    commlib's path; torch.distributed's calls on that group do not). Either way it becomes
    `commlib.dist`'s default communicator unless one is set. With torch's own torchcomms
    routing on (TORCH_DISTRIBUTED_USE_TORCHCOMMS=1), torch never calls a custom backend, so
    the default group is made with the engine's name and wrapped.
    """
    if backend not in BACKENDS:
        raise ValueError(f"commlib.init: expected backend in {BACKENDS}; found {backend!r}")
    timeout_s = seconds(timeout)
    assert timeout_s is not None
    dev = _device(device)
    if store is None:
        store, rank, world_size = next(
            dist.rendezvous("env://", rank if rank is not None else -1, world_size if world_size is not None else -1)
        )
        # torchrun hands every restart of the job the same agent store, with the dead
        # attempt's keys still in it: a rank that starts before its peers would read a peer's
        # stale gloo address ("Connection refused") and stale progress-board entries. The
        # attempt is agreed by every rank of every node (a node's restart count is its own).
        store = dist.PrefixStore(f"attempt{_attempt.agree(store, rank, world_size, timeout_s)}/", store)
    if rank is None or world_size is None:
        raise ValueError(
            f"commlib.init: expected rank and world_size with an explicit store; "
            f"found rank={rank}, world_size={world_size}"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"commlib.init: expected 0 <= rank < world_size; found rank={rank}, world_size={world_size}")
    _log.configure(rank, world_size, log_dir, store=store)
    flight.install_sigusr1(_log.log_dir)

    if not dist.is_initialized() and _torch_routes_to_torchcomms():
        # torch then hands every backend name, "commlib" included, to torchcomms.new_comm:
        # make the group torch's way and take commlib's path for commlib's own calls only.
        engine = backend if backend in ("gloo", "nccl") else ("nccl" if dev.type == "cuda" else "gloo")
        dist.init_process_group(
            engine, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
        )
    if dist.is_initialized():
        comm = _over_existing_group(store, rank, world_size, timeout_s, name, dev, check_consistency)
    else:
        from commlib._torch_backend import register
        from commlib.engines import EngineOptions
        from commlib.process_group import current

        if backend == "auto":
            backend = "torchcomms" if _torchcomms_usable() else ("gloo" if dev.type == "cpu" else "auto")
        register()
        dist.init_process_group(
            "commlib",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
            pg_options=EngineOptions(
                engine=backend,
                name=name,
                check_consistency=check_consistency,
                torchcomms_backend=torchcomms_backend,
                device=dev if dev.type == "cuda" else None,
                configure_process=False,
            ),
        )
        comm = current()
    from commlib import dist as commlib_dist
    from commlib.process_group import CommlibProcessGroup

    if not isinstance(dist.group.WORLD, CommlibProcessGroup):
        commlib_dist.use_if_unset(comm)  # commlib.dist finds a commlib default group by itself
    return comm


def _device(device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _torchcomms_usable() -> bool:
    from commlib.backends import torchcomms as tc

    return tc.available() is None


def _torch_routes_to_torchcomms() -> bool:
    """TORCH_DISTRIBUTED_USE_TORCHCOMMS=1 (torch.distributed.config.use_torchcomms) in effect."""
    return bool(getattr(dist.distributed_c10d, "_use_torchcomms_enabled", lambda: False)())


def _over_existing_group(
    store: dist.Store,
    rank: int,
    size: int,
    timeout_s: float,
    name: str,
    device: torch.device,
    check_consistency: bool | None,
) -> Communicator:
    """The communicator over a default group the caller made before calling commlib.init."""
    if (dist.get_rank(), dist.get_world_size()) != (rank, size):
        raise CommError(
            f"commlib.init: expected the existing default process group to have rank {rank} of "
            f"{size}; found rank {dist.get_rank()} of {dist.get_world_size()}",
            rank=rank,
        )
    from commlib.engines import check_consistency as consistency_setting
    from commlib.process_group import CommlibProcessGroup, current

    if isinstance(dist.group.WORLD, CommlibProcessGroup):
        return current()
    # Another backend's group: commlib's own calls take the one path; torch.distributed's own
    # calls on that group do not (use backend="commlib" for those).
    impl = C10dBackend(dist.group.WORLD, device, dist.PrefixStore("commlib-splits/", store), owned=False)
    return Communicator(
        impl, dist.PrefixStore(f"commlib/{name}/", store), name, timeout_s, consistency_setting(check_consistency, name)
    )
