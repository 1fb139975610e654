#!/usr/bin/env bash
# Install what the tests need into .venv (CPU torch pinned), build the test-only transformers and
# megatron-core environments (tests/models/hf_env.py, tests/checkpoint/megatron_env.py, cached under
# data-cache/), and run the default (non-slow) suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements.txt
.venv/bin/python -m pip install -q --no-deps -e .
.venv/bin/python -m tests.models.hf_env
.venv/bin/python -m tests.checkpoint.megatron_env
exec .venv/bin/python -m pytest -q --durations=20 "$@"
