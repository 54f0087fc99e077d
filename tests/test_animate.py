"""course_lib.attention.animate: the recorded frames follow the algorithm, and every picture draws."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch

from course_lib.attention import animate, tiles


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("order", ["fa1", "fa2"])
def test_forward_frames_end_at_the_answer(order, causal):
    q, k, v = (torch.randn(70, 16, dtype=torch.float64) for _ in range(3))
    frames = animate.forward_frames(q, k, v, 32, 16, causal=causal, order=order)
    assert [f["tile"] for f in frames] == tiles.tile_schedule(70, 70, 32, 16, causal, order=order)
    last = frames[-1]
    assert np.nanmax(last["err"]) < 1e-12, (
        f"{order}, causal={causal}: final O off by {np.nanmax(last['err'])}"
    )
    ref = torch.logsumexp(
        (q @ k.T / 4).masked_fill(torch.ones(70, 70, dtype=torch.bool).triu(1), -float("inf"))
        if causal
        else q @ k.T / 4,
        dim=-1,
    )
    np.testing.assert_allclose(last["m"] + np.log(last["l"]), ref.numpy(), rtol=1e-12, atol=1e-12)
    assert all((b["m"] >= a["m"]).all() for a, b in zip(frames, frames[1:])), "m must never decrease"


def test_backward_frames_finish_dq_and_dk():
    q, k, v, do = (torch.randn(48, 16, dtype=torch.float64) for _ in range(4))
    frames = animate.backward_frames(q, k, v, do, 16, 16, causal=True)
    assert [f["tile"] for f in frames] == tiles.tile_schedule(48, 48, 16, 16, True, order="fa1")
    assert frames[-1]["dq_left"].max() < 1e-12 and frames[-1]["dk_left"].max() < 1e-12
    assert frames[0]["dk_left"][:16].max() > 0  # K/V block 0 is not finished after its first tile


def test_program_map():
    ids = animate.program_map((5, 100), (2, 32))
    assert ids.shape == (5, 100) and ids.max() == 3 * 4 - 1 and ids[4, 99] == 11 and ids[0, 31] == 0
    with pytest.raises(ValueError, match=r"shape \(0, 4\) and block \(1, 4\) must be positive"):
        animate.program_map((0, 4), (1, 4))


def test_pictures_draw_and_widgets_build():
    q, k, v, do = (torch.randn(64, 16, dtype=torch.float64) for _ in range(4))
    fwd = {o: animate.forward_frames(q, k, v, 32, 32, causal=True, order=o) for o in ("fa1", "fa2")}
    bwd = animate.backward_frames(q, k, v, do, 32, 32)
    for fig in (
        animate.forward_strip(fwd),
        animate.forward_step_figure(fwd, 1),
        animate.backward_strip(bwd),
        animate.backward_step_figure(bwd, 2),
        animate.program_strip((3, 40), (2, 16)),
    ):
        assert fig.axes
        plt.close(fig)
    pytest.importorskip("ipywidgets")
    for w in (
        animate.forward_widget(fwd),
        animate.backward_widget(bwd),
        animate.program_widget((3, 40), (2, 16)),
    ):
        assert w.children[0].max >= 1
    plt.close("all")


def test_bad_input():
    with pytest.raises(ValueError, match="shape"):
        animate.forward_frames(torch.randn(2, 8, 4), torch.randn(8, 4), torch.randn(8, 4), 16, 16)
    with pytest.raises(ValueError, match="order"):
        x = torch.randn(8, 4)
        animate.forward_frames(x, x, x, 16, 16, order="fa3")
    # block sizes and empty heads named before any loop (once "range() arg 3 must not be zero")
    x = torch.randn(8, 4)
    for block_m, block_n in ((0, 4), (2.0, 4)):
        with pytest.raises(ValueError, match="tile sizes must be positive integers"):
            animate.forward_frames(x, x, x, block_m, block_n)
        with pytest.raises(ValueError, match="tile sizes must be positive integers"):
            animate.backward_frames(x, x, x, x, block_n, block_m)
    empty = torch.randn(4, 0)
    with pytest.raises(ValueError, match=r"N and d >= 1"):
        animate.forward_frames(empty, empty, empty, 2, 2)
    # dO = 0: every gradient is zero, nothing is left to compute in any frame (once 0 / 0 = NaN)
    frames = animate.backward_frames(x, x, x, torch.zeros_like(x), 4, 4)
    assert all(not np.isnan(f["dq_left"]).any() and not np.isnan(f["dk_left"]).any() for f in frames)


def test_pictures_refuse_what_is_not_frames_by_name():
    q, k, v = (torch.randn(6, 4, dtype=torch.float64) for _ in range(3))
    fwd = {"fa2": animate.forward_frames(q, k, v, 4, 4)}
    bwd = animate.backward_frames(q, k, v, torch.randn_like(q), 4, 4)
    for call, words in (
        (lambda: animate.forward_strip({}), "forward_strip: frames_by_order must be a non-empty dict"),
        (lambda: animate.forward_strip(fwd["fa2"]), "frames_by_order must be a non-empty dict"),
        (lambda: animate.forward_widget({"fa2": []}), "forward_widget: 'fa2': frames must be the non-empty"),
        (lambda: animate.forward_strip(fwd, n_shots=0), "n_shots must be >= 1"),
        (lambda: animate.forward_step_figure(fwd, -1), "step must be >= 0"),
        (lambda: animate.backward_strip([]), "backward_strip: frames must be the non-empty list"),
        (lambda: animate.backward_step_figure(bwd, -2), "step must be >= 0"),
        (lambda: animate.backward_widget({"fa2": bwd}), "backward_widget: frames must be"),
        (lambda: animate.program_strip((4, 8), (2, 4), n_shots=-1), "n_shots must be >= 1"),
    ):
        with pytest.raises(ValueError, match=words):
            call()
    with pytest.raises(TypeError, match="n_shots must be an integer"):
        animate.backward_strip(bwd, n_shots=2.5)
