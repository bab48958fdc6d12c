"""The doctor's statistics: latency and bandwidth per op and size, and how long ranks waited for each other.

`op_stats(run)` and `stragglers(run)` are tables over the log model (`commlib.observe.run_logs`),
from what it accumulated as it read (`Quantiles` sketches: exact up to a few thousand values,
within 0.5 % beyond); `straggler_stats(attempts)` is what the straggler rule
(`commlib.observe.blame`) judges by.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from commlib.observe.records import AttemptLog
from commlib.observe.run_logs import RunLogs
from commlib.observe.sketch import Quantiles

# op -> (S is n * bytes rather than bytes, bus bandwidth factor for n ranks), after
# NCCL-tests' PERFORMANCE.md. `bytes` in the log is what one rank contributes (its input),
# so for the gathers the whole array S is n times that.
BANDWIDTH: dict[str, tuple[bool, Callable[[int], float]]] = {
    "all_reduce": (False, lambda n: 2 * (n - 1) / n),
    "all_gather": (True, lambda n: (n - 1) / n),
    "all_gather_single": (True, lambda n: (n - 1) / n),
    "reduce_scatter": (False, lambda n: (n - 1) / n),
    "reduce_scatter_single": (False, lambda n: (n - 1) / n),
    "all_to_all_single": (False, lambda n: (n - 1) / n),
    "broadcast": (False, lambda n: 1.0),
    "reduce": (False, lambda n: 1.0),
    "gather": (True, lambda n: (n - 1) / n),
    "scatter": (False, lambda n: (n - 1) / n),
    "send": (False, lambda n: 1.0),
}


@dataclass
class StragglerStat:
    """How long the other ranks waited for this rank to arrive (wall clocks: see docs/observability.md)."""

    rank: int
    collectives: int
    last_count: int  # collectives this rank arrived last at
    waited_total_s: float
    waited_p50_s: float
    waited_p99_s: float


@dataclass
class OpStat:
    op: str
    comm_size: int
    bytes: int  # per-rank input bytes as logged
    samples: int  # (rank, collective) pairs that completed
    p50_s: float
    p99_s: float
    algbw_gbps: float | None  # S / p50, GB/s (1e9 bytes)
    busbw_gbps: float | None


def stragglers(run: RunLogs) -> list[StragglerStat]:
    """Per rank, the time others waited for it: (last start - first start) when it arrived last, else 0.

    Over every collective all of whose members logged a start (all attempts). Starts are
    wall clocks (`ts_ns`) of different processes, so across hosts the figures include the
    hosts' clock offset.
    """
    return straggler_stats(run.attempts.values())


def straggler_stats(attempts: Iterable[AttemptLog]) -> list[StragglerStat]:
    collectives: dict[int, int] = defaultdict(int)
    last_count: dict[int, int] = defaultdict(int)
    waited: dict[int, Quantiles] = defaultdict(Quantiles)
    for att in attempts:
        for r, n in att.waited().items():
            w = att.waits.get(r)
            last = w.last_count if w is not None else 0
            collectives[r] += n
            last_count[r] += last
            waited[r].add_zeros(n - last)
            if w is not None:
                waited[r].merge(w.lags)
    return [
        StragglerStat(
            rank=r,
            collectives=collectives[r],
            last_count=last_count[r],
            waited_total_s=q.total,
            waited_p50_s=q.quantile(0.5),
            waited_p99_s=q.quantile(0.99),
        )
        for r, q in sorted(waited.items())
        if q.count
    ]


def bandwidth(op: str, nbytes: int, n: int, seconds: float) -> tuple[float | None, float | None]:
    """(algbw, busbw) in GB/s for `op` on `n` ranks, each contributing `nbytes`, taking `seconds`.

    algbw = S / t, busbw = algbw * factor(n), with NCCL-tests' S and factors (see docs/observability.md).
    """
    if op not in BANDWIDTH or nbytes <= 0 or seconds <= 0 or n < 1:
        return None, None
    times_n, factor = BANDWIDTH[op]
    size = nbytes * n if times_n else nbytes
    algbw = size / seconds / 1e9
    return algbw, algbw * factor(n)


def op_stats(run: RunLogs) -> list[OpStat]:
    """Latency and bandwidth per (op, communicator size, bytes) over completed collectives."""
    samples: dict[tuple[str, int, int], Quantiles] = defaultdict(Quantiles)
    for att in run.attempts.values():
        for comm in att.comms.values():
            n = comm.size or len(comm.members)
            for (op, nbytes), q in comm.latencies().items():
                samples[(op, n, nbytes)].merge(q)
    out = []
    for (op, n, nbytes), q in sorted(samples.items()):
        p50 = q.quantile(0.5)
        algbw, busbw = bandwidth(op, nbytes, n, p50)
        out.append(
            OpStat(
                op=op,
                comm_size=n,
                bytes=nbytes,
                samples=q.count,
                p50_s=p50,
                p99_s=q.quantile(0.99),
                algbw_gbps=algbw,
                busbw_gbps=busbw,
            )
        )
    return out
