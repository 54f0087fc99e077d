import sys, torch, torch.nn.functional as F
import triton, triton.language as tl
from course_lib.perf.timing import graph_ms
import course_lib.fused
swm = sys.modules["course_lib.fused.swiglu"]

@triton.jit
def flat_fwd(a_ptr, b_ptr, y_ptr, n, BLOCK: tl.constexpr, EVICT: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    if EVICT:
        a = tl.load(a_ptr + offs, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
        b = tl.load(b_ptr + offs, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
    else:
        a = tl.load(a_ptr + offs, mask=m, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (a / (1.0 + tl.exp(-a)) * b).to(y_ptr.dtype.element_ty), mask=m)

@triton.jit
def flat_bwd(a_ptr, b_ptr, dy_ptr, da_ptr, db_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(a_ptr + offs, mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=m, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=m, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-a))
    tl.store(da_ptr + offs, (dy * b * s * (1.0 + a * (1.0 - s))).to(da_ptr.dtype.element_ty), mask=m)
    tl.store(db_ptr + offs, (dy * a * s).to(db_ptr.dtype.element_ty), mask=m)

comp = torch.compile(lambda a, b: F.silu(a) * b, dynamic=False)
for T, Fh in ((4096, 14336), (16384, 14336), (3280, 2816)):
    a = torch.randn(T, Fh, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a); dy = torch.randn_like(a)
    y = torch.empty_like(a); da = torch.empty_like(a); db = torch.empty_like(a)
    n = a.numel(); fb = 3 * n * 2
    torch._dynamo.reset(); comp = torch.compile(lambda a, b: F.silu(a) * b, dynamic=False); comp(a, b)
    tc = graph_ms(lambda: comp(a, b)); tcur = graph_ms(lambda: swm.swiglu_forward(a, b))
    out = [f"{T}x{Fh} fwd GB/s: compiled {fb/tc/1e6:.0f}, current {fb/tcur/1e6:.0f}"]
    for blk in (1024, 2048, 4096):
        for w in (4, 8):
            for ev in (False, True):
                t = graph_ms(lambda: flat_fwd[(triton.cdiv(n, blk),)](a, b, y, n, BLOCK=blk, EVICT=ev, num_warps=w))
                out.append(f"flat {blk} w{w}{' evict' if ev else ''} {fb/t/1e6:.0f}")
    bb = 5 * n * 2
    tcb = graph_ms(lambda: swm.swiglu_backward(a, b, dy))
    out.append(f"bwd current {bb/tcb/1e6:.0f}")
    for blk in (1024, 2048):
        for w in (4, 8):
            t = graph_ms(lambda: flat_bwd[(triton.cdiv(n, blk),)](a, b, dy, da, db, n, BLOCK=blk, num_warps=w))
            out.append(f"bwd flat {blk} w{w} {bb/t/1e6:.0f}")
    print("\n  ".join(out), flush=True)
