"""The cells where course_lib and the fastest PyTorch provider run at the same speed, timed many times.

One record gives one timing per provider and cell; where both providers run at the memory ceiling, a
record lands on either side of 1.0x by chance. This script times each such cell `--passes` times, both
providers in turn (`perf.timing.interleaved`, CUDA-graph replays captured once), and prints, per cell,
each provider's median and the per-pass ratio (the other provider's time over course_lib's, the two
timings of the same pass): its median, its 10th and 90th percentiles and how many passes reach 1.0x.

Cells (bf16): the RMSNorm forward at D = 8192 against torch.compile of the eager code
(course_lib.bench.fused); its backward kernels at T = 16k as a share of the copy ceiling; the split-KV
decode at the batches that read at the read ceiling against cuDNN, SDPA's fastest backend there
(course_lib.bench.decode; 32 query / 8 kv heads, d = 128).

    COURSE_DEVICE=cuda python3 scripts/tie_cells.py [--passes 30] [--only fused|decode]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from course_lib import runtime
from course_lib.bench.decode import HKV, HQ, D, kv_bytes
from course_lib.bench.fused import EPS, compiled_for_shape, llama_rms_norm, rms_norm_bytes
from course_lib.decode import decode_attention
from course_lib.fused import rms_norm
from course_lib.fused.rms_norm import rms_norm_backward, rms_norm_forward
from course_lib.perf.ceilings import measure_copy_bandwidth, measure_read_bandwidth
from course_lib.perf.timing import benchmark, graphed, interleaved

RMS_CELLS = [(4096, 8192), (16384, 8192), (65536, 8192)]  # (tokens, hidden)
RMS_BACKWARD_CELLS = [(16384, 2048), (16384, 4096), (16384, 8192)]  # nearest the 85 % line
DECODE_CELLS = [(16, 32768, False), (16, 32768, True), (64, 4096, True), (256, 1024, True), (8, 8192, True)]


def deciles(values: list[float]) -> tuple[float, float]:
    """The 10th and 90th percentiles of values (linear interpolation, as NumPy's default)."""
    cuts = statistics.quantiles(values, n=10, method="inclusive")
    return cuts[0], cuts[-1]


def report(name: str, nbytes: int, ceiling_gbps: float, times: dict, ours: str, theirs: str) -> None:
    """One line per cell: both medians (us, share of the ceiling) and the paired ratio's distribution."""
    ratios = [t / o for o, t in zip(times[ours], times[theirs])]
    p10, p90 = deciles(ratios)
    parts = []
    for who in (ours, theirs):
        ms = statistics.median(times[who])
        parts.append(f"{who} {ms * 1e3:7.1f} us ({nbytes / ms / 1e6 / ceiling_gbps:5.1%})")
    print(
        f"{name:22s} " + ", ".join(parts) + f"; {theirs}/{ours} median {statistics.median(ratios):.4f}"
        f" [p10 {p10:.4f}, p90 {p90:.4f}],"
        f" >= 1.0 in {sum(r >= 1.0 for r in ratios)}/{len(ratios)} passes",
        flush=True,
    )


def rms_cell(tokens: int, hidden: int, passes: int, copy_gbps: float) -> None:
    gen = torch.Generator(device="cuda").manual_seed(tokens + hidden)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = 1 + 0.1 * torch.randn(hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    compiled = compiled_for_shape(llama_rms_norm)
    with torch.no_grad():
        torch.testing.assert_close(rms_norm(x, w, EPS), compiled(x, w), rtol=2e-2, atol=2e-2)
        calls = {
            "course_lib": graphed(lambda: rms_norm(x, w, EPS)),
            "compile": graphed(lambda: compiled(x, w)),
        }
    times = interleaved(calls, passes)
    nbytes = rms_norm_bytes(tokens, hidden, "fwd")
    report(f"T={tokens} D={hidden}", nbytes, copy_gbps, times, "course_lib", "compile")


def rms_backward_cell(tokens: int, hidden: int, passes: int, copy_gbps: float) -> None:
    """The backward kernels alone (dX, the dW partial rows and their column sum) as a share of the copy
    ceiling: median and 10th percentile over the passes."""
    gen = torch.Generator(device="cuda").manual_seed(tokens - hidden)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = 1 + 0.1 * torch.randn(hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    dy = torch.randn_like(x)
    _, rstd = rms_norm_forward(x, w, EPS)
    times = interleaved({"backward": graphed(lambda: rms_norm_backward(dy, x, w, rstd))}, passes)["backward"]
    nbytes = rms_norm_bytes(tokens, hidden, "bwd")
    shares = [nbytes / ms / 1e6 / copy_gbps for ms in times]
    print(
        f"backward T={tokens} D={hidden}: {statistics.median(times) * 1e3:7.1f} us,"
        f" copy ceiling share median {statistics.median(shares):.1%}, p10 {deciles(shares)[0]:.1%}",
        flush=True,
    )


def decode_cell(batch: int, n: int, with_lengths: bool, passes: int, read_gbps: float) -> None:
    gen = torch.Generator().manual_seed(batch * n)
    q = torch.randn(batch, 1, HQ, D, generator=gen).to("cuda", torch.bfloat16)
    k = torch.randn(batch, n, HKV, D, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn(batch, n, HKV, D, generator=gen).to("cuda", torch.bfloat16)
    seqlens = torch.full((batch,), n, dtype=torch.int32, device="cuda") if with_lengths else None
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, N, d) views

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

    def ours():
        return decode_attention(q, k, v, seqlens)

    torch.testing.assert_close(ours(), cudnn().transpose(1, 2), rtol=2e-2, atol=2e-2)
    times = interleaved({"course_lib": graphed(ours), "cuDNN": graphed(cudnn)}, passes)
    name = f"B={batch} N={n // 1024}k" + (" lengths" if with_lengths else "")
    report(name, kv_bytes([n] * batch), read_gbps, times, "course_lib", "cuDNN")


def fused_cells(passes: int) -> None:
    copy_gbps = measure_copy_bandwidth()
    print(f"RMSNorm forward, bf16, graph replays; copy ceiling {copy_gbps:.0f} GB/s")
    for tokens, hidden in RMS_CELLS:
        rms_cell(tokens, hidden, passes, copy_gbps)
    for tokens, hidden in RMS_BACKWARD_CELLS:
        rms_backward_cell(tokens, hidden, passes, copy_gbps)


def decode_cells(passes: int) -> None:
    read_gbps = measure_read_bandwidth()
    print(
        f"Split-KV decode against cuDNN, bf16, {HQ}/{HKV} heads, d = {D}; read ceiling {read_gbps:.0f} GB/s"
    )
    for batch, n, with_lengths in DECODE_CELLS:
        decode_cell(batch, n, with_lengths, passes, read_gbps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=30, help="timings of each provider per cell")
    parser.add_argument("--only", choices=("fused", "decode"), default=None)
    args = parser.parse_args()
    if not runtime.ON_GPU:
        raise SystemExit("tie_cells.py times CUDA-graph replays: run it on a GPU (COURSE_DEVICE=cuda)")
    print(
        f"{torch.cuda.get_device_name()}, {args.passes} passes, timer: {benchmark.__name__} of a graph replay"
    )
    if args.only in (None, "fused"):
        fused_cells(args.passes)
    if args.only in (None, "decode"):
        decode_cells(args.passes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
