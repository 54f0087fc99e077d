"""The floor a memory-bound kernel of a given size can reach: a plain read and a plain copy of each
size, as CUDA-graph replays, against the read and copy ceilings (measured on 1-2 GiB).

    COURSE_DEVICE=cuda python3 scripts/ceiling_by_size.py
"""

from __future__ import annotations

import torch

from course_lib import runtime
from course_lib.perf.ceilings import (
    measure_copy_bandwidth,
    measure_copy_time,
    measure_read_bandwidth,
    measure_read_time,
)

SIZES_MB = (4, 34, 134, 268, 537, 1074, 2147)


def main() -> int:
    if not runtime.ON_GPU:
        raise SystemExit("ceiling_by_size.py times GPU memory: run it with COURSE_DEVICE=cuda on a GPU")
    read_gbps, copy_gbps = measure_read_bandwidth(dtype=torch.bfloat16), measure_copy_bandwidth()
    print(f"read ceiling {read_gbps:.0f} GB/s, copy ceiling {copy_gbps:.0f} GB/s")
    print("| MB | read us | % of read ceiling | copy us (bytes moved) | % of copy ceiling |")
    print("| --- | --- | --- | --- | --- |")
    for mb in SIZES_MB:
        nbytes = mb * 10**6
        read_ms, copy_ms = measure_read_time(nbytes), measure_copy_time(nbytes)
        print(
            f"| {mb} | {read_ms * 1e3:.1f} | {nbytes / read_ms / 1e6 / read_gbps:.0%} "
            f"| {copy_ms * 1e3:.1f} | {nbytes / copy_ms / 1e6 / copy_gbps:.0%} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
