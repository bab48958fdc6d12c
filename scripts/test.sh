#!/usr/bin/env bash
# The test suite, as CI runs it: the Debian packages the tests use (scripts/system_packages.sh,
# before any test starts), bootstrap .venv, the static checks (ruff's lint and format check,
# mypy; configured in pyproject.toml, any finding fails the run), then pytest over every test,
# in parallel.
#
#   ./scripts/test.sh [PYTEST ARGS]          every test: what CI runs (.ci/run)
#   ./scripts/test.sh --fast [PYTEST ARGS]   the fast lane, before each commit: the same static
#                                            checks, then the tests marked `contract` (commlib's
#                                            contracts, ranks as threads), in under a minute
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
fast=false
if [ "${1:-}" = "--fast" ]; then
  fast=true
  shift
fi
# The contract tests run no tool of those packages.
$fast || "$root/scripts/system_packages.sh" test
"$root/scripts/bootstrap.sh"
cd "$root"
.venv/bin/ruff check --quiet
.venv/bin/ruff format --check --quiet
.venv/bin/mypy
if $fast; then
  # In this process: a contract test starts no process, and most of its time is waits (deadlines
  # expiring on purpose), which workers would overlap, but each worker's start (torch's import,
  # the collection) costs more than that saves on two cores. A test past 60 s is a hang: it
  # fails with every thread's stack (pytest-timeout) instead of holding the lane.
  exec .venv/bin/python -m pytest -m contract --timeout 60 -q "$@"
fi
# Two pytest-xdist workers more than the cores: tests spend part of their time waiting out
# deadlines, hangs and Slurm on purpose, and the extra workers fill that time (with one more
# worker than the cores, other work at the lowest priority still got a fifth of the CPU; with
# two more, almost none). Tests are handed out one at a time (`--maxschedchunk 1`) in the order
# they are collected, heaviest first (tests/conftest.py's HEAVY_FIRST): docs/testing.md.
#
# This machine at times stalls every process for about 5 s (docs/testing.md, "Flaky tests"), long
# enough to fail a bound of a few seconds. So each pytest process logs the stalls it sees and the
# tests that failed (tests/conftest.py); when every failed test ran through a stall, those tests
# run once more, said here, and their second run is the verdict. A failure with no stall beside it
# stands.
stall_log="$(mktemp)"
trap 'rm -f "$stall_log"' EXIT
workers=(-n "$(( $(nproc) + 2 ))" --maxschedchunk 1 -q)
status=0
COMMLIB_TEST_STALL_LOG="$stall_log" .venv/bin/python -m pytest "${workers[@]}" "$@" || status=$?
if [ "$status" -eq 1 ]; then
  mapfile -t stalled < <(.venv/bin/python scripts/stalled_failures.py "$stall_log")
  if [ "${#stalled[@]}" -gt 0 ]; then
    echo "test.sh: every failed test (${#stalled[@]}) ran while this machine stalled; running them once more:"
    printf '  %s\n' "${stalled[@]}"
    status=0
    .venv/bin/python -m pytest "${workers[@]}" "${stalled[@]}" || status=$?
  fi
fi
exit "$status"
