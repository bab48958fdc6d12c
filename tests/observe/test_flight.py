"""The SIGUSR1 flight dump: a storm of signals while the rank appends as fast as it can writes
a few dumps, the newest kept, each a consistent copy; a dump thread that outlives a failed
dump and never spins on one that repeats, and an asyncio loop's own signals still delivered
after commlib took the process's wakeup fd (every test on real ranks over gloo)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import commlib
from commlib import testing
from commlib.observe import events
from commlib.record import flight
from doctor_logs import wait_for

STORM = 200  # SIGUSR1s, one every STORM_GAP_S: the "200 signals in about a second"
STORM_GAP_S = 0.005
KEEP, INTERVAL_S = 4, 0.25  # the dump budget under test
DUMP_WAIT_S = 5.0  # for one dump of a full ring on a loaded 2-core machine: generous


def _sigusr1_dumps(directory: Path, rank: int) -> list[Path]:
    return sorted(directory.glob(f"flight_rank{rank}_*_sigusr1.json"))


def _dump_number(path: Path) -> int:
    """The recorder's count of its dumps, in the file's name (`FlightRecorder.dump`)."""
    return int(re.search(r"_(\d+)_sigusr1\.json$", path.name).group(1))  # type: ignore[union-attr]


def _dumped_after(path: Path, mono_ns: int) -> bool:
    """Whether the dump at `path` was taken after `mono_ns`; False where the recorder has
    rotated it away since it was listed (it keeps only the newest while it writes more)."""
    try:
        return json.loads(path.read_text())["dumped_mono_ns"] > mono_ns
    except FileNotFoundError:
        return False


def _storm_under_sigusr1(comm: commlib.Communicator, log_dir: str) -> dict[str, Any]:
    directory = Path(log_dir)
    stop = threading.Event()
    storm: dict[str, int] = {}

    def poke() -> None:
        storm["first_mono_ns"] = time.monotonic_ns()
        for _ in range(STORM):
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(STORM_GAP_S)
        storm["last_mono_ns"] = time.monotonic_ns()
        # The signals of the storm's last interval are owed one dump, taken after them.
        wait_for(lambda: any(_dumped_after(p, storm["last_mono_ns"]) for p in _sigusr1_dumps(directory, 0)),
                 DUMP_WAIT_S)
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
    return {**storm, "seq": comm.seq}


def test_a_sigusr1_storm_writes_a_few_dumps_and_keeps_the_newest(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(flight.DUMPS_ENV, str(KEEP))
    monkeypatch.setenv(flight.INTERVAL_ENV, str(INTERVAL_S))
    r0, _ = testing.run(_storm_under_sigusr1, 2, args=(str(tmp_path),), timeout=180, log_dir=str(tmp_path))
    dumps = _sigusr1_dumps(tmp_path, 0)
    numbers = sorted(_dump_number(p) for p in dumps)
    storm_s = (r0["last_mono_ns"] - r0["first_mono_ns"]) / 1e9
    # Rate: one dump per interval at most, and the one owed to the last signals.
    allowed = int(storm_s / INTERVAL_S) + 2
    assert 1 <= numbers[-1] <= allowed, (
        f"expected at most {allowed} SIGUSR1 dumps for {STORM} signals in {storm_s:.2f} s (one per "
        f"{INTERVAL_S} s); found {numbers[-1]} written")
    # Count: only the newest KEEP files are left, the rest removed.
    assert len(dumps) == min(KEEP, numbers[-1]) and numbers == list(range(numbers[-1] - len(numbers) + 1,
                                                                          numbers[-1] + 1)), numbers
    assert not _sigusr1_dumps(tmp_path, 1)
    kept = sorted((json.loads(p.read_text()) for p in dumps), key=lambda d: d["dumped_mono_ns"])
    assert kept[-1]["dumped_mono_ns"] > r0["last_mono_ns"], "expected the newest state dumped after the storm"
    last_seqs = []
    for data in kept:
        assert data["reason"] == "sigusr1" and data["rank"] == 0 and data["comm"] == "world"
        seqs = [e["seq"] for e in data["entries"]]
        # A copy taken at one moment: consecutive collectives, every one of them whole.
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), f"dump {data['dumped_ns']}: entries not consecutive"
        assert len(seqs) >= 500 and all(e["op"] == "all_reduce" for e in data["entries"])
        last_seqs.append(seqs[-1])
    # The rank went on with its collectives between dumps and after the last one.
    assert sorted(last_seqs) == last_seqs and last_seqs[-1] < r0["seq"]


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
    out["failure_logged"] = wait_for(lambda: "flight.sigusr1_dump_failed" in (away / "rank0.jsonl").read_text(),
                                      DUMP_WAIT_S)
    os.rename(away, directory)
    os.kill(os.getpid(), signal.SIGUSR1)
    out["dumped_after_failure"] = wait_for(lambda: len(_sigusr1_dumps(directory, 0)) == 2, DUMP_WAIT_S)

    # Every turn of the thread fails (the dump interval made absurd since it started): no spin.
    os.environ[flight.INTERVAL_ENV] = "inf"
    for _ in range(3):
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.1)
    cpu = time.process_time()
    time.sleep(1.0)
    out["failing_thread_cpu_s"] = time.process_time() - cpu
    del os.environ[flight.INTERVAL_ENV]
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
    failed, interval = [e for e in events.read_events(tmp_path / "logs" / "rank0.jsonl")
                        if e["event"] == "flight.sigusr1_dump_failed"]
    assert failed["level"] == "error" and "FileNotFoundError" in failed["error"] and failed["comm"] == "world"
    # A failure that repeats is logged once, and the thread rests between tries instead of spinning.
    assert "COMMLIB_FLIGHT_DUMP_INTERVAL_S" in interval["error"], interval
    assert out["failing_thread_cpu_s"] < 0.5, out  # a spinning thread takes the whole second


def test_the_first_failures_dump_is_kept_past_the_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A process asked for a dump, then failed, then went on through aborts and more signals: the
    # budget keeps the newest two, and the first failure's dump beside them, never the later ones.
    monkeypatch.setenv(flight.DUMPS_ENV, "2")
    files = flight._DumpFiles()
    for n, reason in enumerate(["sigusr1", "collective_timeout", "abort", "sigusr1", "abort", "peer_failure"]):
        path = tmp_path / f"flight_{n}_{reason}.json"
        path.write_text("{}")
        files.wrote(path, reason)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "flight_1_collective_timeout.json", "flight_4_abort.json", "flight_5_peer_failure.json"]
