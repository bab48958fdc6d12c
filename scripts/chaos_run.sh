#!/usr/bin/env bash
# The main job: a chaos run on the reference trainer (2 local CPU ranks under torchrun, a rank
# killed mid-run and a collective delayed past its deadline), verified bitwise against a
# fault-free run. Extra arguments go to `python -m chaos run` (see --help).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# What the network and disk faults run (ip, mount, ...). Without root it can only say what is
# missing: those faults need root anyway, and the default job needs none of it.
"$root/scripts/system_packages.sh" run || true
"$root/scripts/bootstrap.sh"
cd "$root"
exec .venv/bin/python -m chaos run "$@"
