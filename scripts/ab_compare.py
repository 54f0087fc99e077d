"""Two checkouts of course_lib timed in one process, cell by cell, on a GPU: is a change free of slowdowns?

Make a copy of the older course_lib importable under another name, with its operator namespace renamed so
that both register their custom operators (`torch.library` names are process-wide):

    git archive <commit> course_lib | tar -x -C build/ab && mv build/ab/course_lib build/ab/course_lib_before
    grep -rl "course_lib::" build/ab/course_lib_before | xargs sed -i 's/course_lib::/course_lib_before::/g'
    COURSE_DEVICE=cuda PYTHONPATH=$PWD python scripts/ab_compare.py --before build/ab/course_lib_before

For every cell (attention forward and forward+backward, split-KV and paged decoding, cascade, RMSNorm, RoPE)
both versions run on the same fresh random inputs, alternately, three times; the table gives each one's median
of CUDA-graph replays (the GPU's work) and, for the attention and decoding cells, of eager calls (with the
host's time per call), and after/before. Run-to-run noise: the spread of the three alternations.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

import course_lib
from course_lib.perf.timing import graph_ms


def cells():
    """[(name, fn factory(lib) -> callable, eager too)] on fresh random inputs."""
    dev, bf16 = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, dtype=bf16):
        return torch.randn(*shape, device=dev, dtype=dtype, generator=gen)

    out = []
    for d, n, causal in ((128, 1024, True), (128, 4096, True), (128, 16384, False), (64, 1024, False),
                         (64, 8192, True)):  # fmt: skip
        h, b = 2048 // d, 16384 // n
        q, k, v = rnd(b, h, n, d), rnd(b, h, n, d), rnd(b, h, n, d)
        do = rnd(b, h, n, d)
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

        def fwd(lib, q=q, k=k, v=v, causal=causal):
            return lambda: lib.flash_attention(q, k, v, causal=causal)

        def fwd_bwd(lib, q=qg, k=kg, v=vg, do=do, causal=causal):
            def run():
                o = lib.flash_attention(q, k, v, causal=causal)
                torch.autograd.grad(o, (q, k, v), do)

            return run

        tag = f"d={d} N={n // 1024}k {'causal' if causal else 'full'}"
        out += [(f"attention fwd {tag}", fwd, True), (f"attention fwd+bwd {tag}", fwd_bwd, True)]
    for b, n, tq in ((1, 32768, 1), (64, 4096, 1), (8, 8192, 4)):
        q, kc, vc = rnd(b, tq, 32, 128), rnd(b, n, 8, 128), rnd(b, n, 8, 128)
        lens = torch.full((b,), n, dtype=torch.int32, device=dev)

        def dec(lib, q=q, kc=kc, vc=vc, lens=lens):
            return lambda: lib.decode.decode_attention(q, kc, vc, lens, validate=False)

        page = 16
        pages = b * n // page
        kp, vp = rnd(pages, page, 8, 128), rnd(pages, page, 8, 128)
        table = torch.randperm(pages, device=dev).to(torch.int32).view(b, -1)

        def paged(lib, q=q, kp=kp, vp=vp, table=table, lens=lens):
            return lambda: lib.decode.paged_decode_attention(q, kp, vp, table, lens, validate=False)

        tag = f"B={b} N={n // 1024}k Tq={tq}"
        out += [(f"decode {tag}", dec, True), (f"paged {tag}", paged, True)]
    b, p, s, page = 64, 32768, 1024, 64
    pages = (p + b * s) // page
    kp, vp = rnd(pages, page, 8, 128), rnd(pages, page, 8, 128)
    perm = torch.randperm(pages, device=dev).to(torch.int32)
    prefix_pages, suffix_table = perm[: p // page], perm[p // page :].view(b, -1)
    q = rnd(b, 1, 32, 128)
    slens = torch.full((b,), s, dtype=torch.int32, device=dev)

    def cascade(lib):
        f = importlib.import_module(f"{lib.__name__}.serving.cascade").cascade_decode_attention
        return lambda: f(q, kp, vp, prefix_pages, p, suffix_table, slens)

    out.append(("cascade B=64 P=32k S=1k", cascade, False))
    x, w = rnd(16384, 4096), rnd(4096)
    dy = rnd(16384, 4096)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    out.append(("rms_norm fwd T=16k D=4096", lambda lib: lambda: lib.fused.rms_norm(x, w), False))

    def rms_bwd(lib):
        def run():
            torch.autograd.grad(lib.fused.rms_norm(xg, wg), (xg, wg), dy)

        return run

    out.append(("rms_norm fwd+bwd T=16k D=4096", rms_bwd, False))
    qr, kr = rnd(1, 32, 8192, 128), rnd(1, 8, 8192, 128)

    def rope(lib):
        cos, sin = lib.fused.rope_cache(8192, 128, device=dev, dtype=bf16)
        return lambda: lib.fused.rope(qr, kr, cos, sin)

    out.append(("rope T=8k 32/8 heads", rope, False))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="directory of the older course_lib (renamed package)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    path = Path(args.before).resolve()
    sys.path.insert(0, str(path.parent))
    before = importlib.import_module(path.name)
    for sub in ("decode", "fused", "serving.cascade"):
        importlib.import_module(f"{path.name}.{sub}")
        importlib.import_module(f"course_lib.{sub}")
    libs = {"before": before, "after": course_lib}
    columns = f"{'graph before':>12s} {'after':>9s} {'ratio':>6s}"
    print(f"{'cell':40s} {columns}  {columns.replace('graph', 'eager')}")
    ratios = []
    for name, factory, eager in cells():
        fns = {key: factory(lib) for key, lib in libs.items()}
        graph = {key: [] for key in libs}
        host = {key: [] for key in libs}
        for _ in range(args.repeats):
            for key, fn in fns.items():
                graph[key].append(graph_ms(fn) * 1e3)
                if eager:
                    host[key].append(do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3)
        g = {key: statistics.median(v) for key, v in graph.items()}
        spread = max(max(v) / min(v) - 1 for v in graph.values())
        row = f"{name:40s} {g['before']:10.1f}us {g['after']:7.1f}us {g['after'] / g['before']:6.3f}"
        ratios.append(g["after"] / g["before"])
        if eager:
            e = {key: statistics.median(v) for key, v in host.items()}
            row += f"  {e['before']:10.1f}us {e['after']:7.1f}us {e['after'] / e['before']:6.3f}"
        print(row + f"   (spread {spread * 100:.1f} %)", flush=True)
    geo = statistics.geometric_mean(ratios)
    print(f"graph replays, after / before: geomean {geo:.3f}, max {max(ratios):.3f}, min {min(ratios):.3f}")


if __name__ == "__main__":
    main()
