"""Beyond one token per step: speculative, parallel and early-exit decoding on the capstone model
(notebook 15). A user of the kernels: it serves models of `course_lib.decode.batching`'s interface over
`course_lib.decode`'s paged cache; `course_lib.bench.speculative` measures it (`make bench BENCH=speculative`).

- `steps`: one forward step of several tokens per sequence (`forward_tokens`) and the cache rollback
  (`truncate`); `TorchPagedKV`, the same pages attended in PyTorch (fast on a CPU).
- `acceptance`: which drafts the target keeps: `accept_greedy`, `accept_sampled` (the rejection rule).
- `drafts`: `NGramDraft` (prompt lookup), `ModelDraft` (a smaller model), `LayerDraft` (the first layers).
- `engine`: `speculative_generate` (batched), `plain_generate` (the one-token baseline), `SpecResult`.
- `metrics`: `expected_tokens`, `predicted_speedup`, `best_gamma` (the textbook model); `cost_model_speedup`,
  `measured_cost_speedup`, `expected_tokens_of_rounds`, `alpha_for_tokens` (the model from measured step,
  verification, draft and rollback times).
- `jacobi`: `jacobi_update`, `jacobi_generate`, `lookahead_generate`.
- `early_exit`: `early_exit_generate` (CALM-style, K/V of skipped layers by `propagate_kv`).
"""

from __future__ import annotations

from .acceptance import accept_greedy, accept_sampled, probabilities, residual
from .drafts import LayerDraft, ModelDraft, NGramDraft
from .early_exit import early_exit_generate, propagate_kv
from .engine import SpecResult, plain_generate, speculative_generate
from .jacobi import jacobi_generate, jacobi_update, lookahead_generate
from .metrics import (
    alpha_for_tokens,
    best_gamma,
    cost_model_speedup,
    expected_batch_time,
    expected_tokens,
    expected_tokens_of_rounds,
    measured_cost_speedup,
    predicted_speedup,
    still_running,
)
from .steps import TorchPagedKV, forward_tokens, truncate

__all__ = [
    "LayerDraft",
    "ModelDraft",
    "NGramDraft",
    "SpecResult",
    "TorchPagedKV",
    "accept_greedy",
    "accept_sampled",
    "alpha_for_tokens",
    "best_gamma",
    "cost_model_speedup",
    "early_exit_generate",
    "expected_batch_time",
    "expected_tokens",
    "expected_tokens_of_rounds",
    "forward_tokens",
    "jacobi_generate",
    "jacobi_update",
    "lookahead_generate",
    "measured_cost_speedup",
    "plain_generate",
    "predicted_speedup",
    "probabilities",
    "propagate_kv",
    "residual",
    "speculative_generate",
    "still_running",
    "truncate",
]
