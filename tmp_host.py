"""Host timeline of the bench's cached 32k first token: perf_counter at entry/exit of the calls on its path."""
import sys, time, statistics, torch
sys.path.insert(0, "scripts")
from serving_probe import _cached_prompt
import course_lib.serving.prefix_cache as pc
import course_lib.decode.batching as bt
import course_lib.decode.paged_kv as pk
import course_lib.decode.prefill_split as ps
import course_lib.models.piecewise as pw
import course_lib.models.llama as ll
from course_lib.kernels import plans

events = []
def wrap(obj, name, label=None):
    f = getattr(obj, name); label = label or name
    def w(*a, **k):
        events.append((label + ">", time.perf_counter()))
        r = f(*a, **k)
        events.append(("<" + label, time.perf_counter()))
        return r
    setattr(obj, name, w)
    return f

wrap(bt.ContinuousBatcher, "submit"); wrap(bt.ContinuousBatcher, "step")
wrap(pc.PrefixCache, "walk"); wrap(pc.PrefixCache, "start"); wrap(pc.PrefixCache, "insert")
wrap(bt.PagedKVCache, "append"); wrap(bt.PagedKVCache, "write")
wrap(pk.PagedKV, "step_arrays"); wrap(pk.PagedKV, "prefill_plan")
wrap(bt, "to_device"); wrap(bt, "_step_inputs")
wrap(pw.PiecewiseGraphs, "run", "pw.run"); wrap(pw.Weights, "changed"); wrap(pw._Pieces, "run", "pieces.run")
wrap(pk, "split_prefill"); wrap(plans, "find"); wrap(ps, "_buffers"); from course_lib.kernels import bound
wrap(bound.Prepared, "__call__", "launch")
wrap(torch.cuda.CUDAGraph, "replay")
wrap(ll.Llama, "forward_step")
wrap(pk.PagedKV, "attend")
_, ready, first = _cached_prompt(32768, 0.9)
for _ in range(2):
    first(ready())
runs = []
for r in range(5):
    b = ready(); events.clear()
    t0 = time.perf_counter(); first(b); t1 = time.perf_counter()
    runs.append([(n, (t - t0) * 1e3) for n, t in events] + [("end", (t1 - t0) * 1e3)])
# median per event index (same sequence each run)
n = min(len(r) for r in runs)
print(f"{n} events; median ms from submit, first 70:")
for i in range(min(n, 70)):
    names = {r[i][0] for r in runs}
    print(f"  {runs[0][i][0]:22s} {statistics.median(r[i][1] for r in runs):7.3f}" + ("" if len(names) == 1 else f" {names}"))
print("last:", [(runs[0][i][0], round(statistics.median(r[i][1] for r in runs), 3)) for i in range(n - 12, n)])
