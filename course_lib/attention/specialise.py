"""The integers the attention kernels are not compiled apart for: first calls at new shapes (notes/attention.md).

Triton compiles a kernel again for every pattern of its integer arguments: each is keyed on whether it equals 1
and whether it divides by 16. For a stride or a length that pays: a unit last stride and 16-element alignment
give vector loads, and the lengths N_Q, N_K set the alignment of L's and D's rows (H200, 2026-11-29: with the
lengths and L's strides unspecialised too, the Triton backward ran 15-25 % slower at d = 64, 2-7 % at d = 128).
A head count, a group size or a window enter only block indices and masks, and cost a first call seconds of
compiling: `make setup` compiles the kernels for 16 heads (`precompile.precompile_setup`), and a model with 12
heads would compile its own. So these are passed as plain integers (`do_not_specialize`).
"""

from __future__ import annotations

import inspect

NOT_SPECIALISED = ("H", "GROUP", "SHARE", "WINDOW", "N_BUCKET", "BH", "BHKV")


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
