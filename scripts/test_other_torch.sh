#!/usr/bin/env bash
# Run commlib's tests (tests/commlib, tests/observe) on another torch release, for real.
#
#   scripts/test_other_torch.sh VERSION [pytest args]     e.g. scripts/test_other_torch.sh 2.14.1
#
# Not part of CI: other torch releases exist on the package index only as CUDA builds, and
# even a CPU-only `import torch` of those needs the nvidia-* wheels they pin (libcudnn,
# libcublas, ...): several GB to download and minutes to install. The venv is
# .venv-torch<VERSION>, never the project's .venv. This machine's pip configuration caps torch
# at 2.14.1 through a constraints file; this script's own pip commands bypass it
# (PIP_CONSTRAINT=/dev/null), so 2.15 installs too.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
version="${1:?usage: scripts/test_other_torch.sh VERSION [pytest args]}"
shift
venv=".venv-torch$version"
python="${PYTHON:-$(command -v python3.11 || command -v python3)}"
export PIP_CONSTRAINT=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet)
# torch itself without its dependency resolution, then exactly the requirements it pins
# (nvidia-*, triton, sympy, ...) for this platform, so nothing else can drag in another torch.
"${pip[@]}" --no-deps "torch==$version" packaging
mapfile -t pinned < <("$venv/bin/python" - <<'PY'
from importlib.metadata import requires
from packaging.requirements import Requirement
for line in requires("torch") or []:
    req = Requirement(line)
    if req.marker is None or req.marker.evaluate({"extra": ""}):
        print(str(req).split(";")[0].strip())
PY
)
# numpy is no requirement of torch's, but torch.distributed's object collectives need it from 2.14 on.
"${pip[@]}" "${pinned[@]}" numpy
"${pip[@]}" -e ".[test]" "torch==$version"
"$venv/bin/python" -c "import sys, torch; v = torch.__version__.split('+')[0]; sys.exit(v != '$version' and f'expected torch $version, found {torch.__version__}')"
exec "$venv/bin/python" -m pytest -q -p no:xdist tests/commlib tests/observe "$@"
