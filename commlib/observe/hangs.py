"""The doctor's hang rules: a collective or a send/recv that a rank started and never left,
while no deadline expired (a job still hung, or one killed while hung).

`collective_hang(att, comm, mismatches, dumps)` finds the oldest unfinished collective of a
communicator and blames the ranks that never started it (else the minority of a mismatch
there); `p2p_hangs(att, comm, dumps)` finds, per pair of ranks and tag, the oldest unfinished
send/recv and blames the peer that never posted the matching op of that tag (both, where both
issued the same one). Flight-recorder dumps (SIGUSR1 on a live job) that still show the op started
confirm its ranks were alive and in it. `commlib.observe.blame` applies these rules where a
communicator logged no failure of its own.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from commlib.members import ranks_text
from commlib.observe.findings import Kind, Problem
from commlib.observe.position import where, where_text
from commlib.observe.records import AttemptLog, Call, CommLog, DumpInfo, p2p_name, tag_text

MATCHING_P2P = {"send": "recv", "recv": "send"}  # the op a send/recv's peer posts to match it


def collective_hang(
    att: AttemptLog, comm: CommLog, mismatches: dict[int, Problem], dumps: list[DumpInfo]
) -> Problem | None:
    """The oldest collective of `comm` that some rank started and never left (no deadline expired).

    Flight-recorder dumps (SIGUSR1 on a live job) that still show it started confirm the
    rank was alive and in it when dumped.
    """
    unfinished = [seq for seq, calls in comm.calls.items() if any(c.status == "started" for c in calls.values())]
    if not unfinished:
        return None
    seq = min(unfinished)
    calls = comm.calls[seq]
    members = comm.member_ranks()
    stuck = sorted(r for r, c in calls.items() if c.status == "started")
    missing = sorted(r for r in members if r not in calls)
    mismatch = mismatches.get(seq)
    culprits = missing or (mismatch.ranks if mismatch else [])
    t = min(c.start_ns or 0 for c in calls.values())
    op = _ops_text(calls)
    message = (
        f"{op} #{seq} on {comm.label!r} never finished and no deadline expired: {ranks_text(stuck)} still "
        f"in it at the end of their logs (hung, or killed while in it)"
    )
    if missing:
        message += f"; {ranks_text(missing)} never started it. Where they were: {where_text(att, missing, None)}"
    elif mismatch is not None:
        message += f"; every rank started it, but: {mismatch.message}"
    else:
        message += "; every rank started it (the backend did not complete it)"
    seen = [d for d in dumps if {"comm": comm.label, "op": op, "seq": seq} in d.unfinished]
    details = {"stuck": stuck, "missing": missing, "where": where(att, missing or stuck, None)}
    return _hang_problem(comm, op, seq, culprits, stuck, t, message, seen, details)


def p2p_hangs(att: AttemptLog, comm: CommLog, dumps: list[DumpInfo]) -> list[Problem]:
    """Per pair of ranks and tag, the oldest send/recv that a side started and never left (no
    deadline expired)."""
    by_pair: dict[tuple[int, int, int], dict[int, dict[int, Call]]] = defaultdict(dict)
    for (lo, hi, tag, seq), calls in comm.pairs().items():
        by_pair[(lo, hi, tag)][seq] = calls
    problems = []
    for (lo, hi, tag), by_seq in sorted(by_pair.items()):
        unfinished = [seq for seq, calls in by_seq.items() if any(c.status == "started" for c in calls.values())]
        if not unfinished:
            continue
        seq = min(unfinished)
        calls = by_seq[seq]
        stuck = sorted(r for r, c in calls.items() if c.status == "started")
        rank = stuck[0]
        peer = hi if rank == lo else lo
        op = calls[rank].op
        theirs = calls.get(peer)
        head = (
            f"{p2p_name(op, seq, peer, tag)} on {comm.label!r} never finished and no deadline "
            f"expired: {ranks_text(stuck)} in it at the end of their logs (hung, or killed while "
            "in it)"
        )
        if theirs is None:
            culprits = [peer]
            matching = p2p_name(MATCHING_P2P.get(op, "?"), seq, rank, tag)
            body = f"rank {peer} never posted the matching {matching}. Where it was: "
            body += where_text(att, [peer], None)
        elif theirs.op == op:
            culprits = [lo, hi]
            both = f"their point-to-point op #{seq}{tag_text(tag)}"
            body = f"both sides issued {op} as {both} with each other"
        else:
            culprits = []
            body = "both sides posted it (the backend did not complete it)"
        seen = [
            d
            for d in dumps
            if d.rank in stuck
            and any(
                u.get("comm") == comm.label
                and u.get("op") == calls[d.rank].op
                and u.get("seq") == seq
                and u.get("peer") == (hi if d.rank == lo else lo)
                and u.get("tag", 0) == tag
                for u in d.unfinished
            )
        ]
        t = min(c.start_ns or 0 for c in calls.values())
        details = {
            "p2p": True,
            "pair": [lo, hi],
            "peer": peer,
            "tag": tag,
            "stuck": stuck,
            "missing": [r for r in (lo, hi) if r not in calls],
            "where": where(att, culprits or stuck, None),
        }
        problems.append(_hang_problem(comm, op, seq, culprits, stuck, t, f"{head}; {body}", seen, details))
    return problems


def _ops_text(calls: dict[int, Call]) -> str:
    return "/".join(sorted({c.op for c in calls.values()})) or "?"


def _hang_problem(
    comm: CommLog,
    op: str,
    seq: int,
    culprits: list[int],
    stuck: list[int],
    t: int,
    message: str,
    seen: list[DumpInfo],
    details: dict[str, Any],
) -> Problem:
    """A hang's Problem, its reporters the ranks stuck in it: `message`, then what the dumps that
    still show the op started (`seen`) say of those ranks, in the text and in the details."""
    if seen:
        message += (
            f". Flight-recorder dumps ({', '.join(sorted({d.reason for d in seen}))}) show "
            f"{ranks_text(d.rank for d in seen)} alive and still in it"
        )
    return Problem(
        Kind.HANG, culprits, comm.label, op, seq, message + ".", stuck, t, {**details, "dumps": [d.path for d in seen]}
    )
