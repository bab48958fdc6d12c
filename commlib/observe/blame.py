"""The doctor's rules: per torchrun attempt, what went wrong, who is blamed for it, and why.

`attempt_finding(att, dumps, final)` applies every rule to one attempt of the log model
(`commlib.observe.records`) and returns its `AttemptFinding` (`commlib.observe.findings`):
a status, the problems found (each a `Problem` of one `Kind`, with its culprits in `ranks`
and a message saying why), and where each rank's log ends. The mismatch rule lives in
`commlib.observe.mismatch`, the hang rules (no deadline expired yet) in `commlib.observe.hangs`.

Culprits: for a timeout, the ranks that had not arrived when the deadline expired (the
progress board's `missing_ranks`, plus ranks with no `collective.start` before the timeout,
plus ranks that started it only after), except a rank held up inside an earlier collective
of the same communicator by ranks that had not started that one (a gather's root waiting
for a late rank, when a peer that left the gather times out in the next op): it is named
as waiting, and the late ranks are the culprits; for a peer failure, the members that stopped
logging before it without logging a failure of their own; for a mismatch, the minority
(every differing rank when there is no majority); for a hang (no deadline expired yet),
the ranks that never started the oldest unfinished collective; for a send/recv that timed
out or hangs, the peer that never posted the matching op; for an application error, the
ranks its events name (else the ranks that logged it); for a straggler (a finding, not a
failure), the rank that arrived last at most of an attempt's collectives (at least
`STRAGGLER_MIN_COLLECTIVES` of them) with a median lag of at least `STRAGGLER_MIN_LAG_S`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict
from typing import Any

from commlib.failures import Failure, classify
from commlib.members import rank_ranges, ranks_text
from commlib.observe.findings import AttemptFinding, Kind, Problem
from commlib.observe.hangs import MATCHING_P2P, collective_hang, p2p_hangs
from commlib.observe.mismatch import first_mismatch
from commlib.observe.position import position, where, where_text
from commlib.observe.records import (
    AttemptLog,
    Call,
    CommLog,
    DumpInfo,
    ErrorGroup,
    p2p_name,
    peer_of,
    tag_of,
    tag_text,
)
from commlib.observe.stats import straggler_stats

COMMLIB_ERRORS = ("CommError", "CollectiveTimeout", "PeerFailure", "CollectiveMismatch", "CommAborted")
# A rank inside a collective that fails elsewhere logs its own outcome by its own deadline;
# one that has not, this long after, was stopped or dead (SIGSTOP, a kill mid-collective).
FROZEN_GRACE_S = 1.0
# A straggler: last to arrive at this share of an attempt's collectives, with this median lag
# (gloo on loopback: ranks of a healthy job start a collective well under a millisecond apart).
STRAGGLER_LAST_SHARE = 0.6
STRAGGLER_MIN_LAG_S = 0.02
STRAGGLER_MIN_COLLECTIVES = 10  # fewer: one late arrival (a rank that hung, then timed out) is no pattern


def attempt_finding(att: AttemptLog, dumps: list[DumpInfo], final: bool, whole: bool = True) -> AttemptFinding:
    """Every rule applied to one attempt (`dumps`: the flight-recorder dumps its processes wrote;
    `final`: it is the run's last, so an attempt that simply ends is ok rather than cut short).

    `whole`: the model holds the whole attempt. Where it holds only the end of each rank's log
    (`commlib.observe.verdict_from_end`), what needs all of it is left out: the straggler rule,
    and the counts of collectives and of the time the logs span (None)."""
    problems: list[Problem] = []
    for comm in att.comms.values():
        mismatches = first_mismatch(comm)
        problems += mismatches.values()
        problems += _failures(att, comm, mismatches, dumps)
    problems += _app_errors(att)  # before dead ranks: a backend failure outside commlib is evidence too
    problems += _dead_ranks(att, problems)
    problems.sort(key=lambda p: (p.ts_ns or 0, p.kind.value))
    slow = _straggler(att) if whole else None
    recovered_ns = _recovered_in_job_at(att)
    if all(p.kind is Kind.HANG for p in problems):
        # Nobody reported a failure: a live hang, a job killed from outside, or (an attempt
        # torchrun followed with another) a rank that died between collectives.
        status = "incomplete" if problems or not final else "ok"
    elif recovered_ns is not None and all((p.ts_ns or 0) <= recovered_ns for p in problems):
        status = "recovered"  # every problem came before every rank went on in a new epoch
    else:
        status = "failed"
    if slow is not None:
        problems.append(slow)  # after the failures: they, when any, name the culprits
    culprits = next((sorted(p.ranks) for p in problems if p.ranks), [])
    return AttemptFinding(
        attempt=att.attempt,
        status=status,
        ranks=sorted(att.ranks),
        world_size=att.world_size,
        collectives=att.collectives if whole else None,
        start_ns=min(rl.first_ns for rl in att.ranks.values()) if whole else None,
        end_ns=max(rl.last_ns for rl in att.ranks.values()),
        problems=problems,
        culprits=culprits,
        positions=[position(att, r) for r in sorted(att.ranks)] if status != "ok" else [],
        p2p_ops=att.p2p_ops if whole else None,
    )


def _recovered_in_job_at(att: AttemptLog) -> int | None:
    """When the last rank logged `recovery.in_job` into the attempt's last epoch, where every
    rank did (`commlib.Recovery`: all ranks joined it, rebuilt their communicators and met
    again); None where the attempt never recovered in-job, or not every rank got there."""
    last: dict[int, dict[str, Any]] = {}
    for r, rl in att.ranks.items():
        if rl.recovered is None:
            return None
        last[r] = rl.recovered
    if len({e.get("epoch") for e in last.values()}) != 1:
        return None
    return max(e["ts_ns"] for e in last.values())


def _app_errors(att: AttemptLog) -> list[Problem]:
    """Error-level events of the application (a trainer's own `train.error`, say), per event name.

    Culprits are the union of the events' `ranks` field when every event has one (the
    convention for an application that knows whom to blame), else the ranks that logged
    it. An error that merely carries a commlib failure up is left out: the failure itself
    is reported from commlib's own events.
    """
    by_name: dict[str, list[ErrorGroup]] = defaultdict(list)
    for group in att.errors.values():  # the model keeps error-level events by (name, error type)
        if group.error_type not in COMMLIB_ERRORS:
            by_name[group.name].append(group)
    problems = []
    for name, groups in sorted(by_name.items()):
        reporters = sorted({r for g in groups for r in g.reporters})
        if all(g.blamed is not None for g in groups):
            culprits = sorted({r for g in groups for r in g.blamed})  # type: ignore[union-attr]
        else:
            culprits = reporters
        first = min((g.first for g in groups), key=lambda e: e["ts_ns"])
        what = first.get("error") or first.get("message") or ""
        message = f"{name} logged at error level by {ranks_text(reporters)}: {first.get('error_type') or ''} {what}"
        details: dict[str, Any] = {"event": name}
        if classify(first.get("error_type"), str(what)) in (Failure.TIMEOUT, Failure.PEER):
            # A torch.distributed call commlib did not issue (DCP's collectives, say) timed out
            # or lost a peer: its reporters are victims, and the suspects are the ranks that
            # had gone quiet before it without an error of their own; failing those, the ranks
            # that had aborted on purpose and left (named for that, not as dead).
            t = first["ts_ns"]
            others = sorted(set(att.ranks) - set(reporters))
            gone = [r for r in _gone_before(att, others, t) if not att.ranks[r].failed_before(t)]
            aborted = [r for r in gone if _left_after_abort(att, r, t)]
            quiet = [r for r in gone if r not in aborted]
            culprits, details["quiet"], details["aborted"] = quiet or aborted, quiet, [] if quiet else aborted
            if quiet:
                why = f"; {ranks_text(quiet)} had stopped logging before it"
            elif aborted:
                why = f"; {_abort_text(att, aborted)}"
            else:
                why = ""
            message += f" (a backend failure in a torch.distributed call outside commlib{why})"
        problems.append(
            Problem(
                Kind.ERROR,
                culprits,
                first.get("label"),
                first.get("op"),
                first.get("seq"),
                message.strip(),
                reporters,
                first["ts_ns"],
                details,
            )
        )
    return problems


def _failures(att: AttemptLog, comm: CommLog, mismatches: dict[int, Problem], dumps: list[DumpInfo]) -> list[Problem]:
    """Timeouts, peer failures and errors logged on `comm` (collectives' and send/recv's), or
    else the oldest unfinished collective and, per pair of ranks, the oldest unfinished send/recv."""
    problems: list[Problem] = []
    by_key: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    by_pair: dict[tuple[tuple[int, int, int, int], str], list[dict[str, Any]]] = defaultdict(list)
    for f in comm.failures:
        peer = peer_of(f)
        if peer is not None and isinstance(f.get("seq"), int):
            by_pair[(comm.pair_key(f["rank"], peer, tag_of(f), f["seq"]), f["event"])].append(f)
        else:
            by_key[(f.get("seq", -1), f["event"])].append(f)
    for (seq, event), events in sorted(by_key.items(), key=lambda kv: min(e["ts_ns"] for e in kv[1])):
        mismatch = mismatches.get(seq)
        if event == "collective.timeout":
            problems.append(_timeout(att, comm, seq, events, mismatch))
        elif event == "peer.failure":
            problems.append(_peer_failure(att, comm, seq, events))
        else:
            problems.append(_error(comm, seq, events, mismatch))
    for (key, event), events in sorted(by_pair.items(), key=lambda kv: min(e["ts_ns"] for e in kv[1])):
        problems.append(_p2p_failure(att, comm, key, event, events))
    if not comm.failures:
        hang = collective_hang(att, comm, mismatches, dumps)
        if hang is not None:
            problems.append(hang)
        problems += p2p_hangs(att, comm, dumps)
    return problems


def _arrivals(comm: CommLog, seq: int) -> dict[int, int | None]:
    return {r: c.start_ns for r, c in comm.calls.get(seq, {}).items()}


def _timeout(
    att: AttemptLog, comm: CommLog, seq: int, events: list[dict[str, Any]], mismatch: Problem | None
) -> Problem:
    t = min(e["ts_ns"] for e in events)
    reporters = sorted({e["rank"] for e in events})
    op = events[0].get("op")
    board_missing = {comm.global_rank(r) for e in events for r in (e.get("missing_ranks") or [])}
    board_known = any(e.get("missing_ranks") is not None for e in events)
    stale = sorted({comm.global_rank(r) for e in events for r in (e.get("stale_ranks") or [])})
    arrivals = _arrivals(comm, seq)
    members = comm.member_ranks()
    late = sorted(r for r, ts in arrivals.items() if r not in reporters and ts is not None and ts > t)
    never = sorted(r for r in members if r not in arrivals and r not in reporters)
    waiting = _held_up(comm, sorted(board_missing | set(late) | set(never)), seq, t, reporters)
    missing = sorted((board_missing | set(late) | set(never)) - set(waiting))
    arrived = sorted(r for r in members if r not in missing and r not in waiting)
    deadline = events[0].get("deadline")
    frozen = _frozen(att, comm.calls.get(seq, {}), t)
    head = (
        f"{op} #{seq} on {comm.label!r} timed out"
        + (f" after {deadline:g} s" if isinstance(deadline, (int, float)) else "")
        + f" on {ranks_text(reporters)}"
    )
    if missing:
        culprits = missing
        body = f"{ranks_text(missing)} had not arrived"
        if late:
            body += "; " + ", ".join(
                f"rank {r} started it {(arrivals[r] - t) / 1e9:.2f} s after the deadline" for r in late
            )
        if waiting:
            body += "; " + ", ".join(
                f"rank {r} was still in {comm.calls[k][r].op} #{k}, waiting for "
                f"{ranks_text(blockers)}, which had not started that"
                for r, (k, blockers) in waiting.items()
            )
    elif mismatch is not None:
        culprits = mismatch.ranks
        body = f"every rank arrived, but {ranks_text(mismatch.ranks)} issued a different collective (see the mismatch)"
    else:
        culprits = sorted(set(stale) | set(frozen))
        body = "every rank arrived and the backend did not complete it"
        if frozen:
            body += f"; {ranks_text(frozen)} never left it, not even at their own deadline (stopped or dead)"
        if stale:
            body += f"; {ranks_text(stale)} had stopped sending heartbeats"
    arrived_text = rank_ranges(arrived) or "none"
    return _timeout_problem(
        att,
        comm,
        op,
        seq,
        t,
        reporters,
        culprits,
        f"{head}: {body}. Arrived: {arrived_text}.",
        {
            "arrived": arrived,
            "missing": missing,
            "waiting": sorted(waiting),
            "board_missing": sorted(board_missing) if board_known else None,
            "late": late,
            "stale": stale,
            "frozen": frozen,
            "deadline_s": deadline,
        },
    )


def _held_up(
    comm: CommLog, ranks: list[int], seq: int, t: int, reporters: list[int]
) -> dict[int, tuple[int, list[int]]]:
    """Of `ranks`, which had not arrived at collective `seq`, those inside an earlier collective k
    of `comm` at `t` (when the deadline of `reporters` expired) that ranks had not started by
    then: {rank: (k, those ranks)}."""
    out = {}
    members = comm.member_ranks()
    for r in ranks:
        inside = [
            k
            for k, calls in comm.calls.items()
            if k < seq
            and (c := calls.get(r)) is not None
            and c.start_ns is not None
            and c.start_ns <= t
            and c.open_at(t, reporters)
        ]
        if not inside:
            continue
        k = max(inside)
        started = {q for q, c in comm.calls[k].items() if c.start_ns is not None and c.start_ns <= t}
        blockers = [q for q in members if q != r and q not in started]
        if blockers:
            out[r] = (k, blockers)
    return out


def _timeout_problem(
    att: AttemptLog,
    comm: CommLog,
    op: str | None,
    seq: int,
    t: int,
    reporters: list[int],
    culprits: list[int],
    message: str,
    details: dict[str, Any],
) -> Problem:
    """A timeout's Problem (collective or send/recv): `message`, then where the culprits were
    at the deadline, in the text and in the details."""
    places = where(att, culprits, t, reporters)
    if aborted := [r for r in culprits if _left_after_abort(att, r, t)]:
        said = _abort_text(att, aborted)
        message += f" {said[0].upper()}{said[1:]}."
    if culprits:
        message += f" Where they were at the deadline: {where_text(att, culprits, t, reporters)}."
    return Problem(Kind.TIMEOUT, culprits, comm.label, op, seq, message, reporters, t, {**details, "where": places})


def _frozen(att: AttemptLog, calls: dict[int, Call], t: int) -> list[int]:
    """Ranks in the collective at `t` that logged no outcome of it by their own deadline (plus grace).

    Reporters count too: a rank stopped past its deadline reports its own timeout once resumed.
    A rank whose log ends in a line cut short was killed while writing after it entered the
    call (that line may have been its outcome): it was not silent in it, and is not counted.
    """
    out = []
    for r, c in sorted(calls.items()):
        if c.start_ns is None or c.start_ns > t or c.deadline_s is None:
            continue
        due = c.start_ns + int((c.deadline_s + FROZEN_GRACE_S) * 1e9)
        if c.end_ns is None and r in att.ranks and att.ranks[r].cut:
            continue
        if c.end_ns is None or c.end_ns > due:
            out.append(r)
    return out


def _gone_before(att: AttemptLog, ranks: list[int], t: int) -> list[int]:
    return [r for r in ranks if r not in att.ranks or att.ranks[r].last_ns <= t]


def _left_after_abort(att: AttemptLog, rank: int, t: int) -> bool:
    """Whether `rank` had left by `t` saying why: it had aborted on purpose, its last deed, and
    reported no failure of its own. Such a rank is named for its abort, never as dead."""
    log = att.ranks.get(rank)
    return log is not None and log.left_after_abort(t) and not log.failed_before(t)


def _abort_text(att: AttemptLog, ranks: list[int]) -> str:
    """What `ranks` did before they left: which communicator they aborted (maybe not the one a
    peer then failed on) and why."""
    aborts = [att.ranks[r].aborted or {} for r in ranks]
    comms = sorted({str(a.get("comm")) for a in aborts})
    reasons = "; ".join(sorted({str(a.get("reason")) for a in aborts}))
    which = f"communicator {comms[0]!r}" if len(comms) == 1 else f"communicators {', '.join(map(repr, comms))}"
    return f"{ranks_text(ranks)} had aborted {which} on purpose ({reasons}) and left"


def _peer_failure(
    att: AttemptLog,
    comm: CommLog,
    seq: int,
    events: list[dict[str, Any]],
    others: list[int] | None = None,
    what: str | None = None,
) -> Problem:
    """`others`: the ranks that could have failed (default every other member); `what`: the op, in words."""
    t = min(e["ts_ns"] for e in events)
    reporters = sorted({e["rank"] for e in events})
    op = events[0].get("op")
    if others is None:
        others = [r for r in comm.member_ranks() if r not in reporters]
    gone = _gone_before(att, others, t)
    # Of those: the ranks that had aborted on purpose (saying why), and the ones that said nothing.
    aborted = [r for r in gone if _left_after_abort(att, r, t)]
    silent = [r for r in gone if r not in aborted and (r not in att.ranks or not att.ranks[r].failed_before(t))]
    head = f"{ranks_text(reporters)} saw a peer fail during {what or f'{op} #{seq}'} on {comm.label!r}"
    if silent:
        message = (
            f"{head}: {ranks_text(silent)} had stopped logging before, without reporting an error "
            f"(killed or crashed). {where_text(att, silent, None)}."
        )
    elif aborted:
        message = f"{head}: {_abort_text(att, aborted)}."
    elif gone:
        message = (
            f"{head}: {ranks_text(gone)} had already failed and left: a consequence of their failure "
            f"(see the earlier problem)."
        )
    elif announced := sorted({comm.global_rank(r) for e in events for r in e.get("failed_ranks") or []}):
        message = (
            f"{head}: {ranks_text(announced)} had aborted the communicator and said so (their own "
            f"failure, or an in-job recovery: see the earlier problem)."
        )
    else:
        message = (
            f"{head}: every other member kept logging after it, so a peer most likely aborted "
            f"its side after an earlier failure (see the earlier problem)."
        )
    return Problem(
        Kind.PEER_FAILURE,
        silent or aborted,
        comm.label,
        op,
        seq,
        message,
        reporters,
        t,
        {
            "gone": gone,
            "aborted": [] if silent else aborted,
            "errors": sorted({str(e.get("error"))[:300] for e in events}),
            "where": where(att, gone, None),
        },
    )


def _error(
    comm: CommLog, seq: int, events: list[dict[str, Any]], mismatch: Problem | None, what: str | None = None
) -> Problem:
    t = min(e["ts_ns"] for e in events)
    reporters = sorted({e["rank"] for e in events})
    op = events[0].get("op")
    errors = sorted({f"{e.get('error_type')}: {e.get('error')}" for e in events})
    culprits = mismatch.ranks if mismatch is not None else reporters
    message = f"{what or f'{op} #{seq}'} on {comm.label!r} failed on {ranks_text(reporters)}: {errors[0]}"
    if mismatch is not None:
        message += f" (ranks disagree on this collective: {mismatch.message})"
    return Problem(Kind.ERROR, culprits, comm.label, op, seq, message, reporters, t, {"errors": errors})


def _p2p_failure(
    att: AttemptLog,
    comm: CommLog,
    key: tuple[int, int, int, int],
    event: str,
    events: list[dict[str, Any]],
) -> Problem:
    """A send/recv that timed out, lost its peer or failed: about the pair, never the whole communicator."""
    lo, hi, tag, seq = key
    first = min(events, key=lambda e: e["ts_ns"])
    rank, op = first["rank"], str(first.get("op"))
    peer = hi if rank == lo else lo
    what = p2p_name(op, seq, peer, tag)
    calls = comm.pairs().get(key, {})
    details: dict[str, Any] = {"p2p": True, "pair": [lo, hi], "peer": peer, "tag": tag}
    if event == "peer.failure":
        problem = _peer_failure(att, comm, seq, events, others=[peer], what=what)
    elif event != "collective.timeout":
        problem = _error(comm, seq, events, None, what=what)
    else:
        mine, theirs = calls.get(rank), calls.get(peer)
        problem = _p2p_timeout(att, comm, seq, tag, events, rank, op, peer, mine, theirs)
    problem.details.update(details)
    return problem


def _p2p_timeout(
    att: AttemptLog,
    comm: CommLog,
    seq: int,
    tag: int,
    events: list[dict[str, Any]],
    rank: int,
    op: str,
    peer: int,
    mine: Call | None,
    theirs: Call | None,
) -> Problem:
    t = min(e["ts_ns"] for e in events)
    reporters = sorted({e["rank"] for e in events})
    want = MATCHING_P2P.get(op, "?")
    deadline = events[0].get("deadline")
    head = (
        f"{p2p_name(op, seq, peer, tag)} on {comm.label!r} timed out"
        + (f" after {deadline:g} s" if isinstance(deadline, (int, float)) else "")
        + f" on {ranks_text(reporters)}"
    )
    late: list[int] = []
    frozen: list[int] = []
    if theirs is None or (theirs.start_ns is not None and theirs.start_ns > t and peer not in reporters):
        culprits = [peer]
        body = f"rank {peer} never posted the matching {p2p_name(want, seq, rank, tag)}"
        if theirs is not None and theirs.start_ns is not None:
            late = [peer]
            body += (
                f" before the deadline (it posted {theirs.op} #{seq}{tag_text(tag)} "
                f"{(theirs.start_ns - t) / 1e9:.2f} s after it)"
            )
    elif theirs.op == op:
        culprits = sorted({rank, peer})
        body = (
            f"rank {peer} posted {p2p_name(theirs.op, seq, rank, tag)} instead of the matching "
            f"{want}: both sides issued {op} as their point-to-point op #{seq}{tag_text(tag)} "
            "with each other"
        )
    else:
        frozen = _frozen(att, {r: c for r, c in ((rank, mine), (peer, theirs)) if c is not None}, t)
        culprits = frozen
        body = f"rank {peer} posted the matching {want} and the backend did not complete it"
        if frozen:
            body += f"; {ranks_text(frozen)} never left it, not even at their own deadline (stopped or dead)"
    return _timeout_problem(
        att,
        comm,
        op,
        seq,
        t,
        reporters,
        culprits,
        f"{head}: {body}.",
        {
            "arrived": sorted(r for r in (rank, peer) if r not in culprits or r in frozen),
            "missing": [r for r in culprits if r not in frozen],
            "late": late,
            "stale": [],
            "frozen": frozen,
            "deadline_s": deadline,
        },
    )


def _dead_ranks(att: AttemptLog, problems: list[Problem]) -> list[Problem]:
    """Ranks that stopped logging silently while peers saw them fail or go quiet on the board."""
    evidence: dict[int, list[str]] = defaultdict(list)
    for p in problems:
        if p.kind is Kind.PEER_FAILURE:
            for r in p.ranks:
                if r in p.details.get("aborted", ()):
                    continue  # it said why it left
                saw = f"{ranks_text(p.reporters)} saw a peer failure"
                evidence[r].append(f"{saw} in {_named(p)} on {p.comm!r}")
        elif p.kind is Kind.TIMEOUT and p.ts_ns is not None:
            quiet = sorted(set(p.details["stale"]) | set(p.details["frozen"]))
            for r in _gone_before(att, quiet, p.ts_ns):
                if _left_after_abort(att, r, p.ts_ns):
                    continue  # it said why it left
                if r not in att.ranks or not att.ranks[r].failed_before(p.ts_ns):
                    evidence[r].append(
                        f"it had gone quiet (no heartbeat, or no outcome by its deadline) when "
                        f"{_named(p)} on {p.comm!r} timed out"
                    )
        elif p.kind is Kind.ERROR and p.details.get("quiet"):
            for r in p.details["quiet"]:
                evidence[r].append(
                    f"it had stopped logging before {ranks_text(p.reporters)} hit a backend failure "
                    f"outside commlib ({p.details['event']})"
                )
    dead = []
    for r, why in sorted(evidence.items()):
        pos = position(att, r)
        when = pos.log_ends_ns
        message = (
            f"rank {r} ({pos.host}, pid {pos.pid}) stopped logging without reporting an error "
            f"(dead, killed or stopped): {pos.describe()}. Evidence: {'; '.join(sorted(set(why)))}."
        )
        last = pos.last_started or pos.last_finished
        dead.append(
            Problem(
                Kind.DEAD_RANK,
                [r],
                last.comm if last else None,
                last.op if last else None,
                last.seq if last else None,
                message,
                [],
                when,
                {"where": asdict(pos)},
            )
        )
    return dead


def _named(p: Problem) -> str:
    """The op a problem is about, as its evidence names it: "recv #2", "recv #2 (tag 3)"."""
    return f"{p.op} #{p.seq}{tag_text(p.details.get('tag', 0))}"


def _straggler(att: AttemptLog) -> Problem | None:
    """The attempt's straggler finding (see STRAGGLER_LAST_SHARE), or None."""
    stats = straggler_stats([att])
    # The rank most often last: the rule is a pattern (share and median lag), so one long
    # wait (ranks reaching the startup barrier seconds apart) must not pick the candidate.
    top = max(stats, key=lambda s: (s.last_count, s.waited_total_s), default=None)
    if top is None or top.collectives < STRAGGLER_MIN_COLLECTIVES:
        return None
    if top.last_count < STRAGGLER_LAST_SHARE * top.collectives or top.waited_p50_s < STRAGGLER_MIN_LAG_S:
        return None
    return Problem(
        Kind.STRAGGLER,
        [top.rank],
        None,
        None,
        None,
        f"rank {top.rank} is a straggler: it arrived last at {top.last_count} of {top.collectives} "
        f"collectives; the others waited p50 {top.waited_p50_s * 1e3:.0f} ms, p99 "
        f"{top.waited_p99_s * 1e3:.0f} ms for it ({top.waited_total_s:.1f} s in all)",
        details=asdict(top),
    )
