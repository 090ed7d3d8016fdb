#!/usr/bin/env bash
# The GPU suite, in one command on a machine with a CUDA GPU and a CUDA build of torch: the parity and engine
# tests with their models on the GPU (--device cuda), and tests/cuda. CI has no GPU and runs the same tests on
# the CPU (./scripts/test.sh), where tests/cuda skips, saying why.
#   ./scripts/test_cuda.sh [more pytest arguments]
# The interpreter: $PYTHON, else .venv/bin/python where ./scripts/setup.sh made one, else python3.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -m pytest --device cuda tests/cuda tests/parity/test_models.py tests/parity/test_longrope.py \
  tests/parity/test_sliding_window.py tests/parity/test_quantization.py tests/engine/test_batching.py \
  tests/engine/test_generate.py tests/engine/test_spec_decode.py \
  tests/engine/test_cuda_graphs_change_no_token.py tests/parity/test_pooling_models.py tests/engine/test_pooling.py "$@"
