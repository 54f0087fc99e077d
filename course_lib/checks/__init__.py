"""Input checks shared by every public function in course_lib: one check per rule, one module per concern.

Bad input must give an error that names the problem (shape, dtype, device, head dimension), never a
crash inside a kernel, a hang or silent garbage.

- `tensors`: a tensor, its dtype (`check_dtype`, `FLOAT_DTYPES`, `KERNEL_DTYPES`) and the device the kernels
  run on (`check_kernel_device`); integers, real numbers, epsilons.
- `attention`: q, k and v together (`check_attention_inputs`), the head dims and dtypes the attention and
  decoding kernels take (`KERNEL_HEAD_DIMS`, `kernel_support`), the scale, the causal alignment of every
  entry point (`causal_alignment`), the sliding window, attention sinks.
- `pages`: a KV cache's lengths, block tables and page ids.
- `tokens`: token ids against a vocabulary, and a generation against a model's positions.

Every public attention entry point calls `check_attention_inputs`; every kernel's entry point (attention,
decoding, RMSNorm, RoPE) checks its tensors' device with `check_kernel_device`. The names below are the
package's: `from course_lib.checks import X` works for each.
"""

from .attention import (
    ALIGNMENTS,
    KERNEL_HEAD_DIMS,
    MAX_HEAD_DIM,
    causal_alignment,
    causal_offset,
    check_attention_inputs,
    check_sinks,
    check_window,
    default_scale,
    kernel_support,
    kernel_window,
    kv_group,
)
from .pages import (
    check_block_table,
    check_cache_seqlens,
    check_lengths,
    check_page_ids,
    should_validate,
)
from .tensors import (
    FLOAT_DTYPES,
    KERNEL_DTYPES,
    OFFSET_LIMIT,
    AcceptedCalls,
    accumulator_dtype,
    as_int,
    check_dtype,
    check_eps,
    check_int,
    check_kernel_device,
    check_real,
    check_tensor,
    describe,
    dtype_names,
    shape_and_dtype,
    tensors_key,
)
from .tokens import (
    check_generation_fits,
    check_token_ids,
    max_positions,
    prompt_lists,
    token_id,
    token_ids,
    token_ids_array,
    vocab_size,
)

__all__ = [
    "ALIGNMENTS",
    "AcceptedCalls",
    "FLOAT_DTYPES",
    "KERNEL_DTYPES",
    "KERNEL_HEAD_DIMS",
    "MAX_HEAD_DIM",
    "OFFSET_LIMIT",
    "accumulator_dtype",
    "as_int",
    "causal_alignment",
    "causal_offset",
    "check_attention_inputs",
    "check_block_table",
    "check_cache_seqlens",
    "check_dtype",
    "check_eps",
    "check_generation_fits",
    "check_int",
    "check_kernel_device",
    "check_lengths",
    "check_page_ids",
    "check_real",
    "check_sinks",
    "check_tensor",
    "check_token_ids",
    "check_window",
    "default_scale",
    "describe",
    "dtype_names",
    "kernel_support",
    "kernel_window",
    "kv_group",
    "max_positions",
    "prompt_lists",
    "shape_and_dtype",
    "should_validate",
    "tensors_key",
    "token_id",
    "token_ids",
    "token_ids_array",
    "vocab_size",
]
