#!/usr/bin/env bash
# Create .venv and install tokenmill with its dev tools. Idempotent; safe to run on a fresh machine.
# torch: CPU wheel by default (pinned so pip does not pull several GB of CUDA packages on CPU-only boxes).
# GPU users: install their CUDA torch first (or set TOKENMILL_TORCH, e.g. "torch --index-url <cuda index>").
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  # shellcheck disable=SC2086
  .venv/bin/python -m pip install --quiet ${TOKENMILL_TORCH:-torch==2.13.0}
fi
.venv/bin/python -m pip install --quiet -e ".[dev]"
# Build tokenmill's CPU kernels for this CPU now (cached; without a compiler this says so and torch runs instead)
.venv/bin/tokenmill env
