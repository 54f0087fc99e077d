"""First-call time of course_lib's attention on a GPU: what a learner waits for the first time a shape runs.

Each measurement runs in a fresh Python process whose Triton cache is an empty folder, so every kernel
is compiled from scratch, as on a new machine. Times the first forward and the first backward of a
shape, then the first forward+backward of a second shape in the same process (new shape class, kernels
already compiled for the first), then of a model's head count (12) and of a 1000-token prompt (Triton
compiles apart for integers that divide by 16 and those that do not: `make setup` covers 16 heads and
power-of-two lengths), and SDPA's first call.

The last row runs first what `make setup` runs on a GPU machine (`python -m course_lib.attention.precompile
--setup`, timed apart as setup_precompile_s) into the same empty cache: the first call a learner meets
after setting the course up.

`import course_lib` (after torch) is timed too: on a GPU it starts building Triton's driver in a
background thread (`course_lib.runtime`), which a first call made at once would wait for.

PyTorch's own one-time costs are measured apart, before the timed calls, and reported as
`pytorch_first_backward_s`: the first autograd backward of a process imports sympy (through
torch.fx.experimental.symbolic_shapes), which takes seconds where the installed packages have no bytecode
cache. Every provider pays it once per process, whatever its kernels; it is not a cost of a new shape.

    COURSE_DEVICE=cuda python3 scripts/first_call.py [--out file.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time
import torch
t0 = time.perf_counter()
import course_lib
from course_lib import flash_attention
import_s = time.perf_counter() - t0
provider = sys.argv[1]
t0 = time.perf_counter()
x = torch.ones(2, requires_grad=True)
(x * 2).backward(torch.ones(2))  # PyTorch's first backward with a given gradient: its lazy imports, no kernel of ours
first_backward = time.perf_counter() - t0

def one(shape, causal):
    B, H, N, d = shape
    q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    fn = (lambda: flash_attention(q, k, v, causal=causal)) if provider == "course_lib" else (
        lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))
    torch.cuda.synchronize(); t0 = time.perf_counter()
    o = fn(); torch.cuda.synchronize(); t1 = time.perf_counter()
    o.backward(torch.randn_like(o)); torch.cuda.synchronize(); t2 = time.perf_counter()
    return t1 - t0, t2 - t1

fwd, bwd = one((4, 16, 4096, 128), True)
fwd2, bwd2 = one((2, 16, 2048, 64), False)
fwd3, bwd3 = one((1, 12, 1024, 128), True)  # a model's head count: 12 (not a multiple of 16)
fwd4, bwd4 = one((1, 12, 1000, 128), True)  # and a prompt of 1000 tokens (not a multiple of 16 either)
print(json.dumps({"provider": provider, "import_course_lib_s": import_s, "pytorch_first_backward_s": first_backward,
                  "first_fwd_s": fwd, "first_bwd_s": bwd, "first_fwd_bwd_s": fwd + bwd,
                  "second_shape_fwd_bwd_s": fwd2 + bwd2, "heads_12_fwd_bwd_s": fwd3 + bwd3,
                  "tokens_1000_fwd_bwd_s": fwd4 + bwd4}))
"""


def measure(provider: str, env_extra: dict, setup: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache, COURSE_DEVICE="cuda", **env_extra)
        setup_s = None
        if setup:  # what `make setup` does on a GPU machine, into the same (empty) cache, timed apart
            t0 = time.perf_counter()
            done = subprocess.run(
                [sys.executable, "-m", "course_lib.attention.precompile", "--setup"], env=env
            )
            setup_s = time.perf_counter() - t0
            if done.returncode:
                return {"provider": provider, "error": "precompile --setup failed"}
        out = subprocess.run([sys.executable, "-c", CHILD, provider], env=env, capture_output=True, text=True)
        if out.returncode:
            return {"provider": provider, "error": out.stderr[-2000:]}
        row = json.loads(out.stdout.strip().splitlines()[-1])
        return row if setup_s is None else dict(row, setup_precompile_s=setup_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--rows", default="sdpa,default,autotune,setup", help="which rows, comma-separated")
    args = parser.parse_args()
    runs = {
        "sdpa": lambda: measure("sdpa", {}),
        "default": lambda: dict(measure("course_lib", {}), mode="default (recorded or rule-chosen config)"),
        "autotune": lambda: dict(
            measure("course_lib", {"COURSE_AUTOTUNE": "1"}), mode="COURSE_AUTOTUNE=1 (no precompile)"
        ),
        "setup": lambda: dict(
            measure("course_lib", {}, setup=True), mode="after make setup's precompile (--setup)"
        ),
    }
    rows = [runs[name]() for name in args.rows.split(",")]
    for r in rows:
        print(json.dumps(r))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
