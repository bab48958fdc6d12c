#!/usr/bin/env bash
# A local Slurm cluster on this machine (root; chaos.slurm.cluster): N nodes in namespaces,
# for trying `python -m chaos sbatch` here. `up` installs munge and Slurm with apt-get when missing
# (scripts/system_packages.sh slurm).
#
#   scripts/slurm_cluster.sh up [--nodes 3] [--dir /tmp/chaos-slurm]
#   scripts/slurm_cluster.sh run [--dir ...] -- python -m chaos sbatch --nnodes 2 --fault preempt:step=6
#   scripts/slurm_cluster.sh status|down [--dir ...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
command="${1:?usage: slurm_cluster.sh up|down|status|run [--dir DIR] [--nodes N] [-- COMMAND]}"
shift
case " $* " in *" --dir "*) ;; *) set -- --dir /tmp/chaos-slurm "$@" ;; esac
if [ "$command" = up ]; then
  "$root/scripts/system_packages.sh" slurm
fi
cd "$root"
exec .venv/bin/python -m chaos.slurm.cluster "$command" "$@"
