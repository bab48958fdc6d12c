"""The engine communicators under a commlib process group: which, and how they are built.

`EngineOptions` say how (`commlib.init` passes them as `pg_options`; groups torch makes by
itself inherit the default group's): "auto" is gloo for CPU tensors plus nccl for CUDA ones
where CUDA is available, or `COMMLIB_ENGINE` (`gloo`, `nccl`, `torchcomms`). A group whose
main device is CUDA also gets a gloo communicator for CPU tensors (object collectives, DCP
metadata), which nccl cannot move. `Recipe` keeps how a group's communicators were built, so
that in-job recovery builds them again under the same group object.

The consistency check is on where the options say so, else where
`COMMLIB_CHECK_CONSISTENCY=1` or `TORCH_DISTRIBUTED_DEBUG=DETAIL` is set when the group is
made (c10d skips its own DETAIL wrapper for a creator that returns a `ProcessGroup`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from commlib import settings
from commlib.communicator import CHECK_CONSISTENCY_ENV, Communicator
from commlib.record import log as _log

ENGINE_ENV = "COMMLIB_ENGINE"
ENGINES = ("auto", "gloo", "nccl", "torchcomms")
TORCH_DEBUG_ENV = "TORCH_DISTRIBUTED_DEBUG"


@dataclass(frozen=True)
class EngineOptions:
    """How the communicators under a commlib process group are built."""

    engine: str = "auto"  # auto | gloo | nccl | torchcomms
    name: str | None = None  # of the communicator; default "world" for the default group, else "group{N}"
    check_consistency: bool | None = None  # None: from the environment (`check_consistency`)
    torchcomms_backend: str | None = None  # torchcomms' own engine (gloo, nccl, ...); default by device
    # The default group configures this process's logs (COMMLIB_LOG_DIR) and SIGUSR1 dump,
    # unless its maker (commlib.init) has done so.
    configure_process: bool = True
    # The device the group's CUDA engine runs on (`main_cuda_device`); commlib.init passes its own.
    device: torch.device | str | None = None
    # An engine of the caller's own, in place of `engine`: called as
    # `backend_factory(store=, rank=, size=, device=, timeout=)` for every communicator of the
    # group (rebuilt ones too) and returning a `commlib.backends.base.Backend`. The tests'
    # emulated stream-ordered engine comes in this way (tests/commlib/emulated_device.py).
    backend_factory: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"commlib process group: expected engine in {ENGINES}; found {self.engine!r}")


def check_consistency(explicit: bool | None, comm_name: str) -> bool:
    """Whether a new communicator checks that every rank issues the same collective.

    `explicit` (an argument or `EngineOptions`) decides where given; otherwise
    `COMMLIB_CHECK_CONSISTENCY=1`, or `TORCH_DISTRIBUTED_DEBUG=DETAIL`, whose own check c10d
    never puts around a commlib group: commlib's stands in for it, and the log says so.
    """
    if explicit is not None:
        return explicit
    because = (
        f"{CHECK_CONSISTENCY_ENV}=1"
        if settings.env_flag(CHECK_CONSISTENCY_ENV)
        else f"{TORCH_DEBUG_ENV}=DETAIL"
        if os.environ.get(TORCH_DEBUG_ENV, "").upper() == "DETAIL"
        else None
    )
    if because is not None:
        _log.get_logger().info("comm.consistency_check", comm=comm_name, enabled=True, because=because)
    return because is not None


@dataclass(frozen=True)
class Recipe:
    """How a group's communicators were built, so in-job recovery can build them again."""

    options: EngineOptions
    devices: tuple[tuple[torch.device, str], ...]  # (device, communicator name), main one first
    store: dist.Store  # the group's own store, as c10d handed it to `create`
    rank: int
    size: int
    timeout_s: float
    global_ranks: tuple[int, ...]  # of the members, by group rank

    def build(self, store: dist.Store, timeouts: dict[str, float] | None = None) -> dict[str, Communicator]:
        """The group's communicators; `timeouts`: each device's deadline, where not the recipe's."""
        timeouts = timeouts or {}
        return {
            device.type: build_communicator(
                self.options,
                device,
                comm_name,
                store,
                self.rank,
                self.size,
                timeouts.get(device.type, self.timeout_s),
                self.global_ranks,
            )
            for device, comm_name in self.devices
        }


def engine_named(options: EngineOptions) -> str:
    """The engine asked for: an explicit choice, else `COMMLIB_ENGINE`, else auto."""
    return options.engine if options.engine != "auto" else settings.env_choice(ENGINE_ENV, ENGINES, "auto")


def devices_for(options: EngineOptions, name: str) -> list[tuple[torch.device, str]]:
    """(device, communicator name) for each communicator of a group: the first is its main one."""
    engine = engine_named(options)
    cuda = torch.cuda.is_available() and engine != "gloo"
    if engine == "nccl" and not cuda:
        raise RuntimeError("commlib process group: expected CUDA for the nccl engine; found none")
    if not cuda:
        return [(torch.device("cpu"), name)]
    local_rank = settings.env_integer("LOCAL_RANK", -1, low=0)
    main = main_cuda_device(options.device, local_rank, torch.cuda.device_count(), torch.cuda.current_device)
    # nccl cannot move CPU tensors (object collectives, DCP metadata): a gloo one beside it can.
    return [(main, name)] + ([(torch.device("cpu"), f"{name}.cpu")] if engine == "auto" else [])


def main_cuda_device(
    asked: torch.device | str | None, local_rank: int, device_count: int, current: Callable[[], int]
) -> torch.device:
    """The CUDA device a group's engine runs on, fixed when the group is made: the one asked for
    (`EngineOptions.device`, which `commlib.init(device=)` sets), else the one torchrun's
    LOCAL_RANK gives this rank of its node, else the current device. Never only the current
    device where anything else says: a trainer may set it after `init_process_group` (or pass
    only `device_id=`, which a creator that returns its own group never sees), and the
    deadline thread would then read events of another device than the one NCCL runs on."""
    if asked is not None:
        device = torch.device(asked)
        if device.type != "cuda":
            raise ValueError(f"commlib process group: expected a CUDA device for its CUDA engine; found {device}")
        return device if device.index is not None else torch.device("cuda", current())
    if 0 <= local_rank < device_count:
        return torch.device("cuda", local_rank)
    return torch.device("cuda", current())


def build_communicator(
    options: EngineOptions,
    device: torch.device,
    name: str,
    store: dist.Store,
    rank: int,
    size: int,
    timeout_s: float,
    global_ranks: tuple[int, ...],
) -> Communicator:
    engine = engine_named(options)
    store = dist.PrefixStore(f"{device.type}/", store)
    timeout = timedelta(seconds=timeout_s)
    if options.backend_factory is not None:
        impl: Any = options.backend_factory(store=store, rank=rank, size=size, device=device, timeout=timeout)
    elif engine == "torchcomms":
        from commlib.backends.torchcomms import TorchcommsBackend

        impl = TorchcommsBackend.create(
            rank=rank,
            size=size,
            store=store,
            name=name,
            device=device,
            timeout=timeout,
            engine=options.torchcomms_backend,
        )
    else:
        from commlib.backends.c10d import C10dBackend

        kind = "nccl" if device.type == "cuda" else "gloo"
        impl = C10dBackend.create(kind, store=store, rank=rank, size=size, device=device, timeout=timeout)
    return Communicator(
        impl,
        dist.PrefixStore("commlib/", store),
        name,
        timeout_s,
        bool(options.check_consistency),
        global_ranks=global_ranks,
    )
