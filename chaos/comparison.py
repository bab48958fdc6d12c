"""The bitwise comparison of what a faulted run computed with what its fault-free reference did.

Both runs' ranks logged a ``train.step`` record after every optimizer step (`chaos.probe`):
the step, the losses, digests of the data the step drew, of the RNG states at its start, and
(every ``digest_every``-th step) of the parameters and the optimizer state. `read_steps`
reads them per rank and optimizer; `final_lineage` takes the steps the run's final state
descends from: from its last record back, each step's latest execution before the one after
it (a step run again after a rollback or a restart replaces the execution that was lost).
`compare` then checks, per rank and optimizer:

- ``steps_exact``: the lineage holds the reference's steps, each once, in order;
- ``losses_bitwise``: each step's losses equal the reference's, as ``float.hex``;
- ``steps_bitwise``: each step's data, parameter and optimizer digests equal the reference's;
- ``state_bitwise``: the last step's parameters and optimizer state equal the reference's.

Where they differ, the first step that differs is named with what differs (the data it drew
and its RNG state, its loss, its parameters, its optimizer state) and what that points to, so
that a trainer that does not restore its RNG state on resume is told from an update lost in
a collective. The same comparison of two fault-free runs says whether the trainer is
reproducible at all (`chaos.verify`). For a trainer whose optimizer keeps no step count
(``step_source`` "count") a restarted process counts from 1 again: its steps cannot be placed,
so only the final state is compared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos.probe import PROBE_EVENT, STEP_EVENT
from commlib.members import rank_list  # steps as ranges, as ranks are
from commlib.observe.events import rank_segments, read_rank


@dataclass(frozen=True)
class StepRecord:
    """One execution of one optimizer step on one rank (a ``train.step`` record)."""

    rank: int
    opt: int
    step: int
    attempt: int
    pid: int
    losses: tuple[str, ...]
    data: str | None
    rng: str | None
    params: str | None
    optim: str | None
    ts_ns: int = field(default=0, compare=False)  # when it was logged: not what the step computed

    @classmethod
    def from_event(cls, e: dict[str, Any]) -> StepRecord:
        return cls(
            rank=int(e["rank"]),
            opt=int(e.get("opt", 0)),
            step=int(e["step"]),
            attempt=int(e.get("attempt", 0)),
            pid=int(e.get("pid", 0)),
            losses=tuple(e.get("losses") or ()),
            data=e.get("data"),
            rng=e.get("rng"),
            params=e.get("params"),
            optim=e.get("optim"),
            ts_ns=int(e.get("ts_ns", 0)),
        )


@dataclass
class Steps:
    """What a run's probes recorded: every execution per (rank, optimizer), in the order each
    rank ran them, and each process's ``train.probe`` description."""

    records: dict[tuple[int, int], list[StepRecord]] = field(default_factory=dict)
    probes: list[dict[str, Any]] = field(default_factory=list)

    @property
    def step_source(self) -> str | None:
        """ "optimizer" (its own step count) or "count" (each process's); None: no step seen."""
        sources = {p.get("step_source") for p in self.probes}
        return "count" if "count" in sources else ("optimizer" if sources else None)

    @property
    def backend(self) -> str | None:
        """What the ranks' default process group ran over ("commlib over gloo")."""
        for p in self.probes:
            if p.get("backend"):
                engine = p.get("engine")
                return f"{p['backend']} over {engine}" if engine else str(p["backend"])
        return None

    @property
    def deadline_s(self) -> float | None:
        """The collective deadline of commlib's default group, where the ranks ran over commlib."""
        found = [float(p["deadline_s"]) for p in self.probes if isinstance(p.get("deadline_s"), (int, float))]
        return min(found) if found else None

    @property
    def last_step(self) -> int:
        return max((r[-1].step for r in self.records.values() if r), default=0)

    @property
    def last_step_ns(self) -> int | None:
        """When the last record of any rank was logged (wall clock)."""
        return max((r.ts_ns for records in self.records.values() for r in records), default=None)


def read_steps(run_dir: Path) -> Steps:
    """The ``train.step`` and ``train.probe`` records of a run's ranks (``{run_dir}/logs``)."""
    out = Steps()
    logs = run_dir / "logs"
    if not logs.is_dir():
        return out
    for _rank, paths in rank_segments(logs).items():
        for e in read_rank(paths):
            if e.get("event") == STEP_EVENT and isinstance(e.get("step"), int) and isinstance(e.get("rank"), int):
                record = StepRecord.from_event(e)
                out.records.setdefault((record.rank, record.opt), []).append(record)
            elif e.get("event") == PROBE_EVENT:
                out.probes.append(e)
    return out


def final_lineage(records: list[StepRecord]) -> list[StepRecord]:
    """The executions the last record descends from, oldest first (module docstring): from the
    last record back, each step's latest execution before the one after it. Where a step was
    never recorded before it (a step skipped), the walk goes on from the latest earlier lower
    one."""
    if not records:
        return []
    chain, at = [records[-1]], len(records) - 1
    while True:
        want = chain[-1].step - 1
        earlier = next((k for k in range(at - 1, -1, -1) if records[k].step == want), None)
        if earlier is None:
            earlier = next((k for k in range(at - 1, -1, -1) if records[k].step < want), None)
        if earlier is None:
            return chain[::-1]
        chain.append(records[earlier])
        at = earlier


@dataclass
class Comparison:
    checks: dict[str, bool] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    # The first step that differs, what differs in it and what that points to.
    first_difference: str | None = None

    @property
    def equal(self) -> bool:
        """Whether the two runs are the same run: every check ran held, and none found a problem."""
        return bool(self.checks) and all(self.checks.values()) and not self.problems


def _what_differs(got: StepRecord, want: StepRecord) -> list[str]:
    """The parts of one step's record that differ (a digest one side lacks is not compared)."""
    parts = []
    if got.data != want.data:
        parts.append("data")
    if got.losses != want.losses:
        parts.append("loss")
    if got.params is not None and want.params is not None and got.params != want.params:
        parts.append("parameters")
    if got.optim is not None and want.optim is not None and got.optim != want.optim:
        parts.append("optimizer state")
    return parts


def _explain(parts: list[str], got: StepRecord, want: StepRecord) -> str:
    """What a first difference points to."""
    if got.rng != want.rng:
        return (
            "torch's RNG state at its start differs too: a trainer that does not restore its "
            "RNG state on resume draws other random numbers (batches, dropout) than an "
            "uninterrupted run"
        )
    if "data" in parts:
        return (
            "it drew other data from the same torch RNG state: the data position (a sampler's, "
            "an iterator's), another RNG (Python's random, NumPy's) or the step the trainer "
            "believes it is at was not restored, or a step was skipped or run twice"
        )
    if "loss" in parts:
        return (
            "the same data gave another loss: the state the step started from differs from the "
            "reference's (parameters or buffers not restored), or the forward pass is not "
            "deterministic"
        )
    if "parameters" in parts:
        return (
            "the same data and loss gave other parameters: the update differs (gradients from a "
            "collective that lost or doubled a contribution, or an optimizer state that was not "
            "restored)"
        )
    return "the parameters are equal but the optimizer state differs: its moments or step count were not restored"


def _lineage_comparison(got: list[StepRecord], want: list[StepRecord], who: str, out: Comparison) -> None:
    """One (rank, optimizer)'s lineage against the reference's (module docstring)."""
    got_steps, want_steps = [r.step for r in got], [r.step for r in want]
    exact = got_steps == want_steps
    out.checks["steps_exact"] = out.checks.get("steps_exact", True) and exact
    if not exact:
        missing = sorted(set(want_steps) - set(got_steps))
        extra = sorted(set(got_steps) - set(want_steps))
        out.problems.append(
            f"steps_exact: expected {who} to end in the reference's steps "
            f"{rank_list(want_steps)} once each; found its final state descending from "
            f"steps {rank_list(got_steps)}"
            + (f", missing {rank_list(missing)}" if missing else "")
            + (f", beyond the reference {rank_list(extra)}" if extra else "")
        )
    by_step = {r.step: r for r in want}
    losses_ok = steps_ok = True
    for r in got:
        ref = by_step.get(r.step)
        if ref is None:
            continue
        parts = _what_differs(r, ref)
        losses_ok = losses_ok and "loss" not in parts
        steps_ok = steps_ok and not parts
        if parts and out.first_difference is None:
            before = next((g for g in got if g.step == r.step - 1), None)
            resumed = before is not None and before.pid != r.pid
            where = f" (the first step after attempt {r.attempt} resumed from step {r.step - 1})" if resumed else ""
            out.first_difference = (
                f"step {r.step} on {who}{where} differs from the reference's: its {', '.join(parts)}; "
                f"{_explain(parts, r, ref)}"
            )
    out.checks["losses_bitwise"] = out.checks.get("losses_bitwise", True) and losses_ok
    out.checks["steps_bitwise"] = out.checks.get("steps_bitwise", True) and steps_ok
    _final_state(_last_digest(got), _last_digest(want), who, out, placed=True)


def _final_state(last: StepRecord | None, ref: StepRecord | None, who: str, out: Comparison, *, placed: bool) -> None:
    """A rank's last state digests against the reference's (at the same step where placed)."""
    equal = (
        last is not None
        and ref is not None
        and (last.params, last.optim) == (ref.params, ref.optim)
        and (last.step == ref.step or not placed)
    )
    out.checks["state_bitwise"] = out.checks.get("state_bitwise", True) and equal
    if equal:
        return
    if ref is None or last is None:
        found = "no state digest" if last is None else f"a digest at step {last.step}"
        expected = "a state digest" if ref is None else f"step {ref.step}'s state digest"
    else:
        differing = [
            n
            for n, a, b in (("parameters", last.params, ref.params), ("optimizer state", last.optim, ref.optim))
            if a != b
        ]
        found = f"step {last.step}'s" + (f" {' and '.join(differing)} differing" if differing else "")
        expected = f"step {ref.step}'s parameters and optimizer state"
    out.problems.append(f"state_bitwise: expected {who}'s final state to be the reference's {expected}; found {found}")


def _last_digest(records: list[StepRecord]) -> StepRecord | None:
    return next((r for r in reversed(records) if r.params is not None), None)


def compare(faulted: Steps, reference: Steps, *, placed: bool = True) -> Comparison:
    """The faulted run's steps against the reference's (module docstring). `placed` False: the
    faulted run's steps cannot be placed (counted per process, with restarts): the final state
    only."""
    out = Comparison()
    if not reference.records:
        out.checks["steps_exact"] = False
        out.problems.append("steps_exact: expected the reference's ranks to record their steps; found none")
        return out
    for key in sorted(reference.records.keys() | faulted.records.keys()):
        rank, opt = key
        who = f"rank {rank}" + (f" (optimizer {opt})" if opt else "")
        want = final_lineage(reference.records.get(key, []))
        got = final_lineage(faulted.records.get(key, []))
        if placed:
            _lineage_comparison(got, want, who, out)
        else:
            _final_state(_last_digest(got), _last_digest(want), who, out, placed=False)
    if out.first_difference is not None:
        out.problems.insert(0, f"first difference: {out.first_difference}")
    return out
