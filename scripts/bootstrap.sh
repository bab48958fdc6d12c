#!/usr/bin/env bash
# Create or reuse .venv with pinned installs. torch is installed FIRST and pinned exactly
# (torch==2.13.0, a CPU wheel on this machine's disk): an unpinned or ranged torch would make
# pip fetch a multi-GB CUDA build. The project's own range (torch>=2.9) is then satisfied and
# installs nothing more. Re-runs are cheap: a stamp records what was installed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
TORCH_PIN="torch==2.13.0"
python="${PYTHON:-$(command -v python3.11 || command -v python3)}"
stamp=".venv/.commlib-bootstrap"
want="$TORCH_PIN $(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --disable-pip-version-check "$TORCH_PIN" 2>&1 | grep -v "is ignored" || true
  .venv/bin/python -c "import torch, sys; v = torch.__version__.split('+')[0]; sys.exit(v != '2.13.0' and f'expected torch 2.13.0, found {torch.__version__}')"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test,report]" "$TORCH_PIN" 2>&1 | grep -v "is ignored" || true
  .venv/bin/python -c "import commlib, structlog, psutil, pytest, xdist, matplotlib"
  echo "$want" > "$stamp"
fi
