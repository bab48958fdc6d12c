"""A timeout's message at scale: its length and the CPU to make it, this tree against `--ref`.

    .venv/bin/python scripts/bench_timeout_message.py [--ranks 1000 4000] [--ref 66c20a5]

The board of a job where rank 0 timed out in all_reduce #5, one rank never started #4 and every
other rank waits in #4 for it (four of them silent for 10 s, one never published): the case
where most ranks are behind. `commlib.missing_ranks.explain_timeout` on it, in a fresh process
for each tree (`--ref`, a git revision, is extracted to a temporary directory), interleaved:
the message's length in characters, whether it is the same, and the best CPU time of three calls.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_MEASURE = """
import json, sys, time
from commlib.members import Members
try:
    from commlib.missing_ranks import explain_timeout
    from commlib.record.board import BoardEntry
except ImportError:  # a tree from before the wording left the progress board
    from commlib.observe.board import BoardEntry, explain_timeout
ranks = int(sys.argv[1])
now = 100 * 10**9
def entry(started, beat_s_ago=0.0):
    return BoardEntry(started_seq=started, started_op="all_reduce", finished_seq=3, finished_op="all_reduce",
                      step=7, phase="backward", heartbeat_ns=now - int(beat_s_ago * 1e9))
entries = {r: entry(4, 10.0 if 10 <= r <= 13 else 0.0) for r in range(1, ranks - 1)}
entries[ranks // 2] = entry(3)
entries[0] = BoardEntry(started_seq=5, finished_seq=4, heartbeat_ns=now)
entries[ranks - 1] = None
best = None
for _ in range(3):
    t = time.process_time()
    said = explain_timeout("all_reduce", 5, Members.of("world", ranks), 0, 300.0, 300.0, entries, now)
    took = time.process_time() - t
    best = took if best is None else min(best, took)
print(json.dumps({"message": said.message, "cpu_s": best, "missing": said.missing_ranks}))
"""


def _measure(tree: Path, ranks: int) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(ranks)],
        cwd=tree,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1000, 4000])
    parser.add_argument("--ref", default="66c20a5")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ref = Path(tmp)
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", args.ref, "commlib"], capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(ref)], input=archive.stdout, check=True)
        for ranks in args.ranks:
            before, now = _measure(ref, ranks), _measure(REPO, ranks)
            if before["missing"] != now["missing"]:
                raise SystemExit(f"expected the same missing ranks; found {before['missing']} and {now['missing']}")
            same = "the same message" if before["message"] == now["message"] else "ANOTHER message"
            print(
                f"{ranks} ranks: {args.ref}: {len(before['message']):,} characters, "
                f"{before['cpu_s'] * 1000:.1f} ms of CPU; this tree: {len(now['message']):,} characters, "
                f"{now['cpu_s'] * 1000:.1f} ms ({now['cpu_s'] / before['cpu_s']:.3f}x); the same missing "
                f"ranks, {same}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
