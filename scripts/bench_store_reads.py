"""The survivors of a failure reading the progress board at once: key by key against `commlib.store_reads`.

    .venv/bin/python scripts/bench_store_reads.py [--ranks 1000] [--readers 8] [--reads 4] [--rounds 2]
    .venv/bin/python scripts/bench_store_reads.py --capacity [--writers 1 4 16]
    .venv/bin/python scripts/bench_store_reads.py --creation [--ranks 1000] [--rounds 2]

A TCPStore server in this process stands for the job's store. Every rank's board entry is
published in it (`board/{r}`, a `BoardEntry` as JSON), then `--readers` processes (the
survivors of a failure; a real job has nearly all its ranks) each read the whole board
`--reads` times, all starting together, as `FailureReports` does when a deadline expires and again
while it waits for a dead peer's heartbeat to go stale. Meanwhile one more process publishes a
heartbeat every 50 ms, as each live rank's board does, and times each publication: whether the
storm of reads holds back the heartbeats by which a live rank is told from a stopped one
(`STALE_AFTER_S`). On this machine it did not: TCPStore's server takes its clients in turn.

The two reads, alternating over `--rounds` rounds in the same run: key by key (a `check` and a
`get` per rank, what `ProgressBoard.read`, the recovery and the creation checks did before) and
`commlib.store_reads.present` (a `check` of every key, then one `multi_get`). Printed for each:
the storm's wall time, each read's median and slowest time, the heartbeats' median and slowest
publication, and the ratio of the two reads' medians.

`--capacity`: how many sets a second the same server takes from 1, 4 and 16 processes each
setting a board-sized value as fast as it can (a TCPStore `set` waits for no reply): the figure
the boards' budget (`commlib.record.board.JOB_SETS_PER_S`) is a tenth of.

`--creation`: every one of `--ranks` ranks creating a communicator at once, as far as the store
sees it (`commlib.consistency.agree_on_settings`, the only store exchange of a creation), each
rank a thread with a client of its own, in 8 processes. Alternating, each time under a new
prefix: the agreement before (every rank waits for every rank's key, then reads them all) and
now (each counts itself in, the last says all came). Printed: the wall time from the start
until the last rank is through, and the ratio of the two.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402

from commlib.consistency import agree_on_settings  # noqa: E402
from commlib.record.board import BoardEntry  # noqa: E402
from commlib.store_reads import present  # noqa: E402

HEARTBEAT_EVERY_S = 0.05


def key_by_key(store: Any, keys: list[str]) -> dict[int, bytes]:
    """The read before `commlib.store_reads`: a check and a get per key."""
    return {i: store.get(k) for i, k in enumerate(keys) if store.check([k])}


READS = {"key by key (before)": key_by_key, "store_reads.present (now)": present}


def _client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))


def _reader(port: int, ranks: int, reads: int, how: str, start: Any, out: Any) -> None:
    store = _client(port)
    keys = [f"board/{r}" for r in range(ranks)]
    read = READS[how]
    start.wait()
    times = []
    for _ in range(reads):
        t = time.perf_counter()
        found = read(store, keys)
        times.append(time.perf_counter() - t)
        assert len(found) == ranks, f"expected {ranks} entries; found {len(found)}"
    out.put(("read", times))


def _heartbeat(port: int, stop: Any, out: Any) -> None:
    store = _client(port)
    entry = json.dumps(asdict(BoardEntry(pid=1)))
    took = []
    while not stop.is_set():
        t = time.perf_counter()
        store.set("board/heartbeat", entry)
        took.append(time.perf_counter() - t)
        time.sleep(HEARTBEAT_EVERY_S)
    out.put(("heartbeat", took))


def _writer(port: int, sets: int, start: Any, out: Any) -> None:
    store = _client(port)
    entry = json.dumps(asdict(BoardEntry(pid=1)))
    start.wait()
    for i in range(sets):
        store.set(f"board/{i % 8}", entry)
    store.get("board/0")  # a round trip: every set before it has been taken
    out.put(True)


def capacity(port: int, writers: int, sets: int = 4000) -> float:
    """Sets a second the server took from `writers` processes setting at once."""
    ctx = mp.get_context("forkserver")
    start, out = ctx.Barrier(writers + 1), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(port, sets, start, out)) for _ in range(writers)]
    for p in procs:
        p.start()
    start.wait()
    t = time.perf_counter()
    for _ in procs:
        out.get(timeout=600)
    wall = time.perf_counter() - t
    for p in procs:
        p.join(60)
    return writers * sets / wall


def agree_before(store: Any, name: str, rank: int, size: int, timeout_s: float, on: bool) -> None:
    """`agree_on_settings` before it counted: wait for every rank's key, then read them all."""
    keys = [f"settings/{r}" for r in range(size)]
    store.set(keys[rank], "on" if on else "off")
    store.wait(keys, timedelta(seconds=timeout_s))
    assert len({value.decode() for value in store.multi_get(keys)}) == 1


AGREEMENTS = {"every rank's key (before)": agree_before, "counted (now)": agree_on_settings}
CREATING_PROCESSES = 8


def _creators(port: int, prefix: str, ranks: list[int], size: int, how: str, start: Any, out: Any) -> None:
    import threading

    stores = [dist.PrefixStore(prefix, _client(port)) for _ in ranks]
    agree = AGREEMENTS[how]
    start.wait()
    threads = [
        threading.Thread(target=agree, args=(store, "world", rank, size, 300.0, False))
        for store, rank in zip(stores, ranks, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(time.perf_counter())


def creation(port: int, size: int, how: str, prefix: str) -> float:
    """Seconds from the start until every one of `size` ranks is through `how`'s agreement."""
    ctx = mp.get_context("forkserver")
    start, out = ctx.Barrier(CREATING_PROCESSES + 1), ctx.Queue()
    procs = [
        ctx.Process(
            target=_creators, args=(port, prefix, list(range(p, size, CREATING_PROCESSES)), size, how, start, out)
        )
        for p in range(CREATING_PROCESSES)
    ]
    for p in procs:
        p.start()
    start.wait()
    t = time.perf_counter()
    ends = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            raise SystemExit(f"expected every creating process to exit 0; found {p.exitcode}")
    return max(ends) - t


def storm(port: int, args: argparse.Namespace, how: str) -> dict[str, float]:
    # Not a plain fork: this process runs the store's server thread, whose locks a forked child
    # could inherit held. The fork server is a process of one thread that imported torch once.
    ctx = mp.get_context("forkserver")
    start, stop, out = ctx.Barrier(args.readers + 1), ctx.Event(), ctx.Queue()
    beat = ctx.Process(target=_heartbeat, args=(port, stop, out))
    beat.start()
    readers = [
        ctx.Process(target=_reader, args=(port, args.ranks, args.reads, how, start, out)) for _ in range(args.readers)
    ]
    for p in readers:
        p.start()
    time.sleep(0.5)  # the heartbeat's first publications, before the storm
    start.wait()
    t = time.perf_counter()
    results = [out.get(timeout=600) for _ in readers]
    wall = time.perf_counter() - t
    stop.set()
    beats = out.get(timeout=60)[1]
    for p in [*readers, beat]:
        p.join(60)
        if p.exitcode != 0:
            raise SystemExit(f"expected every process of the storm to exit 0; found {p.exitcode}")
    reads = [s for kind, times in results for s in times if kind == "read"]
    return {
        "wall_s": wall,
        "read_median_s": statistics.median(reads),
        "read_max_s": max(reads),
        "beat_median_s": statistics.median(beats),
        "beat_max_s": max(beats),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1000)
    parser.add_argument("--readers", type=int, default=8)
    parser.add_argument("--reads", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--capacity", action="store_true", help="the server's sets a second instead")
    parser.add_argument("--writers", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--creation", action="store_true", help="every rank creating a communicator at once instead")
    args = parser.parse_args()
    mp.set_forkserver_preload(["torch.distributed", "commlib.store_reads", "commlib.consistency"])
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    if args.creation:
        took: dict[str, list[float]] = {how: [] for how in AGREEMENTS}
        for round_ in range(args.rounds):
            for how in AGREEMENTS:
                took[how].append(creation(server.port, args.ranks, how, f"round{round_}/{how}/"))
                print(f"round {round_ + 1}, {how}: {args.ranks} ranks through in {took[how][-1]:.2f} s")
        before, now = (min(took[how]) for how in AGREEMENTS)
        print(f"a creation's agreement now takes {now / before:.3f}x the time ({now:.2f} s against {before:.2f} s)")
        return 0
    if args.capacity:
        for writers in args.writers:
            print(f"{writers} writers: {capacity(server.port, writers):,.0f} sets a second")
        return 0
    for r in range(args.ranks):
        server.set(f"board/{r}", json.dumps(asdict(BoardEntry(pid=100_000 + r, host=f"node{r // 8}"))))
    print(
        f"{args.ranks} ranks' board entries; {args.readers} readers, each reading the whole board "
        f"{args.reads} times, all at once; a heartbeat every {HEARTBEAT_EVERY_S * 1000:.0f} ms meanwhile"
    )
    seen: dict[str, list[dict[str, float]]] = {how: [] for how in READS}
    for round_ in range(args.rounds):
        for how in READS:
            m = storm(server.port, args, how)
            seen[how].append(m)
            print(
                f"round {round_ + 1}, {how}: storm {m['wall_s']:.2f} s; a read {m['read_median_s'] * 1000:.1f} ms "
                f"(slowest {m['read_max_s'] * 1000:.1f} ms); a heartbeat {m['beat_median_s'] * 1000:.2f} ms "
                f"(slowest {m['beat_max_s'] * 1000:.1f} ms)"
            )
    before, now = (statistics.median(m["read_median_s"] for m in seen[how]) for how in READS)
    ratio = now / before
    print(f"a read now takes {ratio:.3f}x the time key by key ({now * 1000:.1f} ms against {before * 1000:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
