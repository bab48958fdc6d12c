"""What a fault is, as plain data: its type (and what each type is), its trigger, its fields.

`chaos.plan` parses and checks plans of these (its docstring is the plan format); the
in-rank injector (`chaos.inject`) and the harness's external faults (`chaos.external`) act
on them; the `chaos.ledger` records their firings.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass
from typing import Any

DELAY_MARGIN_S = 0.5  # past the peers' deadline: they have timed out when the held collective starts


class FaultType(enum.StrEnum):
    KILL = "kill"
    SEGFAULT = "segfault"
    EXIT = "exit"
    HANG = "hang"
    DELAY = "delay"
    RAISE = "raise"
    CORRUPT = "corrupt"
    KILL_DURING_CHECKPOINT = "kill_during_checkpoint"
    STRAGGLER = "straggler"
    CORRUPT_CHECKPOINT = "corrupt_checkpoint"
    SIGTERM = "sigterm"
    GIL = "gil"
    DISK_FULL = "disk_full"
    PARTITION = "partition"
    NET_DELAY = "net_delay"
    NET_LOSS = "net_loss"
    PREEMPT = "preempt"
    TIME_LIMIT = "time_limit"
    NODE_LOSS = "node_loss"

    @property
    def external(self) -> bool:
        """Applied by the harness from outside, with a signal (the others act inside the rank)."""
        return (
            self in (FaultType.KILL, FaultType.HANG, FaultType.SIGTERM, FaultType.DISK_FULL)
            or self.network
            or self.slurm
        )

    @property
    def slurm(self) -> bool:
        """Acts on the Slurm job the harness runs in (`chaos.slurm.faults`): the whole job stops."""
        return self in (FaultType.PREEMPT, FaultType.TIME_LIMIT, FaultType.NODE_LOSS)

    @property
    def network(self) -> bool:
        """Acts on the link of the target rank's node (`chaos.net`), for `duration_s`."""
        return self in (FaultType.PARTITION, FaultType.NET_DELAY, FaultType.NET_LOSS)

    @property
    def in_collective(self) -> bool:
        """Acts inside a collective's pre-hook, so `seq`, `op` and `comm` apply to it."""
        return self in (
            FaultType.SEGFAULT,
            FaultType.EXIT,
            FaultType.DELAY,
            FaultType.RAISE,
            FaultType.CORRUPT,
            FaultType.STRAGGLER,
            FaultType.GIL,
        )

    @property
    def default_rank(self) -> int | None:
        """The rank when the plan names none: a checkpoint's files are committed by rank 0."""
        return (
            0
            if self in (FaultType.CORRUPT_CHECKPOINT, FaultType.DISK_FULL, FaultType.PREEMPT, FaultType.TIME_LIMIT)
            else None
        )

    @property
    def default_from_start(self) -> bool:
        """Without a trigger the fault acts from the first step (a straggler is slow from the start)."""
        return self is FaultType.STRAGGLER


class TriggerKind(enum.StrEnum):
    STEP = "step"
    SEQ = "seq"
    AFTER_S = "after_s"
    P = "p"


class Release(enum.StrEnum):
    KILL = "kill"
    CONT = "cont"


@dataclass(frozen=True)
class Trigger:
    """When a fault fires: `kind` and its `value`, narrowed by `op`/`comm` for in-collective faults."""

    kind: TriggerKind
    value: float
    op: str | None = None
    comm: str | None = None
    phase: str | None = None

    def draw(self, seed: int, index: int, attempt: int, step: int) -> bool:
        """The `p` trigger's coin for one step: a pure function of its arguments."""
        digest = hashlib.blake2b(f"{seed}:{index}:{attempt}:{step}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") / 2**64 < self.value

    def matches_step(self, seed: int, index: int, attempt: int, step: int, elapsed_s: float) -> bool:
        """Whether a step-level trigger (step, after_s, p) holds at the start of `step`."""
        if self.kind is TriggerKind.STEP:
            return step == self.value
        if self.kind is TriggerKind.AFTER_S:
            return elapsed_s >= self.value
        if self.kind is TriggerKind.P:
            return self.draw(seed, index, attempt, step)
        return False

    def matches_call(self, op: str, seq: int, comm: str, phase: Any) -> bool:
        """Whether a collective is the one this fault acts on (the seq, and the op/comm/phase filters)."""
        if self.kind is TriggerKind.SEQ and seq != self.value:
            return False
        return (
            (self.op is None or op == self.op)
            and (self.comm is None or comm == self.comm)
            and (self.phase is None or phase == self.phase)
        )

    def filters(self) -> list[tuple[str, str]]:
        """The op/comm/phase filters that are set, as (field, value)."""
        return [(name, v) for name, v in (("op", self.op), ("comm", self.comm), ("phase", self.phase)) if v is not None]


@dataclass(frozen=True)
class Fault:
    type: FaultType
    rank: int | str  # an int, or "random" until `Plan.resolve` draws it
    trigger: Trigger
    count: int = 1
    seed: int = 0
    duration_s: float | None = None
    release: Release = Release.KILL
    code: int = 1
    ms: float | None = None  # straggler: added before each of the rank's collectives; net_delay: per packet
    pct: float | None = None  # net_loss: the percentage of the node's packets dropped
    partition: str | None = None  # preempt: the partition of the job that preempts this one

    def describe(self) -> str:
        where = "".join(f" {name}={v}" for name, v in self.trigger.filters())
        value = self.trigger.value
        shown = int(value) if self.trigger.kind in (TriggerKind.STEP, TriggerKind.SEQ) else value
        return f"{self.type} rank {self.rank} at {self.trigger.kind}={shown}{where} (x{self.count})"

    def to_dict(self) -> dict[str, Any]:
        """The flat form plans are written in."""
        t = self.trigger
        value: float | int = int(t.value) if t.kind in (TriggerKind.STEP, TriggerKind.SEQ) else t.value
        out: dict[str, Any] = {
            "type": self.type.value,
            "rank": self.rank,
            t.kind.value: value,
            "count": self.count,
            "seed": self.seed,
        }
        out.update(t.filters())
        if self.duration_s is not None:
            out["duration_s"] = self.duration_s
        if self.type is FaultType.HANG:
            out["release"] = self.release.value
        if self.type is FaultType.EXIT:
            out["code"] = self.code
        if self.ms is not None:
            out["ms"] = self.ms
        if self.partition is not None:
            out["partition"] = self.partition
        if self.pct is not None:
            out["pct"] = self.pct
        return out
