"""The SIGUSR1 flight dump: a dump per signal while the rank appends as fast as it can, a
dump thread that outlives a failed dump, and an asyncio loop's own signals still delivered
after commlib took the process's wakeup fd (every test on real ranks over gloo)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import commlib
from commlib import testing
from commlib.observe import log

SIGNALS = 50
DUMP_WAIT_S = 5.0  # for one dump of a full ring on a loaded 2-core machine: generous


def _sigusr1_dumps(directory: Path, rank: int) -> list[Path]:
    return sorted(directory.glob(f"flight_rank{rank}_*_sigusr1.json"))


def _wait_for(predicate: Any, timeout: float) -> bool:
    give_up = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > give_up:
            return False
        time.sleep(0.005)
    return True


def _tight_loop_under_sigusr1(comm: commlib.Communicator, log_dir: str) -> dict[str, Any]:
    directory = Path(log_dir)
    stop = threading.Event()
    sent: list[int] = []

    def poke() -> None:
        # One signal at a time, each once the previous one's dump is written: signals sent
        # while one is pending merge into one, and the test counts every one of them.
        for i in range(1, SIGNALS + 1):
            os.kill(os.getpid(), signal.SIGUSR1)
            sent.append(i)
            if not _wait_for(lambda: len(_sigusr1_dumps(directory, 0)) >= i, DUMP_WAIT_S):
                break
        stop.set()

    t = torch.ones(1)
    for _ in range(500):  # the ring holds some hundreds of entries before the first dump
        comm.all_reduce(t)
    if comm.rank == 0:
        threading.Thread(target=poke, daemon=True).start()
    flag = torch.zeros(1)
    while True:  # one collective after another, every rank leaving together
        flag.fill_(1.0 if stop.is_set() else 0.0)
        comm.all_reduce(flag)
        if flag.item() > 0:
            break
    return {"sent": len(sent), "seq": comm.seq}


def test_fifty_sigusr1_give_fifty_dumps_while_collectives_run(tmp_path: Path) -> None:
    r0, _ = testing.run(_tight_loop_under_sigusr1, 2, args=(str(tmp_path),), timeout=180, log_dir=str(tmp_path))
    dumps = _sigusr1_dumps(tmp_path, 0)
    assert len(dumps) == SIGNALS, (
        f"expected one flight dump per SIGUSR1 ({SIGNALS}) from rank 0 in a tight collective loop; found "
        f"{len(dumps)} after {r0['sent']} signals (a dump thread that died stops answering)")
    assert not _sigusr1_dumps(tmp_path, 1)
    last_seqs = []
    for data in sorted((json.loads(p.read_text()) for p in dumps), key=lambda d: d["dumped_mono_ns"]):
        assert data["reason"] == "sigusr1" and data["rank"] == 0 and data["comm"] == "world"
        seqs = [e["seq"] for e in data["entries"]]
        # A copy taken at one moment: consecutive collectives, every one of them whole.
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), f"dump {data['dumped_ns']}: entries not consecutive"
        assert len(seqs) >= 500 and all(e["op"] == "all_reduce" for e in data["entries"])
        last_seqs.append(seqs[-1])
    # The rank went on with its collectives between dumps and after the last one.
    assert sorted(last_seqs) == last_seqs and len(set(last_seqs)) > 1 and last_seqs[-1] < r0["seq"]


def _asyncio_loop_then_commlib(log_dir: str) -> dict[str, Any]:
    directory = Path(log_dir)
    # The host's loop and its signal handlers exist first: asyncio set the wakeup fd.
    loop = asyncio.new_event_loop()
    heard: list[str] = []
    loop.add_signal_handler(signal.SIGUSR2, heard.append, "usr2")
    loop.add_signal_handler(signal.SIGUSR1, heard.append, "usr1")
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), 1, is_master=False)
    comm = commlib.init("gloo", rank=0, world_size=1, store=store, log_dir=directory)
    comm.all_reduce(torch.ones(1))
    out: dict[str, Any] = {}

    async def until(predicate: Any) -> bool:
        give_up = time.monotonic() + DUMP_WAIT_S
        while not predicate():
            if time.monotonic() > give_up:
                return False
            await asyncio.sleep(0.01)
        return True

    async def main() -> None:
        os.kill(os.getpid(), signal.SIGUSR2)
        out["usr2_heard"] = await until(lambda: "usr2" in heard)
        os.kill(os.getpid(), signal.SIGUSR1)  # the loop hears it, and commlib dumps
        out["usr1_heard"] = await until(lambda: "usr1" in heard)
        out["usr1_dumped"] = await until(lambda: len(_sigusr1_dumps(directory, 0)) == 1)

    loop.run_until_complete(main())
    out["heard"] = heard

    # A dump that fails (its directory is gone) is logged, and the next SIGUSR1 dumps again.
    away = directory.with_name(directory.name + ".away")
    os.rename(directory, away)
    os.kill(os.getpid(), signal.SIGUSR1)
    out["failure_logged"] = _wait_for(lambda: "flight.sigusr1_dump_failed" in (away / "rank0.jsonl").read_text(),
                                      DUMP_WAIT_S)
    os.rename(away, directory)
    os.kill(os.getpid(), signal.SIGUSR1)
    out["dumped_after_failure"] = _wait_for(lambda: len(_sigusr1_dumps(directory, 0)) == 2, DUMP_WAIT_S)
    comm.all_reduce(torch.ones(1))
    # Not before: closing a loop removes its signal handlers, and with the last one asyncio
    # resets the process's wakeup fd (and SIGUSR1 to its default action, which kills).
    loop.close()
    return out


def test_asyncio_signals_still_arrive_and_a_failed_dump_is_not_the_last(tmp_path: Path) -> None:
    [out] = testing.run(_asyncio_loop_then_commlib, 1, backend=None, args=(str(tmp_path / "logs"),), timeout=120)
    assert out["usr2_heard"], f"expected the asyncio loop to hear SIGUSR2 after commlib.init; it heard {out['heard']}"
    assert out["usr1_heard"], f"expected the asyncio loop to hear SIGUSR1 too; it heard {out['heard']}"
    assert out["heard"] == ["usr2", "usr1"]
    assert out["usr1_dumped"], "expected commlib's SIGUSR1 dump beside the loop's own handler"
    assert out["failure_logged"], "expected a failed SIGUSR1 dump to be logged as flight.sigusr1_dump_failed"
    assert out["dumped_after_failure"], "expected the SIGUSR1 after a failed dump to dump again"
    [failed] = [e for e in log.read_events(tmp_path / "logs" / "rank0.jsonl")
                if e["event"] == "flight.sigusr1_dump_failed"]
    assert failed["level"] == "error" and "FileNotFoundError" in failed["error"] and failed["comm"] == "world"
