#!/usr/bin/env bash
# Install what the tests need into .venv (CPU torch pinned) and run the default (non-slow) suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements.txt
.venv/bin/python -m pip install -q --no-deps -e .
exec .venv/bin/python -m pytest -q --durations=20 "$@"
