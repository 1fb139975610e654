#!/usr/bin/env bash
# One machine: torchrun --standalone (rendezvous on localhost), NPROC ranks (default 4).
#   bash launch/local.sh --config tiny-cpu [more Megatron-style flags]
#   NPROC=8 bash launch/local.sh --config my.yaml --tensor-model-parallel-size 4
# On GPUs set NPROC to the GPU count; on CPU every rank runs one intra-op thread (2 cores here).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# SIGTERM or Ctrl-C: every rank saves a checkpoint and the command exits 0 (a second Ctrl-C stops at
# once); a failed job exits with the ranks' code (docs/launching.md). launch/torchrun.py is torchrun.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-120}"
exec "$PYTHON" launch/torchrun.py --standalone --nnodes 1 --nproc-per-node "${NPROC:-4}" \
    launch/pretrain_gpt.py "$@"
