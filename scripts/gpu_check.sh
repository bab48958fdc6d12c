#!/usr/bin/env bash
# The checks that need a CUDA GPU (CI has none), in one run that ends within 8 minutes:
#   1. the workload's kernels: FlexAttention forward+backward on CUDA against an fp64 SDPA
#      reference, the fused loss where torch has nn.LinearCrossEntropyLoss
#      (scripts/gpu_check_kernels.py --no-bench; GPU_CHECK_ATTENTION_BENCH=1 adds its benchmark);
#   2. commlib on the GPU (scripts/bench_gpu.py): the CPU cost against raw NCCL, the deadline
#      counted from the device start, a hang detected within 1.5 s (twenty times, and while the
#      host waits in synchronize() and .item()), in-job recovery and its rebuild time, a barrier
#      bounded by its deadline, a deadline set later that never reaches NCCL raw, ops captured
#      in a CUDA graph, a hang whose failure line stalls (the engine aborted all the same);
#   3. the reference trainer on CUDA (1 rank, nccl) for a few steps, where torch has
#      nn.LinearCrossEntropyLoss (>= 2.13); otherwise it says so.
# Uses whatever python/torch the machine has (PYTHON=...); it does not bootstrap .venv. The lent
# GPU machine lacks structlog and orjson and reaches no package index: scripts/gpu_wheels.sh
# (run here, on a machine with pip) puts their wheels in .whl/, and the device run carries it:
#   run(command="scripts/gpu_check.sh", carry=[".whl"], timeout_s=500)
# Its three parts are bounded at 150 + 270 + 50 s, 7 min 50 s in all.
set -uo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/commlib-site .whl/*.whl \
    || { echo "gpu_check: could not install the wheels in .whl/"; exit 1; }
  export PYTHONPATH="/tmp/commlib-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$py" -c "import structlog, orjson" || { echo "gpu_check: structlog and orjson are needed (scripts/gpu_wheels.sh)"; exit 1; }
status=0
echo "== kernels"
bench=--no-bench
[ "${GPU_CHECK_ATTENTION_BENCH:-0}" = 1 ] && bench=
timeout 150 "$py" scripts/gpu_check_kernels.py $bench || status=1
echo "== commlib on the GPU"
timeout 270 "$py" scripts/bench_gpu.py --rounds 5 || status=1
echo "== trainer on CUDA"
if "$py" -c "import torch, sys; sys.exit(not (torch.cuda.is_available() and hasattr(torch.nn, 'LinearCrossEntropyLoss')))"; then
  out="$(mktemp -d)"
  timeout 50 "$py" -m torch.distributed.run --standalone --nproc-per-node 1 -m chaos.entry -m chaos.workload.train \
    --device cuda --backend nccl --steps 5 --ckpt-every 5 --ckpt-dir "$out/ckpt" --log-dir "$out/logs" \
    && "$py" -c "import sys, pathlib; from chaos.comparison import read_steps; \
steps = read_steps(pathlib.Path(sys.argv[1])); print('losses', [r.losses for r in steps.records[(0, 0)]])" \
    "$out" || status=1
else
  echo "NOT RUN: the trainer needs CUDA and torch.nn.LinearCrossEntropyLoss (torch >= 2.13); found torch $("$py" -c 'import torch; print(torch.__version__)')"
fi
echo "gpu_check: $([ $status = 0 ] && echo 'everything passed' || echo 'something FAILED')"
exit $status
