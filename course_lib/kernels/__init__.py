"""The shared kernel layer: what every Triton kernel of course_lib asks the same question of, answered once
(notebooks 06, 07, 09).

- `softmax`: the base-2 constants LOG2E and LN2, the online-softmax step and the logsumexp that finishes it.
- `blocks`: which K/V blocks a query block visits and the reverse (causal alignments, sliding windows,
  splits), packed sequences' bounds, the masks of a tile, and their plain-Python twins.

Kernel modules (`attention/`, `decode/`, `fused/`) import from here, never from one another; this layer
imports only `runtime` and `checks` (README, Layout; `tests/test_layers.py` holds every module to it).
"""
