"""Print the tests that failed in a full run, one node id a line, if every one of them ran
through a stall of the machine; print nothing otherwise (a failure with no stall beside it is
the test's, and stands).

    python scripts/stalled_failures.py STALL_LOG

STALL_LOG is what tests/conftest.py wrote under COMMLIB_TEST_STALL_LOG: stalls (a pytest
process's thread woke seconds late: every process of this machine stopped) and failures (a
test's node id and when it ran). `scripts/test.sh` runs the printed tests once more.
"""

from __future__ import annotations

import json
import sys


def stalled_failures(lines: list[str]) -> list[str]:
    """The failed node ids, in the order first seen, if each one's run overlaps a stall; else []."""
    records = [json.loads(line) for line in lines if line.strip()]
    stalls = [(r["stall_from"], r["stall_to"]) for r in records if "stall_from" in r]
    failures: dict[str, list[tuple[float, float]]] = {}
    for r in records:
        if "failed" in r:
            failures.setdefault(r["failed"], []).append((r["from"], r["to"]))
    stalled = all(any(s < to and e > start for s, e in stalls for start, to in runs) for runs in failures.values())
    return list(failures) if failures and stalled else []


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        for node_id in stalled_failures(f.readlines()):
            print(node_id)
