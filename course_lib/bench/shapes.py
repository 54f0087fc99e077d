"""The grid of `make bench`: the standard shapes of the FlashAttention papers.

Taught in notebook 08. bf16, B·N = 16384 tokens and H·d = 2048 in every cell (the batch shrinks as the
sequence grows), N from 1k to 16k, d in {64, 128}, causal and not; layout (B, H, N, d).
"""

from __future__ import annotations

from .. import runtime

TOKENS = 16384  # B * N: the batch shrinks as the sequence grows, so every cell has the same tokens
MODEL_DIM = 2048  # H * d: 32 heads of 64 or 16 heads of 128
SEQ_LENS = (1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
MODES = ("fwd", "bwd", "fwd_bwd")
BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
MODE_NAMES = {"fwd": "forward", "bwd": "backward", "fwd_bwd": "forward + backward"}

# Standard attention writes B·H·N·N fp32 scores to HBM (and a backward keeps about 3x that alive).
# Past this size eager and compiled standard attention are recorded as skipped: at N = 16k they would
# need tens of GB and minutes, and the point (they grow as N², a fused kernel does not) is made by then.
MAX_SCORE_BYTES = 8 * 2**30


def standard_cells(quick: bool = False, on_gpu: bool | None = None) -> list[dict]:
    """The cells (B, H, N, d, causal) of the benchmark: the papers' shapes on a GPU; with `quick`, a
    few of them (GPU) or tiny ones that the Triton interpreter runs in seconds (CPU)."""
    on_gpu = runtime.ON_GPU if on_gpu is None else on_gpu
    if not on_gpu:
        return [dict(B=1, H=2, N=n, d=32, causal=c) for c in (False, True) for n in (32, 64)]
    seq_lens = (1024, 2048) if quick else SEQ_LENS
    return [
        dict(B=TOKENS // n, H=MODEL_DIM // d, N=n, d=d, causal=c)
        for d in HEAD_DIMS
        for c in (False, True)
        for n in seq_lens
    ]
