#!/usr/bin/env bash
# The runs behind docs/benchmarks.md, in order, one at a time (the machine must be otherwise idle).
# Needs: ./scripts/setup.sh, ../shared/tokenizers/qwen2, and for the llama.cpp peers:
#  - llama-cpp-python (bench compare's llama.cpp backend), built with AMX off:
#      CMAKE_ARGS="$LLAMA_FLAGS" .venv/bin/pip install -e '.[llamacpp]'  (-e: a plain install would replace the editable one)
#  - llama-server and llama-bench, from the llama.cpp source vendored in the llama-cpp-python sdist:
#      .venv/bin/pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/llsrc
#      tar xzf /tmp/llsrc/llama_cpp_python-0.3.36.tar.gz -C /tmp/llsrc
#      cmake -S /tmp/llsrc/llama_cpp_python-0.3.36/vendor/llama.cpp -B /tmp/llbuild -DCMAKE_BUILD_TYPE=Release \
#        $LLAMA_FLAGS -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF && cmake --build /tmp/llbuild --target llama-server llama-bench -j2
#    with LLAMA_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_AVX_VNNI=ON -DGGML_FMA=ON -DGGML_F16C=ON
#      -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
#      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
#    (AMX off: llama.cpp's AMX Q8_0 matmul segfaults on batches > 1 on these Xeons, llama.cpp issue #20824.
#    -DGGML_AVX_VNNI=ON only where /proc/cpuinfo lists avx_vnni: a Zen 4 has AVX512_VNNI but not the VEX form, and a
#    build with it dies of an illegal instruction on Q8_0/Q4_0.)
#    The AVX2 code on an AVX-512 machine (docs/archive/benchmark-log-2026-11.md, fifth Zen 4 sitting): a second build into another
#    directory (LLAMA_BIN) with LLAMA_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON
#      -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX512_VNNI=OFF
#      -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF", and tokenmill under
#      TOKENMILL_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2.
#    The AVX-VNNI code (Intel client cores; docs/archive/benchmark-log-2026-11.md, fourth Xeon sitting): the same with -DGGML_AVX_VNNI=ON,
#      and tokenmill under TOKENMILL_ISA=avxvnni ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2_VNNI.
#  - `transformers serve` needs: .venv/bin/pip install accelerate
# ONLY=kernels runs section 4 alone (issue 14's sitting: every format against llama.cpp, one stream and 16, and tg after
# a 2048-token prompt).
set -euo pipefail
cd "$(dirname "$0")/.."
ONLY=${ONLY:-all}
TM=.venv/bin/tokenmill
MODEL=${MODEL:-/tmp/tokenmill-qwen2.5-0.5b}
OUT=${OUT:-bench-results}
LLAMA_BIN=${LLAMA_BIN:-/tmp/llbuild/bin}

[ -f "$MODEL/config.json" ] || $TM make-model --arch qwen2 --shape qwen2.5-0.5b --tokenizer ../shared/tokenizers/qwen2 \
  --out "$MODEL" --dtype bfloat16 --seed 0
wait_up() { for _ in $(seq 1 300); do curl -sf "$1" >/dev/null && return 0; sleep 1; done; return 1; }

if [ "$ONLY" = all ]; then
# 1. single stream: pp512 / tg128 of every backend and weight format, side by side in one run
$TM bench compare "$MODEL" --backends tokenmill,tokenmill:int8,tokenmill:int4,transformers,llama.cpp,llama.cpp:q8_0 \
  --dtype bfloat16 --num-prompts 2 --prompt-tokens 512 --max-tokens 128 --threads 2 --output-dir "$OUT"
$TM bench latency "$MODEL" --dtype bfloat16 --prompt-tokens 512 --gen-tokens 64 --repeat 2 --warmup 1 --threads 2 \
  --output-dir "$OUT"

# 2. online serving, 128 in / 128 out, at concurrency 1, 4, 16: tokenmill beside llama-server -np 16
GGUF=$(ls -t "$OUT"/compare_*/model-bf16.gguf | head -1)
"$LLAMA_BIN/llama-server" -m "$GGUF" -t 2 -tb 2 -np 16 -c 8192 --port 8102 --host 127.0.0.1 & LPID=$!
wait_up http://127.0.0.1:8102/health
for c in 1 4 16; do
  n=$(( c == 1 ? 3 : c ))
  $TM serve "$MODEL" --dtype bfloat16 --port 8100 --served-model-name qwen --log-level warning & PID=$!
  wait_up http://127.0.0.1:8100/health
  $TM bench serve --url http://127.0.0.1:8100 --model qwen --tokenizer "$MODEL" --workload custom --max-concurrency "$c" \
    --num-prompts "$n" --request-rate inf --input-len 128 --output-len 128 --output-dir "$OUT" \
    --server-peers "llama-server-np16=http://127.0.0.1:8102"
  kill -TERM $PID; wait $PID || true
done
kill -TERM $LPID; wait $LPID || true

.venv/bin/transformers serve "$MODEL" --port 8101 --continuous-batching & PID=$!
wait_up http://127.0.0.1:8101/v1/models
for c in 1 4 16; do
  n=$(( c == 1 ? 3 : c ))
  $TM bench serve --url http://127.0.0.1:8101 --model "$MODEL" --tokenizer "$MODEL" --workload custom --max-concurrency "$c" \
    --num-prompts "$n" --request-rate inf --input-len 128 --output-len 128 --server-label transformers-serve \
    --no-ignore-eos --output-dir "$OUT"
done
kill -TERM $PID; wait $PID || true

# 3. experiments
$TM bench sweep "$MODEL" --dtype bfloat16 --experiment kv_cache --prompt-tokens 64 --gen-lengths 8,16,32,64 \
  --output-dir "$OUT"
$TM bench sweep "$MODEL" --dtype bfloat16 --experiment prompt_length --prompt-lengths 32,128,512,1024 \
  --gen-tokens 8 --trials 3 --output-dir "$OUT"
$TM bench sweep --dtype bfloat16 --experiment quantization --prompt-tokens 128 --gen-tokens 32 --trials 3 \
  --quality-text tests/data/demo_val.txt --output-dir "$OUT"
$TM bench sweep "$MODEL" --dtype bfloat16 --experiment quantization --prompt-tokens 128 --gen-tokens 32 --trials 2 \
  --output-dir "$OUT"
"$LLAMA_BIN/llama-bench" -m "$(ls -t "$OUT"/compare_*/model-bf16.gguf | head -1)" \
  -m "$(ls -t "$OUT"/compare_*/model-q8_0.gguf | head -1)" -t 2 -p 512 -n 128 -r 2

fi

# 4. own CPU kernels (docs/benchmarks.md, issue 14): every format against llama.cpp, single stream and online.
# A server left on either port would answer for a peer (a warm prompt cache voided one sitting): refuse.
for port in 8100 8102; do
  if curl -s "http://127.0.0.1:$port/health" >/dev/null; then echo "a server is already up on port $port"; exit 1; fi
done
$TM bench compare "$MODEL" --backends tokenmill,tokenmill:int8,tokenmill:int4,llama.cpp,llama.cpp:q8_0,llama.cpp:q4_0 \
  --dtype bfloat16 --num-prompts 2 --prompt-tokens 512 --max-tokens 128 --threads 2 --rounds 3 --output-dir "$OUT"
G=$(ls -td "$OUT"/compare_* | head -1)
for pair in none:bf16 int8:q8_0 int4:q4_0; do
  q=${pair%%:*}; g=${pair##*:}
  for c in 1 16; do
    if [ "$c" = 1 ]; then n=4; len=64; else n=32; len=128; fi
    "$LLAMA_BIN/llama-server" -m "$G/model-$g.gguf" -t 2 -tb 2 -np 16 -c 8192 --port 8102 --host 127.0.0.1 & LPID=$!
    wait_up http://127.0.0.1:8102/health
    $TM serve "$MODEL" --dtype bfloat16 --quantization "$q" --port 8100 --served-model-name qwen --log-level warning & PID=$!
    wait_up http://127.0.0.1:8100/health
    $TM bench serve --url http://127.0.0.1:8100 --model qwen --tokenizer "$MODEL" --workload custom --max-concurrency "$c" \
      --num-prompts "$n" --request-rate inf --input-len "$len" --output-len "$len" --warmup 1 --output-dir "$OUT" \
      --server-label "tokenmill-$q" --server-peers "llama-server-$g=http://127.0.0.1:8102"
    kill -TERM $PID $LPID; wait $PID $LPID || true
  done
done
# long context: tg after a 2048-token prompt (llama-bench's tg @ d2048), each format against llama.cpp, same GGUFs
for pair in none:bf16 int8:q8_0 int4:q4_0; do
  q=${pair%%:*}; g=${pair##*:}; b=tokenmill; [ "$q" = none ] || b="tokenmill:$q"
  $TM bench compare "$MODEL" --backends "$b,llama.cpp:$g" --gguf "$G/model-$g.gguf" --dtype bfloat16 --num-prompts 1 \
    --prompt-tokens 2048 --max-tokens 64 --threads 2 --rounds 2 --output-dir "$OUT"
done
# the fixed overhead per step: the demo model, quiet, then with one other process keeping a core busy
$TM bench latency --prompt-tokens 64 --gen-tokens 128 --repeat 3 --output-dir "$OUT"
python3 -c "while True: pass" & BUSY=$!
$TM bench latency --prompt-tokens 64 --gen-tokens 128 --repeat 3 --output-dir "$OUT"
kill $BUSY
