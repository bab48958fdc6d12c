"""commlib leaves a process as it found it once its last group is destroyed, and not before:
the SIGUSR1 thread and its wakeup pipe, the log and stacks files, the SIGUSR1 and SIGUSR2
handlers, the process's wakeup fd and faulthandler on SIGUSR2 (issue 25, item 11). An abort
that in-job recovery follows with a rebuild keeps them. The stacks file exists only once a
dump is in it (item 12). Two real ranks over gloo, through torch.distributed's own calls."""

from __future__ import annotations

import faulthandler
import gc
import os
import signal
import socket
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import commlib
from commlib import testing
from commlib.process_group import commlib_groups
from commlib.record import flight
from commlib.record.files import stacks_file_name
from doctor_logs import wait_for


def _fds() -> dict[int, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass  # the descriptor listdir itself used
    return out


def _commlib_state(log_dir: Path) -> dict[str, Any]:
    """What of commlib's process-wide part is there now."""
    fds = _fds()
    return {"thread": any(t.name == "commlib-sigusr1" for t in threading.enumerate()),
            "log_fds": sorted(v for v in fds.values() if v.startswith(str(log_dir))),
            "installed": bool(getattr(flight.install_sigusr1, "installed", False))}


def _lifecycle(log_dir: str) -> dict[str, Any]:
    directory = Path(log_dir)
    rank = int(os.environ["RANK"])
    # What the process had before commlib: a SIGUSR1 handler of its own and a wakeup fd (asyncio's kind).
    heard: list[int] = []
    own_handler = lambda signum, frame: heard.append(signum)  # noqa: E731
    signal.signal(signal.SIGUSR1, own_handler)
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    signal.set_wakeup_fd(writer.fileno())
    usr2_before = signal.getsignal(signal.SIGUSR2)
    fds_before = _fds()
    out: dict[str, Any] = {}

    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), 2, is_master=False)
    commlib.init("gloo", rank=rank, world_size=2, store=store, log_dir=directory, timeout=30)
    group = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(2))
    dist.all_reduce(torch.ones(2), group=group)
    stacks = directory / stacks_file_name(socket.gethostname(), os.getpid())
    out["stacks_before_a_dump"] = stacks.exists()
    installed = flight._INSTALLED[0]
    pipe = {fds_before.get(fd) or _fds()[fd] for fd in (installed.read_fd, installed.write_fd)}
    out["running"] = _commlib_state(directory)

    # In-job recovery's abort and rebuild (`commlib.Recovery`): every communicator aborted, then
    # new ones built under the same groups.
    for g in commlib_groups():
        g.abort_quietly("in-job recovery")
    for g in commlib_groups():
        g.rebuild_communicators(1)
    dist.all_reduce(torch.ones(2), group=group)
    out["after_rebuild"] = _commlib_state(directory)
    if out["after_rebuild"]["installed"]:  # else SIGUSR2's default action would end the rank
        os.kill(os.getpid(), signal.SIGUSR1)  # still answered by commlib's thread (and our handler still called)
        out["dumped_after_rebuild"] = wait_for(lambda: any(directory.glob(f"flight_rank{rank}_*_sigusr1.json")))
        os.kill(os.getpid(), signal.SIGUSR2)
        out["stacks_after_a_dump"] = wait_for(lambda: stacks.exists()
                                               and "most recent call first" in stacks.read_text())

    dist.destroy_process_group()
    del group, store
    gc.collect()
    out["after_destroy"] = _commlib_state(directory)
    fds_after = _fds()
    out["pipe_left"] = sorted(pipe & set(fds_after.values()))
    out["fds_added"] = sorted(v for fd, v in fds_after.items() if fds_before.get(fd) != v
                              and (v.startswith(str(directory)) or v in pipe))
    out["wakeup_fd_restored"] = signal.set_wakeup_fd(writer.fileno()) == writer.fileno()
    out["usr1_restored"] = signal.getsignal(signal.SIGUSR1) is own_handler
    out["usr2_restored"] = signal.getsignal(signal.SIGUSR2) == usr2_before
    out["faulthandler_left"] = faulthandler.unregister(signal.SIGUSR2)
    out["own_handler_heard"] = signal.SIGUSR1 in heard
    return out


def test_the_last_destroyed_group_leaves_the_process_as_it_was(tmp_path: Path) -> None:
    results = testing.run(_lifecycle, 2, backend=None, args=(str(tmp_path),), timeout=120)
    for rank, out in enumerate(results):
        assert out["running"]["thread"] and out["running"]["log_fds"], out["running"]
        assert not out["stacks_before_a_dump"], f"rank {rank}: expected no stacks file before a SIGUSR2 dump"
        assert out["after_rebuild"] == out["running"] and out["dumped_after_rebuild"], (
            f"rank {rank}: expected an abort followed by a rebuild (in-job recovery) to keep commlib's thread, "
            f"log and handlers; found {out['after_rebuild']} (before: {out['running']})")
        assert out["stacks_after_a_dump"], f"rank {rank}: expected the SIGUSR2 dump in stacks_<host>_<pid>.txt"
        assert out["after_destroy"] == {"thread": False, "log_fds": [], "installed": False}, (
            f"rank {rank}: expected nothing of commlib left after destroy_process_group; found {out['after_destroy']}")
        assert out["pipe_left"] == [] and out["fds_added"] == [], (rank, out["pipe_left"], out["fds_added"])
        assert out["wakeup_fd_restored"], f"rank {rank}: expected the process's own wakeup fd back"
        assert out["usr1_restored"] and out["usr2_restored"], f"rank {rank}: expected the signal handlers back"
        assert not out["faulthandler_left"], f"rank {rank}: expected faulthandler unregistered from SIGUSR2"
        assert out["own_handler_heard"]
