"""Reading one key per rank from the job's store in a few round trips, never one per rank.

When a collective fails, every surviving rank reads every peer's key at the same moment: the
progress board to name who never arrived (`ProgressBoard.read`, again and again while a dead
peer's heartbeat goes stale), the outcomes of a recovery's rebuild, who has not joined an
epoch or created a communicator. Read one key at a time (a `check`, then a `get`), that is
2N round trips per rank and 2N^2 requests to the one store server of the job: 2 million at
1,000 ranks. Each read waits its turn among all the others, and a rank whose deadline expired
raises its error only after its read: with 1,000 ranks' entries, a read took 0.49 s with 8
readers at once and 2.5 s with 32; read as below, 17 ms and 90 ms
(`scripts/bench_store_reads.py`, docs/measurements.md).

Here a read of N keys costs two requests where every key is there (`check` of all of them,
then one `multi_get`), and about 2k log2(N/k) more for the k keys that are missing (the
`check` bisects the keys down to them). Every key read this way must only ever be added,
never deleted: `multi_get` waits for a missing key, up to the store's timeout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

CHECK_EACH_BELOW = 4  # a run of keys this short that `check` says is incomplete is checked key by key


def absent(store: Any, keys: Sequence[str]) -> list[int]:
    """The indices of `keys` that are not set in `store`, in order."""
    missing: list[int] = []

    def bisect(lo: int, hi: int) -> None:
        if store.check(list(keys[lo:hi])):
            return
        if hi - lo <= CHECK_EACH_BELOW:  # at least one is missing: halving again would cost more
            missing.extend(i for i in range(lo, hi) if not store.check([keys[i]]))
            return
        mid = (lo + hi) // 2
        bisect(lo, mid)
        bisect(mid, hi)

    if keys:
        bisect(0, len(keys))
    return missing


def present(store: Any, keys: Sequence[str]) -> dict[int, bytes]:
    """{index: value} of each of `keys` that is set in `store` (keys that are only ever added)."""
    gone = set(absent(store, keys))
    found = [i for i in range(len(keys)) if i not in gone]
    if not found:
        return {}
    return dict(zip(found, store.multi_get([keys[i] for i in found]), strict=True))
