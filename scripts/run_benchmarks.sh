#!/usr/bin/env bash
# The runs behind docs/benchmarks.md, in order, one at a time (the machine must be otherwise idle).
# Needs: ./scripts/setup.sh, ../shared/tokenizers/qwen2, and for the llama.cpp peer (builds llama.cpp, ~10 min):
#   CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_AVX_VNNI=ON -DGGML_FMA=ON -DGGML_F16C=ON \
#     -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
#     -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" .venv/bin/pip install '.[llamacpp]' 'llama-cpp-python[server]'
# `transformers serve` also needs: .venv/bin/pip install accelerate
# (AMX off: llama.cpp's AMX Q8_0 matmul segfaults on batches > 1 on these Xeons, llama.cpp issue #20824.)
set -euo pipefail
cd "$(dirname "$0")/.."
TM=.venv/bin/tokenmill
MODEL=${MODEL:-/tmp/tokenmill-qwen2.5-0.5b}
OUT=${OUT:-bench-results}
PROMPT_TOKENS=${PROMPT_TOKENS:-128}
GEN=${GEN:-64}

[ -f "$MODEL/config.json" ] || $TM make-model --arch qwen2 --shape qwen2.5-0.5b --tokenizer ../shared/tokenizers/qwen2 \
  --out "$MODEL" --dtype bfloat16 --seed 0

# 1. single stream, same weights, three backends (bf16; llama.cpp also Q8_0)
$TM bench compare "$MODEL" --backends tokenmill,transformers,llama.cpp --dtype bfloat16 --num-prompts 2 \
  --prompt-tokens "$PROMPT_TOKENS" --max-tokens "$GEN" --threads 2 --output-dir "$OUT"
$TM bench latency "$MODEL" --dtype bfloat16 --prompt-tokens 512 --gen-tokens "$GEN" --repeat 3 --warmup 1 \
  --output-dir "$OUT"

# 2. experiments
$TM bench sweep "$MODEL" --dtype bfloat16 --experiment kv_cache --prompt-tokens 64 --gen-lengths 8,16,32,64 \
  --output-dir "$OUT"
$TM bench sweep "$MODEL" --dtype bfloat16 --experiment prompt_length --prompt-lengths 32,128,512,1024 \
  --gen-tokens 8 --trials 3 --output-dir "$OUT"

# 3. online serving at concurrency 1, 4, 16 (128 in / 128 out) against each server
serve_runs() {  # $1 = url, $2 = model name, $3 = label, $4 = extra flags (optional)
  for c in 1 4 16; do
    n=$(( c == 1 ? 3 : c ))
    $TM bench serve --url "$1" --model "$2" --tokenizer "$MODEL" --workload custom --max-concurrency "$c" \
      --num-prompts "$n" --request-rate inf --input-len 128 --output-len 128 --server-label "$3" --output-dir "$OUT" ${4:-}
  done
}
wait_up() { for _ in $(seq 1 300); do curl -sf "$1" >/dev/null && return 0; sleep 1; done; return 1; }

$TM serve "$MODEL" --dtype bfloat16 --port 8100 --served-model-name qwen --log-level warning & PID=$!
wait_up http://127.0.0.1:8100/health && serve_runs http://127.0.0.1:8100 qwen tokenmill
kill -TERM $PID; wait $PID || true

.venv/bin/transformers serve "$MODEL" --port 8101 --continuous-batching & PID=$!
wait_up http://127.0.0.1:8101/v1/models && serve_runs http://127.0.0.1:8101 "$MODEL" transformers-serve --no-ignore-eos
kill -TERM $PID; wait $PID || true

if .venv/bin/python -c "import llama_cpp.server" 2>/dev/null; then
  GGUF=$(ls -t "$OUT"/compare_*/model.gguf | head -1)
  .venv/bin/python -m llama_cpp.server --model "$GGUF" --n_threads 2 --n_ctx 4096 --port 8102 & PID=$!
  wait_up http://127.0.0.1:8102/v1/models && serve_runs http://127.0.0.1:8102 "$GGUF" llama-cpp-python-server
  kill -TERM $PID; wait $PID || true
fi
