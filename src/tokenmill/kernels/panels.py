"""What every packed weight format shares (formats.py, kformats.py): the panel width, the quantization block, and
the formats' ids as the kernels number them (csrc/linear/format.h: enum Format)."""

PANEL = 16  # output channels per panel
BLOCK = 32  # weights per quantization block (the activations' Q8_0 blocks too)
FORMATS = {"bf16": 0, "q8_0": 1, "q4_0": 2, "f32": 3, "q4_k": 4, "q5_k": 5, "q6_k": 6, "q5_0": 7, "q5_1": 8, "q4_1": 9,
           "iq4_nl": 10, "iq4_xs": 11, "mxfp4": 12}  # fmt: skip
