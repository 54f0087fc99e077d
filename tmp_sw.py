import torch, torch.nn.functional as F
from course_lib.perf.timing import graph_ms
from course_lib.fused import swiglu as sw_api
import course_lib.fused.swiglu as sw
for T, Fh in ((3280, 2816), (16384, 8192), (4096, 14336)):
    ab = torch.randn(T, 2 * Fh, device="cuda", dtype=torch.bfloat16)
    a, b = ab.chunk(2, -1); dy = torch.randn(T, Fh, device="cuda", dtype=torch.bfloat16)
    t_torch_f = graph_ms(lambda: F.silu(a) * b)
    x = ab.clone().requires_grad_()
    def torch_bwd():
        aa, bb = x.chunk(2, -1)
        return torch.autograd.grad(F.silu(aa) * bb, x, dy)
    row = [f"{T}x{Fh}: torch fwd {t_torch_f*1e3:.1f} us, fwd+bwd {graph_ms(torch_bwd)*1e3:.1f}"]
    for tile in (1024, 2048, 4096, 8192):
        sw.TILE = tile
        tf = graph_ms(lambda: sw.swiglu_forward(a, b)); tb = graph_ms(lambda: sw.swiglu_backward(a, b, dy))
        row.append(f"tile {tile}: fwd {tf*1e3:.1f} ({3*T*Fh*2/tf/1e6:.0f} GB/s) bwd {tb*1e3:.1f} ({5*T*Fh*2/tb/1e6:.0f} GB/s)")
    sw.TILE = 4096
    print("\n  ".join(row), flush=True)
