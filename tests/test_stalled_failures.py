"""scripts/stalled_failures.py: which failures of a full run `scripts/test.sh` runs once more."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
from stalled_failures import stalled_failures  # noqa: E402


def _log(*records: dict) -> list[str]:
    return [json.dumps(r) for r in records]


def test_failures_that_all_ran_through_a_stall_are_run_again() -> None:
    """Every failure overlaps a stall: each is named once, in the order first seen."""
    lines = _log({"stall_from": 10.0, "stall_to": 15.0}, {"failed": "t::a", "from": 9.0, "to": 16.0},
                 {"failed": "t::b", "from": 14.0, "to": 20.0}, {"failed": "t::a", "from": 9.0, "to": 16.0})
    assert stalled_failures(lines) == ["t::a", "t::b"]


def test_one_failure_without_a_stall_keeps_every_failure_standing() -> None:
    """A failure that no stall overlaps is the test's own: nothing is run again."""
    lines = _log({"stall_from": 10.0, "stall_to": 15.0}, {"failed": "t::a", "from": 9.0, "to": 16.0},
                 {"failed": "t::b", "from": 30.0, "to": 31.0})
    assert stalled_failures(lines) == []
    assert stalled_failures(_log({"failed": "t::a", "from": 9.0, "to": 16.0})) == []
    assert stalled_failures(_log({"stall_from": 10.0, "stall_to": 15.0})) == []
