"""The benchmarks behind `make bench` (`python -m course_lib bench [names...]`) and notebook 08's plots.

Taught in notebook 08. One module per concern of the attention benchmark:
- `shapes` ..... the grid: the FlashAttention papers' shapes (B·N = 16384 tokens, H·d = 2048)
- `providers` .. who is measured: course_lib, each SDPA backend, standard attention eager and compiled
- `measure` .... time and peak memory of one provider on one cell; `run_attention`, the whole grid
- `report` ..... ratios to the baselines, min / geometric mean, the targets, the text table
- `ladder` ..... the optimisation ladder, predicted then measured
- `plots` ...... figures of the records, written next to them as PNGs
- `attention` .. the attention benchmark: `run(quick)` and `main(quick, out)` (grid, ladder, ceilings)
- `registry` ... `main(names, quick, out)`: runs every benchmark module present (attention, host_time,
  decode, fused, train, serving, speculative) or the ones named; each new benchmark is a module
  `course_lib/bench/<name>.py` with `run(quick) -> dict` and `main(quick, out)`.
The names below stay reachable as `course_lib.bench.<name>`, as before the split.
"""

from __future__ import annotations

from .ladder import BWD0, BWD1, BWD2, BWD3, BWD4, FWD0, FWD1, FWD2, FWD3, FWD4, LADDER, Step, ladder
from .measure import TIMER_MS, make_timer, measure_provider, run_attention, timer_name
from .plots import COLORS, credit, plot_ladder, plot_memory, plot_tflops, save_plots
from .providers import LABELS, PROVIDERS, SDPA_BACKENDS, attention_fns, skip_reason
from .registry import BENCHMARKS, available, main
from .report import (
    MEMORY_TARGET,
    RATIO_COLUMNS,
    TARGETS,
    check_targets,
    format_report,
    lookup,
    ratio_rows,
    ratios,
    report_columns,
    summarise,
    tflops_of,
)
from .shapes import (
    BYTES,
    HEAD_DIMS,
    MAX_SCORE_BYTES,
    MODE_NAMES,
    MODEL_DIM,
    MODES,
    SEQ_LENS,
    TOKENS,
    standard_cells,
)

__all__ = [
    "BENCHMARKS",
    "BWD0",
    "BWD1",
    "BWD2",
    "BWD3",
    "BWD4",
    "BYTES",
    "COLORS",
    "FWD0",
    "FWD1",
    "FWD2",
    "FWD3",
    "FWD4",
    "HEAD_DIMS",
    "LABELS",
    "LADDER",
    "MAX_SCORE_BYTES",
    "MEMORY_TARGET",
    "MODEL_DIM",
    "MODES",
    "MODE_NAMES",
    "PROVIDERS",
    "RATIO_COLUMNS",
    "SDPA_BACKENDS",
    "SEQ_LENS",
    "TARGETS",
    "TIMER_MS",
    "TOKENS",
    "Step",
    "attention_fns",
    "available",
    "check_targets",
    "credit",
    "format_report",
    "ladder",
    "lookup",
    "main",
    "make_timer",
    "measure_provider",
    "plot_ladder",
    "plot_memory",
    "plot_tflops",
    "ratio_rows",
    "ratios",
    "report_columns",
    "run_attention",
    "save_plots",
    "skip_reason",
    "standard_cells",
    "summarise",
    "tflops_of",
    "timer_name",
]
