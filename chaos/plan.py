"""Fault plans: what to break, on which rank, when, and how often.

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
``step`` outside the run's steps, an ``after_s`` past the job's timeout, a ``duration_s``
the job's timeout cuts short, a straggler whose ``ms`` reaches the collective deadline or
whose delays alone outlast the job's timeout. Every field is read by the rule for its kind
(`commlib.settings`: numbers finite, integers integers, names one printable line) within
the bounds of `chaos.options` (a week of seconds, a million firings, indices up to 10^15),
so no value can overflow a sleep or a float in a rank; a field given twice
(``kill:rank=1,rank=0``, or a repeated YAML or JSON key) is refused rather than read as its
last value, though a YAML merge key's (``<<: *base``) may be given again; and a plan file is
bounded in size, depth and values (YAML aliases followed) before any of it is read.

Validation is written here by hand, not with a schema library (pydantic was weighed, as
issue #15 asked). What it would take over is small: the per-field type and range checks
(`commlib.settings`' rules, the enums), a few dozen lines. The rest is rules between fields and
against the job (exactly one trigger, the fields each fault type requires, ranks against
the world size at `resolve`, network faults against the topology and the deadline), which
pydantic would hold as validators of the same code. Its messages name a location tuple
and an error type (``Input should be a valid integer [type=int_type, ...]``), not this
module's ``faults[1].rank: expected rank to be an integer in [0, 1e+15]; found 'x'``, so
keeping the messages would mean a translation layer on top; and every rank of a trainer parses its plan
(`chaos.inject`), so the dependency (a compiled pydantic-core) would ride into every job.

This module owns the plan: its parsing and its checks. What a fault is (its types,
triggers and fields) is `chaos.fault`'s; the record of firings is `chaos.ledger`'s, whose
`Ledger` persists them in the run directory so that counts hold across restarts.
"""

from __future__ import annotations

import collections.abc
import enum
import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from chaos.fault import DELAY_MARGIN_S, Fault, FaultType, Release, Trigger, TriggerKind
from chaos.ledger import Firing, Ledger
from chaos.options import LARGEST_INDEX, LONGEST_S, MOST_FIRINGS
from commlib import settings
from commlib.ops import OpName

# What other modules import from here; the faults' types and the ledger live in their own modules.
__all__ = [
    "DELAY_MARGIN_S",
    "MAX_LOSS_PCT",
    "RESTART_MARGIN",
    "Fault",
    "FaultType",
    "Firing",
    "Ledger",
    "PartitionOutcome",
    "Plan",
    "PlanError",
    "Release",
    "Trigger",
    "TriggerKind",
    "check_network",
    "check_run",
    "load_plan",
    "parse_fault",
    "parse_shorthand",
    "partition_outcome",
]

RESTART_MARGIN = 2
DEEPEST_PLAN = 16  # a value within mappings and lists within each other: a plan's are 4 deep
MOST_PLAN_VALUES = 10_000  # a thousand faults
LARGEST_PLAN_BYTES = 1 << 20
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


@dataclass(frozen=True)
class Plan:
    faults: tuple[Fault, ...] = ()
    max_restarts: int | None = None

    def __post_init__(self) -> None:
        if self.max_restarts is not None:
            object.__setattr__(
                self,
                "max_restarts",
                _checked("max_restarts", settings.integer, self.max_restarts, low=0, high=MOST_FIRINGS),
            )
        firings = sum(f.count for f in self.faults)
        if firings > MOST_FIRINGS:
            raise PlanError(
                "faults",
                f"expected at most {MOST_FIRINGS} firings in all (the counts' sum, and "
                f"torchrun's restarts); found {firings}",
            )

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
                raise PlanError(
                    f"faults[{i}].rank",
                    f"expected an int in [0, {world_size}) or 'random' for a world "
                    f"of {world_size} ranks; found {f.rank!r} ({f.describe()})",
                )
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
        unknown = sorted(set(data) - {"faults", "max_restarts"}, key=str)
        if unknown:
            raise PlanError(unknown[0], "unknown plan field; expected 'faults' and optionally 'max_restarts'")
        items = data.get("faults")
        if items is None:
            raise PlanError("faults", "missing; expected a list of faults")
        if not isinstance(items, list):
            raise PlanError("faults", f"expected a list; found {type(items).__name__}")
        return cls(tuple(parse_fault(item, f"faults[{i}]") for i, item in enumerate(items)), data.get("max_restarts"))


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
            raise PlanError(
                f"{where}.type",
                f"a {f.type} fault needs every node of the job on this machine (the "
                f"harness puts each in a network namespace of its own); found one node "
                f"of a multi-node job (--rdzv-endpoint)",
            )
        if nnodes < 2:
            raise PlanError(
                f"{where}.type", f"a {f.type} fault acts between nodes; expected a job of --nnodes >= 2; found {nnodes}"
            )
        if backend != "gloo":
            raise PlanError(
                f"{where}.type",
                f"a {f.type} fault needs the gloo backend, whose traffic crosses the "
                f"network (NCCL between GPUs of one machine takes P2P or shared memory "
                f"and would never see it); found {backend}",
            )
        if deadline_s is None:
            continue
        assert f.duration_s is not None  # parse_fault requires it
        if f.type is FaultType.PARTITION and partition_outcome(f.duration_s, deadline_s) is None:
            short = (deadline_s - TCP_FIRST_RTO_S - TCP_RESUME_SLACK_S) / 2
            raise PlanError(
                f"{where}.duration_s",
                f"expected a partition either survived (at most {short:g} s: "
                f"TCP may resume only {f.duration_s:g} + {TCP_FIRST_RTO_S:g} s after the link is "
                f"back) or detected (at least "
                f"{deadline_s + PARTITION_PAST_DEADLINE_S:g} s) with the "
                f"collective deadline of {deadline_s:g} s; found "
                f"{f.duration_s:g} s, which may do either",
            )
        if f.type is FaultType.NET_DELAY:
            assert f.ms is not None
            most = deadline_s * 1000 / (2 * NET_DELAY_ROUND_TRIPS)
            if f.ms > most:
                raise PlanError(
                    f"{where}.ms",
                    f"expected a delay a collective survives: {NET_DELAY_ROUND_TRIPS} "
                    f"round trips of 2 x ms within the deadline of {deadline_s:g} s, so at "
                    f"most {most:g} ms; found {f.ms:g} (a partition goes past the "
                    f"deadline)",
                )


def check_run(plan: Plan, *, steps: int | None, deadline_s: float | None, timeout_s: float | None) -> None:
    """Check the plan against the run it is for; raises PlanError naming the fault's field.

    `steps`: the run's last step; `deadline_s`: its collective deadline; `timeout_s`: how long
    the harness lets the job run. None where unknown (a trainer other than the reference one):
    what depends on it is not checked."""
    for i, f in enumerate(plan.faults):
        where, t = f"faults[{i}]", f.trigger
        if steps is not None and t.kind is TriggerKind.STEP and not 1 <= t.value <= steps:
            raise PlanError(
                f"{where}.step",
                f"expected a step the run reaches (from 1, at most {steps}, its last "
                f"step); found {int(t.value)}, where the fault would never fire",
            )
        if timeout_s is not None and t.kind is TriggerKind.AFTER_S and t.value >= timeout_s:
            raise PlanError(
                f"{where}.after_s",
                f"expected a time before the job's timeout of {timeout_s:g} s "
                f"(--job-timeout); found {t.value:g}, where the fault would never fire",
            )
        if timeout_s is not None and f.duration_s is not None and f.duration_s >= timeout_s:
            raise PlanError(
                f"{where}.duration_s",
                f"expected a duration the job can hold: under the job's timeout "
                f"of {timeout_s:g} s (--job-timeout); found {f.duration_s:g} s, "
                f"whose end the job would never reach",
            )
        if f.type is not FaultType.STRAGGLER:
            continue
        assert f.ms is not None  # parse_fault requires it
        if deadline_s is not None and f.ms / 1000 >= deadline_s:
            raise PlanError(
                f"{where}.ms",
                f"expected a straggler's ms under the collective deadline of "
                f"{deadline_s:g} s, so that it slows the job without failing it; found "
                f"{f.ms:g} (use delay to go past the deadline)",
            )
        # At least one collective per step: a lower bound on what the straggler adds.
        first = int(t.value) if t.kind is TriggerKind.STEP else 1
        slowed = 1 if steps is None else steps - first + 1
        if timeout_s is not None and slowed * f.ms / 1000 >= timeout_s:
            raise PlanError(
                f"{where}.ms",
                f"expected a straggler the job can finish with: {f.ms:g} ms before each "
                f"collective of {slowed} step(s) adds {slowed * f.ms / 1000:g} s at "
                f"least; found that past the job's timeout of {timeout_s:g} s "
                f"(--job-timeout)",
            )


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """A plan from a .yaml/.yml/.json file."""
    where = str(path)
    if not Path(path).is_file():
        found = "a directory" if Path(path).is_dir() else "a special file" if Path(path).exists() else "no such file"
        raise PlanError(where, f"expected a YAML or JSON plan file; found {found}")
    size = Path(path).stat().st_size
    if size > LARGEST_PLAN_BYTES:
        raise PlanError(where, f"expected a plan file of at most {LARGEST_PLAN_BYTES} bytes; found {size}")
    try:
        if where.endswith(".json"):
            data = json.loads(Path(path).read_text(), object_pairs_hook=lambda pairs: _unique(pairs, where))
        else:
            with open(path) as f:  # a stream with a name: the loader's messages say which file
                data = yaml.load(f, Loader=_UniqueKeyLoader)  # a SafeLoader
    except PlanError:
        raise
    except RecursionError:  # JSON's decoder is recursive: the depth past Python's stack
        raise PlanError(where, f"expected a plan nested at most {DEEPEST_PLAN} deep; found one deeper") from None
    except (ValueError, yaml.YAMLError) as exc:
        raise PlanError(where, f"expected a YAML or JSON plan; could not parse it ({exc})") from exc
    _check_shape(data, where)
    return Plan.from_dict(data)


def _check_shape(data: Any, where: str) -> None:
    """PlanError for a document nested deeper than `DEEPEST_PLAN` or holding more than
    `MOST_PLAN_VALUES` values once YAML's aliases are followed (a small file of aliases to
    aliases holds billions, which an error quoting one would spell out). Walked without
    recursing, and only as far as the bounds."""
    seen, level = 0, [(data, 1)]
    while level:
        item, depth = level.pop()
        seen += 1
        if seen > MOST_PLAN_VALUES:
            raise PlanError(
                where,
                f"expected a plan of at most {MOST_PLAN_VALUES} values; found more (YAML aliases count once per use)",
            )
        if depth > DEEPEST_PLAN:
            raise PlanError(where, f"expected a plan nested at most {DEEPEST_PLAN} deep; found one deeper")
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        level.extend((child, depth + 1) for child in children)


def _unique(pairs: list[tuple[Any, Any]], where: str) -> dict[Any, Any]:
    """A mapping from its (key, value) pairs; PlanError for a key given twice."""
    out: dict[Any, Any] = {}
    for key, value in pairs:
        if key in out:
            raise PlanError(f"{where}.{key}", f"given twice ({out[key]!r}, then {value!r}); expected each field once")
        out[key] = value
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last) and a
    document nested deeper than any plan (PyYAML composes it recursively, into Python's stack
    limit). A merge key's (``<<: *base``) keys may be given again: that is what a merge is for."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        self._depth += 1
        try:
            if self._depth > DEEPEST_PLAN:
                raise PlanError(
                    self.name,
                    f"expected a plan nested at most {DEEPEST_PLAN} deep; found one deeper "
                    f"at line {self.get_mark().line + 1}",
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        own = [(k, v) for k, v in node.value if k.tag != "tag:yaml.org,2002:merge"]  # before flattening merges
        keys = [self.construct_object(k) for k, _ in own]
        if all(isinstance(k, collections.abc.Hashable) for k in keys) and len(set(keys)) < len(keys):
            _unique(
                [(key, self.construct_object(v, deep=True)) for key, (_, v) in zip(keys, own, strict=True)],
                f"{self.name}:{node.start_mark.line + 1}",
            )
        return super().construct_mapping(node, deep=True)  # refuses unhashable keys


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
    """A shorthand value as a plan file would hold it: an int, a float, or else the text (the
    field's own rule then checks it, as it checks a file's)."""
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:  # int() also refuses text longer than Python's digit limit
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


def _checked(name: str, rule: Callable[..., Any], value: Any, why: str = "", **bounds: Any) -> Any:
    """`value` by the rule for its kind (`commlib.settings`); a PlanError naming field `name`
    (its last part, e.g. ``step``, is what the rule's message calls it) where the rule refuses it."""
    try:
        return rule(value, name.rpartition(".")[2], **bounds)
    except (ValueError, TypeError) as exc:
        raise PlanError(name, f"{exc}{f' ({why})' if why else ''}") from None


def _seconds(name: str, value: Any, *, positive: bool = True) -> float:
    bounds: dict[str, Any] = {"above": 0.0} if positive else {"low": 0.0}
    return _checked(name, settings.number, value, high=LONGEST_S, unit="seconds", **bounds)


def _milliseconds(name: str, value: Any) -> float:
    return _checked(name, settings.number, value, high=LONGEST_S * 1000, above=0.0, unit="milliseconds")


def _required(item: dict[str, Any], key: str, where: str, what: str) -> Any:
    if key not in item:
        raise PlanError(f"{where}.{key}", f"missing; expected {what}")
    return item[key]


def parse_fault(item: Any, where: str) -> Fault:
    """One fault from its flat mapping; every error names `where` and the field."""
    if not isinstance(item, dict):
        raise PlanError(where, f"expected a mapping with 'type', 'rank' and a trigger; found {item!r}")
    ftype = FaultType(
        _checked(
            f"{where}.type",
            settings.choice,
            _required(item, "type", where, "a fault type"),
            choices=[t.value for t in FaultType],
        )
    )
    allowed = _fields_of(ftype)
    unknown = sorted(set(item) - allowed, key=str)
    if unknown:
        raise PlanError(
            f"{where}.{unknown[0]}", f"unknown field for a {ftype} fault; expected some of {sorted(allowed)}"
        )
    if "rank" not in item and ftype.default_rank is None:
        raise PlanError(f"{where}.rank", "missing; expected a rank (an int >= 0) or 'random'")
    rank = item.get("rank", ftype.default_rank)
    if rank != "random":
        rank = _checked(f"{where}.rank", settings.integer, rank, low=0, high=LARGEST_INDEX)
    trigger = _trigger(ftype, item, where)
    count = _checked(f"{where}.count", settings.integer, item.get("count", 1), low=1, high=MOST_FIRINGS)
    seed = _checked(f"{where}.seed", settings.integer, item.get("seed", 0), low=0, high=LARGEST_INDEX)
    duration = item.get("duration_s")
    if duration is not None:
        duration = _seconds(f"{where}.duration_s", duration)
    release = Release(
        _checked(f"{where}.release", settings.choice, item.get("release", "kill"), choices=[r.value for r in Release])
    )
    code = _checked(f"{where}.code", settings.integer, item.get("code", 1), low=0, high=255)
    ms = pct = None
    if ftype is FaultType.STRAGGLER:
        ms = _milliseconds(f"{where}.ms", _required(item, "ms", where, "the milliseconds added before each collective"))
        if count != 1:
            raise PlanError(f"{where}.count", f"a straggler stays slow once it starts; expected count 1, found {count}")
    if ftype.network and duration is None:
        raise PlanError(f"{where}.duration_s", f"missing; expected how long the {ftype} lasts, in seconds")
    if ftype is FaultType.NET_DELAY:
        ms = _milliseconds(
            f"{where}.ms", _required(item, "ms", where, "the milliseconds added to each packet to or from the node")
        )
    if ftype is FaultType.NET_LOSS:
        pct = _checked(
            f"{where}.pct",
            settings.number,
            _required(item, "pct", where, "the percentage of the node's packets dropped"),
            "more loss than TCP retransmits through within a deadline stalls a connection for "
            "seconds: that is a partition",
            high=MAX_LOSS_PCT,
            above=0.0,
            unit="percent",
        )
    partition = item.get("partition")
    if partition is not None:
        partition = _checked(f"{where}.partition", settings.text, partition)
    return Fault(ftype, rank, trigger, count, seed, duration, release, code, ms, pct, partition)


def _trigger(ftype: FaultType, item: dict[str, Any], where: str) -> Trigger:
    given = [k for k in TriggerKind if k.value in item]
    if not given and (ftype.default_from_start or ftype.in_collective and any(name in item for name in _FILTERS)):
        item = {**item, TriggerKind.AFTER_S.value: 0}  # a filter alone: from the first step on
        given = [TriggerKind.AFTER_S]
    if len(given) != 1:
        found = f"found {[k.value for k in given]}" if given else "found none"
        raise PlanError(
            f"{where}.trigger", f"expected exactly one trigger of {[k.value for k in TriggerKind]}; {found}"
        )
    kind = given[0]
    name = f"{where}.{kind.value}"
    raw = item[kind.value]
    if kind in (TriggerKind.STEP, TriggerKind.SEQ):
        low = 0 if kind is TriggerKind.STEP else 1
        value = float(_checked(name, settings.integer, raw, low=low, high=LARGEST_INDEX))
    elif kind is TriggerKind.AFTER_S:
        value = _seconds(name, raw, positive=False)
    else:
        value = _checked(name, settings.number, raw, high=1.0, above=0.0)
    if kind is TriggerKind.SEQ and not ftype.in_collective:
        raise PlanError(
            name,
            f"a {ftype} fault cannot be triggered by a collective sequence number; expected one of step, after_s, p",
        )
    op, comm, phase = (item.get(f) for f in _FILTERS)
    if op is not None:
        op = _checked(f"{where}.op", settings.choice, op, choices=[o.value for o in OpName])
    if comm is not None:
        comm = _checked(f"{where}.comm", settings.text, comm)
    if phase is not None:
        phase = _checked(f"{where}.phase", settings.text, phase)
    return Trigger(kind, value, op, comm, phase)
