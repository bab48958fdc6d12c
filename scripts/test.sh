#!/usr/bin/env bash
# The test suite, as CI runs it: the Debian packages the tests use (scripts/system_packages.sh,
# before any test starts), bootstrap .venv, then pytest over every test, in parallel.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/system_packages.sh" test
"$root/scripts/bootstrap.sh"
cd "$root"
exec .venv/bin/python -m pytest -n auto -q "$@"
