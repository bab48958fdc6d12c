#!/usr/bin/env bash
# Wheels of what the lent GPU machine lacks (structlog, orjson, msgspec) for its Python 3.12 on x86-64,
# into .whl/ (git-ignored), for scripts/gpu_check.sh to install there. Run here, where pip reaches PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "structlog==$(.venv/bin/python -c 'import structlog; print(structlog.__version__)')" \
  "orjson==$(.venv/bin/python -c 'import orjson; print(orjson.__version__)')" \
  "msgspec==$(.venv/bin/python -c 'import msgspec; print(msgspec.__version__)')"
ls .whl
