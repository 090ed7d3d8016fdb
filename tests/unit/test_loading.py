"""Loading real checkpoint folders, and a clear error for every way a checkpoint can be wrong."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenmill import LLM
from tokenmill.errors import ConfigError, ModelLoadError


@pytest.fixture(scope="module")
def folder(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama")


def _copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "ckpt"))


def _edit_config(folder: Path, **changes: object) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def _greedy(llm: LLM) -> list[int]:
    from tokenmill import SamplingParams

    return llm.generate("Hello", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0].token_ids


def test_sharded_checkpoint_loads_identically(folder: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(str(folder)).save_pretrained(str(sharded), max_shard_size="50KB")
    for f in folder.glob("tokenizer*"):
        shutil.copy(f, sharded)
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 2
    assert _greedy(LLM(str(sharded), dtype="float32")) == _greedy(LLM(str(folder), dtype="float32"))


def test_dtype_auto_follows_config(make_checkpoint: Callable[..., Path]) -> None:
    llm = LLM(str(make_checkpoint("llama", dtype="bfloat16")))
    assert llm.loaded.dtype == torch.bfloat16 and llm.loaded.model.decoder().norm.weight.dtype == torch.bfloat16
    assert LLM(str(make_checkpoint("llama", dtype="bfloat16")), dtype="float32").loaded.dtype == torch.float32


def test_a_checkpoint_dtype_we_cannot_compute_in_is_refused(folder: Path, tmp_path: Path) -> None:
    bad = _copy(folder, tmp_path)
    _edit_config(bad, dtype="float8_e4m3fn", torch_dtype="float8_e4m3fn")
    with pytest.raises(ConfigError, match="dtype 'float8_e4m3fn' is not one tokenmill computes in; pass --dtype"):
        LLM(str(bad))
    assert LLM(str(bad), dtype="float32").loaded.dtype == torch.float32  # an explicit dtype still loads it


def test_unknown_architecture_lists_supported(folder: Path, tmp_path: Path) -> None:
    bad = _copy(folder, tmp_path)
    _edit_config(bad, architectures=["FancyNetForCausalLM"])
    with pytest.raises(
        ConfigError,
        match="FancyNetForCausalLM.*supported architectures: GPT2LMHeadModel, Gemma3ForCausalLM, .*LlamaForCausalLM",
    ):
        LLM(str(bad))


def test_a_rope_base_of_zero_and_bad_generation_defaults_are_named(folder: Path, tmp_path: Path) -> None:
    """rope_theta 0 made every logit NaN with no error; generation_config.json's temperature -1 was refused without
    naming the file."""
    bad = _copy(folder, tmp_path)
    _edit_config(bad, rope_parameters={"rope_type": "default", "rope_theta": 0.0})
    with pytest.raises(ConfigError, match=r"config.json.*rope_theta=0.0 is invalid: allowed a finite number > 0"):
        LLM(str(bad))
    _edit_config(bad, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=0)
    with pytest.raises(ConfigError, match=r"max_position_embeddings=0 must be >= 1"):  # (every request failed)
        LLM(str(bad))
    _edit_config(bad, max_position_embeddings=512)
    (bad / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ConfigError, match=r"^generation_config.json: temperature=-1 is invalid"):
        LLM(str(bad)).get_default_sampling_params()


def test_an_eos_id_outside_the_vocabulary_is_left_out(
    folder: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """config.json's eos_token_id 10^9 reached min_tokens' mask of the logits (an index error in every request that
    set min_tokens); llama.cpp leaves such ids out with a warning, and so does the load here."""
    from tokenmill import SamplingParams

    bad = _copy(folder, tmp_path)
    _edit_config(bad, eos_token_id=[10**9, -1, 1])
    with caplog.at_level("WARNING", logger="tokenmill.engine"):
        llm = LLM(str(bad), dtype="float32")
    assert any("EOS ids [-1, 1000000000] lie outside the vocabulary" in r.getMessage() for r in caplog.records)
    assert 1 in llm.loaded.eos_token_ids and 10**9 not in llm.loaded.eos_token_ids
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4, min_tokens=4))[0].outputs[0]
    assert len(out.token_ids) == 4 and 1 not in out.token_ids


def test_a_weight_file_that_is_not_a_regular_file_is_refused(folder: Path, tmp_path: Path) -> None:
    """A FIFO named model.safetensors blocked the load forever (opening it waits for a writer)."""
    import os

    bad = _copy(folder, tmp_path)
    (bad / "model.safetensors").unlink()
    os.mkfifo(bad / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model.safetensors is not a regular file"):
        LLM(str(bad))


def test_missing_folder_and_missing_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nope" / "model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        LLM(str(tmp_path / "empty"))


def test_missing_weight_files(folder: Path, tmp_path: Path) -> None:
    bad = _copy(folder, tmp_path)
    (bad / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no weight file \(\*\.safetensors\)"):
        LLM(str(bad))
    (bad / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="only PyTorch pickle weights"):
        LLM(str(bad))


def test_index_names_a_missing_shard(folder: Path, tmp_path: Path) -> None:
    bad = _copy(folder, tmp_path)
    names = load_file(str(bad / "model.safetensors")).keys()
    index = {"metadata": {}, "weight_map": {n: "model-00002-of-00002.safetensors" for n in names}}
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors is listed .* does not exist"):
        LLM(str(bad))


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_weight_file_is_named(folder: Path, tmp_path: Path, damage: str) -> None:
    bad = _copy(folder, tmp_path)
    path = bad / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(b"\x00garbage" * 10 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors is corrupt"):
        LLM(str(bad))


def test_missing_tensor_is_named(folder: Path, tmp_path: Path) -> None:
    bad = _copy(folder, tmp_path)
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing tensor\(s\): model\.layers\.1\.self_attn\.k_proj\.weight"):
        LLM(str(bad))


def test_shape_mismatch_names_tensor_and_shapes(folder: Path, tmp_path: Path) -> None:
    bad = _copy(folder, tmp_path)
    _edit_config(bad, intermediate_size=80)
    pattern = r"tensor .model\.layers\.0\.mlp\.\w+_proj\.weight. in .* has shape \[\d+, \d+\], but config\.json implies"
    with pytest.raises(ModelLoadError, match=pattern):
        LLM(str(bad))


def test_unexpected_tensor_is_named(folder: Path, tmp_path: Path) -> None:
    bad = _copy(folder, tmp_path)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.extra\.weight'"):
        LLM(str(bad))


def test_config_errors_are_clear(folder: Path, tmp_path: Path) -> None:
    bad = _copy(folder, tmp_path)
    _edit_config(bad, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(ConfigError, match="rope type 'dynamic' is not supported"):
        LLM(str(bad))
    cfg = json.loads((bad / "config.json").read_text())
    del cfg["hidden_size"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="missing the required field 'hidden_size'"):
        LLM(str(bad))


def test_offline_hub_id_gives_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="unreachable .*offline.*pass a local checkpoint folder"):
        LLM("tokenmill-tests/not-a-cached-model")


def test_engine_options_are_validated() -> None:
    with pytest.raises(ValueError, match="dtype='float8' is not supported; allowed: auto, float32"):
        LLM("x", dtype="float8")
    with pytest.raises(ValueError, match="kv_cache='paged2'"):
        LLM("x", kv_cache="paged2")


def test_a_sliding_window_binds_where_it_is_shorter_than_the_context(make_checkpoint: Callable[..., Path]) -> None:
    windowed = make_checkpoint("mistral", sliding_window=16)
    llm = LLM(str(windowed), dtype="float32")
    assert llm.loaded.config.layer_windows() == [16, 16] and llm.loaded.max_model_len == 512
    # a window switched off (Qwen2's configs carry one) or as long as the context binds nothing
    off = make_checkpoint("qwen2", sliding_window=16, use_sliding_window=False)
    assert LLM(str(off), dtype="float32").loaded.config.layer_windows() == [None, None]
    long = LLM(str(make_checkpoint("mistral", sliding_window=4096)), dtype="float32")
    assert long.loaded.config.layer_windows() == [None, None]


def test_gpt2_config_names_and_the_conv1d_layout_load(make_checkpoint: Callable[..., Path]) -> None:
    llm = LLM(str(make_checkpoint("gpt2")), dtype="float32", cpu_kernels=False)  # plain nn.Linear weights
    cfg, model = llm.loaded.config, llm.loaded.model
    assert (cfg.hidden_size, cfg.num_layers, cfg.intermediate_size, cfg.hidden_act) == (64, 2, 96, "gelu_new")
    assert cfg.tie_word_embeddings and model.lm_head.weight is model.embeddings().weight
    assert model.transformer.h[0].attn.c_attn.weight.shape == (3 * 64, 64)  # [out, in], turned around


def test_gpt2_options_we_do_not_compute_are_refused(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    bad = _copy(make_checkpoint("gpt2"), tmp_path)
    _edit_config(bad, scale_attn_by_inverse_layer_idx=True)
    with pytest.raises(ConfigError, match="scale_attn_by_inverse_layer_idx=true is not supported"):
        LLM(str(bad))


def test_the_demo_model_loads_by_the_name_the_server_gives_it() -> None:
    from tokenmill.assembly.model import DEMO_MODEL
    from tokenmill.weights import resolve_model

    assert resolve_model("tokenmill-demo") == DEMO_MODEL == resolve_model("demo")
    assert LLM(model="tokenmill-demo").loaded.path == DEMO_MODEL


# The allocator tests run in a fresh Python: what earlier tests left in this process's arenas (a free chunk big
# enough for the block) would decide them instead of the switch under test.
_GLIBC = """
import ctypes, sys, threading
from tokenmill.memory import return_freed_memory, trim
if not return_freed_memory():
    print("not glibc"); sys.exit(0)
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))
"""


def _glibc_run(body: str) -> list[int]:
    import subprocess
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("not Linux: glibc's allocator switches are all memory.py sets")
    done = subprocess.run([sys.executable, "-c", _GLIBC + body], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    if done.stdout.strip() == "not glibc":
        pytest.skip("not glibc: its mmap threshold and malloc_trim are the only allocator switches this sets")
    return [int(x) for x in done.stdout.split()]


def test_loading_a_model_fixes_the_allocators_mmap_threshold() -> None:
    """glibc raises its mmap threshold as large blocks are freed, after which freed activations stay resident
    (memory.py); a loaded model's process keeps it at 128 KB: a 1 MB block is mapped, and unmapped when freed."""
    before, during, after = _glibc_run("""
libc.free(libc.malloc(8 << 20))  # glibc's own threshold would now rise to 8 MB: a 1 MB block from the heap
before = status("VmSize")
block = libc.malloc(1 << 20)
during = status("VmSize")
libc.free(block)
print(before, during, status("VmSize"))
""")
    assert during - before >= 1000 and after - before < 1000  # mapped for the block, gone after it


def test_trim_gives_freed_small_blocks_back() -> None:
    """Blocks under the mmap threshold stay in their arena when freed; `trim` (run by the engine when it goes idle)
    hands their pages back: 64 MB of 1 KB blocks, all but one in 64 freed (the live ones keep glibc from giving back
    the freed runs between them by itself), leave the resident set after it."""
    start, held, trimmed = _glibc_run("""
live = []
def churn():  # in a thread of its own, as the engine's loop is: its own arena
    blocks = [libc.malloc(1024) for _ in range(64 * 1024)]
    for b in blocks:
        ctypes.memset(b, 1, 1024)
    for i, b in enumerate(blocks):
        live.append(b) if i % 64 == 63 else libc.free(b)
start = status("VmRSS")
worker = threading.Thread(target=churn)
worker.start()
worker.join()
held = status("VmRSS")
trim()
print(start, held, status("VmRSS"))
""")
    assert held - start > 48 * 1024  # the freed runs are still resident ...
    assert held - trimmed > 32 * 1024  # ... until the trim


def test_the_collector_pauses_for_a_load_and_the_kept_heap_freezes() -> None:
    """`serve` and `generate` pause Python's cyclic collector for their imports and load (memory.py): the pause
    restores whatever state it found, and `freeze_heap` (a kept model, loaded) turns it on with the objects alive
    then out of its sight, while objects made afterwards are still collected. In a fresh Python: a freeze would
    otherwise keep this test process's objects."""
    import subprocess
    import sys

    code = """
import gc
from tokenmill.memory import collector_paused, freeze_heap
with collector_paused():
    inside = gc.isenabled()
gc.disable()
with collector_paused():
    pass
kept_off = not gc.isenabled()
with collector_paused():
    held = [[] for _ in range(1000)]
    freeze_heap()
frozen = gc.get_freeze_count()
cycle = []
cycle.append(cycle)
del cycle
print(inside, kept_off, gc.isenabled(), frozen >= 1000, gc.collect() >= 1)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "True", "True", "True"]
