"""course_lib.attention's face (attention/api.py): `flash_attention` refuses bad shapes, head dims, dtypes,
devices, configurations and dQ modes by name."""

from __future__ import annotations

import pytest
import torch

import course_lib
from course_lib import flash_attention
from course_lib.attention import backward as bwd_mod
from course_lib.attention import forward as fwd_mod
from course_lib.testing import random_qkv

DEVICE = course_lib.DEVICE
ON_GPU = course_lib.ON_GPU


def _qkv(shape_q=(1, 2, 8, 16), n_k=8, dtype=torch.float32, device=DEVICE):
    return random_qkv(shape_q, n_k, dtype=dtype, device=device)


def test_bad_shapes_and_head_dims():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="head dims differ"):
        flash_attention(q, k[..., :8], v)
    with pytest.raises(ValueError, match="same number of keys"):
        flash_attention(q, k, v[..., :5, :])
    with pytest.raises(ValueError, match="leading"):
        flash_attention(q, torch.cat([k, k]), torch.cat([v, v]))  # batch 2 against q's 1
    with pytest.raises(ValueError, match="multiple of k's and v's"):
        flash_attention(torch.cat([q, q[:, :1]], dim=1), k, v)  # 3 query heads, 2 key/value heads
    with pytest.raises(ValueError, match="v must have the head dim"):
        flash_attention(q, k, torch.cat([v, v], dim=-1))
    with pytest.raises(ValueError, match="at least 2 dims"):
        flash_attention(q[0, 0, 0], k[0, 0, 0], v[0, 0, 0])
    for d in (8, 12, 264):
        q, k, v = _qkv((1, 4, d), 4)
        with pytest.raises(ValueError, match=f"head dim d={d} is not supported"):
            flash_attention(q, k, v)


def test_bad_dtypes():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="share one dtype"):
        flash_attention(q, k.half(), v)
    with pytest.raises(TypeError, match="floating-point"):
        flash_attention(*(torch.ones(1, 8, 16, dtype=torch.int32, device=DEVICE) for _ in range(3)))
    if ON_GPU:
        with pytest.raises(TypeError, match="float64 runs only under the Triton interpreter"):
            flash_attention(q.double(), k.double(), v.double())


def test_bad_devices():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="one device"):
        flash_attention(q, k.to("meta"), v)
    if course_lib.INTERPRET:
        # A tensor on another device (meta stands in for CUDA on a machine without a GPU).
        with pytest.raises(ValueError, match="interpreter on the CPU"):
            flash_attention(*(t.to("meta") for t in (q, k, v)))
    if ON_GPU:
        with pytest.raises(ValueError, match="compiled for the GPU"):
            flash_attention(*(t.cpu() for t in (q, k, v)))


def test_bad_config_and_dq_mode():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="unknown config keys"):
        fwd_mod.forward(q, k, v, config={"BLOCK_K": 32})
    with pytest.raises(ValueError, match="powers of two"):
        fwd_mod.forward(q, k, v, config={"BLOCK_M": 24})
    with pytest.raises(TypeError, match="config must be a dict"):
        fwd_mod.forward(q, k, v, config="fast")
    with pytest.raises(TypeError, match="config switch exp2 must be True or False; got 'no'"):
        fwd_mod.forward(q, k, v, config={"exp2": "no"})  # a truthy string once meant True
    o, lse = fwd_mod.forward(q, k, v)
    with pytest.raises(ValueError, match="dq_mode"):
        bwd_mod.backward(o, q, k, v, o, lse, dq_mode="fused")
    with pytest.raises(ValueError, match="L must have shape"):
        bwd_mod.backward(o, q, k, v, o, lse[..., :3])
