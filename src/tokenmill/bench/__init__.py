"""`tokenmill bench`: the measuring instrument. Never imported by runtime code.

- `store.py`   one self-contained folder per run + `index.csv` (layout in store.py)
- `stats.py`   summaries (mean, p50, p90, p99) shared by every subcommand
- `latency.py` single-stream pp/tg (llama-bench style), `throughput.py` offline all-at-once
- `serve.py`   streaming load generator against any OpenAI-compatible server
- `compare.py` the same weights through tokenmill, transformers and llama.cpp, each in its own process
- `gguf_export.py` HF checkpoint -> GGUF for the llama.cpp peer
- `sweep.py`   experiments (threads, kv_cache, prompt_length, quantization, switches)
- `report.py`  markdown tables and matplotlib plots across runs
"""
