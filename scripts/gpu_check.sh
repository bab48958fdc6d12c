#!/usr/bin/env bash
# The checks that need a CUDA GPU (CI has none), in one run that ends within 5 minutes, so that a
# rerun fits in the lent machine's 15 minutes:
#   1. the workload's kernels: FlexAttention forward+backward on CUDA against an fp64 SDPA
#      reference (scripts/gpu_check_kernels.py --no-bench; GPU_CHECK_ATTENTION_BENCH=1 adds its
#      benchmark); its model check needs nn.LinearCrossEntropyLoss (torch >= 2.13);
#   2. commlib on the GPU (scripts/bench_gpu.py): its CPU cost against raw NCCL, its deadlines,
#      failures and in-job recovery on one GPU, and the settings traps, each in a process of its own;
#   3. the reference trainer on CUDA (1 rank, nccl) for a few steps: it needs
#      nn.LinearCrossEntropyLoss (torch >= 2.13).
# What the machine's torch cannot run is said NOT RUN, and the last line then never says that
# everything passed. Uses whatever python/torch the machine has (PYTHON=...). The lent machine
# lacks structlog, orjson and msgspec and reaches no package index: scripts/gpu_wheels.sh (run
# here) puts their wheels in .whl/, and the device run carries it:
#   run(command="scripts/gpu_check.sh", carry=[".whl"], timeout_s=330)
set -uo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/commlib-site .whl/*.whl \
    || { echo "gpu_check: could not install the wheels in .whl/"; exit 1; }
  export PYTHONPATH="/tmp/commlib-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$py" -c "import structlog, orjson, msgspec" || { echo "gpu_check: structlog, orjson and msgspec are needed (scripts/gpu_wheels.sh)"; exit 1; }
has_fused_loss=$("$py" -c "import torch; print(int(hasattr(torch.nn, 'LinearCrossEntropyLoss')))")
failed=() not_run=()
echo "== kernels"
bench=--no-bench
[ "${GPU_CHECK_ATTENTION_BENCH:-0}" = 1 ] && bench=
timeout 90 "$py" scripts/gpu_check_kernels.py $bench || failed+=(kernels)
[ "$has_fused_loss" = 1 ] || not_run+=("the model with nn.LinearCrossEntropyLoss")
echo "== commlib on the GPU"
timeout 180 "$py" scripts/bench_gpu.py --rounds 3 || failed+=(commlib)
echo "== trainer on CUDA"
if [ "$has_fused_loss" = 1 ]; then
  out="$(mktemp -d)"
  timeout 50 "$py" -m torch.distributed.run --standalone --nproc-per-node 1 -m chaos.entry -m chaos.workload.train \
    --device cuda --backend nccl --steps 5 --ckpt-every 5 --ckpt-dir "$out/ckpt" --log-dir "$out/logs" \
    && "$py" -c "import sys, pathlib; from chaos.comparison import read_steps; \
steps = read_steps(pathlib.Path(sys.argv[1])); print('losses', [r.losses for r in steps.records[(0, 0)]])" \
    "$out" || failed+=(trainer)
else
  echo "NOT RUN: the trainer needs torch.nn.LinearCrossEntropyLoss (torch >= 2.13); found torch $("$py" -c 'import torch; print(torch.__version__)')"
  not_run+=("the trainer on CUDA")
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_check: FAILED: ${failed[*]}${not_run:+; NOT RUN: ${not_run[*]}}"
  exit 1
elif [ ${#not_run[@]} -gt 0 ]; then
  echo "gpu_check: what ran passed; NOT RUN: $(IFS=';'; echo "${not_run[*]}")"
else
  echo "gpu_check: everything passed"
fi
