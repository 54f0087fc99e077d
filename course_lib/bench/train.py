"""The capstone's benchmark: training and serving a ~100M-parameter Llama-style model (notebook 12).

`python -m course_lib.bench.train [--quick]` (or `python -m course_lib bench train`), on a GPU:
1. Training throughput at sequence 4096, bf16 autocast, AdamW, the same weights for each attention
   provider: course_lib's kernels (FlashAttention-2, fused RMSNorm and RoPE), SDPA, and eager
   attention (N x N scores in HBM). Tokens/s, the step's time against its kernels' time (the
   profiler's), and peak memory per provider; an out-of-memory provider is recorded as such.
2. The memory of a training step split into parameters : gradients : optimizer states : activations,
   measured with `torch.cuda.memory_allocated` under two precision schemes: autocast with fp32 weights
   (4 : 4 : 8 bytes per parameter, 1 : 1 : 2) and bf16 weights with fp32 master weights in the
   optimizer (2 : 2 : 12 bytes, notebook 01's 1 : 1 : 6); both are 16 bytes per parameter.
3. Training with course_lib's kernels for a fixed time (loss curve, a sample).
4. Serving the trained model in bf16: prompts of different lengths at once through course_lib's paged
   KV cache and split-KV decode kernel (each kernel launched from Python, then the decode steps
   replayed as CUDA graphs), against transformers' `generate` with SDPA (same weights), each timed on
   its second full run; the greedy tokens compared with the plain PyTorch path.
Records "train" and "serve" (`course_lib.records`), plots next to them. Keep it under 4 minutes.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from .. import records, runtime
from ..models import Llama, LlamaConfig, convert, count_parameters, data, generate
from ..models import train as training
from ..perf import timing
from .plots import save_figure
from .report import command_line

CONFIG = LlamaConfig(
    vocab_size=256, dim=768, n_layers=16, n_heads=6, n_kv_heads=2, hidden_dim=2048, max_seq_len=4096
)
SEQ_LEN = 4096
# Micro-batches of 8 sequences (32768 tokens per forward): with 2 or 4 the GPU finished a micro-batch's
# kernels sooner than the CPU could launch them (notes/capstone.md), so the throughput measured the
# host's Python speed, not the kernels.
BATCH = 8
ACCUM = 1  # one micro-batch per optimizer step: 32768 tokens per step
PROVIDERS = ("course_lib", "sdpa", "eager")
SERVE_LABELS = {  # the serving record's providers, as the report and notebook 12 name them
    "course_lib_paged": "course_lib paged + split-KV",
    "course_lib_paged_graphs": "course_lib paged + split-KV, CUDA-graph decode",
    "transformers": "transformers generate + SDPA",
}
# The CPU smoke test (tests, `--quick` without a GPU): the same code at toy sizes.
CPU_CONFIG = LlamaConfig(dim=64, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=128, max_seq_len=128)


def _sizes(quick: bool) -> dict:
    if not runtime.ON_GPU:
        return dict(config=CPU_CONFIG, seq=64, batch=2, accum=2, steps=2, train_s=3, new_tokens=4, prompts=3)
    return dict(
        config=CONFIG,
        seq=SEQ_LEN,
        batch=BATCH,
        accum=ACCUM,
        steps=3 if quick else 8,
        train_s=15 if quick else 90,
        new_tokens=32 if quick else 128,
        prompts=8,
    )


def _sync():
    if runtime.ON_GPU:
        torch.cuda.synchronize()


def _allocated() -> int:
    return torch.cuda.memory_allocated() if runtime.ON_GPU else 0


def _free():
    gc.collect()
    if runtime.ON_GPU:
        torch.cuda.empty_cache()


def _model(config, backend, seed=0):
    torch.manual_seed(seed)
    return Llama(config, backend).to(runtime.DEVICE)


def measure_throughput(provider: str, tokens, s: dict) -> dict:
    """Tokens/s and peak memory of `s['steps']` optimizer steps (after one warm-up step)."""
    row = {"provider": provider, "seq_len": s["seq"], "tokens_per_step": s["seq"] * s["batch"] * s["accum"]}
    model = None
    try:
        model = _model(s["config"], provider)
        kw = dict(batch_size=s["batch"], seq_len=s["seq"], accum_steps=s["accum"], lr=1e-3, progress=False)
        training.train(model, tokens, steps=1, **kw)  # compile kernels, allocate the optimizer states
        _sync()
        if runtime.ON_GPU:
            torch.cuda.reset_peak_memory_stats()
        history = training.train(model, tokens, steps=s["steps"], **kw)
        _sync()
        row.update(
            status="ok",
            tokens_per_s=history["tokens_per_s"],
            step_ms=1e3 * history["seconds"] / s["steps"],
            peak_bytes=torch.cuda.max_memory_allocated() if runtime.ON_GPU else None,
        )
        # the GPU's share of a step: its kernels in one more step, under the profiler
        kernels = timing.kernel_stats(lambda m=model: training.train(m, tokens, steps=1, **kw))
        if kernels is not None:
            row.update(
                kernel_ms=kernels["ms"], kernels_per_step=kernels["count"], kernel_wall_ms=kernels["wall_ms"]
            )
    except torch.OutOfMemoryError as exc:
        row.update(status="oom", reason=str(exc).splitlines()[0])
    del model
    _free()
    return row


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def memory_breakdown(scheme: str, tokens, s: dict) -> dict:
    """P : G : OS : activations of one training step, in bytes, measured with memory_allocated.

    scheme "autocast": fp32 weights, bf16 autocast, AdamW on the weights (4 + 4 + 8 B per parameter).
    scheme "bf16_master": bf16 weights and gradients, AdamW on fp32 master copies (2 + 2 + 12 B)."""
    _free()
    base = _allocated()
    model = _model(s["config"], "course_lib")
    if scheme == "bf16_master":
        model.to(torch.bfloat16)
    p_bytes = _allocated() - base
    params = list(model.parameters())
    if scheme == "bf16_master":
        master = [p.detach().float().requires_grad_() for p in params]
        optimizer = torch.optim.AdamW(master, lr=1e-4)
    else:
        master = params
        optimizer = torch.optim.AdamW(params, lr=1e-4)
    x, y = data.get_batch(tokens, s["batch"], s["seq"], torch.Generator().manual_seed(0), runtime.DEVICE)
    autocast = torch.autocast(
        runtime.DEVICE.type, torch.bfloat16, enabled=scheme == "autocast" and runtime.ON_GPU
    )

    def step():
        before_forward = _allocated()
        with autocast:
            loss = model(x, y)[1]
        activations = _allocated() - before_forward
        loss.backward()
        if scheme == "bf16_master":
            for m, p in zip(master, params):
                m.grad = p.grad.float()
        optimizer.step()
        if scheme == "bf16_master":
            with torch.no_grad():
                for m, p in zip(master, params):
                    p.copy_(m)
                    m.grad = None
        return activations

    step()  # creates the optimizer states
    model.zero_grad(set_to_none=True)
    _sync()
    held = _allocated() - base  # P + optimizer states (incl. master copies)
    activations = step()
    # gradients as they stand after the step: bf16 on the model for bf16_master, fp32 otherwise
    g_bytes = _tensor_bytes(p.grad for p in params if p.grad is not None)
    state_bytes = _tensor_bytes(v for st in optimizer.state.values() for k, v in st.items() if k != "step")
    if scheme == "bf16_master":
        state_bytes += _tensor_bytes(master)
    n = sum(p.numel() for p in params)
    result = {
        "scheme": scheme,
        "n_params": n,
        "parameters": p_bytes if runtime.ON_GPU else _tensor_bytes(params),
        "gradients": g_bytes,
        "optimizer_states": (held - p_bytes) if runtime.ON_GPU else state_bytes,
        "optimizer_states_counted": state_bytes,
        "activations": activations if runtime.ON_GPU else None,
        "tokens": s["batch"] * s["seq"],
    }
    result["bytes_per_param"] = {
        k: result[k] / n for k in ("parameters", "gradients", "optimizer_states") if result[k] is not None
    }
    return result  # the model and optimizer go with this frame; the next measurement's _free() collects them


def train_for_a_while(tokens, val_tokens, s: dict):
    """Train with course_lib's kernels for about s['train_s'] seconds; returns (model, history)."""
    model = _model(s["config"], "course_lib")
    t0 = time.perf_counter()
    kw = dict(batch_size=s["batch"], seq_len=s["seq"], accum_steps=s["accum"], progress=False)
    training.train(model, tokens, steps=1, lr=1e-3, **kw)
    _sync()
    step_s = max(time.perf_counter() - t0, 1e-3) if not runtime.ON_GPU else None
    if runtime.ON_GPU:  # time one more step, now compiled, to size the run
        t0 = time.perf_counter()
        training.train(model, tokens, steps=1, lr=1e-3, **kw)
        _sync()
        step_s = time.perf_counter() - t0
    steps = max(2, int(s["train_s"] / step_s))
    model = _model(s["config"], "course_lib")
    history = training.train(
        model,
        tokens,
        steps=steps,
        lr=1e-3,
        val_tokens=val_tokens,
        eval_every=max(1, steps // 8),
        max_seconds=1.2 * s["train_s"],
        **kw,
    )
    return model, history


def measure_serving(model, text: str, s: dict) -> dict:
    """Tokens/s of greedy generation for prompts of different lengths: course_lib's paged serving (decode
    steps launched one kernel at a time, and replayed as CUDA graphs) vs transformers' generate with SDPA
    (same bf16 weights); tokens compared with the plain path. Every provider is timed on its second
    full run: the first compiles the kernels of every step shape (Triton's, and transformers' warm-up)
    and, for course_lib, captures the CUDA graph of every decode-step shape in a loop (page pool and
    graphs) that the second run reuses, as a server keeps them; it is recorded apart as `first_run_s`."""
    dtype = torch.bfloat16 if runtime.ON_GPU else torch.float32
    model = model.to(dtype).eval()
    lengths = [16 * 2**i for i in range(s["prompts"])] if runtime.ON_GPU else [3, 9, 5][: s["prompts"]]
    lengths = [min(n, s["config"].max_seq_len - s["new_tokens"] - 1) for n in lengths]
    starts = range(0, len(text), len(text) // (len(lengths) + 1))
    prompts = [data.encode(text[a : a + n]).tolist() for a, n in zip(starts, lengths)]
    new = s["new_tokens"]
    out = {"prompt_lengths": lengths, "new_tokens": new, "dtype": str(dtype).replace("torch.", "")}

    def timed(fn, *args, **kwargs):
        """fn(*args, **kwargs) twice: (seconds of the first run, seconds of the second, its result)."""
        times = []
        for _ in range(2):
            _sync()
            t0 = time.perf_counter()
            result = fn(*args, **kwargs)
            _sync()
            times.append(time.perf_counter() - t0)
        return times[0], times[1], result

    model.backend = "course_lib"
    variants = (
        {"course_lib_paged": False, "course_lib_paged_graphs": True}
        if runtime.ON_GPU
        else {"course_lib_paged": False}
    )
    tokens = {}
    for name, graphs in variants.items():  # one loop per variant, serving both runs as a server would
        loop = generate.make_batcher(model, prompts, new, cuda_graphs=graphs)
        first, seconds, tokens[name] = timed(generate.serve, model, prompts, new, batcher=loop)
        del loop
        out[name] = {"seconds": seconds, "tokens_per_s": len(prompts) * new / seconds, "first_run_s": first}
    paged = tokens[list(variants)[-1]]
    out["sample"] = data.decode(prompts[-1][-64:]) + " ||| " + data.decode(paged[-1])
    if len(tokens) == 2:
        out["graphs_same_tokens_as_plain_launches"] = [a == b for a, b in zip(*tokens.values())]

    model.backend = "sdpa"
    plain = generate.greedy_cached(model, prompts, new)
    same = [a == b for a, b in zip(paged, plain)]
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(paged, plain)]
    out.update(same_tokens=all(same), same_per_prompt=same, matching_prefix=prefix)

    try:
        import transformers  # noqa: F401
    except ImportError:
        out["transformers"] = {"status": "skipped", "reason": "transformers is not installed"}
        return out
    hf = convert.to_hf(model)
    batch = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), batch, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as decoder-only generation needs
        ids[i, batch - len(p) :] = torch.tensor(p)
        mask[i, batch - len(p) :] = 1
    ids, mask = ids.to(runtime.DEVICE), mask.to(runtime.DEVICE)
    kw = dict(do_sample=False, pad_token_id=0, attention_mask=mask)
    with torch.no_grad():
        first, seconds, hf_out = timed(hf.generate, ids, max_new_tokens=new, min_new_tokens=new, **kw)
    hf_tokens = hf_out[:, batch:].tolist()
    out["transformers"] = {
        "status": "ok",
        "version": transformers.__version__,
        "seconds": seconds,
        "tokens_per_s": len(prompts) * new / seconds,
        "first_run_s": first,
        "same_tokens_as_plain": [a == b for a, b in zip(hf_tokens, plain)],
    }
    del hf
    _free()
    return out


def run(quick: bool = False) -> dict:
    """Measure everything in the module docstring; returns {"train": [...], "memory": [...],
    "training_run": {...}, "serve": {...}, "config": ...}."""
    s = _sizes(quick)
    text = data.load_corpus()
    tokens, val_tokens = data.split(data.encode(text))
    result = {
        "config": s["config"].as_dict(),
        "n_params": count_parameters(s["config"]),
        "sizes": {k: v for k, v in s.items() if k != "config"},
        "quick": quick,
    }
    # --quick on a GPU (the smoke test that `make test-gpu` runs beside other test processes) leaves out the eager
    # model: its N x N scores for 16 layers take about 105 GiB, which the other processes' tests then lack.
    providers = PROVIDERS if not (quick and runtime.ON_GPU) else tuple(p for p in PROVIDERS if p != "eager")
    result["train"] = [measure_throughput(p, tokens, s) for p in providers]
    schemes = ("autocast", "bf16_master") if runtime.ON_GPU else ("autocast",)  # no bf16 in the interpreter
    result["memory"] = [memory_breakdown(scheme, tokens, s) for scheme in schemes]
    model, history = train_for_a_while(tokens, val_tokens, s)
    result["training_run"] = {
        k: history[k] for k in ("step", "loss", "val_step", "val_loss", "tokens", "seconds")
    }
    result["training_run"]["tokens_per_s"] = history["tokens_per_s"]
    result["serve"] = measure_serving(model, text, s)
    return result


def print_report(result: dict) -> None:
    print(f"model: {result['n_params'] / 1e6:.1f}M parameters, {result['config']}")
    print(
        f"{'provider':12} {'status':7} {'tokens/s':>10} {'step ms':>9} {'kernels ms':>10} {'kernels':>8} "
        f"{'peak GiB':>9}"
    )
    for r in result["train"]:
        if r["status"] != "ok":
            print(f"{r['provider']:12} {r['status']:7}")
            continue
        peak = r["peak_bytes"] / 2**30 if r["peak_bytes"] else float("nan")
        kernel_ms, count = r.get("kernel_ms", float("nan")), r.get("kernels_per_step", 0)
        print(
            f"{r['provider']:12} {'ok':7} {r['tokens_per_s']:10.0f} {r['step_ms']:9.1f} {kernel_ms:10.1f} "
            f"{count:8d} {peak:9.2f}"
        )
    for m in result["memory"]:
        bpp = m["bytes_per_param"]
        ratio = " : ".join(f"{bpp[k] / bpp['parameters']:.2f}" for k in bpp)
        act = f", activations {m['activations'] / 2**30:.2f} GiB" if m["activations"] else ""
        print(
            f"memory ({m['scheme']}): B/param P, G, OS = {[round(v, 2) for v in bpp.values()]}; {ratio}{act}"
        )
    sv = result["serve"]
    print("serving, tokens/s (second full run; the first, which compiles, in brackets):")
    for name, label in SERVE_LABELS.items():
        if sv.get(name, {}).get("tokens_per_s"):
            print(f"  {label:46} {sv[name]['tokens_per_s']:7.0f}  ({sv[name]['first_run_s']:.1f} s)")
    if "graphs_same_tokens_as_plain_launches" in sv:
        print(f"graphs: same tokens as plain launches: {sv['graphs_same_tokens_as_plain_launches']}")
    print(f"same tokens as SDPA's step-by-step greedy decoding: {sv['same_per_prompt']}")


def plot(result: dict, out: Path, slug: str) -> list[Path]:
    """Three figures: throughput and peak memory per provider, the memory breakdown, the loss curve."""
    paths = []
    ok = [r for r in result["train"] if r["status"] == "ok"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.bar([r["provider"] for r in ok], [r["tokens_per_s"] / 1e3 for r in ok], label="measured")
    bound = [(r["provider"], r["tokens_per_step"] / r["kernel_ms"]) for r in ok if r.get("kernel_ms")]
    if bound:  # tokens/ms = thousand tokens/s: the rate if a step took only its kernels' time
        a.plot(*zip(*bound), "k_", markersize=40, mew=2, label="if a step took only its kernels' time")
        a.set_ylim(0, 1.3 * max(max(v for _, v in bound), max(r["tokens_per_s"] / 1e3 for r in ok)))
        a.legend(loc="upper right", fontsize=8, markerscale=0.5)
    a.set(ylabel="thousand tokens / s", title="training throughput, seq 4096, bf16")
    b.bar([r["provider"] for r in ok], [(r["peak_bytes"] or 0) / 2**30 for r in ok], color="tab:orange")
    b.set(ylabel="peak memory (GiB)", title="peak memory of a training step")
    paths.append(save_figure(fig, out / f"train-{slug}-throughput.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    parts = ("parameters", "gradients", "optimizer_states", "activations")
    bottom = [0.0] * len(result["memory"])
    for part in parts:
        vals = [(m[part] or 0) / 2**30 for m in result["memory"]]
        ax.bar([m["scheme"] for m in result["memory"]], vals, bottom=bottom, label=part)
        bottom = [x + y for x, y in zip(bottom, vals)]
    ax.set(ylabel="GiB", title="memory of a training step: P, G, optimizer states, activations")
    ax.legend()
    paths.append(save_figure(fig, out / f"train-{slug}-memory.png"))

    run_ = result["training_run"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(run_["step"], run_["loss"], label="train")
    ax.plot(run_["val_step"], run_["val_loss"], "o-", label="validation")
    ax.set(
        xlabel="optimizer step",
        ylabel="cross-entropy (nats / byte)",
        title="training with course_lib's kernels",
    )
    ax.legend()
    paths.append(save_figure(fig, out / f"train-{slug}-loss.png"))
    return paths


def main(quick: bool = False, out: str | Path = records.ASSETS) -> int:
    """Run, print, save the "train" and "serve" records and the plots in `out`; 0 when all ran."""
    t0 = time.perf_counter()
    result = run(quick)
    print_report(result)
    out = Path(out)
    serve = result.pop("serve")
    path = records.save_record("train", result, out)
    records.save_record("serve", serve, out)
    if path is not None:
        for p in plot(result, out, path.stem.removeprefix("train-")):
            print(f"wrote {p}")
    print(f"bench train: {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(command_line(main, __doc__))
