#!/usr/bin/env bash
# README command 1: a real GPT pretraining run on this CPU machine, a few minutes.
# 4 CPU ranks = tensor parallel 2 x data parallel 2, ZeRO stage 2, bf16 with fp32 master weights, on
# the embedded default corpus (built and tokenized on first use, cached in data-cache/).
# Extra arguments are passed on, e.g.  bash launch/main_job.sh --train-iters 50
# Another preset of pretrain/presets/ writing checkpoints/<name> and runs/<name>, e.g. the Llama-style
# twin:  bash launch/main_job.sh --config tiny-llama-cpu
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements.txt
.venv/bin/python -m pip install -q --no-deps -e .
export OMP_NUM_THREADS=1
# SIGTERM or Ctrl-C: every rank saves a checkpoint and the command exits 0 (a second Ctrl-C stops at
# once); a failed job exits with the ranks' code (docs/launching.md). launch/torchrun.py is torchrun.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-120}"
# Run again, the main job starts a new run over the previous one's checkpoints (--overwrite: they
# are deleted when the new run saves its first), unless the arguments say --load / --save / --overwrite.
ARGS=("$@")
CHOSEN=""
NAME=tiny-cpu
PREV=""
for arg in "$@"; do
    case "$arg" in --load|--load=*|--save|--save=*|--overwrite|--no-overwrite) CHOSEN=1 ;; esac
    case "$arg" in --config=*) NAME="${arg#--config=}" ;; esac
    if [ "$PREV" = "--config" ]; then NAME="$arg"; fi
    PREV="$arg"
done
if [ -z "$CHOSEN" ] && [ -f "checkpoints/$NAME/latest" ]; then
    echo "note: checkpoints/$NAME holds the previous main job's run; this one starts anew and" \
         "replaces it (--overwrite). To continue it instead:" \
         "bash launch/main_job.sh --config $NAME --load checkpoints/$NAME --train-iters 400 --use-checkpoint-opt_param-scheduler"
    ARGS+=(--overwrite)
fi
source launch/signals.sh
run_forwarding_signals .venv/bin/python launch/torchrun.py --standalone --nnodes 1 --nproc-per-node 4 \
    launch/pretrain_gpt.py --config "$NAME" ${ARGS[@]+"${ARGS[@]}"}
cat <<MSG

Main job finished.
  TensorBoard logs : runs/$NAME (one sub-directory per run)   view with: .venv/bin/tensorboard --logdir runs/$NAME
  Checkpoint       : checkpoints/$NAME/$(cat checkpoints/$NAME/latest 2>/dev/null || echo '<none>')
                     resume/continue: bash launch/main_job.sh --config $NAME --load checkpoints/$NAME --train-iters 400 --use-checkpoint-opt_param-scheduler
  Layout check     : .venv/bin/python launch/pretrain_gpt.py --config table5-zero-100B --dry-run
MSG
# Sample from the model just trained: one process, a fixed prompt, seeded top-k (a few seconds).
PROMPT='def __init__(self'
echo
echo "Sample from the model:  (tools/generate.py --prompt '$PROMPT' --max-new-tokens 48 --temperature 0.7 --top-k 20 --seed 1234)"
echo "----"
if [ -f checkpoints/$NAME/latest ]; then
    printf '%s' "$PROMPT"
    .venv/bin/python tools/generate.py --load checkpoints/$NAME --prompt "$PROMPT" \
        --max-new-tokens 48 --temperature 0.7 --top-k 20 --seed 1234
else
    echo "(no checkpoint in checkpoints/$NAME - a --save elsewhere? - so no sample)"
fi
echo "----"
