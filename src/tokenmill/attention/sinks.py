"""Attention with sinks (gpt-oss): each query head has a learned logit that joins the softmax's denominator and
attends to nothing, so a head can put weight "nowhere" rather than on some key.

    p_i = exp(s_i) / (sum_j exp(s_j) + exp(sink_h)),   out = sum_i p_i v_i

This is the torch path every KV backend takes for a model with sinks where no kernel does: the CPU kernels fold the
sink into their softmax (attention/decode.h, prefill.h), the GPU's decode kernel into its last step
(kernels/cuda/attention.py), and a GPU's prefills come here. It is transformers' eager attention (`modeling_gpt_oss`:
the sink concatenated to the scores as one more column, the largest logit taken out, softmax, the column dropped),
in float32 whatever the model's dtype, and queries are taken in chunks so the [rows, context] scores of a long prompt
are never held at once.

Shapes: N = sequences (or 1), Hkv = KV heads, G = query heads per KV head, R = query rows, S = context, Dh = head dim.
"""

from __future__ import annotations

import torch

SCORES_PER_CHUNK = 1 << 24  # floats of scores a chunk of queries holds (64 MiB)


def attend_with_sinks(
    queries: torch.Tensor,  # [N, Hkv, G, R, Dh]
    keys: torch.Tensor,  # [N, Hkv, S, Dh]
    values: torch.Tensor,  # [N, Hkv, S, Dh]
    sinks: torch.Tensor,  # [Hkv * G]: query head h = g_kv * G + j
    allowed: torch.Tensor | None = None,  # bool, broadcast to [N, 1, 1, R, S]: which keys each row sees; None: all
) -> torch.Tensor:  # [N, Hkv, G, R, Dh], in the queries' dtype
    n, hkv, g, rows, dh = queries.shape
    k, v = keys.float()[:, :, None], values.float()[:, :, None]  # [N, Hkv, 1, S, Dh]
    sink = sinks.float().view(1, hkv, g, 1, 1)
    step = max(1, SCORES_PER_CHUNK // max(1, n * hkv * g * keys.shape[2]))
    out = torch.empty(queries.shape, dtype=queries.dtype, device=queries.device)
    for r0 in range(0, rows, step):
        q = queries[:, :, :, r0 : r0 + step].float()  # [N, Hkv, G, r, Dh]
        scores = (q @ k.transpose(-1, -2)) * dh**-0.5  # [N, Hkv, G, r, S]
        if allowed is not None:
            scores = scores.masked_fill(~allowed[..., r0 : r0 + step, :], float("-inf"))
        logits = torch.cat([scores, sink.expand(n, hkv, g, scores.shape[3], 1)], dim=-1)  # [N, Hkv, G, r, S + 1]
        logits = logits - logits.amax(dim=-1, keepdim=True)
        probs = torch.softmax(logits, dim=-1)[..., :-1]  # the sink's share dropped
        out[:, :, :, r0 : r0 + step] = (probs @ v).to(queries.dtype)
    return out
