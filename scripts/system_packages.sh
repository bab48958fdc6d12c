#!/usr/bin/env bash
# The Debian packages a command of this project needs, installed with apt-get (root) when one of
# their tools is missing; a few `command -v` and nothing more when all are there (CI runs this on
# every submission).
#
#   scripts/system_packages.sh run     # python -m chaos run's faults: network namespaces (ip),
#                                      # the disk_full tmpfs (mount), namespaces (nsenter, unshare)
#   scripts/system_packages.sh slurm   # the local Slurm cluster (chaos.slurm.cluster): run's, munge, Slurm
#   scripts/system_packages.sh test    # everything the test suite uses (slurm's)
#
# scripts/test.sh, scripts/chaos_run.sh and scripts/slurm_cluster.sh call it before they start
# anything, so no test and no run installs a package itself: a test never waits on, or races,
# another that is installing. Without root, the missing tools are named and it exits 1.
set -euo pipefail
need="${1:?usage: system_packages.sh run|slurm|test}"
# tool:package, for each tool a command of the project runs.
run_tools=(ip:iproute2 mount:mount umount:mount nsenter:util-linux unshare:util-linux flock:util-linux)
slurm_tools=(munged:munge slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client srun:slurm-client
             scontrol:slurm-client scancel:slurm-client sinfo:slurm-client squeue:slurm-client)
case "$need" in
  run) wanted=("${run_tools[@]}") ;;
  slurm | test) wanted=("${run_tools[@]}" "${slurm_tools[@]}") ;;
  *) echo "system_packages.sh: expected run, slurm or test; found '$need'" >&2; exit 2 ;;
esac

missing() {
  local pair
  for pair in "${wanted[@]}"; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || echo "${pair#*:}"
  done | sort -u
}

packages=$(missing)
[ -z "$packages" ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "system_packages.sh: expected root to install the Debian packages $(echo $packages) ($need); found uid $(id -u)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
# Two of these at once (two checkouts' test runs) take turns: the second finds the first's install.
lock=/var/lock/commlib-system-packages.lock
if command -v flock >/dev/null 2>&1; then
  exec 9>"$lock"
  flock 9
  packages=$(missing)
  [ -z "$packages" ] && exit 0
fi
echo "system_packages.sh: installing $(echo $packages) ($need)" >&2
# A new machine has no package lists: install fails on every package until they are fetched.
apt-get update -qq
# shellcheck disable=SC2086  # one word per package
apt-get install -y -qq --no-install-recommends $packages >/dev/null
left=$(missing)
if [ -n "$left" ]; then
  echo "system_packages.sh: expected the tools of $(echo $packages) after installing them; still missing those of $(echo $left)" >&2
  exit 1
fi
