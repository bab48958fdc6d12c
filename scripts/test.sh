#!/usr/bin/env bash
# The test suite, as CI runs it: bootstrap .venv, then pytest over every test, in parallel.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/bootstrap.sh"
cd "$root"
exec .venv/bin/python -m pytest -n auto -q "$@"
