"""Tests of course_lib.attention.hopper_onepass: FlashAttention-3's one-pass backward in Gluon (dK, dV and dQ
from one kernel, dQ added by TMA's reduce-add). Not the backward's default (its docstring gives the numbers);
tested so that it stays correct for the next attempt to make it faster.

On a Hopper GPU: dQ, dK, dV against the float64 reference for ragged lengths (the last query tile of a head
adds zeros to the next head's rows, or falls past the tensor), Nq != Nk, both causal alignments with rows
that see no key, grouped- and multi-query attention, bf16 and fp16, d = 64 and 128.
Anywhere: the module imports (the Gluon builder it calls for the reduce is there).
"""

from __future__ import annotations

import zlib

import pytest
import torch

import course_lib
from course_lib.attention.forward import forward as attention_forward
from course_lib.checks import causal_alignment, causal_offset
from course_lib.testing import assert_close_to_reference, random_qkv, reference_outputs

onepass = pytest.importorskip("course_lib.attention.hopper_onepass", reason="needs a Triton with Gluon")

ON_HOPPER = course_lib.ON_GPU and torch.cuda.get_device_capability()[0] == 9
hopper_gpu = pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU (compute capability 9.x)")


def test_the_reduce_is_in_this_triton():
    """The kernel's TMA reduce-add goes through Gluon's builder: this Triton has it."""
    from triton._C.libtriton import gluon_ir, ir

    assert hasattr(gluon_ir.GluonOpBuilder, "create_async_tma_reduce")
    assert hasattr(ir.DESCRIPTOR_REDUCE_KIND, "ADD")


# (name, q shape (B, H, Nq), Nk, K/V heads, causal)
CASES = [
    ("N=1000, Nk=1531", (2, 3, 1000), 1531, 3, False),
    ("N=1000, Nk=1531, causal", (2, 3, 1000), 1531, 3, True),
    ("Nq=77 < Nk=300, bottom-right", (2, 3, 77), 300, 3, "bottom_right"),
    ("Nq=300 > Nk=77, bottom-right (rows that see no key)", (2, 3, 300), 77, 3, "bottom_right"),
    ("N=130 ragged", (1, 5, 130), 130, 5, False),
    ("GQA 8 / 2, N=700, causal", (1, 8, 700), 700, 2, True),
    ("MQA 4 / 1, Nq=200, Nk=333", (2, 4, 200), 333, 1, False),
]


@hopper_gpu
@pytest.mark.parametrize("dq_chunks", (1, 2))
@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
@pytest.mark.parametrize("name,shape,n_k,kv_heads,causal", CASES, ids=[c[0] for c in CASES])
def test_gradients_match_reference(name, shape, n_k, kv_heads, causal, dtype, d, dq_chunks):
    """dq_chunks: a warpgroup's columns of dQ in one product a step, or two (`_steps`' DQ_CHUNKS)."""
    torch.manual_seed(zlib.crc32(name.encode()) + d)
    q, k, v = random_qkv((*shape, d), n_k, dtype=dtype, device="cuda", kv_heads=kv_heads)
    do = torch.randn_like(q)
    o, lse = attention_forward(q, k, v, causal)
    offset = causal_offset(causal_alignment(causal), q.shape[2], n_k)
    _, ref = reference_outputs(*(t.cpu().double() for t in (q, k, v)), causal, None, do.cpu().double())
    _, base = reference_outputs(q, k, v, causal, None, do)
    grads = onepass.backward(q, k, v, o, do, lse, offset, bool(causal), d**-0.5, dq_chunks=dq_chunks)
    for g, got, r, b in zip("qkv", grads, ref, base):
        assert got.shape == r.shape and got.dtype == dtype
        assert torch.isfinite(got).all(), f"d{g}, {name}: not finite"
        assert_close_to_reference(got, r, b, what=f"d{g}, {name}, d={d}, {dtype}")
