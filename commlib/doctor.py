"""`commlib doctor`: read every rank's log in a directory and say who is stuck where.

    python -m commlib.doctor LOGDIR [--json] [--trace out.json] [--job ID]   (or: commlib-doctor ...)
    python -m commlib.doctor LOGDIR --verdict [--json]   (the verdict alone, read from the end)

Prints the verdict read from the end of each rank's log first (seconds at any size), then the
full report, read from every line, with its statistics; where the verdict from the end cannot
decide, the full report alone. With --json, `Diagnosis.to_dict()` of the full report
(with --verdict, of the verdict). It can write a Chrome/Perfetto trace (in the full read's pass
over the logs), and exits 0 when no attempt of the run had a problem, 1 when the final attempt
has one, 3 when earlier attempts failed but the final one is clean (a recovered run), and 2
when there is nothing it can judge: the directory is missing or holds no readable event, it
holds several jobs' logs and --job does not pick one, or the trace cannot be written where
--trace says (checked before any log is read, and again before it is moved there). A trace
replaces only a regular file (or makes a new one): a FIFO, a device or a symlink to one
(/dev/null, /dev/stdout) is refused, naming what it is; a symlink to a regular file is written
through. Rank logs, flight dumps and stacks files that are not regular files are named as not
read, never waited on. The analysis itself lives in `commlib.observe` (`run_logs`: the logs
read once; `blame`: the rules; `stats`: the tables; `diagnosis`: the three composed;
`verdict_from_end`: the verdict from the end; `trace`: the trace); this module only renders
it. Neither imports torch: the logs copied from a cluster can be read on a machine without it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

from commlib.members import rank_ranges, ranks_text
from commlib.observe.diagnosis import Diagnosis, analyze
from commlib.observe.events import RANK_FILE
from commlib.observe.findings import AttemptFinding
from commlib.observe.position import RankPosition
from commlib.observe.records import tag_text
from commlib.observe.replicas import group_dirs
from commlib.observe.replicas import main as replicas_main
from commlib.observe.run_logs import LogDirError, load
from commlib.observe.trace import TraceFile, TracePathError
from commlib.observe.verdict_from_end import ReadInfo, from_the_end, verdict

WIDTH = 110


def _secs(x: float | None) -> str:
    if x is None:
        return "-"
    if x < 1e-3:
        return f"{x * 1e6:.0f} us"
    if x < 1:
        return f"{x * 1e3:.2f} ms"
    return f"{x:.2f} s"


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    x = float(n) / 1024
    for unit in ("KiB", "MiB"):
        if x < 1024:
            return f"{x:.1f} {unit}"
        x /= 1024
    return f"{x:.1f} GiB"


def _wrap(text: str, indent: str) -> str:
    return textwrap.fill(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "    ")


def _attempt_lines(a: AttemptFinding, final: bool) -> list[str]:
    head = f"Attempt {a.attempt}{' (final)' if final else ''}: {a.status.upper()}"
    head += f", ranks {rank_ranges(a.ranks)}" + (f" of {a.world_size}" if a.world_size else "")
    if a.collectives is not None:  # counted where the whole log was read
        head += f", {a.collectives} collectives" + (f", {a.p2p_ops} send/recv" if a.p2p_ops else "")
    if a.start_ns is not None:
        head += f", {(a.end_ns - a.start_ns) / 1e9:.1f} s of logs"
    if a.culprits:
        head += f"; culprit {ranks_text(a.culprits)}"
    lines = [head]
    for p in a.problems:
        lines.append(_wrap(f"[{p.kind.value}] {ranks_text(p.ranks) if p.ranks else 'no culprit'}: {p.message}", "  "))
    if a.status != "ok" and not a.problems:
        lines.append(
            _wrap(
                "The logs end without a failure or an unfinished collective, and torchrun started "
                "another attempt: a process died between collectives (see where each log ends).",
                "  ",
            )
        )
    if a.positions:
        lines.append("  Where each rank's log ends:")
        places: dict[str, list[RankPosition]] = {}
        for pos in a.positions:
            places.setdefault(pos.describe(), []).append(pos)
        for text, same in places.items():
            who = (
                f"rank {same[0].rank} ({same[0].host}, pid {same[0].pid})"
                if len(same) == 1
                else f"{ranks_text(p.rank for p in same)} ({_hosts_text({p.host or '?' for p in same})})"
            )
            lines.append(_wrap(f"{who}: {text}", "    "))
    return lines


def _hosts_text(hosts: set[str]) -> str:
    """A few hosts by name; many, by count with the first and last."""
    names = sorted(hosts)
    return ", ".join(names) if len(names) <= 3 else f"{len(names)} hosts, {names[0]} ... {names[-1]}"


def render(d: Diagnosis) -> str:
    """The human-readable report."""
    n_ranks = len({r for a in d.attempts for r in a.ranks})
    lines = [
        f"commlib doctor: {d.logdir}" + (f" (job {d.job})" if d.job is not None else ""),
        f"{n_ranks} rank(s) (world size {d.world_size}) on {_hosts_text(set(d.hosts)) or 'no named host'}; "
        f"{len(d.attempts)} attempt(s)",
    ]
    for f in d.unreadable:
        what = " What follows says nothing of that rank's log there." if RANK_FILE.match(Path(f["path"]).name) else ""
        lines.append(_wrap(f"Not read: {f['path']}: {f['why']}.{what}", ""))
    for path, n in d.skipped_lines.items():
        lines.append(_wrap(f"Skipped {n} line(s) of {path} that are not JSON events.", ""))
    if d.read is not None:
        lines.append(_wrap(_read_text(d.read), ""))
    lines.append("")
    for i, a in enumerate(d.attempts):
        lines += _attempt_lines(a, final=i == len(d.attempts) - 1)
        lines.append("")
    if d.stragglers:
        lines.append(
            "Stragglers: how long the others waited for each rank (last start - first start of each "
            "collective, counted for the rank that arrived last)."
        )
        lines.append("  Wall clocks (ts_ns) of different processes: across hosts these include the clocks' offset.")
        lines.append(f"  {'rank':>4} {'collectives':>11} {'last':>6} {'waited total':>13} {'p50':>10} {'p99':>10}")
        for s in sorted(d.stragglers, key=lambda s: -s.waited_total_s):
            lines.append(
                f"  {s.rank:>4} {s.collectives:>11} {s.last_count:>6} {_secs(s.waited_total_s):>13} "
                f"{_secs(s.waited_p50_s):>10} {_secs(s.waited_p99_s):>10}"
            )
        lines.append("")
    if d.ops:
        lines.append(
            "Collectives by op and size (bytes = each rank's input; latency over every rank's completed "
            "calls; bandwidth at p50, GB/s):"
        )
        lines.append(
            f"  {'op':<22} {'ranks':>5} {'bytes':>11} {'samples':>8} {'p50':>10} {'p99':>10} {'algbw':>8} {'busbw':>8}"
        )
        for o in d.ops:
            bw = [f"{x:.3g}" if x is not None else "-" for x in (o.algbw_gbps, o.busbw_gbps)]
            lines.append(
                f"  {o.op:<22} {o.comm_size:>5} {_size(o.bytes):>11} {o.samples:>8} {_secs(o.p50_s):>10} "
                f"{_secs(o.p99_s):>10} {bw[0]:>8} {bw[1]:>8}"
            )
        lines.append("")
    telling = [x for x in d.dumps if x.unfinished]  # the others only repeat the logs
    for dump in telling:
        unfinished = ", ".join(
            f"{u['op']} #{u['seq']}" + (f" (peer {u['peer']}{tag_text(u.get('tag', 0))})" if "peer" in u else "")
            for u in dump.unfinished
        )
        lines.append(
            f"Flight dump ({dump.reason}) of rank {dump.rank}, comm {dump.comm!r}, attempt {dump.attempt}: "
            f"still in {unfinished} [{dump.path}]"
        )
    if d.dumps:
        lines.append(f"{len(d.dumps)} flight-recorder dump(s), {len(telling)} with an unfinished collective.")
        lines.append("")
    if d.exit_code == 0:
        lines.append(
            "No problem found."
            if not d.unreadable
            else f"No problem found in the logs read ({len(d.unreadable)} file(s) could not be read: see above)."
        )
    elif d.exit_code == 3:
        failed = [a.attempt for a in d.attempts if a.status != "ok"]
        final = d.final
        if final is not None and final.status == "recovered":
            lines.append(
                f"Recovered: attempt(s) {failed} had problems; the final attempt recovered in-job from its own."
            )
        else:
            lines.append(f"Recovered: attempt(s) {failed} had problems; the final attempt is clean.")
    else:
        final = d.final
        lines.append(
            f"PROBLEM: final attempt {final.attempt if final else '?'} {final.status if final else 'missing'}"
            + (f"; culprit {ranks_text(final.culprits)}" if final and final.culprits else "")
            + "."
        )
    return "\n".join(lines)


def _read_text(read: ReadInfo) -> str:
    """How a verdict read the logs."""
    if read.full_read_because is not None:
        return f"Verdict: read in full ({read.bytes_total / 1e6:.1f} MB): {read.full_read_because}."
    whole = f"; ranks read whole: {rank_ranges(read.ranks_whole)}" if read.ranks_whole else ""
    return (
        f"Verdict read from the end of each rank's log: {read.bytes_read / 1e6:.1f} MB of "
        f"{read.bytes_total / 1e6:.1f} MB{whole}. No statistics (the full report has them)."
    )


def _show(text: str) -> bool:
    """Print `text`; False where the reader has left (`| head`): the exit code is kept, and
    interpreter exit flushes nowhere."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="commlib-doctor", description=__doc__.split("\n")[0])
    parser.add_argument("logdir", help="directory holding rank*.jsonl logs (and flight_rank*.json dumps)")
    parser.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    parser.add_argument("--trace", metavar="OUT.json", help="also write a Chrome/Perfetto trace there")
    parser.add_argument("--job", metavar="ID", help="read only this job's logs (a directory holding several jobs')")
    parser.add_argument(
        "--verdict",
        action="store_true",
        help="only the verdict (who is stuck where, who is dead, who waits for whom), read from the "
        "end of each rank's logs: seconds at any size; no statistics, no full report after it",
    )
    args = parser.parse_args(argv)
    if args.verdict and args.trace is not None:
        print(
            "commlib-doctor: --trace draws every call: it needs the whole logs, not --verdict's end of them",
            file=sys.stderr,
        )
        return 2
    if group_dirs(args.logdir):  # one log dir per replica group (commlib.replicas): the replicas rule
        return replicas_main([args.logdir, *(["--json"] if args.json else [])])
    try:
        trace = TraceFile(args.trace) if args.trace is not None else None
    except TracePathError as exc:
        print(f"commlib-doctor: {exc}", file=sys.stderr)
        return 2
    try:
        if args.verdict:
            diagnosis = verdict(args.logdir, job=args.job)
        else:
            first = from_the_end(args.logdir, job=args.job) if not args.json else None
            if isinstance(first, Diagnosis) and not _show(render(first) + "\n"):
                if trace is not None:
                    trace.discard()
                return first.exit_code
            run = load(args.logdir, job=args.job, observers=[trace.writer] if trace else [])
            diagnosis = analyze(run)
            if trace is not None:
                trace.commit(run)
    except BaseException as exc:
        if trace is not None:
            trace.discard()  # no trace, and no part of one
        if not isinstance(exc, (LogDirError, TracePathError)):
            raise
        print(f"commlib-doctor: {exc}", file=sys.stderr)
        return 2
    as_json = json.dumps(diagnosis.to_dict(), indent=1, default=str) if args.json else None
    _show(as_json or render(diagnosis))
    return diagnosis.exit_code


if __name__ == "__main__":
    sys.exit(main())
