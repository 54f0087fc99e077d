"""Training the capstone model: AdamW, warm-up then cosine learning rate, gradient accumulation,
bf16 autocast on a GPU, a progress bar and a live loss plot (notebook 12).

One optimizer step sees `batch_size * accum_steps` sequences: `accum_steps` micro-batches run
forward and backward one after another, each loss divided by `accum_steps`, so their gradients add
up to the gradient of the mean loss over the whole batch while only one micro-batch's activations
are alive at a time.
"""

from __future__ import annotations

import math
import time

import matplotlib.pyplot as plt
import torch
from tqdm.auto import tqdm

from ..checks import check_int, check_real, check_token_ids, shape_and_dtype
from .data import get_batch


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.1) -> torch.optim.AdamW:
    """AdamW with betas (0.9, 0.95); weight decay on the matrices only (not on norms)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=next(model.parameters()).is_cuda)


def learning_rate(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to lr / 10 at `steps`."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


class LossPlot:
    """A loss curve redrawn in place in a notebook every `every` steps (nothing outside a notebook)."""

    def __init__(self, every: int = 20, title: str = "training loss"):
        self.every, self.title, self.handle = every, title, None
        try:
            from IPython import get_ipython
            from IPython.display import display

            self._live = get_ipython() is not None and hasattr(get_ipython(), "kernel")
            self._display = display
        except ImportError:
            self._live = False

    def __call__(self, history: dict, final: bool = False) -> None:
        if not self._live or (not final and len(history["step"]) % self.every):
            return
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.plot(history["step"], history["loss"], label="train (per step)", alpha=0.6)
        if history["val_step"]:
            ax.plot(history["val_step"], history["val_loss"], "o-", label="validation")
        ax.set(xlabel="optimizer step", ylabel="cross-entropy (nats / byte)", title=self.title)
        ax.grid(alpha=0.3)
        ax.legend()
        if self.handle is None:
            self.handle = self._display(fig, display_id=True)
        else:
            self.handle.update(fig)
        plt.close(fig)


def _check_data(where: str, model, tokens, **counts) -> None:
    """tokens a 1-D int64 tensor of ids in the model's vocabulary, each of `counts` an int >= 1: errors
    naming the argument (a batch of 0 or accum_steps=0 once trained nothing and reported a loss of 0)."""
    for name, value in counts.items():
        check_int(where, name, value, 1)
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.dtype != torch.int64:
        raise TypeError(
            f"{where}: tokens must be a 1-D int64 tensor of token ids (course_lib.models.data.encode gives "
            f"one); got {shape_and_dtype(tokens)}"
        )
    check_token_ids(f"{where}: tokens", tokens.cpu(), model.config.vocab_size)


@torch.no_grad()
def evaluate(
    model, tokens, batch_size: int, seq_len: int, batches: int = 4, seed: int = 1, autocast=None
) -> float:
    """Mean loss over `batches` fixed random batches of `tokens` (the same windows every call)."""
    _check_data("evaluate", model, tokens, batch_size=batch_size, seq_len=seq_len, batches=batches)
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    total = 0.0
    for _ in range(batches):
        x, y = get_batch(tokens, batch_size, seq_len, g, device)
        with _autocast(device, autocast):
            total += model(x, y)[1].item()
    model.train(was_training)
    return total / batches


def _autocast(device, dtype):
    if dtype is None:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=dtype)


def train(
    model,
    tokens: torch.Tensor,
    *,
    steps: int,
    batch_size: int,
    seq_len: int,
    lr: float = 3e-3,
    accum_steps: int = 1,
    warmup: int | None = None,
    val_tokens: torch.Tensor | None = None,
    eval_every: int = 50,
    autocast: torch.dtype | None | str = "auto",
    progress: bool = True,
    plot: LossPlot | None = None,
    seed: int = 0,
    max_seconds: float | None = None,
) -> dict:
    """Train `model` (a `course_lib.models.Llama`) on random windows of `tokens` (1-D int64).

    steps optimizer steps of batch_size x accum_steps sequences of seq_len tokens. autocast: "auto"
    is bf16 on a GPU and off on the CPU; a dtype forces it; None turns it off. `plot`: a LossPlot
    (live curve in a notebook). `max_seconds` stops early after that much wall time.
    Returns a history: step, loss, lr, val_step, val_loss, tokens, seconds, tokens_per_s."""
    _check_data(
        "train", model, tokens, steps=steps, batch_size=batch_size, seq_len=seq_len, accum_steps=accum_steps,
        eval_every=eval_every,
    )  # fmt: skip
    if val_tokens is not None:
        _check_data("train: val_tokens", model, val_tokens)
    check_real("train", "lr", lr, low=0, low_open=True)
    if not (autocast in ("auto", None) or isinstance(autocast, torch.dtype)):
        raise TypeError(
            f"train: autocast must be 'auto', None or a torch dtype such as torch.bfloat16, got {autocast!r}"
        )
    device = next(model.parameters()).device
    if autocast == "auto":
        autocast = torch.bfloat16 if device.type == "cuda" else None
    warmup = max(1, steps // 10) if warmup is None else warmup
    optimizer = make_optimizer(model, lr)
    g = torch.Generator().manual_seed(seed)
    history = {"step": [], "loss": [], "lr": [], "val_step": [], "val_loss": []}
    model.train()
    start, tokens_seen = time.perf_counter(), 0
    bar = tqdm(range(steps), desc=f"training ({model.backend})", disable=not progress)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps, lr, warmup)
        loss_sum = torch.zeros((), device=device)  # summed on the device: no wait between micro-batches
        for _ in range(accum_steps):
            x, y = get_batch(tokens, batch_size, seq_len, g, device)
            with _autocast(device, autocast):
                _, loss = model(x, y)
            (loss / accum_steps).backward()
            loss_sum += loss.detach() / accum_steps
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum = loss_sum.item()  # the step's one wait for the GPU
        tokens_seen += batch_size * accum_steps * seq_len
        history["step"].append(step)
        history["loss"].append(loss_sum)
        history["lr"].append(optimizer.param_groups[0]["lr"])
        last = step == steps - 1 or (max_seconds is not None and time.perf_counter() - start > max_seconds)
        if val_tokens is not None and (step % eval_every == 0 or last):
            history["val_step"].append(step)
            history["val_loss"].append(evaluate(model, val_tokens, batch_size, seq_len, autocast=autocast))
        bar.set_postfix(loss=f"{loss_sum:.3f}")
        if plot is not None:
            plot(history, final=last)
        if last:
            break
    seconds = time.perf_counter() - start
    history.update(tokens=tokens_seen, seconds=seconds, tokens_per_s=tokens_seen / seconds)
    return history
