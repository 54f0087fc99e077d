"""Random inputs and the accuracy rule that every attention implementation in the course is held to.

The rule (used by tests and notebooks alike): an implementation's error against the float64
reference may be at most `factor` (2) times the error of plain PyTorch standard attention computed
in the same dtype as the inputs, plus a small floor. A kernel is judged against what its dtype
allows, not against a tolerance picked to make it pass.
"""

from __future__ import annotations

import math
import zlib

import torch

from . import runtime
from .attention.merge import merge_attention_states
from .attention.reference import attention
from .exercises import check

# Floors: absolute slack on top of 2x the same-dtype reference's error, per dtype.
FLOOR = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def seeded_randn(*shape, dtype=torch.float32, seed: int = 0, device=None) -> torch.Tensor:
    """Standard-normal values of `shape` drawn on the CPU from `seed` (the same on every device), then
    cast to `dtype` and moved to `device` (default: course_lib's)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(
        dtype=dtype, device=runtime.DEVICE if device is None else device
    )


def merge_cases(d: int = 8, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Partial attention results (o_a, lse_a, o_b, lse_b), float64 on the CPU, shapes (5, d) and (5,),
    whose rows are the cases a merge of two partials must handle: keys in both parts, only in b, in
    neither (o = 0, lse = -inf), logsumexps of 800 and 799 (exp overflows even float64 above ~709), and
    only in a. The exercises on the merge (notebooks 09 and 13) check a learner's merge on them."""
    inf = float("inf")
    lse_a = torch.tensor([0.5, -inf, -inf, 800.0, 1.5], dtype=torch.float64)
    lse_b = torch.tensor([2.0, 1.0, -inf, 799.0, -inf], dtype=torch.float64)
    o_a, o_b = (seeded_randn(5, d, dtype=torch.float64, seed=seed + i, device="cpu") for i in (0, 1))
    # a part that saw no key holds o = 0
    return o_a * lse_a.isfinite()[:, None], lse_a, o_b * lse_b.isfinite()[:, None], lse_b


MERGE_HINTS = [
    "Each part's share of the row's probability mass is exp(lse_part - lse), with lse = log(exp(lse_a) + "
    "exp(lse_b)). Computed as written, exp(800) overflows: torch.logaddexp computes the same log safely.",
    "lse = torch.logaddexp(lse_a, lse_b); safe = lse with -inf replaced by 0 (a row empty in both parts); "
    "return exp(lse_a - safe)[..., None] * o_a + exp(lse_b - safe)[..., None] * o_b, lse",
]


def check_merge(name: str, merge) -> None:
    """The exercise check of a learner's `merge(o_a, lse_a, o_b, lse_b) -> (o, lse)` (notebooks 09 and 13):
    on `merge_cases`, against `merge_attention_states`, with MERGE_HINTS."""
    o_a, lse_a, o_b, lse_b = merge_cases()
    expected = merge_attention_states(o_a, lse_a, o_b, lse_b)
    check(name, lambda: merge(o_a, lse_a, o_b, lse_b), expected, parts=["o", "lse"], hints=MERGE_HINTS)


def random_qkv(
    shape_q,
    n_keys: int | None = None,
    *,
    dtype=torch.float32,
    device=None,
    transposed: bool = False,
    scale: float = 1.0,
    requires_grad: bool = False,
    generator: torch.Generator | None = None,
    kv_heads: int | None = None,
):
    """Fresh standard-normal q (shape_q), k and v (shape_q with n_keys rows) times `scale`.

    `transposed=True` returns non-contiguous views: the tensors are stored as (..., d, N) and
    transposed, so kernels must honour strides. `kv_heads` gives k and v that many heads (dim -3 of
    shape_q (..., H, N, d)): grouped-query attention. Never zeros: zeros hide indexing bugs."""
    *lead, n_q, d = shape_q
    n_k = n_q if n_keys is None else n_keys
    lead_kv = lead if kv_heads is None else [*lead[:-1], kv_heads]

    def make(n, lead):
        if transposed:
            t = torch.randn(*lead, d, n, generator=generator, dtype=torch.float32).transpose(-1, -2)
        else:
            t = torch.randn(*lead, n, d, generator=generator, dtype=torch.float32)
        t = (t * scale).to(dtype=dtype, device=device)
        if requires_grad:
            t.requires_grad_(True)
        return t

    return make(n_q, lead), make(n_k, lead_kv), make(n_k, lead_kv)


def gqa_qkv(b: int, hq: int, hkv: int, n_q: int, n_k: int, d: int, dtype, seed: int, device=None):
    """q (b, hq, n_q, d), k and v (b, hkv, n_k, d) (grouped-query attention when hkv < hq) drawn on the
    CPU from `seed` (the same values on every device), in `dtype`, on `device` (default: course_lib's)."""
    g = torch.Generator().manual_seed(seed)
    device = runtime.DEVICE if device is None else device
    return random_qkv((b, hq, n_q, d), n_k, kv_heads=hkv, dtype=dtype, device=device, generator=g)


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| in float64; inf if `actual` holds a NaN or an inf (the references the
    tests compare with are finite)."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if a.shape != e.shape:
        raise AssertionError(f"shape {tuple(a.shape)} != expected {tuple(e.shape)}")
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - e).abs().max()) if a.numel() else 0.0


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| over the whole tensor, in float64: the measure for a gradient
    whose entries are mostly small next to an absolute tolerance (0 when both are zero). Either device."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    return ((a - e).norm() / e.norm().clamp_min(1e-30)).item()


def assert_close_to_reference(actual, reference64, baseline, what: str, factor: float = 2.0, floor=None):
    """Assert error(actual) <= factor * error(baseline) + floor, both against `reference64`.

    `baseline` is the same quantity computed by plain PyTorch in the inputs' dtype; `what` names the
    case (shape, dtype, causal, device) in the failure message."""
    floor = FLOOR.get(actual.dtype, 1e-3) if floor is None else floor
    err, base = max_error(actual, reference64), max_error(baseline, reference64)
    bound = factor * base + floor
    if not err <= bound:
        raise AssertionError(
            f"{what}: max error {err:.3g} against the float64 reference exceeds {bound:.3g} "
            f"(= {factor} x plain PyTorch's {base:.3g} in {actual.dtype} + floor {floor:.1g})"
        )


def assert_grads_close_to_reference(
    grads: dict, grads64: dict, baseline: dict, what: str, factor=2.0, floor=1e-3
):
    """Each named gradient (a model's parameters, say) within `factor` x the relative error of `baseline`
    plus `floor`, both against `grads64` (`relative_error`). `baseline`: the same gradients from plain
    PyTorch (SDPA) in the low-precision dtype, where the dtype's own matrix products set most of the error;
    a wrong attention gradient is off by ~1, not by ~1e-2."""
    assert grads.keys() == grads64.keys() == baseline.keys(), (sorted(grads), sorted(grads64))
    for name, g64 in grads64.items():
        err, base = relative_error(grads[name], g64), relative_error(baseline[name], g64)
        assert err <= factor * base + floor, (
            f"{what}: grad of {name}: relative error {err:.3g}, PyTorch's {base:.3g}"
        )


def reference64(q, k, v, causal, heads_at_once: int = 8, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, L) of the float64 reference on the CPU for q (B, Hq, Nq, d), k and v (B, Hkv, Nk, d), a few heads at
    a time: its S and P take 8 bytes per (query, key) pair and head, 5.4 GB a matrix at 40 heads of 4096 x 4096,
    and several float64 references side by side in a test run's workers can fill a host. `heads_at_once`
    query heads (a multiple of the group, Hq / Hkv) per call of `attention`; kwargs go to it (scale, window)."""
    group = q.shape[1] // k.shape[1]
    step = max(group, heads_at_once // group * group)
    outs, lses = [], []
    for h in range(0, q.shape[1], step):
        kv = slice(h // group, (h + step) // group)
        o, lse = attention(
            *(t.detach().cpu().double() for t in (q[:, h : h + step], k[:, kv], v[:, kv])),
            causal, return_lse=True, **kwargs,
        )  # fmt: skip
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


def reference_outputs(q, k, v, causal: bool, scale=None, grad_out=None, window=None):
    """Forward (and, with grad_out, dq, dk, dv) of the standard reference on the given tensors
    (window: a sliding window, as in `flash_attention`).

    Runs on detached copies, so it works for float64 references and same-dtype baselines alike."""
    q, k, v = (t.detach().clone().requires_grad_(grad_out is not None) for t in (q, k, v))
    o = attention(q, k, v, causal=causal, scale=scale, window=window)
    if grad_out is None:
        return o.detach(), None
    o.backward(grad_out.to(o.dtype))
    return o.detach(), (q.grad, k.grad, v.grad)


def check_forward_backward(fn, q, k, v, causal, what: str) -> torch.Tensor:
    """`fn(q, k, v, causal=causal)` and its backward against the float64 reference, by the rule above
    (the bound from plain PyTorch in the inputs' dtype, which repeats K/V for grouped-query attention);
    O and every gradient finite, each gradient of its input's shape. q (..., Nq, d), k and v (..., Nk, d)
    with Hq a multiple of Hkv, any device and dtype `fn` takes. dO is drawn from a generator seeded by `what`, so
    that a failure repeats whatever ran before in the process. Returns O."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    o = fn(q, k, v, causal=causal)
    seeded = torch.Generator().manual_seed(zlib.crc32(what.encode()))
    do = torch.randn(o.shape, generator=seeded, dtype=torch.float32).to(o)
    o.backward(do)
    ref_o, ref_g = reference_outputs(
        *(t.detach().cpu().double() for t in (q, k, v)), causal, None, do.cpu().double()
    )
    base_o, base_g = reference_outputs(q, k, v, causal, None, do)
    assert torch.isfinite(o).all(), f"O has NaN/inf, {what}"
    assert_close_to_reference(o, ref_o, base_o, what=f"O, {what}")
    for name, t, r, b in zip(("dq", "dk", "dv"), (q, k, v), ref_g, base_g):
        assert t.grad.shape == t.shape, f"{name}, {what}: gradient shape {t.grad.shape}"
        assert torch.isfinite(t.grad).all(), f"{name} has NaN/inf, {what}"
        assert_close_to_reference(t.grad, r, b, what=f"{name}, {what}")
    return o.detach()


def run_cases(check, cases, threads: int | None = None) -> list:
    """`check(case)` for every case of `cases`; returns the results in order and raises the first failure.

    On a GPU the cases run from several threads at once (`threads`, default: `runtime.compile_workers(8)`).
    Each new kernel variant (a dtype, causal or not, another launch) is compiled by Triton on its first
    call, and most of a compile is spent in LLVM and ptxas, which release Python's lock: compiled
    side by side, a notebook's dozen variants cost a fraction of their time one after another. Under the
    interpreter (a CPU) the cases run one after another: the interpreter is not thread-safe. The cases
    share the GPU, so `check` must not time anything (compile in it, time afterwards). Notebooks 06-07."""
    from concurrent.futures import ThreadPoolExecutor

    cases = list(cases)
    if not runtime.ON_GPU or len(cases) < 2:
        return [check(case) for case in cases]
    threads = threads or runtime.compile_workers(8)
    device = torch.cuda.current_device()  # a new thread starts on GPU 0: keep the caller's GPU

    def on_device(case):
        with torch.cuda.device(device):
            return check(case)

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(on_device, cases))


# Decoding (notebooks 09-10): the inputs and the rule every decode kernel's (out, lse) is judged by.
# Max |lse - reference lse|, every dtype. The kernels compute the scores and the logsumexp in fp32 from the
# inputs as stored (on a GPU the 16-bit products accumulate in fp32 on the tensor cores), so what is left is
# fp32 rounding: about 1e-6 on the CPU for fp32, fp16 and bf16 alike. Absolute rather than relative to |lse|,
# because lse is used through exp(lse) (merging splits, the backward pass): an error e scales those weights by
# exp(e) ~ 1 + e, whatever the size of lse.
LSE_TOL = 1e-4


def make_cache(B, n_max, hq, hkv, d, tq, dtype, seed=0, device=None):
    """A decoding step's q (B, tq, hq, d) and a contiguous cache k, v (B, n_max, hkv, d), standard normal,
    drawn on the CPU from `seed` (the same values on every device), in `dtype`, on `device` (default:
    course_lib's)."""
    device = runtime.DEVICE if device is None else device
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, tq, hq, d, generator=g).to(dtype=dtype, device=device)
    k = torch.randn(B, n_max, hkv, d, generator=g).to(dtype=dtype, device=device)
    v = torch.randn(B, n_max, hkv, d, generator=g).to(dtype=dtype, device=device)
    return q, k, v


def to_pages(k, v, page_size, seed=0):
    """Scatter contiguous caches (B, Nmax, Hkv, d) into a shuffled page pool with a spare page.

    Returns k_pages, v_pages (num_pages, page_size, Hkv, d), random values outside the sequences' pages,
    and the block table (B, ceil(Nmax / page_size)) int32, on the caches' device."""
    B, n_max, hkv, d = k.shape
    max_pages = math.ceil(n_max / page_size)
    num_pages = B * max_pages + 3
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))[: B * max_pages]
    table = perm.reshape(B, max_pages).to(torch.int32)
    pools = []
    for x in (k, v):
        pool = torch.randn(num_pages, page_size, hkv, d).to(dtype=x.dtype, device=x.device)  # junk elsewhere
        padded = torch.zeros(B, max_pages * page_size, hkv, d, dtype=x.dtype, device=x.device)
        padded[:, :n_max] = x
        pool[table.long().to(x.device)] = padded.view(B, max_pages, page_size, hkv, d)
        pools.append(pool)
    return pools[0], pools[1], table.to(k.device)


def same_dtype_baseline(q, k_cache, v_cache, cache_seqlens, causal=True):
    """Plain PyTorch attention (`attention.reference.attention`) in the inputs' dtype, on their device: what
    `decode_reference` computes, one sequence at a time over its valid keys, the kv heads repeated for GQA and
    the bottom-right causal mask, at the precision the dtype allows. Rows that see no key: out 0."""
    out = torch.zeros_like(q)
    for b, n in enumerate(cache_seqlens.tolist()):
        if n:
            qb = q[b : b + 1].transpose(1, 2)  # (1, Hq, Tq, d)
            kb, vb = (x[b : b + 1, :n].transpose(1, 2) for x in (k_cache, v_cache))  # (1, Hkv, n, d)
            out[b] = attention(qb, kb, vb, causal="bottom_right" if causal else False)[0].transpose(0, 1)
    return out


def decode_references(q, k_cache, v_cache, cache_seqlens, causal=True):
    """(out, lse) of the float64 reference and plain PyTorch's out in the inputs' dtype: what `assert_matches`
    judges a decode kernel's result by."""
    from .decode.reference import decode_reference

    ref_out, ref_lse = decode_reference(q, k_cache, v_cache, cache_seqlens, causal=causal)
    return ref_out, ref_lse, same_dtype_baseline(q, k_cache, v_cache, cache_seqlens, causal)


def assert_matches(out, lse, refs, case):
    """A decode kernel's out within twice plain PyTorch's error in the inputs' dtype plus a floor, lse within
    LSE_TOL of the float64 reference (`decode_references`), and rows that see no key give out 0 and lse -inf.

    The floor is the dtype's (`FLOOR`, set for outputs of order 1) times the largest |output|: the outputs
    shrink as the cache grows (about 0.05 at 16k keys), and a floor of fixed size would let a result that
    misses keys pass. It still covers rounding the output to the dtype (half an ulp: 2**-9 of |out| in bf16,
    2**-11 in fp16) twice over on its own."""
    ref_out, ref_lse, baseline = refs
    floor = FLOOR[out.dtype] * ref_out.abs().max().item()
    assert_close_to_reference(out, ref_out, baseline, f"{case}: out", floor=floor)
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse.cpu()), empty), f"{case}: -inf rows differ"
    assert (out.cpu()[empty] == 0).all(), f"{case}: a row that sees no key is not 0"
    if not empty.all():
        lerr = max_error(lse.cpu()[~empty], ref_lse[~empty])
        assert lerr <= LSE_TOL, f"{case}: max |lse - ref| = {lerr:.3g} > {LSE_TOL}"


# Fused kernels (notebook 11): elementwise results against float64 within about 2 units in the last place of
# the dtype, relative and near 1 (rtol, atol). The interpreter rounds float32 -> bfloat16 towards zero where a
# GPU rounds to nearest, so bf16's allows 2 units.
ULP_TOL = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def dtype_name(dtype) -> str:
    """'bfloat16' for torch.bfloat16: a test id."""
    return str(dtype).replace("torch.", "")


def assert_close_in_ulps(actual, expected, dtype, what: str, scale: float = 1.0) -> None:
    """actual (any dtype, any device) against a float64 expected, within ULP_TOL[dtype] x scale."""
    rtol, atol = ULP_TOL[dtype]
    torch.testing.assert_close(
        actual.detach().double().cpu(),
        expected.detach().double().cpu(),
        rtol=rtol * scale,
        atol=atol * scale,
        msg=lambda m: f"{what}: {m}",
    )


def eager_and_compiled(fn, inputs, grad_out):
    """(outputs, input gradients) of fn eagerly, then under torch.compile(fullgraph=True) (the aot_eager
    backend: on the CPU the kernels are interpreted; a graph break raises). `inputs`: tensors fn takes,
    `grad_out`: a tuple of gradients, one per output."""
    results = []
    torch._dynamo.reset()
    for run in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        outs = run(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.autograd.backward(outs, grad_out)
        results.append((tuple(o.detach() for o in outs), tuple(t.grad for t in leaves)))
    return results
