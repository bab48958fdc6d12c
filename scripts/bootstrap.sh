#!/usr/bin/env bash
# Create or reuse .venv with pinned installs. torch is installed FIRST and pinned exactly
# (torch==2.13.0, a CPU wheel on this machine's disk): an unpinned or ranged torch would make
# pip fetch a multi-GB CUDA build. The project's own range (torch>=2.9) is then satisfied and
# installs nothing more. Re-runs are cheap: a stamp records what was installed.
#
# numpy goes in with torch, before anything imports torch: torch does not require numpy, but
# imports it at start ("Failed to initialize NumPy" when it is missing) and needs it for
# Tensor.numpy() (chaos.probe's digests) and, from 2.14, the object collectives.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
TORCH_PIN="torch==2.13.0"
python="${PYTHON:-$(command -v python3.11 || command -v python3)}"
stamp=".venv/.commlib-bootstrap"
want="$TORCH_PIN $(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
  "${pip[@]}" "$TORCH_PIN" numpy 2>&1 | grep -v "is ignored" || true
  .venv/bin/python -c "import numpy, torch, sys; v = torch.__version__.split('+')[0]; torch.from_numpy(numpy.zeros(1)); sys.exit(v != '2.13.0' and f'expected torch 2.13.0, found {torch.__version__}')"
  # The pin again, so that resolving the project's dependencies can never replace torch.
  "${pip[@]}" -e ".[test,report,replicas]" "$TORCH_PIN" 2>&1 | grep -v "is ignored" || true
  .venv/bin/python -c "import sys, numpy, torch, commlib, structlog, msgspec, psutil, pytest, xdist, matplotlib, torchft; v = torch.__version__.split('+')[0]; sys.exit(v != '2.13.0' and f'expected torch 2.13.0 after installing the project, found {torch.__version__}')"
  echo "$want" > "$stamp"
fi
# This machine's environment sets PYTHONDONTWRITEBYTECODE=1, so no process leaves .pyc files for
# the project's own modules, and every rank, harness and test process would compile the ones it
# imports again (all 102 cost 0.4 s of CPU; a rank imports most of them). Written here, once per
# change: Python checks each against its source's mtime.
.venv/bin/python -m compileall -q commlib chaos fsdp_overlap
