"""course_lib's attention inside other libraries' models (notebook 08b).

- `transformers`: `use_in_transformers()` registers the attention with Hugging Face transformers'
  `AttentionInterface` under the name "course_lib", so `model.set_attn_implementation("course_lib")`
  runs a Llama-style model (prefill, decoding with a KV cache, grouped-query attention, training) on
  course_lib's kernels.

transformers stays optional: `import course_lib` and `import course_lib.integrations` never import it;
`use_in_transformers` does, on its first call.
"""

from __future__ import annotations


def use_in_transformers(name: str = "course_lib") -> str:
    """Register course_lib's attention with transformers under `name`; return `name`.

    Then `model.set_attn_implementation(name)` (or `config._attn_implementation = name` before the
    model is built) routes every attention layer through `course_lib.flash_attention` (the custom
    operator of `course_lib.attention.op` under `torch.compile`). See
    `course_lib.integrations.transformers` for what is handled and what falls back to SDPA."""
    from .transformers import register

    return register(name)


__all__ = ["use_in_transformers"]
