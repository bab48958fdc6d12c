#!/usr/bin/env bash
# The test suite, as CI runs it: the Debian packages the tests use (scripts/system_packages.sh,
# before any test starts), bootstrap .venv, the static checks (ruff's lint and format check,
# mypy; configured in pyproject.toml, any finding fails the run), then pytest over every test,
# in parallel.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/system_packages.sh" test
"$root/scripts/bootstrap.sh"
cd "$root"
.venv/bin/ruff check --quiet
.venv/bin/ruff format --check --quiet
.venv/bin/mypy
# Two pytest-xdist workers more than the cores: tests spend part of their time waiting out
# deadlines, hangs and Slurm on purpose, and the extra workers fill that time (with one more
# worker than the cores, other work at the lowest priority still got a fifth of the CPU; with
# two more, almost none). Tests are handed out one at a time (`--maxschedchunk 1`) in the order
# they are collected, heaviest first (tests/conftest.py's HEAVY_FIRST): docs/testing.md.
exec .venv/bin/python -m pytest -n "$(( $(nproc) + 2 ))" --maxschedchunk 1 -q "$@"
