"""Tests of course_lib.attention.hopper: FlashAttention-3's warp-specialised forward in Gluon.

The kernel runs only on a Hopper GPU (Gluon has no interpreter): there every variant is compared with
the float64 reference (ragged lengths, Nq != Nk, causal top-left and bottom-right, bf16 and fp16,
d = 64 and 128, one or several tiles per program), and `forward.forward` is checked to take it where
`hopper.choose` says and to leave it otherwise. On any machine: the launch parameters fit the
hardware, and the CPU never takes it.
"""

from __future__ import annotations

import zlib

import pytest
import torch

import course_lib
from course_lib.attention import forward as fwd_mod
from course_lib.attention.reference import attention as reference_attention
from course_lib.testing import assert_close_to_reference, random_qkv, reference64, reference_outputs

hopper = pytest.importorskip("course_lib.attention.hopper", reason="needs a Triton with Gluon")

ON_HOPPER = course_lib.ON_GPU and torch.cuda.get_device_capability()[0] == 9
hopper_gpu = pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU (compute capability 9.x)")
SMEM_BYTES = 227 * 1024  # shared memory one program may use on a Hopper SM


def _smem(variant, d: int) -> int:
    block_n, stages, consumers, _, _ = variant
    return (hopper.QUERY_ROWS * consumers + 2 * stages * block_n) * d * 2


def test_variants_fit_an_sm():
    """Every variant (and every choice) fits in shared memory and the register file."""
    for d, variants in hopper.VARIANTS.items():
        for variant in variants:
            per_sm = variant.programs_per_sm  # programs an SM runs at once, sharing its memory and registers
            assert per_sm * _smem(variant, d) <= SMEM_BYTES, (
                f"d={d} {variant}: {per_sm} x {_smem(variant, d)} bytes of shared memory"
            )
            opts = variant.kwargs()
            warps = 4 * variant.num_consumers + 4
            assert per_sm * opts["maxnreg"] * warps * 32 <= 65536, (
                f"{variant}: {per_sm} x {opts} exceeds 64K registers"
            )
            assert opts["CONSUMER_REGS"] % 8 == 0 and 24 < opts["CONSUMER_REGS"] <= 240, f"{variant}: {opts}"
    for d in (64, 128):
        for causal in (False, True):
            for n in (1, 100, 1024, 4096, 16384, 65536):
                variant = hopper.choose(d, causal, n, n)
                assert variant is None or variant in hopper.VARIANTS[d], f"d={d} N={n}: {variant}"
        # bottom-right: a chunk of n_q queries at the end of n_k keys (offset n_k - n_q)
        for n_q, n_k in ((256, 8192), (1024, 2048), (3280, 32768), (4096, 4096), (1000, 1500)):
            variant = hopper.choose(d, True, n_q, n_k, n_k - n_q)
            assert variant is None or variant in hopper.VARIANTS[d], f"d={d} {n_q} x {n_k}: {variant}"
            if d == 64 and n_k - n_q >= n_q and variant is not None:
                assert variant.num_consumers == 2, (
                    f"{n_q} x {n_k}: bottom-right at d = 64 takes 128-row tiles"
                )
    assert hopper.choose(32, False, 4096, 4096) is None and hopper.choose(256, True, 4096, 4096) is None


def test_persistent_grid(monkeypatch):
    """A persistent launch takes one program a slot, or fewer where the tiles are fewer; on causal top-left rows
    a multiple of a head's query blocks (each round a chunk of whole heads, `_tile`) where that keeps 90 % of
    the slots, else every slot (the kernel then deals over all heads at once)."""
    monkeypatch.setattr(hopper, "sm_count", lambda index=None: 132)
    d128, d64 = hopper.D128_SHORT, hopper.D64
    assert hopper.persistent_grid(d128, 16 * 8 * 16, 16, True, 0) == 128  # 2k keys: 8 heads a round
    assert hopper.persistent_grid(d128, 16 * 8 * 16, 16, False, 0) == 132  # bottom-right: every slot
    assert hopper.persistent_grid(d128, 64 * 128, 128, True, 0) == 128  # 16k keys: one head a round
    assert hopper.persistent_grid(d64, 32 * 86, 86, True, 0) == 132  # 86 programs would leave 35 % idle
    assert hopper.persistent_grid(d128, 40, 8, True, 0) == 40  # fewer tiles than slots: one round
    one_consumer = hopper.Variant(64, 3, 1, False, True)  # two programs an SM: 264 slots
    assert hopper.persistent_grid(one_consumer, 256 * 16, 16, True, 0) == 256


def test_choose_grid_rule():
    """With the grid given (batch x query heads, SMs), `choose` leaves to the Triton kernel the grids where the
    Gluon kernel's larger tiles lose (measured in its docstring): at d = 64 where an SM's rows (rounds of tiles
    x 192, weighed by 0.85) outnumber the Triton kernel's (rounds x 128), at d = 128 fewer 128-row tiles than
    half the SMs over <= 2048 keys; the standard grid keeps its variant."""
    sms = 132
    for d, heads, n, causal, taken in [
        (64, 2, 4096, False, False),  # 44 tiles of 192 rows: one round, 163 rows against 128
        (64, 8, 4096, False, False),  # 176 tiles, two rounds: 326 against 256
        (64, 2, 16384, False, False),  # 172
        (64, 9, 4096, False, True),  # 198: 326 against 384
        (64, 12, 4096, False, True),  # 264
        (64, 16, 4096, False, True),  # 352: 490 against 512
        (64, 2, 8192, True, False),  # 86
        (128, 2, 2048, True, False),  # 32 tiles
        (128, 4, 2048, True, False),  # 64
        (128, 2, 4096, False, True),  # 64 tiles over 4096 keys
        (128, 8, 2048, True, True),  # 128
        (128, 4, 1024, True, False),  # 32 tiles
        (128, 16, 1024, True, True),  # 128
    ]:
        assert hopper.choose(d, causal, n, n) is not None
        assert (hopper.choose(d, causal, n, n, 0, heads, sms) is not None) == taken, (d, heads, n, causal)
    for d in (64, 128):  # the standard grid (B x N = 16k tokens, H x d = 2048)
        for n in (2048, 4096, 8192, 16384):
            for causal in (False, True):
                free = hopper.choose(d, causal, n, n)
                assert hopper.choose(d, causal, n, n, 0, 16384 // n * 2048 // d, sms) == free
    # bottom-right (a cached prompt's rest) keeps its variant at any grid
    assert hopper.choose(64, True, 3280, 32768, 32768 - 3280, 16, sms) == hopper.D64_ROWS_128
    assert hopper.choose(128, True, 256, 8192, 8192 - 256, 2, sms) is not None


def test_cpu_never_takes_it():
    """Under the interpreter `forward.forward` has no Gluon path to take."""
    if course_lib.ON_GPU:
        pytest.skip("a GPU run")
    assert fwd_mod.hopper_kernels() is None


# (name, q shape (B, H, Nq, d), Nk, causal): a tile of 128 or 192 query rows, K/V blocks of 128. Bottom-right
# offsets (Nk - Nq) that 64 does not divide, below Nq and above it (`choose`'s two rules).
CASES = [
    ("N=1000, Nk=1531", (2, 3, 1000, None), 1531, False),
    ("N=1000, Nk=1531, causal", (2, 3, 1000, None), 1531, True),
    ("Nq=77 < Nk=300, causal", (2, 3, 77, None), 300, True),
    ("Nq=300 > Nk=77, causal", (2, 3, 300, None), 77, True),
    ("Nq=77 < Nk=300, bottom-right", (2, 3, 77, None), 300, "bottom_right"),
    ("Nq=700 < Nk=1531, bottom-right", (2, 3, 700, None), 1531, "bottom_right"),
    ("Nq=200 < Nk=2345, bottom-right", (1, 4, 200, None), 2345, "bottom_right"),
    ("N=130 ragged", (1, 5, 130, None), 130, False),
    ("N=4096, causal, many tiles per SM", (1, 40, 4096, None), 4096, True),
    ("N=2048, causal, a last chunk of fewer heads", (1, 37, 2048, None), 2048, True),
    ("N=1, one query", (3, 2, 1, None), 1, True),
]


@hopper_gpu
@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
@pytest.mark.parametrize("name,shape,n_k,causal", CASES, ids=[c[0] for c in CASES])
def test_every_variant_matches_reference(name, shape, n_k, causal, dtype, d):
    torch.manual_seed(zlib.crc32(name.encode()) + d)
    q, k, v = random_qkv(shape[:3] + (d,), n_k, dtype=dtype, device="cuda")
    ref_o, ref_l = reference64(q, k, v, causal)  # a few heads at a time: 40 heads of 4096 x 4096 here
    base_o, _ = reference_outputs(q, k, v, causal)
    assert hopper.VARIANTS[d], f"no Gluon variant for d={d}"
    for variant in hopper.VARIANTS[d]:
        # NaN first: a variant that leaves a row unwritten fails here, whatever memory it is handed
        o = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[:-1], float("nan"), dtype=torch.float32, device="cuda")
        offset = n_k - shape[2] if causal == "bottom_right" else 0
        hopper.forward(q, k, v, o, lse, bool(causal), d**-0.5, variant, offset)
        what = f"{name}, d={d}, {dtype}, variant {variant}"
        assert_close_to_reference(o, ref_o, base_o, what=f"O, {what}")
        torch.testing.assert_close(lse.cpu().double(), ref_l, rtol=1e-4, atol=1e-4, msg=f"L, {what}")


@hopper_gpu
def test_forward_takes_it_where_chosen(monkeypatch):
    """`forward.forward` runs the Gluon kernel for contiguous 16-bit inputs where `choose` picks it,
    and the Triton kernel for strided inputs, other head dims, `hopper=False` and fixed launches."""
    calls = []
    real = hopper.forward
    monkeypatch.setattr(hopper, "forward", lambda *a: calls.append(a[7]) or real(*a))  # the variant
    torch.manual_seed(7)
    q, k, v = random_qkv((4, 4, 700, 128), 1500, dtype=torch.bfloat16, device="cuda")
    sms = course_lib.runtime.sm_count()
    chosen = hopper.choose(128, True, 700, 1500, 0, 16, sms)
    assert chosen is not None, "the test needs a shape where the Gluon kernel is chosen"
    o, lse = fwd_mod.forward(q, k, v, True)
    assert calls == [chosen], f"Gluon kernel calls: {calls}"
    o_triton, lse_triton = fwd_mod.forward(q, k, v, True, config={"hopper": False})
    assert len(calls) == 1, "config={'hopper': False} still ran the Gluon kernel"
    ref_o, ref_l = reference_attention(*(t.cpu().double() for t in (q, k, v)), True, return_lse=True)
    base_o, _ = reference_outputs(q, k, v, True)
    for what, out, l in (("Gluon", o, lse), ("Triton", o_triton, lse_triton)):
        assert_close_to_reference(out, ref_o, base_o, what=f"O, {what}, (4, 4, 700 / 1500, 128) causal")
        torch.testing.assert_close(l.cpu().double(), ref_l, rtol=1e-4, atol=1e-4, msg=f"L, {what}")
    # The homework's (batch, N, d) layout takes it too (viewed as (batch, 1, N, d)).
    o3, _ = fwd_mod.forward(q.reshape(16, 700, 128), k.reshape(16, 1500, 128), v.reshape(16, 1500, 128), True)
    assert len(calls) == 2, f"3-D inputs did not take the Gluon kernel: {calls}"
    torch.testing.assert_close(o3, o.reshape(16, 700, 128), rtol=0, atol=0)
    # Not taken: a strided view (SDPA's (B, N, H, d) layout), d = 32, a fixed launch, d = 64 at Nk = 1500, and
    # a grid of 12 tiles of 128 rows (`choose`'s grid rule: the Triton kernel's smaller tiles finish first).
    fwd_mod.forward(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, True)
    fwd_mod.forward(q[..., :32], k[..., :32], v[..., :32], True)
    fwd_mod.forward(q, k, v, True, config={"BLOCK_M": 64})
    fwd_mod.forward(q[..., :64].contiguous(), k[..., :64].contiguous(), v[..., :64].contiguous(), True)
    fwd_mod.forward(q[:1, :2].contiguous(), k[:1, :2].contiguous(), v[:1, :2].contiguous(), True)
    assert (
        hopper.choose(128, True, 700, 1500) is not None
        and hopper.choose(128, True, 700, 1500, 0, 2, sms) is None
    )
    assert len(calls) == 2, f"the Gluon kernel ran where it should not: {calls}"
    # Bottom-right (a chunk of queries at the end of a KV cache) takes it; with Nq > Nk (rows that see no
    # key) it does not.
    chosen = hopper.choose(128, True, 700, 1500, 800, 16, sms)
    assert chosen is not None, "the test needs a bottom-right shape where the Gluon kernel is chosen"
    o_br, lse_br = fwd_mod.forward(q, k, v, "bottom_right")
    assert calls[2:] == [chosen], f"bottom-right: Gluon kernel calls {calls[2:]}"
    ref_o, ref_l = reference_attention(
        *(t.cpu().double() for t in (q, k, v)), "bottom_right", return_lse=True
    )
    base_o, _ = reference_outputs(q, k, v, "bottom_right")
    assert_close_to_reference(o_br, ref_o, base_o, what="O, Gluon, (4, 4, 700 / 1500, 128) bottom-right")
    torch.testing.assert_close(lse_br.cpu().double(), ref_l, rtol=1e-4, atol=1e-4, msg="L, bottom-right")
    fwd_mod.forward(k, q, v[:, :, :700].contiguous(), "bottom_right")  # 1500 queries over 700 keys
    assert len(calls) == 3, f"bottom-right with Nq > Nk ran the Gluon kernel: {calls}"
    assert not fwd_mod.HOPPER_FAILED, fwd_mod.HOPPER_FAILED


@hopper_gpu
def test_training_step_through_it():
    """flash_attention forward (Gluon kernel) + backward (Triton kernels, from the Gluon kernel's L)
    against the float64 reference, at a size where `choose` picks a kernel for each head dim."""
    for d, n, heads in ((128, 1024, 16), (64, 2048, 12)):  # grids that fill the GPU (`choose`'s grid rule)
        assert hopper.choose(d, False, n, n, 0, heads, course_lib.runtime.sm_count()) is not None
        torch.manual_seed(d)
        q, k, v = random_qkv((1, heads, n, d), n, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        do = torch.randn_like(q)
        o = course_lib.flash_attention(q, k, v)
        o.backward(do)
        q64, k64, v64, do64 = (t.detach().cpu().double() for t in (q, k, v, do))
        ref_o, ref_g = reference_outputs(q64, k64, v64, False, None, do64)
        base_o, base_g = reference_outputs(q, k, v, False, None, do)
        assert_close_to_reference(o, ref_o, base_o, what=f"O, d={d}, N={n}")
        for name, t, r, b in zip(("dq", "dk", "dv"), (q, k, v), ref_g, base_g):
            assert_close_to_reference(t.grad, r, b, what=f"{name}, d={d}, N={n}")


def test_key_splits_fill_the_waves():
    """`key_splits`: no split where the tiles fill their waves (every cell of the standard grid); a cached
    prompt's rest (3280 rows over 32k keys at 16 heads: 416 tiles of 128 rows, 3.15 waves of 132 SMs) is split
    so that its waves are fuller, never into more runs than its shortest tile has key blocks."""
    for d in (64, 128):
        for n in (1024, 4096, 16384):
            for causal in (False, True):
                variant = hopper.choose(d, causal, n, n) or hopper.VARIANTS[d][0]
                heads = 16384 // n * 2048 // d
                assert hopper.key_splits(variant, heads, n, n, causal, 0, 132) == 1, (d, n, causal)
        variant = hopper.choose(d, True, 3280, 32768, 32768 - 3280)
        splits = hopper.key_splits(variant, 16, 3280, 32768, True, 32768 - 3280, 132)
        tiles = -(-3280 // (hopper.QUERY_ROWS * variant.num_consumers)) * 16
        waves = splits * tiles / 132
        assert splits > 1 and waves / -(-waves // 1) > 0.9, (d, splits, waves)
        # 200 rows over 300 keys: the shortest tile (rows 0-127) sees 3 blocks of 128 at most
        short = hopper.key_splits(hopper.VARIANTS[d][0], 4, 200, 300, True, 100, 132)
        assert 1 <= short <= 3, short


def test_stream_work_gives_every_program_an_equal_span():
    """`stream_work` (stream-K): the tiles' key blocks in the kernel's order, cut into one span a program that
    differ by at most a block; every block in exactly one span; no tile in more than two parts (the two slots of
    partials); None where spans would be shorter than a tile or tiles are fewer than programs."""
    variant = hopper.D64_ROWS_128
    shapes = ((16, 3280, 32768, True, 132), (4, 1000, 5000, True, 8), (3, 700, 4000, False, 5))
    for heads, n_q, n_k, causal, sms in shapes:
        offset = n_k - n_q if causal else 0
        table = hopper.stream_work(variant, heads, n_q, n_k, causal, offset, sms)
        assert table is not None and table.dtype.name == "int32" and table.shape == (sms + 1, 2)
        rows = 128
        num_m = -(-n_q // rows)
        blocks = []
        for t in range(num_m * heads):
            m = num_m - 1 - t % num_m if causal else t % num_m
            n = -(-n_k // 128)
            blocks.append(min(n, -(-((m + 1) * rows + offset) // 128)) if causal else n)
        starts = [0]
        for b in blocks:
            starts.append(starts[-1] + b)
        at = [starts[t] + lo for t, lo in table.tolist()]
        assert at[0] == 0 and at[-1] == starts[-1] and table[-1].tolist() == [len(blocks), 0]
        spans = [b - a for a, b in zip(at, at[1:])]
        assert max(spans) - min(spans) <= 1 and min(spans) >= max(blocks)
        cuts = [t for t, lo in table[1:-1].tolist() if lo > 0]
        assert len(cuts) == len(set(cuts))  # a tile cut once at most: two parts
    assert hopper.stream_work(variant, 4, 1000, 5000, True, 4000, 132) is None  # 32 tiles, 132 programs
    # causal top-left, one head of 140 tiles: 1 to 140 blocks, 9870 in all, spans of 74 on 132 programs
    assert hopper.stream_work(variant, 1, 140 * 128, 140 * 128, True, 0, 132) is None


# (q shape (B, H, Nq), Hkv, Nk, causal, splits): bottom-right (offsets 64 does not divide), non-causal, grouped
SPLIT_CASES = [
    ((1, 4, 200), 2, 2345, "bottom_right", 2),
    ((2, 3, 300), 3, 1531, "bottom_right", 3),
    ((1, 4, 77), 1, 1200, "bottom_right", 5),
    ((2, 2, 1000), 2, 1531, False, 3),
]


def _partials_match_reference(case, d, slots, launches, seed):
    """Draw q, k, v (bf16) for `case` ((B, H, Nq), Hkv, Nk, causal, _); for each (what, launch) of `launches`,
    launch(q, k, v, o_part, l_part, offset) fills `slots` slots of partials, which start as NaN (an unused slot's
    O must not be read), notebook 09's combine merges them, and O and L are checked against float64."""
    from course_lib.decode.combine import combine

    (B, H, n_q), hkv, n_k, causal, _ = case
    torch.manual_seed(seed)
    q = torch.randn(B, H, n_q, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, hkv, n_k, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ref_o, ref_l = reference_attention(*(t.cpu().double() for t in (q, k, v)), causal, return_lse=True)
    base_o, _ = reference_outputs(q, k, v, causal)
    offset = n_k - n_q if causal else 0
    for what, launch in launches:
        o_part = torch.full((slots, B, H, n_q, d), float("nan"), device="cuda")
        l_part = torch.full((slots, B, H, n_q), float("nan"), device="cuda")
        launch(q, k, v, o_part, l_part, offset)
        o = torch.empty(B, n_q, H, d, device="cuda", dtype=q.dtype)
        lse = torch.empty(B, n_q, H, device="cuda")
        combine(o_part.permute(0, 1, 3, 2, 4), l_part.permute(0, 1, 3, 2), o, lse)
        what = f"{(B, H, n_q, d)} x {n_k} {causal}, {what}"
        assert_close_to_reference(o.transpose(1, 2), ref_o, base_o, what=f"O, {what}")
        torch.testing.assert_close(
            lse.transpose(1, 2).cpu().double(), ref_l, rtol=1e-4, atol=1e-4, msg=f"L, {what}"
        )


@hopper_gpu
@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("case", SPLIT_CASES, ids=[f"{c[0]}x{c[2]} {c[3]} S={c[4]}" for c in SPLIT_CASES])
def test_key_splits_match_reference(case, d):
    """Every variant with its keys cut into S runs (`forward`'s key_splits), the partials merged by notebook
    09's combine: O and L against float64, bf16."""
    (_, _, n_q), _, n_k, causal, splits = case

    def launch(variant):
        return lambda q, k, v, o, lse, offset: hopper.forward(
            q, k, v, o, lse, bool(causal), d**-0.5, variant, offset, splits
        )

    runs = [(f"{splits} splits, variant {variant}", launch(variant)) for variant in hopper.VARIANTS[d]]
    _partials_match_reference(case, d, splits, runs, seed=n_q * 7 + n_k + d)


# (q shape (B, H, Nq), Hkv, Nk, causal, programs): each program's span a few tiles long, tiles cut mid-way
STREAM_CASES = [
    ((1, 4, 1000), 2, 5000, "bottom_right", 8),
    ((2, 3, 300), 3, 1531, "bottom_right", 4),
    ((1, 6, 700), 2, 4000, False, 5),
]


@hopper_gpu
@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("case", STREAM_CASES, ids=[f"{c[0]}x{c[2]} {c[3]} P={c[4]}" for c in STREAM_CASES])
def test_stream_k_matches_reference(case, d):
    """Stream-K (`forward`'s work, `stream_work`'s table for a few programs): each program's even share of the
    key blocks, a tile cut between two programs into the two slots of partials, merged by notebook 09's combine,
    against float64, bf16."""
    (B, H, n_q), _, n_k, causal, programs = case
    offset = n_k - n_q if causal else 0
    variant = hopper.D64_ROWS_128 if d == 64 else hopper.D128_LONG
    table = hopper.stream_work(variant, B * H, n_q, n_k, bool(causal), offset, programs)
    assert table is not None and (table[1:-1, 1] > 0).any(), "no tile is cut: the case tests nothing"
    work = torch.from_numpy(table).cuda()

    def launch(q, k, v, o, lse, offset):
        hopper.forward(q, k, v, o, lse, bool(causal), d**-0.5, variant, offset, work=work)

    _partials_match_reference(case, d, 2, [(f"{programs} programs", launch)], seed=n_q * 5 + n_k + d)


def test_forward_names_wrong_outputs_and_split_counts():
    """`forward` refuses, by name and before any launch, a split count that is not an int >= 1 and outputs whose
    shapes do not match q's (head-major, token-major, with a leading split dimension)."""
    q = torch.zeros(1, 4, 200, 64)
    k = torch.zeros(1, 2, 300, 64)
    variant = hopper.VARIANTS[64][0]
    o, lse = torch.zeros(1, 4, 200, 64), torch.zeros(1, 4, 200)
    bad = [
        (dict(key_splits=0), o, lse, "key_splits"),
        (dict(key_splits=2.0), o, lse, "key_splits"),
        (dict(key_splits=True), o, lse, "key_splits"),
        (dict(token_major=True), o, lse, "token-major"),  # (B, H, Nq, d) given where (B, Nq, H, d) is asked
        (dict(key_splits=2), o, lse, "2 key splits"),  # no split dimension
        (dict(work=torch.zeros(5, 2, dtype=torch.int32), key_splits=2), o, lse, "key_splits=1"),
        (dict(work=torch.zeros(5, 2)), torch.zeros(2, 1, 4, 200, 64), torch.zeros(2, 1, 4, 200), "int32"),
        (
            dict(work=torch.zeros(5, 3, dtype=torch.int32)),
            torch.zeros(2, 1, 4, 200, 64),
            torch.zeros(2, 1, 4, 200),
            "int32",
        ),
        ({}, torch.zeros(1, 4, 200, 32), lse, "head-major"),
        ({}, o, torch.zeros(1, 4, 199), "head-major"),
    ]
    for kwargs, o4, lse3, words in bad:
        with pytest.raises(ValueError, match=words):
            hopper.forward(q, k, k, o4, lse3, True, 0.125, variant, 100, **kwargs)
