"""Our K-family quantizers (kernels/kquantize.py) give ggml's reference bits.

- Q5_0, Q5_1, Q4_1: byte for byte the gguf package's quantizers (ports of ggml's quantize_row_*_ref).
- Q4_K, Q5_K, Q6_K: the gguf package has no quantizer for them; byte for byte ggml's own C functions where a
  llama.cpp build's libggml-base is at hand ($TOKENMILL_GGML_LIB), and everywhere: the bytes decode (through gguf's
  dequantizer too) to what the quantizer meant, and the error stays within the format's step.
"""

from __future__ import annotations

import ctypes
import os

import gguf
import numpy as np
import pytest
import torch

from tokenmill.kernels.kformats import GGUF_KTYPES, KSPECS, QUANTIZABLE, decode_gguf_rows, encode_gguf_rows
from tokenmill.kernels.kquantize import quantize_k

GGML_TYPE = {v: k for k, v in GGUF_KTYPES.items()}


def weights(n: int, k: int, seed: int) -> torch.Tensor:
    """Rows of several kinds: gaussian, heavy-tailed, one-signed, with exact ties, and all zero."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w[1] = torch.distributions.StudentT(2.0).sample((k,)) * 0.1
    w[2] = w[2].abs() + 0.5  # all positive: the min is clamped to 0 in K-quants
    w[3] = torch.round(w[3] * 4) / 4  # ties at the rounding points
    w[4] = 0.0
    w[5, :32] = 1.0  # a flat block
    return w * 0.02


@pytest.mark.parametrize("fmt", ["q5_0", "q5_1", "q4_1"])
def test_legacy_types_equal_the_gguf_quantizer_byte_for_byte(fmt: str) -> None:
    w = weights(8, 256, seed=0)
    want = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[GGML_TYPE[fmt]])
    got = encode_gguf_rows(quantize_k(w, fmt)).numpy()
    assert got.shape == want.shape and np.array_equal(got, want)


@pytest.mark.parametrize("fmt", QUANTIZABLE)  # (IQ4: loaded only)
def test_the_bytes_decode_to_what_the_quantizer_meant_within_its_step(fmt: str) -> None:
    w = weights(8, 512, seed=1)
    blocks = quantize_k(w, fmt)
    raw = encode_gguf_rows(blocks)
    back = decode_gguf_rows(fmt, raw, w.shape[1])
    for field in ("q", "d", "dmin", "sc", "mn"):
        a, b = getattr(blocks, field), getattr(back, field)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), field
    deq = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[GGML_TYPE[fmt]]))
    torch.testing.assert_close(blocks.dequantize(), deq, rtol=0, atol=0)
    rows = [0, 3, 6, 7]  # the gaussian ones: a uniform step's RMS error is step / sqrt(12)
    rel = ((deq - w)[rows].pow(2).mean() / w[rows].pow(2).mean()).sqrt().item()
    assert rel < {0: 0.12, 1: 0.06, 2: 0.03}[KSPECS[fmt].planes], (fmt, rel)


def _ggml() -> ctypes.CDLL | None:
    path = os.environ.get("TOKENMILL_GGML_LIB")
    return ctypes.CDLL(path) if path else None


@pytest.mark.parametrize("fmt", QUANTIZABLE)  # (IQ4: loaded only)
def test_every_type_equals_ggml_reference_quantizer_byte_for_byte(fmt: str) -> None:
    lib = _ggml()
    if lib is None:
        pytest.skip("no llama.cpp build here: set TOKENMILL_GGML_LIB to its libggml-base.so to check against ggml")
    spec = KSPECS[fmt]
    fn = getattr(lib, f"quantize_row_{GGML_TYPE[fmt].lower().replace('_k', '_K')}_ref")
    w = weights(16, 1024, seed=2)
    for seed in range(3):  # and some wider spreads
        w = torch.cat([w, weights(8, 1024, seed=10 + seed) * 10 ** (seed - 1)])
    x = w.numpy().astype(np.float32)
    out = np.zeros((x.shape[0], x.shape[1] // spec.sb * spec.gguf_bytes), dtype=np.uint8)
    for r in range(x.shape[0]):
        fn(x[r].ctypes.data_as(ctypes.c_void_p), out[r].ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(x.shape[1]))
    got = encode_gguf_rows(quantize_k(w, fmt)).numpy()
    bad = np.nonzero((got != out).any(axis=1))[0]
    assert len(bad) == 0, f"rows {bad.tolist()} differ"
