"""Fault plans: what to break, on which rank, when, and how often -- and the ledger of firings.

A plan is data. It is written as YAML or JSON::

    faults:
      - {type: kill, rank: 1, step: 12}
      - {type: delay, rank: 1, step: 22, op: all_reduce}
      - {type: kill, rank: random, seed: 3, p: 0.2, count: 2}
    max_restarts: 4          # optional; default: every firing plus RESTART_MARGIN

or on the command line, one fault per ``--fault``: ``kill:rank=1,step=12``.

Every fault has a type, a target rank (an int, or ``random`` drawn from ``seed`` once the
world size is known), exactly one trigger, and a ``count``: how many times it fires in
total, across torchrun restarts. Triggers:

``step: S``       at step S (every time step S runs, until ``count`` is spent);
``seq: N``        at collective sequence number N (in-rank faults; ``op``/``comm`` narrow
                  it to one op name / communicator name; without ``comm`` any
                  communicator whose sequence reaches N matches);
``after_s: T``    at the first step that starts T seconds or more after the job started;
``p: P``          at each step with probability P, drawn from ``seed``, the fault's index,
                  the attempt and the step (so a run is reproducible).

In-collective faults (delay, raise, corrupt, exit, segfault) may narrow the collective they
act on with ``op`` (its name), ``comm`` (its communicator's name) and ``phase`` (the
``commlib.context(phase=...)`` it runs in: ``checkpoint`` picks DCP's collectives in the
reference trainer, which runs torch.distributed through commlib's backend). With a step
trigger the fault acts at the first matching collective from that step on; alone
(``delay:rank=1,phase=checkpoint``) a filter acts at the first matching collective of the
run, i.e. the trigger defaults to ``after_s: 0``.

Type-specific fields: ``duration_s`` (delay, gil: how long the collective is held, default
its deadline plus ``DELAY_MARGIN_S``; hang: how long the rank stays stopped, default until
a survivor reports the failure), ``release`` (hang: ``kill`` or ``cont``), ``code``
(exit: the exit status, default 1), ``ms`` (straggler: milliseconds added before each of
the rank's collectives, required; it must stay under the deadline).

``straggler`` is slow from its trigger on (no trigger: from the first step), in every
attempt, so its count is 1 (the ledger records when it started). ``corrupt_checkpoint``
targets rank 0 unless told otherwise: at the first checkpoint committed from its step on,
it flips bytes in one of that checkpoint's files and then SIGKILLs its rank, so that the
job has to load a checkpoint from disk (an in-job rollback would never read it).
``disk_full`` (external, rank 0 by default: its step trigger is read from that rank's log)
fills the checkpoint directory's filesystem at the start of its step; the space comes back
when a rank reports the failed save, or after ``duration_s``.

Network faults (external: the harness applies them to the link of the node holding the
rank, through `chaos.net`'s emulator, and lifts them after ``duration_s``, required):
``partition`` (the node cut off from every other node), ``net_delay`` (``ms``, required:
added to every packet to or from the node, so a round trip gains 2 x ms) and ``net_loss``
(``pct``, required: the percentage of those packets dropped). They need a job whose nodes
all run on this machine, at least two of them, on gloo (`check_network`, with the job's
collective deadline: a partition is either short enough to be survived or long enough to
be detected, nothing in between).

Slurm faults (external, on the whole job the harness runs in: `chaos.slurm.faults`, which
also says where each can run): ``preempt`` (a job of the preempting ``partition``, default
``urgent``, takes the job's nodes), ``time_limit`` (the job's time limit brought near, for
Slurm's notice) and ``node_loss`` (the node holding the rank loses power). ``preempt`` and
``time_limit`` default to rank 0, whose step triggers them.

`Plan.resolve(world_size)` checks everything against the world size before anything
starts and returns the plan with random ranks drawn; every error names the field.
`check_run` checks what would never fire or could never finish in the run it is for: a
``step`` past the run's last, an ``after_s`` past the job's timeout, a straggler whose ``ms``
reaches the collective deadline or whose delays alone outlast the job's timeout. Every
number is finite, and a field given twice (``kill:rank=1,rank=0``, or a repeated YAML or
JSON key) is refused rather than read as its last value.

Validation is written here by hand, not with a schema library (pydantic was weighed, as
issue #15 asked). What it would take over is small: the per-field type and range checks
(`_int`, `_number`, the enums), a few dozen lines. The rest is rules between fields and
against the job (exactly one trigger, the fields each fault type requires, ranks against
the world size at `resolve`, network faults against the topology and the deadline), which
pydantic would hold as validators of the same code. Its messages name a location tuple
and an error type (``Input should be a valid integer [type=int_type, ...]``), not this
module's ``faults[1].rank: expected an int >= 0; found 'x'``, so keeping the messages would
mean a translation layer on top; and every rank of a trainer parses its plan
(`chaos.inject`), so the dependency (a compiled pydantic-core) would ride into every job.

The `Ledger` persists firings in the run directory (one file per firing, created with
O_EXCL *before* the fault acts), so that a restarted rank, or the harness, never fires a
fault more often than its count, and the report knows exactly what was done and when.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import os
import random
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from commlib.ops import OpName

DELAY_MARGIN_S = 0.5  # past the peers' deadline: they have timed out when the held collective starts
RESTART_MARGIN = 2
# Network faults against the collective deadline (docs/chaos.md, "Network faults"). After a
# partition of D seconds, TCP resumes a connection at its next retransmission, and its
# exponential backoff (200 ms doubling) puts that up to D + 0.2 s after the link is back:
# a collective caught in it lasts up to 2 D + 0.2 s. A short partition keeps that, plus
# this slack, under the deadline; a long one outlasts the deadline by at least
# PARTITION_PAST_DEADLINE_S, so the step's first collective (which starts half a second
# after the cut) certainly times out.
TCP_FIRST_RTO_S = 0.2  # Linux's first retransmission timeout, which the backoff doubles
TCP_RESUME_SLACK_S = 1.0
PARTITION_PAST_DEADLINE_S = 1.0
MAX_LOSS_PCT = 10.0
# A delayed collective makes a few round trips (each + 2 x ms); this many must fit in a deadline.
NET_DELAY_ROUND_TRIPS = 10


class PlanError(ValueError):
    """A plan that cannot run. `field` is where it is wrong (e.g. ``faults[1].rank``)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


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
        return (self in (FaultType.KILL, FaultType.HANG, FaultType.SIGTERM, FaultType.DISK_FULL) or self.network
                or self.slurm)

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
        return self in (FaultType.SEGFAULT, FaultType.EXIT, FaultType.DELAY, FaultType.RAISE, FaultType.CORRUPT,
                        FaultType.STRAGGLER, FaultType.GIL)

    @property
    def default_rank(self) -> int | None:
        """The rank when the plan names none: a checkpoint's files are committed by rank 0."""
        return 0 if self in (FaultType.CORRUPT_CHECKPOINT, FaultType.DISK_FULL, FaultType.PREEMPT,
                             FaultType.TIME_LIMIT) else None

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
        return ((self.op is None or op == self.op) and (self.comm is None or comm == self.comm)
                and (self.phase is None or phase == self.phase))

    def filters(self) -> list[tuple[str, str]]:
        """The op/comm/phase filters that are set, as (field, value)."""
        return [(name, v) for name, v in (("op", self.op), ("comm", self.comm), ("phase", self.phase))
                if v is not None]


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
        out: dict[str, Any] = {"type": self.type.value, "rank": self.rank, t.kind.value: value,
                               "count": self.count, "seed": self.seed}
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


@dataclass(frozen=True)
class Plan:
    faults: tuple[Fault, ...] = ()
    max_restarts: int | None = None

    @property
    def restarts(self) -> int:
        """torchrun's --max-restarts: the plan's, or one per possible firing plus RESTART_MARGIN
        (a restart can itself fail, e.g. when a slow rank misses the backend's connect timeout)."""
        if self.max_restarts is not None:
            return self.max_restarts
        return sum(f.count for f in self.faults) + RESTART_MARGIN if self.faults else 0

    def resolve(self, world_size: int) -> Plan:
        """Check every fault against `world_size` and draw `random` ranks. Raises PlanError."""
        if not isinstance(world_size, int) or world_size < 1:
            raise PlanError("world_size", f"expected a positive int; found {world_size!r}")
        resolved = []
        for i, f in enumerate(self.faults):
            rank = f.rank
            if rank == "random":
                rank = random.Random(f"{f.seed}:{i}").randrange(world_size)
            if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
                raise PlanError(f"faults[{i}].rank", f"expected an int in [0, {world_size}) or 'random' for a world "
                                                     f"of {world_size} ranks; found {f.rank!r} ({f.describe()})")
            resolved.append(replace(f, rank=rank))
        return replace(self, faults=tuple(resolved))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"faults": [f.to_dict() for f in self.faults]}
        if self.max_restarts is not None:
            out["max_restarts"] = self.max_restarts
        return out

    def save(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, data: Any) -> Plan:
        if not isinstance(data, dict):
            raise PlanError("plan", f"expected a mapping with 'faults'; found {type(data).__name__}")
        unknown = sorted(set(data) - {"faults", "max_restarts"})
        if unknown:
            raise PlanError(unknown[0], "unknown plan field; expected 'faults' and optionally 'max_restarts'")
        items = data.get("faults")
        if items is None:
            raise PlanError("faults", "missing; expected a list of faults")
        if not isinstance(items, list):
            raise PlanError("faults", f"expected a list; found {type(items).__name__}")
        max_restarts = data.get("max_restarts")
        if max_restarts is not None:
            _int("max_restarts", max_restarts, minimum=0)
        return cls(tuple(parse_fault(item, f"faults[{i}]") for i, item in enumerate(items)), max_restarts)


class PartitionOutcome(enum.StrEnum):
    """What a partition of a given length must do to a job with a given deadline."""

    SURVIVED = "survived"  # no restart, no recovery: TCP resumes inside the deadline
    DETECTED = "detected"  # a collective times out naming the cut-off side; the job recovers


def partition_outcome(duration_s: float, deadline_s: float) -> PartitionOutcome | None:
    """SURVIVED or DETECTED, or None for a length in between (either may happen: refused)."""
    if 2 * duration_s + TCP_FIRST_RTO_S + TCP_RESUME_SLACK_S <= deadline_s:
        return PartitionOutcome.SURVIVED
    if duration_s >= deadline_s + PARTITION_PAST_DEADLINE_S:
        return PartitionOutcome.DETECTED
    return None


def check_network(plan: Plan, *, nnodes: int, local: bool, backend: str, deadline_s: float | None) -> None:
    """Check the plan's network faults against the job; raises PlanError naming the fault's field.

    `local`: every node runs on this machine (the harness gives each its own network
    namespace); `deadline_s`: the job's collective deadline, when known (None: the length
    checks are skipped)."""
    for i, f in enumerate(plan.faults):
        if not f.type.network:
            continue
        where = f"faults[{i}]"
        if not local:
            raise PlanError(f"{where}.type", f"a {f.type} fault needs every node of the job on this machine (the "
                                             f"harness puts each in a network namespace of its own); found one node "
                                             f"of a multi-node job (--rdzv-endpoint)")
        if nnodes < 2:
            raise PlanError(f"{where}.type", f"a {f.type} fault acts between nodes; expected a job of --nnodes >= 2; "
                                             f"found {nnodes}")
        if backend != "gloo":
            raise PlanError(f"{where}.type", f"a {f.type} fault needs the gloo backend, whose traffic crosses the "
                                             f"network (NCCL between GPUs of one machine takes P2P or shared memory "
                                             f"and would never see it); found {backend}")
        if deadline_s is None:
            continue
        assert f.duration_s is not None  # parse_fault requires it
        if f.type is FaultType.PARTITION and partition_outcome(f.duration_s, deadline_s) is None:
            short = (deadline_s - TCP_FIRST_RTO_S - TCP_RESUME_SLACK_S) / 2
            raise PlanError(f"{where}.duration_s", f"expected a partition either survived (at most {short:g} s: "
                                                   f"TCP may resume only {f.duration_s:g} + {TCP_FIRST_RTO_S:g} s after the link is "
                                                   f"back) or detected (at least "
                                                   f"{deadline_s + PARTITION_PAST_DEADLINE_S:g} s) with the "
                                                   f"collective deadline of {deadline_s:g} s; found "
                                                   f"{f.duration_s:g} s, which may do either")
        if f.type is FaultType.NET_DELAY:
            assert f.ms is not None
            most = deadline_s * 1000 / (2 * NET_DELAY_ROUND_TRIPS)
            if f.ms > most:
                raise PlanError(f"{where}.ms", f"expected a delay a collective survives: {NET_DELAY_ROUND_TRIPS} "
                                               f"round trips of 2 x ms within the deadline of {deadline_s:g} s, so at "
                                               f"most {most:g} ms; found {f.ms:g} (a partition goes past the "
                                               f"deadline)")


def check_run(plan: Plan, *, steps: int | None, deadline_s: float | None, timeout_s: float | None) -> None:
    """Check the plan against the run it is for; raises PlanError naming the fault's field.

    `steps`: the run's last step; `deadline_s`: its collective deadline; `timeout_s`: how long
    the harness lets the job run. None where unknown (a trainer other than the reference one):
    what depends on it is not checked."""
    for i, f in enumerate(plan.faults):
        where, t = f"faults[{i}]", f.trigger
        if steps is not None and t.kind is TriggerKind.STEP and t.value > steps:
            raise PlanError(f"{where}.step", f"expected a step the run reaches (at most {steps}, its --steps); found "
                                             f"{int(t.value)}, where the fault would never fire")
        if timeout_s is not None and t.kind is TriggerKind.AFTER_S and t.value >= timeout_s:
            raise PlanError(f"{where}.after_s", f"expected a time before the job's timeout of {timeout_s:g} s "
                                                f"(--job-timeout); found {t.value:g}, where the fault would never fire")
        if f.type is not FaultType.STRAGGLER:
            continue
        assert f.ms is not None  # parse_fault requires it
        if deadline_s is not None and f.ms / 1000 >= deadline_s:
            raise PlanError(f"{where}.ms", f"expected a straggler's ms under the collective deadline of "
                                           f"{deadline_s:g} s, so that it slows the job without failing it; found "
                                           f"{f.ms:g} (use delay to go past the deadline)")
        # At least one collective per step: a lower bound on what the straggler adds.
        first = int(t.value) if t.kind is TriggerKind.STEP else 1
        slowed = 1 if steps is None else steps - first + 1
        if timeout_s is not None and slowed * f.ms / 1000 >= timeout_s:
            raise PlanError(f"{where}.ms", f"expected a straggler the job can finish with: {f.ms:g} ms before each "
                                           f"collective of {slowed} step(s) adds {slowed * f.ms / 1000:g} s at "
                                           f"least; found that past the job's timeout of {timeout_s:g} s "
                                           f"(--job-timeout)")


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """A plan from a .yaml/.yml/.json file."""
    if not Path(path).is_file():
        raise PlanError(str(path), "expected a YAML or JSON plan file; found no such file")
    try:
        if str(path).endswith(".json"):
            data = json.loads(Path(path).read_text(), object_pairs_hook=lambda pairs: _unique(pairs, str(path)))
        else:
            with open(path) as f:  # a stream with a name: the loader's messages say which file
                data = yaml.load(f, Loader=_UniqueKeyLoader)  # a SafeLoader
    except PlanError:
        raise
    except (ValueError, yaml.YAMLError) as exc:
        raise PlanError(str(path), f"expected a YAML or JSON plan; could not parse it ({exc})") from exc
    return Plan.from_dict(data)


def _unique(pairs: list[tuple[Any, Any]], where: str) -> dict[Any, Any]:
    """A mapping from its (key, value) pairs; PlanError for a key given twice."""
    out: dict[Any, Any] = {}
    for key, value in pairs:
        if key in out:
            raise PlanError(f"{where}.{key}", f"given twice ({out[key]!r}, then {value!r}); expected each field once")
        out[key] = value
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        mapping = super().construct_mapping(node, deep=True)  # refuses unhashable keys
        _unique([(self.construct_object(k), self.construct_object(v)) for k, v in node.value],
                f"{self.name}:{node.start_mark.line + 1}")
        return mapping


def parse_shorthand(text: str) -> Fault:
    """A fault from the CLI form ``TYPE:key=value,key=value`` (e.g. ``kill:rank=1,step=5``)."""
    kind, _, rest = text.partition(":")
    pairs: list[tuple[str, Any]] = [("type", kind.strip())]
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise PlanError(f"--fault {text}", f"expected key=value pairs after 'TYPE:'; found {part!r}")
        pairs.append((key.strip(), _scalar(value.strip())))
    return parse_fault(_unique(pairs, f"--fault {text}"), f"--fault {text}")


def _scalar(text: str) -> Any:
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


_FILTERS = ("op", "comm", "phase")  # what narrows an in-collective fault to one collective
_COMMON_FIELDS = {"type", "rank", "count", "seed"} | {k.value for k in TriggerKind}
_TYPE_FIELDS = {
    FaultType.DELAY: {"duration_s"},
    FaultType.GIL: {"duration_s"},
    FaultType.HANG: {"duration_s", "release"},
    FaultType.DISK_FULL: {"duration_s"},
    FaultType.EXIT: {"code"},
    FaultType.STRAGGLER: {"ms"},
    FaultType.PARTITION: {"duration_s"},
    FaultType.NET_DELAY: {"duration_s", "ms"},
    FaultType.NET_LOSS: {"duration_s", "pct"},
    FaultType.PREEMPT: {"partition"},
}


def _fields_of(ftype: FaultType) -> set[str]:
    return _COMMON_FIELDS | (set(_FILTERS) if ftype.in_collective else set()) | _TYPE_FIELDS.get(ftype, set())


def parse_fault(item: Any, where: str) -> Fault:
    """One fault from its flat mapping; every error names `where` and the field."""
    if not isinstance(item, dict):
        raise PlanError(where, f"expected a mapping with 'type', 'rank' and a trigger; found {item!r}")
    if "type" not in item:
        raise PlanError(f"{where}.type", f"missing; expected one of {[t.value for t in FaultType]}")
    try:
        ftype = FaultType(item["type"])
    except ValueError:
        raise PlanError(f"{where}.type", f"unknown fault {item['type']!r}; expected one of "
                                         f"{[t.value for t in FaultType]}") from None
    allowed = _fields_of(ftype)
    unknown = sorted(set(item) - allowed)
    if unknown:
        raise PlanError(f"{where}.{unknown[0]}", f"unknown field for a {ftype} fault; expected some of "
                                                 f"{sorted(allowed)}")
    if "rank" not in item and ftype.default_rank is None:
        raise PlanError(f"{where}.rank", "missing; expected a rank (an int >= 0) or 'random'")
    rank = item.get("rank", ftype.default_rank)
    if rank != "random":
        _int(f"{where}.rank", rank, minimum=0)
    trigger = _trigger(ftype, item, where)
    count = _int(f"{where}.count", item.get("count", 1), minimum=1)
    seed = _int(f"{where}.seed", item.get("seed", 0), minimum=0)
    duration = item.get("duration_s")
    if duration is not None:
        _number(f"{where}.duration_s", duration, positive=True)
    try:
        release = Release(item.get("release", "kill"))
    except ValueError:
        raise PlanError(f"{where}.release", f"expected 'kill' or 'cont'; found {item['release']!r}") from None
    code = _int(f"{where}.code", item.get("code", 1), minimum=0)
    if code > 255:
        raise PlanError(f"{where}.code", f"expected an exit status in [0, 255]; found {code}")
    ms = None
    if ftype is FaultType.STRAGGLER:
        if "ms" not in item:
            raise PlanError(f"{where}.ms", "missing; expected the milliseconds added before each collective")
        ms = _number(f"{where}.ms", item["ms"], positive=True)
        if count != 1:
            raise PlanError(f"{where}.count", f"a straggler stays slow once it starts; expected count 1, found {count}")
    pct = None
    if ftype.network:
        if duration is None:
            raise PlanError(f"{where}.duration_s", f"missing; expected how long the {ftype} lasts, in seconds")
        if ftype is FaultType.NET_DELAY:
            if "ms" not in item:
                raise PlanError(f"{where}.ms", "missing; expected the milliseconds added to each packet to or "
                                               "from the node")
            ms = _number(f"{where}.ms", item["ms"], positive=True)
        if ftype is FaultType.NET_LOSS:
            if "pct" not in item:
                raise PlanError(f"{where}.pct", "missing; expected the percentage of the node's packets dropped")
            pct = _number(f"{where}.pct", item["pct"], positive=True)
            if pct > MAX_LOSS_PCT:
                raise PlanError(f"{where}.pct", f"expected a loss in (0, {MAX_LOSS_PCT:g}] percent, which TCP "
                                                f"retransmits through within a deadline (more stalls a connection "
                                                f"for seconds: that is a partition); found {pct:g}")
    partition = item.get("partition")
    if partition is not None and (not isinstance(partition, str) or not partition):
        raise PlanError(f"{where}.partition", f"expected a Slurm partition's name; found {partition!r}")
    return Fault(ftype, rank, trigger, count, seed, float(duration) if duration is not None else None,
                 release, code, ms, pct, partition)


def _trigger(ftype: FaultType, item: dict[str, Any], where: str) -> Trigger:
    given = [k for k in TriggerKind if k.value in item]
    if not given and (ftype.default_from_start or ftype.in_collective and any(name in item for name in _FILTERS)):
        item = {**item, TriggerKind.AFTER_S.value: 0}  # a filter alone: from the first step on
        given = [TriggerKind.AFTER_S]
    if len(given) != 1:
        found = f"found {[k.value for k in given]}" if given else "found none"
        raise PlanError(f"{where}.trigger", f"expected exactly one trigger of "
                                            f"{[k.value for k in TriggerKind]}; {found}")
    kind = given[0]
    name = f"{where}.{kind.value}"
    raw = item[kind.value]
    if kind in (TriggerKind.STEP, TriggerKind.SEQ):
        value = float(_int(name, raw, minimum=0 if kind is TriggerKind.STEP else 1))
    elif kind is TriggerKind.AFTER_S:
        value = _number(name, raw, positive=False)
    else:
        value = _number(name, raw, positive=True)
        if value > 1:
            raise PlanError(name, f"expected a probability in (0, 1]; found {raw!r}")
    if kind is TriggerKind.SEQ and not ftype.in_collective:
        raise PlanError(name, f"a {ftype} fault cannot be triggered by a collective sequence number; "
                              f"expected one of step, after_s, p")
    op, comm = item.get("op"), item.get("comm")
    if op is not None and op not in {o.value for o in OpName}:
        raise PlanError(f"{where}.op", f"unknown op {op!r}; expected one of {[o.value for o in OpName]}")
    if comm is not None and (not isinstance(comm, str) or not comm):
        raise PlanError(f"{where}.comm", f"expected a communicator name; found {comm!r}")
    phase = item.get("phase")
    if phase is not None and (not isinstance(phase, str) or not phase):
        raise PlanError(f"{where}.phase", f"expected a phase name (e.g. 'checkpoint'); found {phase!r}")
    return Trigger(kind, value, op, comm, phase)


def _int(name: str, value: Any, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise PlanError(name, f"expected an int >= {minimum}; found {value!r}")
    if value < minimum:
        raise PlanError(name, f"expected an int >= {minimum}; found {value}")
    return value


def _number(name: str, value: Any, positive: bool) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or isinstance(value, float) and not math.isfinite(value):
        raise PlanError(name, f"expected a finite number; found {value!r}")
    if value < 0 or (positive and value == 0):
        raise PlanError(name, f"expected a {'positive' if positive else 'non-negative'} number; found {value}")
    return float(value)


@dataclass(frozen=True)
class Firing:
    """One firing of one fault, as the ledger holds it."""

    index: int  # the fault's position in the plan
    n: int  # 1-based: the n-th firing of that fault
    type: str
    rank: int
    attempt: int
    ts_ns: int  # wall clock when the fault acted (just before)
    step: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Firing:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class Ledger:
    """Firings of a plan's faults, one small JSON file per firing under `directory`.

    The harness and every rank share it (through the run directory), so a fault with
    count N fires N times in all, however many times torchrun restarts the job.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def fired(self, index: int) -> int:
        return len(list(self.directory.glob(f"fault{index}.*.json")))

    def total(self) -> int:
        return len(list(self.directory.glob("fault*.json")))

    def claim(self, fault: Fault, index: int, attempt: int, step: int | None = None,
              **detail: Any) -> Firing | None:
        """Record the next firing of `fault` before it acts; None when its count is spent."""
        for n in range(self.fired(index) + 1, fault.count + 1):
            firing = Firing(index, n, fault.type.value, int(fault.rank), attempt, time.time_ns(), step, detail)
            try:
                fd = os.open(self.directory / f"fault{index}.{n}.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                continue  # someone else took number n: try the next one
            with os.fdopen(fd, "w") as f:
                json.dump(firing.__dict__, f)
            return firing
        return None

    def firings(self) -> list[Firing]:
        """Every firing so far, in the order they happened."""
        out = []
        for path in self.directory.glob("fault*.json"):
            try:
                out.append(Firing.from_dict(json.loads(path.read_text())))
            except (ValueError, TypeError):
                continue  # a firing being written right now: it is read on the next call
        return sorted(out, key=lambda f: (f.ts_ns, f.index, f.n))
