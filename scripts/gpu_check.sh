#!/usr/bin/env bash
# For a machine with a CUDA GPU (not used by CI): the checks that need one, in under 5 minutes.
# 1. FlexAttention forward+backward on CUDA against an SDPA reference, the fused loss where the
#    running torch has nn.LinearCrossEntropyLoss, and the attention benchmark on the GPU.
# 2. The reference trainer on CUDA (1 rank, nccl, FlexAttention's own backward) for a few
#    steps, only where nn.LinearCrossEntropyLoss exists (torch >= 2.13); otherwise it says so.
# Uses whatever python/torch the machine has (PYTHON=...); it does not bootstrap .venv.
set -uo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "== kernels"
timeout 240 "$py" scripts/gpu_check_kernels.py
echo "== trainer on CUDA"
if "$py" -c "import torch, sys; sys.exit(not (torch.cuda.is_available() and hasattr(torch.nn, 'LinearCrossEntropyLoss')))"; then
  out="$(mktemp -d)"
  timeout 240 "$py" -m torch.distributed.run --standalone --nproc-per-node 1 -m chaos.workload.train \
    --device cuda --backend nccl --steps 5 --ckpt-every 5 --ckpt-dir "$out/ckpt" --results "$out/results.json" \
    --log-dir "$out/logs" && "$py" -c "import json,sys; r=json.load(open(sys.argv[1])); print('losses', r['losses'])" "$out/results.json"
else
  echo "SKIPPED: needs CUDA and torch.nn.LinearCrossEntropyLoss (torch >= 2.13); found torch $("$py" -c 'import torch; print(torch.__version__)')"
fi
