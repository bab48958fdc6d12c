"""The rules for values a user hands commlib or chaos: one rule per kind of value.

A number of seconds, a count, a size, a flag, a choice or a name means the same wherever it
comes from (an environment variable, a command-line option, a fault plan, an API argument), so
each kind is checked by one function here and every reader calls it, instead of a
`float()` or `int()` of its own per call site. What the rules hold, everywhere:

- a number is finite (no inf, no nan) and inside the bounds its reader gives, so an
  absurd value (1e308 seconds, a 400-digit count) is refused by name instead of
  overflowing somewhere deep inside;
- an integer is an integer: "3" and 3 are, "3.5", True and 3.0 are not;
- a piece of text (a name, a host, an option handed on) is one line of printable
  characters, so a newline in it cannot become a line of its own in a script or a log;
- an environment variable set to the empty string is unset (its default applies), as a
  shell's `VAR= cmd` is commonly meant;
- a refusal is a `ValueError` (a `TypeError` for a value of the wrong type) saying what
  was expected, naming the value, and quoting what was found.

Modules own their own names and bounds (`COMMLIB_LOG_MAX_MB` and its range live in
`commlib.record.log`); this module owns only what the kinds mean.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import TypeVar

_T = TypeVar("_T", bound=str)


def _describe(low: float | None, high: float | None) -> str:
    """The bounds of a range with at least one end."""
    if low is not None and high is not None:
        return f"in [{low:g}, {high:g}]"
    return f">= {low:g}" if low is not None else f"<= {high:g}"


def number(
    value: object,
    what: str,
    *,
    low: float | None = None,
    high: float | None = None,
    above: float | None = None,
    unit: str = "",
) -> float:
    """`value` (a number, or its text) as a finite float within [`low`, `high`], and strictly
    greater than `above` where given (a duration that must be positive: `above=0`)."""
    bounds = [_describe(low, high)] if low is not None or high is not None else []
    if above is not None:
        bounds.append(f"> {above:g}")
    expected = f"expected {what} to be a finite number{' of ' + unit if unit else ''} {' and '.join(bounds)}".rstrip()
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"{expected}; found {type(value).__name__} {value!r}")
    try:
        result = float(value)
    except (ValueError, OverflowError):  # an int too large for a float overflows
        raise ValueError(f"{expected}; found {value!r}") from None
    fine = (
        math.isfinite(result)
        and (low is None or result >= low)
        and (high is None or result <= high)
        and (above is None or result > above)
    )
    if not fine:
        raise ValueError(f"{expected}; found {value!r}")
    return result


def integer(value: object, what: str, *, low: int | None = None, high: int | None = None) -> int:
    """`value` (an int, or its decimal text) as an int within [`low`, `high`]."""
    kind = f"an integer {_describe(low, high)}" if low is not None or high is not None else "an integer"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"expected {what} to be {kind}; found {type(value).__name__} {value!r}")
    text = value.strip() if isinstance(value, str) else None
    # Bounded before conversion: int() of a 100,000-digit string is slow and refused by Python itself.
    if text is not None and (not text.lstrip("+-").isdigit() or len(text) > 40):
        raise ValueError(f"expected {what} to be {kind}; found {value!r}")
    result = int(text) if text is not None else value
    assert isinstance(result, int)
    if (low is not None and result < low) or (high is not None and result > high):
        raise ValueError(f"expected {what} to be {kind}; found {value!r}")
    return result


def choice(value: object, what: str, choices: Sequence[_T]) -> _T:
    """`value`, which must be one of `choices`."""
    for option in choices:
        if value == option:
            return option
    raise ValueError(f"expected {what} to be one of {list(choices)}; found {value!r}")


def text(value: object, what: str, *, spaces: bool = False, longest: int = 1024) -> str:
    """`value`, a non-empty string of at most `longest` printable characters, and without
    whitespace unless `spaces`: a name, a host, an option handed on to another program. No
    control character, so that none can start a new line of a script, a log or a command."""
    kind = f"a non-empty line of at most {longest} printable characters{'' if spaces else ' without spaces'}"
    if not isinstance(value, str):
        raise TypeError(f"expected {what} to be {kind}; found {type(value).__name__} {value!r}")
    fine = 0 < len(value) <= longest and value.isprintable() and (spaces or not any(c.isspace() for c in value))
    if not fine:
        shown = value if len(value) <= 80 else value[:80] + "..."
        raise ValueError(f"expected {what} to be {kind}; found {shown!r}")
    return value


def flag(value: object, what: str) -> bool:
    """A boolean given as 1/0 (also true/false, yes/no, on/off, in any case)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected {what} to be 1 or 0; found {value!r}")


def env(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of environment variable `name`; None where it is unset or empty."""
    raw = (os.environ if environ is None else environ).get(name)
    return raw if raw else None


def env_number(
    name: str,
    default: float,
    *,
    environ: Mapping[str, str] | None = None,
    low: float | None = None,
    high: float | None = None,
    above: float | None = None,
    unit: str = "",
) -> float:
    raw = env(name, environ)
    return default if raw is None else number(raw, name, low=low, high=high, above=above, unit=unit)


def env_integer(
    name: str,
    default: int,
    *,
    environ: Mapping[str, str] | None = None,
    low: int | None = None,
    high: int | None = None,
) -> int:
    raw = env(name, environ)
    return default if raw is None else integer(raw, name, low=low, high=high)


def env_flag(name: str, default: bool = False, *, environ: Mapping[str, str] | None = None) -> bool:
    raw = env(name, environ)
    return default if raw is None else flag(raw, name)


def env_choice(name: str, choices: Sequence[_T], default: _T, *, environ: Mapping[str, str] | None = None) -> _T:
    raw = env(name, environ)
    return default if raw is None else choice(raw, name, choices)
