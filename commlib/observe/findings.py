"""What the doctor's rules find, as plain data: per attempt an `AttemptFinding`, made of `Problem`s of one `Kind`.

The rules that make them live in `commlib.observe.blame` (and `commlib.observe.mismatch`
for ranks that issued different collectives); `commlib.observe.diagnosis` gathers them into a
`Diagnosis` and `commlib.doctor` renders it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from commlib.observe.position import RankPosition


class Kind(enum.StrEnum):
    """What a problem is. The rules are named after it: in `commlib.observe.blame`, `_timeout`, `_hang`,
    `_dead_ranks`, `_peer_failure`, `_error` and `_app_errors`, `_straggler`, send/recv's `_p2p_*`;
    `commlib.observe.mismatch.first_mismatch`."""

    TIMEOUT = "timeout"
    HANG = "hang"
    MISMATCH = "mismatch"
    DEAD_RANK = "dead_rank"
    PEER_FAILURE = "peer_failure"
    ERROR = "error"
    STRAGGLER = "straggler"  # not a failure: the attempt may still be ok


@dataclass
class Problem:
    kind: Kind
    ranks: list[int]  # culprits (global ranks)
    comm: str | None
    op: str | None
    seq: int | None
    message: str
    reporters: list[int] = field(default_factory=list)  # ranks whose logs show it
    ts_ns: int | None = None  # when it first showed
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class AttemptFinding:
    attempt: int
    status: str  # ok | failed | incomplete | recovered (in-job: every problem before every rank's last recovery)
    ranks: list[int]
    world_size: int | None
    collectives: int | None  # distinct (communicator, seq) started; None where the logs were read from the end
    start_ns: int | None  # its first event; None where the logs were read from the end
    end_ns: int
    problems: list[Problem]
    culprits: list[int]  # the culprits of the earliest problem that names any
    positions: list[RankPosition]  # every rank at the end of its log (failed/incomplete attempts)
    p2p_ops: int | None = 0  # distinct (comm, pair, tag, pair seq) started; None as `collectives`
