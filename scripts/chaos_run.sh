#!/usr/bin/env bash
# The main job: a chaos run on the reference trainer (2 local CPU ranks under torchrun, a rank
# killed mid-run and a collective delayed past its deadline), verified bitwise against a
# fault-free run. Extra arguments go to `python -m chaos run` (see --help).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/bootstrap.sh"
cd "$root"
exec .venv/bin/python -m chaos run "$@"
