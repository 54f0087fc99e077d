"""The integers the attention kernels are not compiled apart for: first calls at new shapes (notes/attention.md).

Triton compiles a kernel again for every pattern of its integer arguments: each is keyed on whether it equals 1
and whether it divides by 16. For a stride that pays (a unit last stride and 16-element alignment give vector
loads); for a head count, a sequence length or the causal offset it buys nothing measurable in these kernels
(they enter loop bounds, masks and block indices, never a vector's width), and costs a first call seconds of
compiling: `make setup` compiles the kernels for 16 heads and power-of-two lengths
(`precompile.precompile_setup`), and a model with 12 heads or a 1000-token prompt would compile its own. So
these are passed as plain integers (`do_not_specialize`), and so are L's two outer strides (N_Q and H x N_Q
elements of a float32 row per query, loaded a row at a time).
"""

from __future__ import annotations

import inspect

NOT_SPECIALISED = (
    "H", "GROUP", "SHARE", "N_Q", "N_K", "OFFSET", "WINDOW", "N_BUCKET", "BH", "BHKV", "stride_lb", "stride_lh",
)  # fmt: skip


def unspecialised(jit):
    """`jit` (triton.jit or gluon.jit) with do_not_specialize set to the kernel's parameters named in
    NOT_SPECIALISED that are not compile-time constants."""

    def wrap(fn):
        names = [
            name
            for name, p in inspect.signature(fn).parameters.items()
            if name in NOT_SPECIALISED and "constexpr" not in str(p.annotation)
        ]
        return jit(do_not_specialize=names)(fn)

    return wrap
