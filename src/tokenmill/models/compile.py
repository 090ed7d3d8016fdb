"""`--compile`: torch.compile (inductor) over the dense, shape-regular parts of each decoder layer.

Attention stays eager: its batch layout lives in Python lists (`AttentionMetadata`) that would split the graph
on every step. What gets compiled is what inductor can fuse: each RMSNorm (one kernel instead of five) and the
gated MLP (SiLU * up fused into the GEMM epilogue). Shapes are dynamic in the token count, so one compile
serves every batch size; the first steps pay the compile time (seconds to minutes on a small CPU).
"""

from __future__ import annotations

from torch import nn

from tokenmill import reaper


def compile_model(model: nn.Module) -> int:
    """Compile every RMSNorm and gated MLP in place; returns how many modules were compiled."""
    from tokenmill.models.layers import GatedMLP, RMSNorm

    reaper.before_spawn()  # inductor's compiler jobs
    count = 0
    for module in model.modules():
        if isinstance(module, RMSNorm | GatedMLP):
            module.compile(dynamic=True)
            count += 1
    return count
