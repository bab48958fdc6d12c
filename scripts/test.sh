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
exec .venv/bin/python -m pytest -n auto -q "$@"
