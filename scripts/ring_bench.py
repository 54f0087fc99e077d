"""Ring attention on two GPUs against one GPU and against PyTorch's context_parallel (notebook 13).

    torchrun --nproc_per_node 2 scripts/ring_bench.py [--quick]
    COURSE_DEVICE=cpu torchrun --nproc_per_node 2 scripts/ring_bench.py   # CPU smoke run of the same steps

bf16, d = 128, 16 heads, batch 1, causal, total N in {32k, 128k, 512k} (--quick: {8k, 32k}). For each N:
forward + backward time of `course_lib.distributed.ring_attention` (zigzag and contiguous sharding) on the
two GPUs, of `course_lib.flash_attention` on the full sequence on one GPU, and of
`torch.distributed.tensor.experimental.context_parallel` around SDPA on the same two GPUs where the
installed torch has it. Also: the GPU-to-GPU bandwidth of the ring's transfers, and a torch.profiler
trace of one zigzag step at the middle N, summarised as compute time, communication time and the
share of the communication that ran while compute ran.
Writes the record `ring` (course_lib.records.save_record) and assets/benchmarks/ring-*.png from rank 0.
With COURSE_DEVICE=cpu the same steps run on CPU processes (gloo, tiny sizes, float32, no profile, no
record): a check of the script on a machine without GPUs, not a measurement.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

# NVLink multicast (NVLS) stays off (point-to-point transfers only; multicast can disturb a shared host);
# set before NCCL starts.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
os.environ.setdefault("COURSE_DEVICE", "cuda")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

GPU = os.environ["COURSE_DEVICE"] != "cpu"
DEVICE = "cuda" if GPU else "cpu"
if GPU:  # each process on its own GPU from the start (course_lib looks at the current device on import)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))

import course_lib  # noqa: E402
from course_lib import records  # noqa: E402
from course_lib.distributed import figures, ring_attention, shard  # noqa: E402
from course_lib.distributed.trace import overlap_summary  # noqa: E402

B, H, D = (1, 16, 128) if GPU else (1, 2, 32)
DTYPE = torch.bfloat16 if GPU else torch.float32
SINGLE_GPU_LIMIT_S = 30.0  # one GPU at 512k takes seconds per step: measured once, not more


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def log(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def sync() -> None:
    if GPU:
        torch.cuda.synchronize()


def seconds(fn, reps: int) -> float:
    """Seconds per call of fn over reps calls on this rank (CUDA events on a GPU, else wall clock)."""
    if not GPU:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def timed(fn, reps: int) -> float:
    """Seconds per call of fn (after one warm-up call), the slowest rank's, with both GPUs in step."""
    fn()
    sync()
    dist.barrier()
    t = torch.tensor(seconds(fn, reps), device=DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def full_inputs(n: int, seed: int = 0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return [torch.randn(B, H, n, D, device=DEVICE, dtype=DTYPE, generator=g) for _ in range(4)]  # q, k, v, dO


def reps_for(n: int) -> int:
    return max(1, min(10, (128 * 1024) // n * 2))


def ring_step(q, k, v, do, scheme):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def step():
        for t in leaves:
            t.grad = None
        ring_attention(*leaves, causal=True, sharding=scheme).backward(do)

    return step


def measure_ring(n: int, scheme: str) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, do = (shard(t, rank, world, scheme) for t in full_inputs(n))
    return timed(ring_step(q, k, v, do, scheme), reps_for(n))


def measure_one_gpu(n: int) -> float | None:
    """fwd + bwd of course_lib.flash_attention on the whole sequence on rank 0's GPU (None: no memory)."""
    t = torch.zeros((), device=DEVICE)
    if dist.get_rank() == 0:
        try:
            q, k, v, do = full_inputs(n)
            for x in (q, k, v):
                x.requires_grad_()

            def step():
                for x in (q, k, v):
                    x.grad = None
                course_lib.flash_attention(q, k, v, causal=True).backward(do)

            step()
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            once = time.perf_counter() - t0
            reps = max(1, min(reps_for(n), int(SINGLE_GPU_LIMIT_S / max(once, 1e-3)) - 1))
            t.fill_(seconds(step, reps))
        except torch.OutOfMemoryError:
            t.fill_(-1.0)
        if GPU:
            torch.cuda.empty_cache()
    dist.broadcast(t, 0)  # the other rank waits here
    return None if float(t) < 0 else float(t)


_MESH = None  # one device mesh for every context_parallel measurement


def measure_context_parallel(n: int) -> tuple[float | None, str]:
    """fwd + bwd of SDPA under torch's context_parallel on both GPUs; (None, why) where unavailable."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
    except ImportError as exc:
        return None, f"not in torch {torch.__version__}: {exc}"
    try:
        global _MESH
        if _MESH is None:
            _MESH = init_device_mesh(DEVICE, (dist.get_world_size(),))
        mesh = _MESH
        q, k, v, _ = full_inputs(n)
        with context_parallel(
            mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2], no_restore_buffers={q, k, v}
        ):
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            do = torch.randn_like(q)

            def step():
                for t in leaves:
                    t.grad = None
                F.scaled_dot_product_attention(*leaves, is_causal=True).backward(do)

            return timed(
                step, reps_for(n)
            ), "SDPA under context_parallel (default rotation and load balancing)"
    except Exception as exc:  # a prototype API: record why it did not run instead of stopping the benchmark
        return None, f"failed in torch {torch.__version__}: {type(exc).__name__}: {exc}"


def measure_bandwidth(n_bytes: int = 256 * 2**20) -> float:
    """GB/s of one rank's send to the next while receiving from the previous (the ring's transfer)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    send = torch.empty(n_bytes // DTYPE.itemsize, dtype=DTYPE, device=DEVICE).normal_()
    recv = torch.empty_like(send)

    def exchange():
        ops = [
            dist.P2POp(dist.isend, send, (rank + 1) % world),
            dist.P2POp(dist.irecv, recv, (rank - 1) % world),
        ]
        for r in dist.batch_isend_irecv(ops):
            r.wait()

    return n_bytes / timed(exchange, 10) / 1e9


def profile_zigzag(n: int) -> dict:
    """A torch.profiler trace of one zigzag forward + backward, summarised by `overlap_summary`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, do = (shard(t, rank, world, "zigzag") for t in full_inputs(n))
    step = ring_step(q, k, v, do, "zigzag")
    step()
    torch.cuda.synchronize()
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"trace{rank}.json")
        prof.export_chrome_trace(path)
        return overlap_summary(path)


def check_once(n: int) -> float:
    """Max |ring zigzag O - one-GPU O| on the gathered sequence (bf16; a sanity check, not the test)."""
    from course_lib.distributed import gather

    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, _ = full_inputs(n)
    with torch.no_grad():
        o = ring_attention(*(shard(t, rank, world, "zigzag") for t in (q, k, v)), causal=True)
        full = gather(o, "zigzag")
        return float((full.float() - course_lib.flash_attention(q, k, v, causal=True).float()).abs().max())


def run(quick: bool) -> dict:
    if not GPU:
        ns = [128, 256]
    else:
        ns = [8 * 1024, 32 * 1024] if quick else [32 * 1024, 128 * 1024, 512 * 1024]
    t_start = time.perf_counter()
    data = {
        "shape": {"B": B, "H": H, "d": D, "dtype": str(DTYPE).removeprefix("torch."), "causal": True},
        "world": dist.get_world_size(),
        "ns": ns,
        "check_n": 4096 if GPU else 128,
        "max_error_vs_one_gpu": check_once(4096 if GPU else 128),
        "bandwidth_GBps": measure_bandwidth(256 * 2**20 if GPU else 4 * 2**20),
        "rows": [],
    }
    log(f"check vs one GPU (N={data['check_n']}): max error {data['max_error_vs_one_gpu']:.3g}")
    log(f"ring transfer bandwidth: {data['bandwidth_GBps']:.0f} GB/s")
    for n in ns:
        row = {"N": n}
        row["zigzag_s"] = measure_ring(n, "zigzag")
        row["contiguous_s"] = measure_ring(n, "contiguous")
        row["one_gpu_s"] = measure_one_gpu(n)
        row["context_parallel_s"], row["context_parallel_note"] = measure_context_parallel(n)
        flops = 4 * B * H * n * n * D / 2 * 3.5  # causal: half the pairs; fwd + bwd = 3.5 x fwd (2 matmuls)
        row["flops"] = flops
        data["rows"].append(row)
        log(
            f"N={n}: zigzag {row['zigzag_s'] * 1e3:.1f} ms, contiguous {row['contiguous_s'] * 1e3:.1f} ms, "
            f"one GPU {ms(row['one_gpu_s'])}, context_parallel {ms(row['context_parallel_s'])} "
            f"({row['context_parallel_note']}); "
            f"{time.perf_counter() - t_start:.0f} s so far"
        )
        if GPU:
            torch.cuda.empty_cache()
    data["seconds"] = time.perf_counter() - t_start
    if not GPU:
        return data  # no GPU kernels to profile
    n_prof = ns[len(ns) // 2]
    summaries = [None] * dist.get_world_size()
    dist.all_gather_object(summaries, profile_zigzag(n_prof))
    data["trace"] = {"N": n_prof, "ranks": summaries}
    log(
        f"trace at N={n_prof}, rank 0: compute {summaries[0]['compute_ms']:.1f} ms, communication "
        f"{summaries[0]['comm_ms']:.1f} ms, {100 * summaries[0]['hidden_fraction']:.0f}% of it during compute"
    )
    data["seconds"] = time.perf_counter() - t_start
    return data


def main(quick: bool = False) -> None:
    if GPU:
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        dist.init_process_group("gloo")
    try:
        data = run(quick)
        if dist.get_rank() == 0 and not GPU:
            print("CPU smoke run finished (no record):", {k: v for k, v in data.items() if k != "rows"})
        elif dist.get_rank() == 0:
            kind = "ring_quick" if quick else "ring"
            path = records.save_record(kind, data)
            print(f"record: {path}")
            if path is not None:
                for name, fig in figures.record_figures(data).items():
                    out = path.with_name(f"{path.stem}-{name}.png")
                    fig.savefig(out, dpi=110)
                    print(f"figure: {out}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N in {8k, 32k} only (a smoke run)")
    main(parser.parse_args().quick)
