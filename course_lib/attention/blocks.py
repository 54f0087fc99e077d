"""Which blocks a program visits (notebooks 04, 06, 07): the helpers live in the shared kernel layer,
`course_lib.kernels.blocks` (the block ranges, masks and their Python twins) and `course_lib.kernels.softmax`
(LOG2E, LN2); the notebooks meet them under this name, which keeps them."""

from __future__ import annotations

from ..kernels.blocks import (  # noqa: F401  (re-exported under the name the notebooks use)
    causal_alignment,
    causal_offset,
    kv_block_range,
    kv_block_range_py,
    load_rows,
    program_block,
    q_block_range,
    q_block_range_py,
    row_mask,
    sequence,
    sequence_py,
    visible_keys,
    window_kv_range,
    window_kv_range_py,
    window_q_range,
    window_q_range_py,
)
from ..kernels.softmax import LN2, LOG2E  # noqa: F401
