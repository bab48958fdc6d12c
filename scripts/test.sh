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
# One pytest-xdist worker more than the cores: tests spend part of their time waiting out
# deadlines and hangs on purpose, and a third worker on two cores fills that time (the CPU
# was idle a third of a two-worker run; 2% of a three-worker one: docs/testing.md).
exec .venv/bin/python -m pytest -n "$(( $(nproc) + 1 ))" -q "$@"
