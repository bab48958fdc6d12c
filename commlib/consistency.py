"""The consistency check: every rank issues the same collective, or every rank raises.

With `check_consistency` on, a communicator's ranks compare each collective's fingerprint
(op, shapes, dtypes, root; `Collective.fingerprint`) before it is launched, and every rank
raises `CollectiveMismatch` naming who issued what, instead of hanging or mixing unlike
buffers. `ConsistencyCheck.agree` runs on the communicator's one path, after the call is
numbered and before its pre-hooks.

On a CPU engine the ranks first compare a digest of their fingerprints with one small
collective of the engine's own (`digest_exchange`): one 16-byte all_reduce, where the store
exchange costs two TCP round trips. Elsewhere that exchange would sync the device on every
call (its result is read on the host), so GPU communicators compare through the store alone.
Only when the digests differ, which every rank then sees, do the ranks swap whole
fingerprints through the store (`fingerprints_through_store`), to say who issued what.

`ConsistencyCheck` says what to exchange and what an exchange means; the communicator runs
the exchanges on its one path, with its own waits and failures (`Communicator._agree`).

The setting itself must be the same on every rank (`agree_on_settings`, at creation): a rank
without the check would pair a peer's digest exchange with its real collective.
"""

from __future__ import annotations

import hashlib
import json
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from commlib.errors import CollectiveMismatch, CommError
from commlib.failures import Failure, classify
from commlib.members import Members, rank_list
from commlib.ops import Collective, OpName, ReduceOp
from commlib.store_reads import absent

CONSISTENCY_SLOTS = 2  # store keys per rank the check reuses in turn (`StoreExchange`)
_STORE_PAUSE_MAX_S = 0.05  # the longest pause between two reads of the peers' fingerprints
# `agree_on_settings`' keys, beside each rank's own setting (settings/{rank}): how many ranks
# came, how many of them with the check on, and that every one came.
SETTINGS_CAME, SETTINGS_ON, SETTINGS_ALL_CAME = "settings/came", "settings/on", "settings/all_came"


def agree_on_settings(store: dist.Store, name: str, rank: int, size: int, timeout_s: float, on: bool) -> None:
    """Raise unless every rank creates communicator `name` with the check on, or every rank with it off.

    A checked call issues one collective of its own on the engine (`ConsistencyCheck.digest_exchange`): a
    rank without the check would pair it with its real collective, and the two would mix
    each other's data instead of failing. So the setting is compared once, at creation,
    through the store, which makes creating a communicator wait for every rank to create it
    (as the engine's own rendezvous mostly does anyway), at most `timeout_s`.

    Each rank counts itself in (how many came, how many with the check on) and the last to
    come says all came: a handful of requests a rank, each of one key. Waiting for every
    rank's key and reading them all instead made each of N ranks ask about N keys, N^2 at
    the job's one store server (`scripts/bench_store_reads.py --creation`). The rank keys are
    read only to name who never came, or who differs.
    """
    keys = [f"settings/{r}" for r in range(size)]
    store.set(keys[rank], "on" if on else "off")
    store.add(SETTINGS_ON, int(on))  # before this rank counts as come: the last one's count then includes it
    if store.add(SETTINGS_CAME, 1) == size:
        store.set(SETTINGS_ALL_CAME, "1")
    try:
        store.wait([SETTINGS_ALL_CAME], timedelta(seconds=timeout_s))
    except Exception as exc:
        raise CommError(
            f"creating {name!r} on rank {rank}: expected every rank to create it within "
            f"{timeout_s:g} s; found ranks {rank_list(absent(store, keys))} did not",
            op="init",
            comm=name,
            rank=rank,
        ) from exc
    if store.add(SETTINGS_ON, 0) in (0, size):
        return
    settings = [value.decode() for value in store.multi_get(keys)]
    by_setting = {s: [r for r, v in enumerate(settings) if v == s] for s in ("on", "off")}
    raise ValueError(
        f"creating {name!r} on rank {rank}: expected every rank to create it with the "
        f"same check_consistency (COMMLIB_CHECK_CONSISTENCY); found it on for ranks "
        f"{rank_list(by_setting['on'])} and off for ranks {rank_list(by_setting['off'])}"
    )


class ConsistencyCheck:
    """One communicator's check (module docstring): what its ranks exchange, and what that means."""

    def __init__(self, store: dist.Store, members: Members, rank: int, *, via_engine: bool) -> None:
        self._store = store
        self._members = members
        self._rank = rank
        self.via_engine = via_engine  # digests compared by a collective of the engine's own first
        # The digests exchanged on a CPU engine, written and read through a numpy view
        # (cheaper than torch's indexing).
        self._digest_tensor = torch.zeros(2, dtype=torch.int64)
        self._digest_pair = self._digest_tensor.numpy()
        self._digest = 0

    def digest_exchange(self, call: Collective, fingerprint: dict[str, object]) -> Collective:
        """The engine's all_reduce(MAX) of (digest, -digest) for `call`, which every rank issues
        for every checked call (the setting is agreed at creation, `agree_on_settings`), so it
        pairs with nothing else; `digests_agree` reads it once it has completed."""
        # repr, not JSON: the fingerprint is built in one order on every rank, and this is cheaper.
        digest = int.from_bytes(hashlib.blake2b(repr(fingerprint).encode(), digest_size=8).digest(), "little") >> 2
        self._digest = digest
        both = self._digest_pair
        both[0], both[1] = digest, -digest  # after MAX: the largest digest, and minus the smallest
        return Collective(
            op=OpName.ALL_REDUCE,
            comm=call.comm,
            rank=call.rank,
            size=call.size,
            async_op=False,
            deadline_s=call.deadline_s,
            seq=call.seq,
            tensor=self._digest_tensor,
            reduce_op=ReduceOp.MAX,
        )

    def digests_agree(self) -> bool:
        """After `digest_exchange`'s op completed: whether every rank's digest is this rank's."""
        both = self._digest_pair
        return int(both[0]) == self._digest == -int(both[1])

    def fingerprints_through_store(self, call: Collective, fingerprint: dict[str, object]) -> StoreExchange:
        """Post this rank's fingerprint of `call`; the exchange to wait for (`StoreExchange.poll`)."""
        mine = json.dumps(fingerprint, sort_keys=True)
        return StoreExchange(self._store, call, mine, self._rank, self.via_engine)

    def mismatch(
        self, call: Collective, values: list[str], mine: str, where: dict[str, Any]
    ) -> CollectiveMismatch | None:
        """The error every rank raises when the fingerprints differ (None when they agree)."""
        if len(set(values)) == 1:
            return None
        groups: dict[str, list[int]] = {}
        for r, v in enumerate(values):
            groups.setdefault(v, []).append(r)
        members = self._members
        differing = members.global_of(sorted(r for v, rs in groups.items() if v != mine for r in rs))
        detail = "; ".join(f"{members.names(rs)}: {v}" for v, rs in groups.items())
        return CollectiveMismatch(
            f"{call.op} #{call.seq} on {call.comm!r} {members.name(self._rank)}: expected every rank to issue the "
            f"same collective; found {detail}",
            differing_ranks=differing,
            **where,
        )


class StoreExchange:
    """Every rank's fingerprint of one call, in rank order, through the store.

    Each rank's fingerprint goes to one of `CONSISTENCY_SLOTS` keys of its own, in turn, tagged
    with the call's number, so an exchange costs two store round trips (set, then one multi_get
    that finds every peer's value already there) and leaves nothing to delete. Two slots
    suffice: no rank passes check n+1 before every rank has set n+1, so a peer's slot holds
    either this call's value or one of an earlier call (that peer has not arrived yet: read
    again until it has).
    """

    def __init__(self, store: dist.Store, call: Collective, mine: str, rank: int, after_digests: bool) -> None:
        self._store = store
        self.mine = mine
        self._tag = f"{call.seq}|".encode()
        self._keys = [f"fp/{call.seq % CONSISTENCY_SLOTS}/{r}" for r in range(call.size)]
        store.set(self._keys[rank], self._tag + mine.encode())
        # A peer's key may not exist yet: in its first calls, or at all where only a mismatch of
        # digests brings the ranks here.
        self._may_be_unset = after_digests or call.seq <= CONSISTENCY_SLOTS
        self._values: list[bytes] = []

    def poll(self, slice_td: timedelta) -> bool:
        """Wait at most `slice_td` for every rank's fingerprint; whether they are all there."""
        store, keys, tag = self._store, self._keys, self._tag
        until = time.monotonic() + slice_td.total_seconds()
        pause_s = 0.0005
        while True:
            if self._may_be_unset:
                try:
                    store.wait(keys, timedelta(seconds=max(until - time.monotonic(), 1e-3)))
                except Exception as exc:
                    if classify(type(exc).__name__, str(exc)) is Failure.TIMEOUT:
                        return False
                    raise
            self._values = store.multi_get(keys)
            if all(v.startswith(tag) for v in self._values):
                return True
            left = until - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause_s, left))
            pause_s = min(pause_s * 2, _STORE_PAUSE_MAX_S)

    def values(self) -> list[str]:
        """Once `poll` said they are all there: every rank's fingerprint, in rank order."""
        return [v[len(self._tag) :].decode() for v in self._values]
