"""The doctor's mismatch rule: the first collective of a communicator at which ranks issued different things.

Seen two ways: the consistency check raised it (`collective.mismatch` events, each rank
naming the ranks that differed from it), or, with the check off, the ranks'
`collective.start` events disagree (op, shapes, dtype, root: `Call.signature`). Culprits
are the minority, or every rank when there is no majority. Later mismatches on the same
communicator are consequences of the first and are only counted.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from commlib.members import ranks_text
from commlib.observe.findings import Kind, Problem
from commlib.observe.records import CommLog


def first_mismatch(comm: CommLog) -> dict[int, Problem]:
    """The first seq of `comm` at which ranks disagree (later ones are its consequences)."""
    found = [p for p in (_checked_mismatch(comm), _seen_mismatch(comm)) if p is not None]
    first = min(found, key=lambda p: p.seq or 0) if found else None
    return {first.seq: first} if first is not None and first.seq is not None else {}


def _checked_mismatch(comm: CommLog) -> Problem | None:
    """The first mismatch the consistency check raised (`collective.mismatch` events)."""
    if not comm.mismatches:
        return None
    seq = min(comm.mismatches)
    by_rank = comm.mismatches[seq]
    ops = {r: ev.get("op") for r, ev in by_rank.items()}
    return _mismatch_problem(
        comm,
        seq,
        _agreement_groups(comm, by_rank),
        ops,
        reporters=sorted(by_rank),
        ts=min(ev["ts_ns"] for ev in by_rank.values()),
        detail=by_rank[min(by_rank)].get("error"),
        checked=True,
    )


def _seen_mismatch(comm: CommLog) -> Problem | None:
    """The first seq whose `collective.start` events disagree (the check was off).

    Only calls whose start was logged count: a call made up from its failure event (a rank
    whose pre-hook raised, or that failed before its start was written) has no shapes to compare.
    """
    found = comm.first_differing()
    if found is None:
        return None
    seq, calls, differing = found
    by_sig: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    for r, c in sorted(calls.items()):
        by_sig[c.signature()].append(r)
    detail = "; ".join(
        f"rank {r}: {c.op}(shapes={c.shapes}, dtype={c.dtype}, root={c.root})" for r, c in sorted(calls.items())
    )
    problem = _mismatch_problem(
        comm,
        seq,
        list(by_sig.values()),
        {r: c.op for r, c in calls.items()},
        reporters=sorted(calls),
        ts=min(c.start_ns or 0 for c in calls.values()),
        detail=detail,
        checked=False,
    )
    problem.details["later_differing_seqs"] = differing - 1
    return problem


def _agreement_groups(comm: CommLog, by_rank: dict[int, dict[str, Any]]) -> list[list[int]]:
    """Ranks that agreed with each other, from each rank's `differing_ranks` (comm ranks)."""
    differ = {r: {comm.global_rank(d) for d in ev.get("differing_ranks") or []} for r, ev in by_rank.items()}
    groups: list[list[int]] = []
    for r in sorted(by_rank):
        for g in groups:
            s = g[0]
            if r not in differ.get(s, set()) and s not in differ.get(r, set()):
                g.append(r)
                break
        else:
            groups.append([r])
    return groups


def _mismatch_problem(
    comm: CommLog,
    seq: int,
    groups: list[list[int]],
    ops: dict[int, Any],
    *,
    reporters: list[int],
    ts: int,
    detail: str | None,
    checked: bool,
) -> Problem:
    groups = sorted(groups, key=lambda g: (-len(g), g))
    majority = groups[0] if len(groups) > 1 and len(groups[0]) > len(groups[1]) else None
    culprits = sorted(r for g in groups if g is not majority for r in g)
    parts = []
    for g in groups:
        g_ops = sorted({str(ops[r]) for r in g if r in ops})
        parts.append(f"{ranks_text(g)} issued {'/'.join(g_ops) or '?'}")
    how = "the consistency check caught it" if checked else "seen in the collective.start events"
    who = f"the minority, {ranks_text(culprits)}" if majority else f"no majority: all of {ranks_text(culprits)}"
    message = f"ordering mismatch at #{seq} on {comm.label!r}: {'; '.join(parts)} ({how}); culprits: {who}"
    op_names = sorted({str(o) for o in ops.values()})
    return Problem(
        Kind.MISMATCH,
        culprits,
        comm.label,
        "/".join(op_names),
        seq,
        message,
        reporters,
        ts,
        {"groups": groups, "ops": {str(r): o for r, o in sorted(ops.items())}, "detail": detail, "checked": checked},
    )
