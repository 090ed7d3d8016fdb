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
# Bytecode for the source tree, as pip writes it for an installed wheel: an editable install has none, and where
# PYTHONDONTWRITEBYTECODE is set every start compiled ~120 modules again (~0.3 s of `tokenmill serve`'s start)
.venv/bin/python -m compileall -q src >/dev/null
# The web page's browser tests (tests/server/test_web_ui.py) drive Debian's Chromium; they skip without it.
# Installed where this runs as root with apt; anything else (no root, no apt, no network) leaves it out, never failing.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null 2>&1 \
    || echo "setup: could not install chromium with apt-get; the browser tests will skip" >&2
fi
# Build tokenmill's CPU kernels for this CPU now (cached; without a compiler this says so and torch runs instead)
.venv/bin/tokenmill env
