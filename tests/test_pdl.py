"""course_lib.pdl: programmatic dependent launch, on only for compiled kernels on compute capability >= 9,
off with COURSE_PDL=0, and on a GPU the same bits as plain launches for the decoding kernels."""

from __future__ import annotations

import pytest
import torch

import course_lib
from course_lib.decode import decode_attention, paged_decode_attention
from course_lib.testing import make_cache, to_pages

DEV = course_lib.DEVICE


def test_dependent_launch_is_off_without_a_hopper_gpu():
    """Programmatic dependent launch only for compiled kernels on compute capability >= 9 (never in the
    interpreter), and COURSE_PDL=0 turns it off."""
    from course_lib import pdl

    expected = course_lib.ON_GPU and torch.cuda.get_device_capability()[0] >= 9
    assert pdl.enabled() == expected
    assert pdl.launch_options(False) == {} and pdl.launch_options(True) == {"launch_pdl": True}
    assert not pdl.enabled(torch.device("cpu"))


def test_dependent_launch_can_be_turned_off(monkeypatch):
    from course_lib import pdl

    monkeypatch.setenv("COURSE_PDL", "0")
    assert not pdl.enabled()


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
def test_gpu_dependent_launch_gives_the_same_bits(paged, monkeypatch):
    """The combine launched early (PDL) reads the partials only once the split kernel has written them:
    the same bits as with plain launches, called directly and in 20 replays of a CUDA graph."""
    from course_lib import pdl
    from course_lib.perf.timing import graphed

    if not course_lib.ON_GPU or not pdl.enabled():
        pytest.skip("needs a GPU with programmatic dependent launch (compute capability >= 9)")
    q, k, v = make_cache(4, 9000, 32, 8, 128, 1, torch.bfloat16, seed=5)
    k_pages, v_pages, table = to_pages(k, v, 16, seed=5)
    seqlens = torch.tensor([5000, 17, 3000, 9000], dtype=torch.int32, device=DEV)

    def step():
        if paged:
            return paged_decode_attention(q, k_pages, v_pages, table, seqlens, validate=False)
        return decode_attention(q, k, v, seqlens, validate=False)

    monkeypatch.setenv("COURSE_PDL", "0")
    plain = step().clone()
    monkeypatch.setenv("COURSE_PDL", "1")
    assert torch.equal(step(), plain)
    out = {}
    replay = graphed(lambda: out.update(value=step()))
    for i in range(20):
        replay()
        torch.cuda.synchronize()
        assert torch.equal(out["value"], plain), f"replay {i} paged={paged}: differs from plain launches"
