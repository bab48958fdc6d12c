"""The consistency check: every rank issues the same collective, or every rank raises.

With `check_consistency` on, a communicator's ranks compare each collective's fingerprint
(op, shapes, dtypes, root; `Collective.fingerprint`) before it is launched, and every rank
raises `CollectiveMismatch` naming who issued what, instead of hanging or mixing unlike
buffers. `ConsistencyCheck.agree` runs on the communicator's one path, after the call is
numbered and before its pre-hooks.

On a CPU engine the ranks first compare a digest of their fingerprints with one small
collective of the engine's own (`_digests_agree`): one 16-byte all_reduce, where the store
exchange costs two TCP round trips. Elsewhere that exchange would sync the device on every
call (its result is read on the host), so GPU communicators compare through the store alone.
Only when the digests differ, which every rank then sees, do the ranks swap whole
fingerprints through the store, to say who issued what.

The setting itself must be the same on every rank (`agree_on_settings`, at creation): a rank
without the check would pair a peer's digest exchange with its real collective.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from commlib.backends.base import Backend, keep_until_done
from commlib.errors import CollectiveMismatch, CommError
from commlib.failures import Failure
from commlib.hooks import HookRegistry, run_hooks
from commlib.lifecycle import Lifecycle
from commlib.members import Members, rank_list
from commlib.ops import Collective, OpName, ReduceOp
from commlib.record.flight import FlightEntry, FlightRecorder
from commlib.store_reads import absent
from commlib.validation import deadline_timedelta
from commlib.verdicts import Judge

CONSISTENCY_SLOTS = 2  # store keys per rank the check reuses in turn (`_fingerprints_through_store`)
_STORE_PAUSE_MAX_S = 0.05  # the longest pause between two reads of the peers' fingerprints
# `agree_on_settings`' keys, beside each rank's own setting (settings/{rank}): how many ranks
# came, how many of them with the check on, and that every one came.
SETTINGS_CAME, SETTINGS_ON, SETTINGS_ALL_CAME = "settings/came", "settings/on", "settings/all_came"


def agree_on_settings(store: dist.Store, name: str, rank: int, size: int, timeout_s: float, on: bool) -> None:
    """Raise unless every rank creates communicator `name` with the check on, or every rank with it off.

    A checked call issues one collective of its own on the engine (`_digests_agree`): a
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


class CheckedComm(Protocol):
    """What the check needs of the communicator whose calls it checks (`Communicator` is one): who
    it is, its engine and store, and its one path's wait and failures, which the check's own
    waits and failures take."""

    name: str
    rank: int
    size: int
    members: Members
    recorder: FlightRecorder
    hooks: HookRegistry
    _backend: Backend
    _store: dist.Store
    _fingerprints_via_engine: bool
    _judge: Judge
    _lifecycle: Lifecycle
    _log: Any

    def _wait_in_slices(
        self, wait: Callable[[timedelta], bool], budget_s: float, since_mono_ns: int
    ) -> bool | dict[str, Any]: ...


class ConsistencyCheck:
    """One communicator's check (module docstring). Its waits and failures take the
    communicator's own: waits in slices that a peer's abort announcement ends, failures
    recorded and raised by the communicator."""

    def __init__(self, comm: CheckedComm) -> None:
        self._comm = comm
        # The digests exchanged on a CPU engine, written and read through a numpy view
        # (cheaper than torch's indexing).
        self._digest_tensor = torch.zeros(2, dtype=torch.int64)
        self._digest_pair = self._digest_tensor.numpy()

    def agree(self, call: Collective) -> None:
        """Raise `CollectiveMismatch` on every rank unless every rank issues the same collective."""
        comm = self._comm
        fingerprint = call.fingerprint()
        started = time.time_ns(), time.monotonic_ns()
        if comm._fingerprints_via_engine and self._digests_agree(call, fingerprint, started):
            return
        mine = json.dumps(fingerprint, sort_keys=True)
        values = self._fingerprints_through_store(call, mine, started)
        if len(set(values)) == 1:
            return
        groups: dict[str, list[int]] = {}
        for r, v in enumerate(values):
            groups.setdefault(v, []).append(r)
        members = comm.members
        differing = members.global_of(sorted(r for v, rs in groups.items() if v != mine for r in rs))
        detail = "; ".join(f"{members.names(rs)}: {v}" for v, rs in groups.items())
        error = CollectiveMismatch(
            f"{call.op} #{call.seq} on {comm.name!r} {members.name(comm.rank)}: expected every rank to issue the "
            f"same collective; found {detail}",
            differing_ranks=differing,
            **comm._judge.where(call),
        )
        comm._log.error(
            "collective.mismatch", op=call.op.value, seq=call.seq, error=str(error), differing_ranks=differing
        )
        run_hooks(comm.hooks, "failure", call, error)
        raise error

    def _digests_agree(self, call: Collective, fingerprint: dict[str, object], started: tuple[int, int]) -> bool:
        """Whether every rank's fingerprint has the digest of this rank's: an all_reduce(MAX)
        of (digest, -digest) on the engine, which every rank issues for every checked call (the
        setting is agreed at creation, `agree_on_settings`), so it pairs with nothing else."""
        comm = self._comm
        # repr, not JSON: the fingerprint is built in one order on every rank, and this is cheaper.
        digest = int.from_bytes(hashlib.blake2b(repr(fingerprint).encode(), digest_size=8).digest(), "little") >> 2
        both = self._digest_pair
        both[0], both[1] = digest, -digest  # after MAX: the largest digest, and minus the smallest
        exchange = Collective(
            op=OpName.ALL_REDUCE,
            comm=comm.name,
            rank=comm.rank,
            size=comm.size,
            async_op=False,
            deadline_s=call.deadline_s,
            seq=call.seq,
            tensor=self._digest_tensor,
            reduce_op=ReduceOp.MAX,
        )
        backend = comm._backend
        try:
            work = backend.launch(exchange, deadline_timedelta(call.deadline_s))
            outcome = (
                comm._wait_in_slices(work.wait, call.deadline_s, started[1])
                if backend.resumable_wait
                else work.wait(deadline_timedelta(call.deadline_s))
            )
        except Exception as exc:
            raise comm._lifecycle.fail(call, self._entry(call, started), exc) from exc
        if outcome is not True:
            keep_until_done(work, backend, work.is_completed)
            self._failed(call, started, outcome)
        return int(both[0]) == digest == -int(both[1])

    def _fingerprints_through_store(self, call: Collective, mine: str, started: tuple[int, int]) -> list[str]:
        """Every rank's fingerprint, in rank order, through the store.

        Each rank's fingerprint goes to one of `CONSISTENCY_SLOTS` keys of its own, in turn,
        tagged with the call's number, so an exchange costs two store round trips (set, then
        one multi_get that finds every peer's value already there) and leaves nothing to
        delete. Two slots suffice: no rank passes check n+1 before every rank has set n+1,
        so a peer's slot holds either this call's value or one of an earlier call (that
        peer has not arrived yet: read again until it has, in slices, like an op's wait).
        """
        comm = self._comm
        store = comm._store
        tag = f"{call.seq}|".encode()
        keys = [f"fp/{call.seq % CONSISTENCY_SLOTS}/{r}" for r in range(comm.size)]
        store.set(keys[comm.rank], tag + mine.encode())
        # A peer's key may not exist yet: in its first calls, or at all where only a
        # mismatch of digests brings the ranks here.
        may_be_unset = comm._fingerprints_via_engine or call.seq <= CONSISTENCY_SLOTS
        values: list[bytes] = []

        def every_rank_set(slice_td: timedelta) -> bool:
            nonlocal values
            until = time.monotonic() + slice_td.total_seconds()
            pause_s = 0.0005
            while True:
                if may_be_unset:
                    try:
                        store.wait(keys, timedelta(seconds=max(until - time.monotonic(), 1e-3)))
                    except Exception as exc:
                        if comm._backend.classify(exc) is Failure.TIMEOUT:
                            return False
                        raise
                values = store.multi_get(keys)
                if all(v.startswith(tag) for v in values):
                    return True
                left = until - time.monotonic()
                if left <= 0:
                    return False
                time.sleep(min(pause_s, left))
                pause_s = min(pause_s * 2, _STORE_PAUSE_MAX_S)

        try:  # in slices, like an op's wait: a peer that aborted meanwhile ends it at once
            outcome = comm._wait_in_slices(every_rank_set, call.deadline_s, started[1])
        except Exception as exc:
            raise comm._lifecycle.timed_out(call, self._entry(call, started), exc) from exc
        if outcome is not True:
            self._failed(call, started, outcome)
        return [v[len(tag) :].decode() for v in values]

    def _entry(self, call: Collective, started: tuple[int, int]) -> FlightEntry:
        """The flight entry of a call whose check failed: the check's wait is what failed, so
        the entry starts when it did (the call itself never started)."""
        entry = self._comm.recorder.start(call)
        entry.start_ns, entry.start_mono_ns = started
        return entry

    def _failed(self, call: Collective, started: tuple[int, int], outcome: bool | dict[str, Any]) -> None:
        """Raise for a check's wait that ended without every rank: its deadline expired
        (False), or a peer's abort announcement was read (`Communicator._wait_in_slices`)."""
        if outcome is False:
            raise self._comm._lifecycle.timed_out(call, self._entry(call, started), None)
        assert isinstance(outcome, dict)
        raise self._comm._lifecycle.peer_left(call, self._entry(call, started), outcome)
