"""Tune and benchmark course_lib's Triton FlashAttention-2 against PyTorch SDPA on a CUDA GPU.

    COURSE_DEVICE=cuda python3 scripts/gpu_tune.py [--out DIR] [--quick] [--workers 12]

1. Compiles every autotune candidate of the forward, dK/dV and dQ kernels in parallel worker processes
   (Triton's on-disk cache then serves the autotuner in the main process, which only times them).
2. For the standard shapes (bf16, B * N = 16384 tokens, H * d = 2048, N in 1k..16k, d in 64/128,
   causal and not) checks ours and SDPA's FLASH_ATTENTION backend against a float32 reference on one
   (batch, head), then times forward and forward+backward of SDPA's default backend, SDPA's
   FLASH_ATTENTION backend and ours (triton.testing.do_bench, median), in one run.
3. Peak memory of forward+backward at N = 16k against inputs + outputs + gradients.
Prints a compact table last; writes every timing and the autotuner's choices to DIR/tune.json.
TFLOP/s: 4 * B * H * N^2 * d per forward, halved when causal; forward+backward counts 3.5x.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

os.environ.setdefault("COURSE_DEVICE", "cuda")

from course_lib.perf.timing import attention_flops  # noqa: E402

TOKENS, HIDDEN = 16384, 2048
SEQ_LENS = (1024, 2048, 4096, 8192, 16384)


def flops(b, h, n, d, causal, mode):
    return attention_flops(b, h, n, n, d, causal, mode)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="N in {1k, 4k, 16k} only")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--deadline", type=float, default=400.0, help="seconds; later cells are skipped")
    ap.add_argument("--no-atomic", action="store_true")
    args = ap.parse_args()
    t_start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import torch

    import course_lib
    from course_lib.runtime import triton

    assert course_lib.ON_GPU, "needs a CUDA GPU"
    print(
        f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}",
        flush=True,
    )

    # 1. parallel compilation of every candidate (course_lib.attention.precompile)
    from course_lib.attention.precompile import precompile

    seconds, errors = precompile(workers=args.workers)
    print(f"precompiled every candidate in {seconds:.0f} s", flush=True)
    for e in errors:
        print(f"  could not compile {e}")

    rows, record = [], {"cells": [], "compile_errors": errors}
    seq_lens = (1024, 4096, 16384) if args.quick else SEQ_LENS

    for d in (64, 128):
        for causal in (False, True):
            for n in seq_lens:
                if time.time() - t_start > args.deadline:
                    print(f"deadline: skipping d={d} causal={causal} N={n}")
                    continue
                cell = _bench_cell(d, causal, n, atomic=not args.no_atomic and n == 4096)
                record["cells"].append(cell)
                rows.append(cell)
                print(_row(cell), flush=True)

    # 3. memory at N = 16k: allocations during forward + backward on top of q, k, v, dO
    if time.time() - t_start < args.deadline + 30:
        record["memory"] = _memory(16384, 128)

    (out / "tune.json").write_text(json.dumps(record, indent=1, default=str))
    _summary(rows)
    print(f"total {time.time() - t_start:.0f} s")


def _tuned(tuner):
    """The autotuner's last choice and the median ms of every candidate it timed."""
    timings = getattr(tuner, "configs_timings", None) or {}
    return str(tuner.best_config), {
        str(c): round(t[0] if isinstance(t, list) else t, 4) for c, t in timings.items()
    }


def _bench_cell(d, causal, n, atomic):
    """Check and time one standard shape: ours, SDPA FLASH_ATTENTION, SDPA default."""
    import torch
    import torch.nn.functional as Fn
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from course_lib.attention import backward as B
    from course_lib.attention import flash_attention
    from course_lib.attention import forward as F
    from course_lib.runtime import triton

    do_bench = triton.testing.do_bench
    b, h = TOKENS // n, HIDDEN // d
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    do = torch.randn_like(q)
    impls = {
        "ours": lambda q, k, v: flash_attention(q, k, v, causal=causal),
        "flash": lambda q, k, v: _sdpa(Fn, sdpa_kernel, SDPBackend.FLASH_ATTENTION, q, k, v, causal),
        "default": lambda q, k, v: Fn.scaled_dot_product_attention(q, k, v, is_causal=causal),
    }
    cell = {"d": d, "causal": causal, "N": n, "B": b, "H": h}
    impls["ours"](q, k, v).backward(do)  # warm-up: ours autotunes here
    cell["fwd_cfg"] = _tuned(F._fwd_tuned)
    cell["dkdv_cfg"] = _tuned(B._dkdv_tuned)
    cell["dq_cfg"] = _tuned(B._dq_tuned)
    if n <= 4096:
        cell["check"] = _check(q, k, v, do, causal, impls)
    for name, fn in impls.items():
        ms_f = do_bench(lambda fn=fn: fn(q, k, v), warmup=25, rep=100, return_mode="median")
        ms_fb = do_bench(
            lambda fn=fn: fn(q, k, v).backward(do),
            warmup=25,
            rep=100,
            grad_to_none=[q, k, v],
            return_mode="median",
        )
        cell[name] = {
            "fwd_ms": ms_f,
            "fwd_bwd_ms": ms_fb,
            "fwd_tflops": flops(b, h, n, d, causal, "fwd") / ms_f * 1e-9,
            "fwd_bwd_tflops": flops(b, h, n, d, causal, "fwd_bwd") / ms_fb * 1e-9,
        }
    if atomic:
        qd, kd, vd = q.detach(), k.detach(), v.detach()
        o, lse = F.forward(qd, kd, vd, causal, None)
        for mode in ("two_kernel", "atomic"):

            def run(mode=mode):
                return B.backward(do, qd, kd, vd, o, lse, causal, None, dq_mode=mode)

            run()
            ms = do_bench(run, warmup=25, rep=100, return_mode="median")
            cell[f"bwd_{mode}_tflops"] = flops(b, h, n, d, causal, "bwd") / ms * 1e-9
        cell["atomic_cfg"] = _tuned(B._dkdv_atomic_tuned)
    torch.cuda.empty_cache()
    return cell


def _memory(n, d):
    """Peak memory of one forward + backward (causal=False), step by step."""
    import torch

    import course_lib.attention.api as api
    from course_lib.attention import flash_attention

    q, k, v = (
        torch.randn(1, HIDDEN // d, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    do = torch.randn_like(q)
    flash_attention(q, k, v).backward(do)  # warm-up: compiled and tuned before measuring
    for t in (q, k, v):
        t.grad = None
    torch.cuda.synchronize()
    mem = {"inputs": 4 * q.numel() * q.element_size()}
    mem["allocated_before"] = torch.cuda.memory_allocated()
    original = api._backward

    def traced(*a, **kw):
        torch.cuda.synchronize()
        mem["backward_entry"] = torch.cuda.memory_allocated()
        out = original(*a, **kw)
        torch.cuda.synchronize()
        mem["backward_exit"] = torch.cuda.memory_allocated()
        return out

    api._backward = traced
    try:
        torch.cuda.reset_peak_memory_stats()
        o = flash_attention(q, k, v)
        torch.cuda.synchronize()
        mem["after_forward"] = torch.cuda.memory_allocated()
        o.backward(do)
        torch.cuda.synchronize()
    finally:
        api._backward = original
    mem["peak"] = torch.cuda.max_memory_allocated()
    mem["after"] = torch.cuda.memory_allocated()
    ideal = 8 * q.numel() * q.element_size()  # q, k, v, dO, O, dq, dk, dv
    extra = mem["peak"] - mem["allocated_before"]
    mib = {key: round(val / 2**20, 1) for key, val in mem.items()}
    print(f"memory N={n} d={d} fwd+bwd (MiB): {mib}")
    print(
        f"memory: peak above what existed before = {extra / 2**20:.0f} MiB; inputs q,k,v,dO + that = "
        f"{(extra + mem['inputs']) / 2**20:.0f} MiB vs inputs+outputs+grads {ideal / 2**20:.0f} MiB "
        f"({(extra + mem['inputs']) / ideal:.3f}x)"
    )
    mem["ratio"] = (extra + mem["inputs"]) / ideal
    return mem


def _sdpa(Fn, sdpa_kernel, backend, q, k, v, causal):
    with sdpa_kernel(backend):
        return Fn.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _check(q, k, v, do, causal, impls):
    """Max error of O, dq, dk, dv on (batch 0, head 0), relative to the float32 reference's max, for
    ours and SDPA FLASH."""
    import torch

    qs, ks, vs = (t[:1, :1].detach().float().requires_grad_(True) for t in (q, k, v))
    s = qs @ ks.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, device=q.device, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.softmax(s, -1) @ vs
    ref.backward(do[:1, :1].float())
    refs = [ref.detach(), qs.grad, ks.grad, vs.grad]
    res = {}
    for name in ("ours", "flash"):
        qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        o = impls[name](qq, kk, vv)
        o.backward(do)
        outs = [o[:1, :1], qq.grad[:1, :1], kk.grad[:1, :1], vv.grad[:1, :1]]
        res[name] = [float((a.float() - r).abs().max() / r.abs().max()) for a, r in zip(outs, refs)]
    res["ok"] = all(a <= 2 * b + 2e-3 and math.isfinite(a) for a, b in zip(res["ours"], res["flash"]))
    return res


def _row(c):
    o, f, dft = c["ours"], c["flash"], c["default"]
    chk = c.get("check", {})
    ff, fd = o["fwd_tflops"] / f["fwd_tflops"], o["fwd_tflops"] / dft["fwd_tflops"]
    bf = o["fwd_bwd_tflops"] / f["fwd_bwd_tflops"]
    return (
        f"d={c['d']:3d} causal={int(c['causal'])} N={c['N']:5d} | fwd {o['fwd_tflops']:4.0f} "
        f"flash {f['fwd_tflops']:4.0f} dflt {dft['fwd_tflops']:4.0f} ({ff:.2f}x, {fd:.2f}x) | "
        f"f+b {o['fwd_bwd_tflops']:4.0f} flash {f['fwd_bwd_tflops']:4.0f} dflt {dft['fwd_bwd_tflops']:4.0f} "
        f"({bf:.2f}x) {'' if not chk else ('ok' if chk['ok'] else 'CHECK-FAIL')}"
    )


def _summary(rows):
    if not rows:
        return
    print("\nchosen configs (fwd | dkdv | dq):")
    for c in rows:
        cfgs = " | ".join(c[key][0] for key in ("fwd_cfg", "dkdv_cfg", "dq_cfg"))
        print(f"  d={c['d']} causal={int(c['causal'])} N={c['N']}: {cfgs}")
    for c in rows:
        if "bwd_atomic_tflops" in c:
            two, atomic = c["bwd_two_kernel_tflops"], c["bwd_atomic_tflops"]
            print(
                f"  bwd-only TFLOP/s d={c['d']} causal={int(c['causal'])} N={c['N']}: "
                f"two_kernel {two:.0f}, atomic {atomic:.0f}"
            )
        if "check" in c and not c["check"]["ok"]:
            print(f"  CHECK FAIL d={c['d']} causal={c['causal']} N={c['N']}: {c['check']}")
    print("\n" + "\n".join(_row(c) for c in rows))
    r_ff = [c["ours"]["fwd_tflops"] / c["flash"]["fwd_tflops"] for c in rows]
    r_fd = [c["ours"]["fwd_tflops"] / c["default"]["fwd_tflops"] for c in rows]
    r_bf = [c["ours"]["fwd_bwd_tflops"] / c["flash"]["fwd_bwd_tflops"] for c in rows]
    gm = math.exp(sum(map(math.log, r_fd)) / len(r_fd))
    print(f"fwd vs FLASH: min {min(r_ff):.2f}x | fwd vs default: geomean {gm:.2f}x | "
          f"fwd+bwd vs FLASH: min {min(r_bf):.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
