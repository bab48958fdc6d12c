"""The bounds of what a user gives a chaos run, and the command line's side of the rules.

Every number, integer, choice and name of a fault plan (`chaos.plan`), of ``python -m chaos``
and its trainer (`chaos.workload.train`), and of `chaos.run` is checked with the one rule
for its kind in `commlib.settings`; this module owns the bounds those rules are given where
more than one reader shares them, and `option`, which makes a rule an argparse type. It
also owns the check of a directory a run is to write in (`directory_problem`).

The bounds are far past any real run and close enough that no value inside them can
overflow a sleep, a deadline or a float: a week of seconds, a million firings or restarts,
and indices (steps, sequence numbers, seeds, ranks) up to 10^15, which a float holds exactly.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

LONGEST_S = 7 * 86400.0  # any duration, timeout or delay of a run, in seconds
MOST_FIRINGS = 10**6  # a fault's count, and the restarts of a job
LARGEST_INDEX = 10**15  # a step, a sequence number, a seed, a rank
MOST_PER_NODE = 1024  # processes on one node
MOST_NODES = 10**4


def option(rule: Callable[..., Any], name: str, **bounds: Any) -> Callable[[str], Any]:
    """An argparse type that checks an option's text with `rule` (one of `commlib.settings`'),
    so that argparse refuses it as ``argument NAME: expected NAME to be ...; found ...``."""

    def parse(text: str) -> Any:
        try:
            return rule(text, name, **bounds)
        except (ValueError, TypeError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = name  # what argparse calls the type in its own messages
    return parse


def directory_problem(path: str | os.PathLike[str], what: str, *, empty: bool) -> str | None:
    """Why `path` cannot be the directory a run writes in, or None: it must be a directory (an
    empty one where `empty`), or one this process can create (tried, then removed again, so
    that a special file system, a missing permission or a file on the way is said now)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        return f"{what} {path}: expected {'a new or empty' if empty else 'a'} directory; found a file"
    if path.is_dir():
        if not os.access(path, os.W_OK | os.X_OK):
            return f"{what} {path}: expected a directory this process can write in; found it not writable"
        if empty and any(path.iterdir()):
            return f"{what} {path} is not empty; expected a new or empty directory"
        return None
    missing = [p for p in [path.absolute(), *path.absolute().parents] if not p.exists()]
    if not missing[-1].parent.is_dir():
        return f"{what} {path}: expected a directory to create it in; found {missing[-1].parent}, a file"
    try:
        path.mkdir(parents=True)
    except FileExistsError:
        # Made meanwhile by another process: the harness of another node of the same run, which
        # checks the same directory at the same moment. Judged as the directory it now is.
        return directory_problem(path, what, empty=empty)
    except OSError as exc:
        return f"{what} {path}: expected a directory this process can create; could not ({exc.strerror})"
    for made in missing:  # deepest first: each is empty once the one below it is gone
        try:
            made.rmdir()
        except OSError:  # another node's harness has begun writing in it: it is the run's now
            break
    return None
