"""course_lib.attention.configs: the named launch tables are well formed and chosen per kind of input;
the teaching variants of notebook 08's ladder (attention/teaching.py) are function arguments with a
fixed launch."""

from __future__ import annotations

import torch

from course_lib.attention import backward as bwd_mod
from course_lib.attention import forward as fwd_mod


def test_launch_configs_well_formed():
    """The named launch tables: every candidate and every default choice has blocks >= 16 and powers of
    two; the choice without autotuning is the table's for each kind of input (the CPU's one config
    under the interpreter)."""
    from course_lib.attention import configs

    for table in (configs.FORWARD, configs.DKDV, configs.DQ):
        launches = list(table.candidates) + [table.cpu, table.fixed, table.fp32, table.wide_head, table.short]
        launches += [
            table.long(d, c, n) for d in (64, 128) for c in (False, True) for n in (1024, 4096, 16384)
        ]
        for c in launches:
            assert min(c.block_m, c.block_n) >= 16 and not (
                c.block_m & (c.block_m - 1) or c.block_n & (c.block_n - 1)
            ), f"{table.name}: {c}"
        assert table.choose(64, True, 4096, torch.bfloat16, interpret=True) == table.cpu
        assert table.choose(64, True, 4096, torch.float32, interpret=False) == table.fp32
        assert table.choose(256, True, 4096, torch.bfloat16, interpret=False) == table.wide_head
        assert table.choose(64, True, 256, torch.bfloat16, interpret=False) == table.short
        assert table.choose(128, False, 16384, torch.bfloat16, interpret=False) == table.long(
            128, False, 16384
        )
    assert configs.split_config(None, configs.FORWARD.fixed) == (
        None,
        {"EXP2": True, "SKIP_MASKED": True, "HOPPER": True, "HOPPER_DQ": True, "HOPPER_ONEPASS": True},
    )


def test_teaching_variants_are_function_arguments_with_a_fixed_launch():
    """The ladder's first rungs swap teaching.py's variants into the production kernels (no switch
    inside a kernel), and always with a fixed launch: never through the tuned choice or the Hopper
    path, whose shape keys know nothing of them."""
    from course_lib.attention import configs, teaching

    for kernel in (fwd_mod._fwd_kernel, bwd_mod._dq_kernel, bwd_mod._dkdv_kernel):
        assert not {"EXP2", "SKIP_MASKED"} & set(kernel.arg_names), f"{kernel.__name__}: {kernel.arg_names}"
    _, fast = configs.split_config(None, configs.FORWARD.fixed)
    for names in (fwd_mod.HOOKS, bwd_mod.DQ_HOOKS, bwd_mod.DKDV_HOOKS):
        assert configs.teaching_hooks(fast, names) == {}, f"{names}: the production helpers are the defaults"
    launch, switches = configs.split_config({"exp2": False}, configs.FORWARD.fixed)
    assert launch == configs.FORWARD.fixed.kwargs(), f"exp2=False alone must fix the launch; got {launch}"
    assert configs.teaching_hooks(switches, fwd_mod.HOOKS) == {
        "SOFTMAX_STEP": teaching.softmax_step_natural,
        "LOGSUMEXP": teaching.logsumexp_natural,
    }
    assert configs.teaching_hooks(switches, bwd_mod.DKDV_HOOKS) == {
        "PROBABILITIES": teaching.probabilities_natural
    }
    launch, switches = configs.split_config({"skip_masked_blocks": False, "BLOCK_M": 32}, configs.DKDV.fixed)
    assert launch["BLOCK_M"] == 32 and launch["BLOCK_N"] == configs.DKDV.fixed.block_n, launch
    assert configs.teaching_hooks(switches, bwd_mod.DQ_HOOKS) == {"KV_RANGE": teaching.every_kv_block}
    assert configs.teaching_hooks(switches, bwd_mod.DKDV_HOOKS) == {"Q_RANGE": teaching.every_q_block}
