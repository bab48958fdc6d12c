"""Reading every rank's key costs a few store requests, not one or two per rank
(`commlib.store_reads`): the progress board that every survivor of a failure reads at once,
and the absent ranks that a recovery, a communicator's creation and an attempt's agreement name."""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import asdict
from typing import Any

import pytest
import torch.distributed as dist

from commlib.record.board import BoardEntry, ProgressBoard
from commlib.store_reads import absent, present

pytestmark = pytest.mark.contract

RANKS = 256


class _CountingStore(dist.Store):
    """A real store (a HashStore underneath) that counts the reads made of it: on a TCPStore,
    each is a round trip to the job's one store server."""

    def __init__(self) -> None:
        super().__init__()
        self._inner = dist.HashStore()
        self.requests = 0
        self.keys = 0  # the keys those reads asked about

    def set(self, key: str, value: Any) -> None:  # the writers' side: not counted
        self._inner.set(key, value)

    def get(self, key: str) -> bytes:
        self.requests += 1
        self.keys += 1
        return self._inner.get(key)

    def check(self, keys: list[str]) -> bool:
        self.requests += 1
        self.keys += len(keys)
        return self._inner.check(keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.requests += 1
        self.keys += len(keys)
        return self._inner.multi_get(keys)

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        self.requests += 1
        self.keys += len(keys)
        self._inner.wait(keys) if timeout is None else self._inner.wait(keys, timeout)

    def add(self, key: str, amount: int) -> int:
        self.requests += 1
        self.keys += 1
        return self._inner.add(key, amount)


def _board(missing: set[int]) -> tuple[ProgressBoard, _CountingStore]:
    """Rank 0's board of a `RANKS`-rank communicator where every rank but `missing` published."""
    store = _CountingStore()
    for r in range(1, RANKS):
        if r not in missing:
            store.set(f"board/{r}", json.dumps(asdict(BoardEntry(pid=10_000 + r, started_seq=r))))
    board = ProgressBoard(store, 0, RANKS, os.getpid())  # publishes rank 0's entry itself
    store.requests = 0
    return board, store


def test_a_whole_board_is_read_in_two_store_requests_whatever_the_ranks() -> None:
    board, store = _board(missing=set())
    try:
        entries = board.read()
    finally:
        board.close()
    # Read key by key (a check, then a get), it took 2 x 256 = 512.
    assert store.requests == 2, f"expected a check and a multi_get; found {store.requests} requests"
    assert entries[0] is not None and entries[0].pid == os.getpid()
    assert all(entries[r] is not None and (entries[r].pid, entries[r].started_seq) == (10_000 + r, r)
               for r in range(1, RANKS))


def test_ranks_that_never_published_cost_a_few_requests_each_and_read_as_none() -> None:
    missing = {7, 100, 201}
    board, store = _board(missing)
    try:
        entries = board.read()
    finally:
        board.close()
    assert [r for r, e in entries.items() if e is None] == sorted(missing)
    assert all(entries[r].pid == 10_000 + r for r in range(1, RANKS) if r not in missing)  # type: ignore[union-attr]
    bound = 2 * len(missing) * math.log2(RANKS) + 2
    assert store.requests <= bound, f"expected at most {bound:.0f} requests; found {store.requests}"


@pytest.mark.parametrize("count", [0, 1, 5, 63, 64])
def test_absent_names_exactly_the_keys_not_set(count: int) -> None:
    keys = [f"k/{i}" for i in range(64)]
    gone = set(random.Random(count).sample(range(64), count))
    store = _CountingStore()
    for i, key in enumerate(keys):
        if i not in gone:
            store.set(key, str(i))
    assert absent(store, keys) == sorted(gone)
    # Bisecting costs at most about twice what checking each key would, when every key is missing.
    assert store.requests <= 2 * len(keys)
    assert present(store, keys) == {i: str(i).encode() for i in range(64) if i not in gone}
    assert absent(store, []) == [] and present(store, []) == {}


def test_the_ranks_that_never_created_a_communicator_are_named() -> None:
    from commlib.consistency import agree_on_settings
    from commlib.errors import CommError

    store = dist.HashStore()
    store.set("settings/2", "on")  # of 4 ranks, only rank 2 came (and rank 0, which asks)
    with pytest.raises(CommError, match=r"expected every rank to create it within 0.2 s; found ranks \[1, 3\] did not"):
        agree_on_settings(store, "world", 0, 4, 0.2, True)
    # Of 4,000, said in ranges: every rank listed was 20,000 characters.
    with pytest.raises(CommError) as raised:
        agree_on_settings(dist.HashStore(), "world", 0, 4000, 0.2, True)
    assert str(raised.value).endswith("found ranks [1-3999] did not"), str(raised.value)[-200:]


def test_creating_a_communicator_asks_the_store_about_a_few_keys_not_every_ranks() -> None:
    # The last of 4,000 ranks to create it: each rank asking after every rank's setting was
    # 8,000 keys a rank, 32 million at the job's one store server.
    from commlib.consistency import SETTINGS_CAME, SETTINGS_ON, agree_on_settings

    store = _CountingStore()
    store.add(SETTINGS_CAME, 3999)  # every other rank came, with the check off
    store.requests = store.keys = 0
    agree_on_settings(store, "world", 0, 4000, 1.0, False)
    assert store.keys <= 4, store.keys
    # One that came with the check on is named, with everyone else, from every rank's key.
    store = _CountingStore()
    for r in range(1, 4):
        store.set(f"settings/{r}", "on" if r == 2 else "off")
        store.add(SETTINGS_ON, r == 2)
    store.add(SETTINGS_CAME, 3)
    with pytest.raises(ValueError, match=r"found it on for ranks \[2\] and off for ranks \[0-1, 3\]"):
        agree_on_settings(store, "world", 0, 4, 1.0, False)


def test_looking_for_a_dead_peer_reads_the_board_again_only_as_often_as_a_heartbeat_can_change() -> None:
    # Rank 0's connection broke; ranks 1 and 2 live on another host, where only their heartbeat
    # can tell, and they stop beating now: rank 0 names them once it is STALE_AFTER_S old.
    import time

    from commlib.members import Members
    from commlib.record import log
    from commlib.record.board import HEARTBEAT_S, STALE_AFTER_S
    from commlib.failure_reports import BOARD_REREAD_S, FailureReports

    store = _CountingStore()
    stopped_ns = time.time_ns()  # both at once: a read between two clocks would name one (seen in run AB)
    for r in (1, 2):
        store.set(f"board/{r}", json.dumps(asdict(BoardEntry(pid=10_000 + r, host="another-host",
                                                            heartbeat_ns=stopped_ns))))
    board = ProgressBoard(store, 0, 3, os.getpid())
    try:
        reports = FailureReports(Members.of("world", 3), 0, board, log.get_logger(), backend=None)  # type: ignore[arg-type]
        store.requests = 0
        gone, how = reports._find_gone_peers(None)
    finally:
        board.close()
    assert gone == [1, 2] and how == f"no heartbeat for over {STALE_AFTER_S:g} s", (gone, how)
    # Two requests a read (a check and a multi_get), a read every BOARD_REREAD_S, and one more
    # read to see that they did not break the communicator themselves. Read every 20 ms, as
    # before, it was about 300.
    bound = 2 * ((STALE_AFTER_S + HEARTBEAT_S) / BOARD_REREAD_S + 2)
    assert store.requests <= bound, f"expected at most {bound:.0f} requests; found {store.requests}"


def test_a_large_communicators_waits_read_the_abort_key_less_often() -> None:
    # All the ranks of a communicator waiting at once (for a straggler) read its abort key
    # between the slices of their waits: 4,000 of them every 0.1 s would be 40,000 reads a
    # second of the job's one store server; their first slice is 0.2 s.
    import time
    from datetime import timedelta

    import torch

    from commlib.communicator import ABORT_POLL_S, ABORT_READS_PER_S, Communicator, abort_poll_s

    assert abort_poll_s(2) == abort_poll_s(2000) == ABORT_POLL_S
    assert abort_poll_s(4000) == 4000 / ABORT_READS_PER_S == 0.2 and abort_poll_s(10**6) == 1.0

    class Instant:  # an engine of 4,000 ranks, of which this is rank 0: only what a creation touches
        name, rank, size, device, resumable_wait, events = "gloo", 0, 4000, torch.device("cpu"), True, None

        def supports(self, device: torch.device, op: object) -> None:
            return None

        def finalize(self) -> None:
            return None

    from commlib.consistency import SETTINGS_CAME

    import torch.distributed as dist

    store = _CountingStore()
    # Every peer created it too, with the check off (`agree_on_settings`), under the prefix of
    # the first creation over this store (`Communicator`).
    dist.PrefixStore("1/", store).add(SETTINGS_CAME, 3999)
    comm = Communicator(Instant(), store, "world", 60.0)  # type: ignore[arg-type]
    try:
        slices: list[float] = []

        def still_running(slice_td: timedelta) -> bool:
            slices.append(slice_td.total_seconds())
            return len(slices) == 3

        assert comm._wait_in_slices(still_running, 60.0, time.monotonic_ns()) is True
    finally:
        comm.finalize()
    assert comm.abort_poll_s == 0.2 and slices[:2] == [0.2, 0.2], slices
