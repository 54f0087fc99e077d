import sys, time, torch, torch.nn.functional as F
from course_lib.perf.timing import graph_ms
swm = sys.modules["course_lib.fused.swiglu"] if "course_lib.fused.swiglu" in sys.modules else None
import course_lib.fused
swm = sys.modules["course_lib.fused.swiglu"]
for T, Fh in ((3280, 2816), (16384, 8192), (4096, 14336)):
    ab = torch.randn(T, 2 * Fh, device="cuda", dtype=torch.bfloat16)
    a, b = ab.chunk(2, -1); dy = torch.randn(T, Fh, device="cuda", dtype=torch.bfloat16)
    ac, bc = a.contiguous(), b.contiguous()
    t_torch_f = graph_ms(lambda: F.silu(ac) * bc)
    x1 = ac.clone().requires_grad_(); x2 = bc.clone().requires_grad_()
    t_torch_fb = graph_ms(lambda: torch.autograd.grad(F.silu(x1) * x2, (x1, x2), dy))
    row = [f"{T}x{Fh}: torch fwd {t_torch_f*1e3:.1f} us, fwd+bwd {t_torch_fb*1e3:.1f}"]
    for tile in (1024, 2048, 4096, 8192):
        swm.TILE = tile
        tf = graph_ms(lambda: swm.swiglu_forward(ac, bc)); tb = graph_ms(lambda: swm.swiglu_backward(ac, bc, dy))
        tfs = graph_ms(lambda: swm.swiglu_forward(a, b))
        row.append(f"tile {tile}: fwd {tf*1e3:.1f} ({3*T*Fh*2/tf/1e6:.0f} GB/s; halves {tfs*1e3:.1f}) bwd {tb*1e3:.1f} ({5*T*Fh*2/tb/1e6:.0f} GB/s)")
    swm.TILE = 4096
    print("\n  ".join(row), flush=True)
# cache write host time
from course_lib.decode.cache import PagedKVCache
cache = PagedKVCache(8, 2200, 16, 4, 64, torch.bfloat16, torch.device("cuda"))
slots = torch.randperm(2200 * 16, device="cuda")[:3280]
k = torch.randn(3280, 4, 64, device="cuda", dtype=torch.bfloat16); v = torch.randn_like(k)
def w1(): cache.write(0, slots, k, v, validate=False)
def w2():
    for pool, x in ((cache.k_pages[0], k), (cache.v_pages[0], v)):
        pool.view(-1, *pool.shape[2:]).index_copy_(0, slots, x)
for f in (w1, w2, w1, w2):
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(2000): f()
    torch.cuda.synchronize(); print(f.__name__, f"{(time.perf_counter()-t)/2000*1e6:.1f} us a call", flush=True)
