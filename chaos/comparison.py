"""The bitwise comparison of a faulted run's results file with its fault-free reference's.

Every step's loss bitwise equal (compared as ``float.hex``), every step exactly once in
the final history (same steps in the same order as the reference, none missing, none
doubled), final model and optimizer state digests equal. `chaos.verify` runs it as part
of its verdict; the results files are `chaos.results`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Comparison:
    checks: dict[str, bool] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        """Whether the two runs are the same run: every check ran held, and none found a problem."""
        return bool(self.checks) and all(self.checks.values()) and not self.problems


def compare(faulted: dict[str, Any], reference: dict[str, Any]) -> Comparison:
    """Bitwise comparison of two results files (as `chaos.results.read_results` returns them)."""
    out = Comparison()
    got = [x.hex() for x in faulted["losses"]]
    want = [x.hex() for x in reference["losses"]]
    differing = [i for i in range(min(len(got), len(want))) if got[i] != want[i]]
    out.checks["losses_bitwise"] = len(got) == len(want) and not differing
    if len(got) != len(want):
        out.problems.append(f"losses: expected {len(want)} steps as in the reference; found {len(got)}")
    if differing:
        i = differing[0]
        out.problems.append(
            f"losses: {len(differing)} step(s) differ from the reference, first at index {i}: "
            f"expected {float.fromhex(want[i])!r}; found {float.fromhex(got[i])!r}"
        )

    want_steps = _history_steps(reference) or list(range(1, int(reference["steps"]) + 1))
    got_steps = _history_steps(faulted)
    if got_steps is None and _history_steps(reference) is not None:
        out.checks["history_exact"] = False
        out.problems.append("history: expected a history of the steps applied, as the reference has; found none")
    elif got_steps is not None:
        out.checks["history_exact"] = got_steps == want_steps
        if got_steps != want_steps:
            doubled = sorted({s for s in got_steps if got_steps.count(s) > 1})
            missing = sorted(set(want_steps) - set(got_steps))
            expected = f"steps {want_steps[0]}..{want_steps[-1]}" if want_steps else "no steps"
            out.problems.append(
                f"history: expected {expected} once each, in order; found doubled {doubled}, "
                f"missing {missing}" + ("" if doubled or missing else f", order {got_steps}")
            )

    got_digest, want_digest = faulted["state_digest"], reference["state_digest"]
    out.checks["state_bitwise"] = got_digest["total"] == want_digest["total"]
    if not out.checks["state_bitwise"]:
        names = sorted(
            k
            for k in want_digest["tensors"].keys() | got_digest["tensors"].keys()
            if want_digest["tensors"].get(k) != got_digest["tensors"].get(k)
        )
        out.problems.append(
            f"state: expected the reference's final model and optimizer state; "
            f"{len(names)} tensor(s) differ: {names[:5]}"
        )
    return out


def _history_steps(results: dict[str, Any]) -> list[int] | None:
    history = results.get("history")
    if not isinstance(history, list):
        return None
    return [int(h["step"]) for h in history]
