#!/usr/bin/env bash
# Several machines: run this same command on every node (torchrun's c10d rendezvous).
#   NNODES=2 NPROC=16 MASTER=node0.example:29500 JOB_ID=gpt100b bash launch/multinode.sh --config table5-zero-100B
# Rank order is TP-fastest (docs/design.md §2): a TP group of <= NPROC ranks stays inside one node, DP groups
# stride across nodes. The checkpoint directory (--save) must be on a filesystem every node shares.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${NNODES:?set NNODES to the number of machines}"
: "${MASTER:?set MASTER=host:port of the rendezvous (any one node)}"
PYTHON="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# SIGTERM or Ctrl-C: every rank saves a checkpoint and the command exits 0 (a second Ctrl-C stops at
# once); a failed job exits with the ranks' code (docs/launching.md). launch/torchrun.py is torchrun.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-120}"
# Nodes whose hostname does not resolve to the interface the job should use (secondary NICs):
#   LOCAL_ADDR=<this node's IP>  the address this node advertises to the others (torchrun --local-addr)
#   RDZV_IS_HOST=1               on the node MASTER names: it hosts the rendezvous store
RDZV_CONF=()
if [ "${RDZV_IS_HOST:-0}" = 1 ]; then RDZV_CONF+=(--rdzv-conf is_host=true); fi
if [ -n "${LOCAL_ADDR:-}" ]; then RDZV_CONF+=(--local-addr "$LOCAL_ADDR"); fi
exec "$PYTHON" launch/torchrun.py --nnodes "$NNODES" --nproc-per-node "${NPROC:-16}" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER" --rdzv-id "${JOB_ID:-hybrid-gpt}" \
    "${RDZV_CONF[@]}" --max-restarts 0 launch/pretrain_gpt.py "$@"
