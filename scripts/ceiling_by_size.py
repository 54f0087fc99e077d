"""The floor a memory-bound kernel of a given size can reach: a plain read and a plain copy of each
size, as CUDA-graph replays, against the read and copy ceilings (measured on 1-2 GiB). The last column
times the same read under `triton.testing.do_bench`, whose L2 flush writes a 256 MB buffer: the
difference is the flush's dirty lines, written back at the start of the timed kernel (notebook 08,
section 1.4; `perf.timing.benchmark` flushes with a read).

    COURSE_DEVICE=cuda python3 scripts/ceiling_by_size.py
"""

from __future__ import annotations

from functools import partial

import torch

from course_lib import runtime
from course_lib.perf.ceilings import (
    block_sums,
    measure_copy_bandwidth,
    measure_copy_time,
    measure_read_bandwidth,
    measure_read_time,
)
from course_lib.perf.timing import graphed

SIZES_MB = (4, 34, 134, 268, 537, 1074, 2147)


def main() -> int:
    if not runtime.ON_GPU:
        raise SystemExit("ceiling_by_size.py times GPU memory: run it with COURSE_DEVICE=cuda on a GPU")
    read_gbps, copy_gbps = measure_read_bandwidth(dtype=torch.bfloat16), measure_copy_bandwidth()
    print(f"read ceiling {read_gbps:.0f} GB/s, copy ceiling {copy_gbps:.0f} GB/s")
    print(
        "| MB | read us | % of read ceiling | copy us (bytes moved) | % of copy ceiling | read us, write flush |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for mb in SIZES_MB:
        nbytes = mb * 10**6
        read_ms, copy_ms = measure_read_time(nbytes), measure_copy_time(nbytes)
        x = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
        dirty_ms = runtime.triton.testing.do_bench(graphed(partial(block_sums, x)), return_mode="median")
        del x
        print(
            f"| {mb} | {read_ms * 1e3:.1f} | {nbytes / read_ms / 1e6 / read_gbps:.0%} "
            f"| {copy_ms * 1e3:.1f} | {nbytes / copy_ms / 1e6 / copy_gbps:.0%} | {dirty_ms * 1e3:.1f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
