"""A sequence's K and V gathered from the paged cache, head-major (notebook 10's pages, read as notebook 08c's
warp-specialised forward reads a dense cache): what `prefill_split` hands the Gluon forward."""

from __future__ import annotations

import torch

from ..kernels import bound
from ..runtime import tl, triton


@triton.jit
def _gather_heads_kernel(
    K_POOL, V_POOL, PAGES, K_OUT, V_OUT, LENGTH,
    stride_page, stride_slot, stride_head,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """K and V of tokens BLOCK_T * i ... of K/V head h (program (i, h)): token t lies in slot t % PAGE_SIZE of
    page PAGES[t // PAGE_SIZE]; its d values go to row t of head h of K_OUT, V_OUT (Hkv, LENGTH, d)."""
    h = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = t < LENGTH
    page = tl.load(PAGES + t // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    src = (page * stride_page + (t % PAGE_SIZE) * stride_slot + h * stride_head)[:, None] + offs_d[None, :]
    dst = (h * LENGTH + t).to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(K_OUT + dst, tl.load(K_POOL + src, mask=ok[:, None]), mask=ok[:, None])
    tl.store(V_OUT + dst, tl.load(V_POOL + src, mask=ok[:, None]), mask=ok[:, None])


GATHER_TOKENS = 64  # tokens a program of `gather_heads`


def gather_heads(k_pool: torch.Tensor, v_pool: torch.Tensor, pages: torch.Tensor, length: int):
    """A sequence's first `length` tokens in one layer's page pools (num_pages, page_size, Hkv, d) (d a power of
    two), held by `pages` ((n_pages,) page ids on the pools' device), head-major and contiguous: K and V as
    (1, Hkv, length, d) each, as the warp-specialised forward's TMA descriptors read them. One launch for both
    (the token-major gather and a transposed copy took 0.27 ms at 32k tokens, 8 K/V heads, d = 128 on an H200:
    PyTorch's copy of the transpose ran at 0.7 TB/s; this kernel 0.065 ms)."""
    _, _, hkv, d = k_pool.shape
    k_out, v_out = k_pool.new_empty((1, hkv, length, d)), v_pool.new_empty((1, hkv, length, d))
    gather_into(k_pool, v_pool, pages, k_out, v_out, length)
    return k_out, v_out


def gather_into(k_pool, v_pool, pages, k_out, v_out, length: int) -> None:
    """`gather_heads` into given outputs k_out, v_out (1, Hkv, length, d), contiguous."""
    bound.launch(_gather_heads_kernel, (triton.cdiv(length, GATHER_TOKENS), k_pool.shape[2]),
        k_pool, v_pool, pages, k_out, v_out, length, k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        PAGE_SIZE=k_pool.shape[1], HEAD_DIM=k_pool.shape[3], BLOCK_T=GATHER_TOKENS,
    )  # fmt: skip
