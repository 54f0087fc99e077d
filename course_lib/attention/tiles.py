"""Tiles of the attention matrix: which blocks a loop visits, what they cost in HBM traffic, and pictures.

Taught in notebook 04. Q is cut into row blocks of BLOCK_M rows (the paper's B_r), K and V into blocks
of BLOCK_N rows (B_c); tile (i, j) is the BLOCK_M x BLOCK_N piece S_ij = Q_i K_j^T of the score matrix.
Under a causal mask (query r sees keys c <= r, top-left aligned) a tile is
    full      no entry masked: computed as is;
    diagonal  crossing the diagonal: computed, then masked;
    skipped   every entry masked: never loaded, never computed.
HBM traffic is counted in *elements* of the forward pass (multiply by the bytes per element).
"""

from __future__ import annotations

import math

import numpy as np

SKIPPED, DIAGONAL, FULL = 0, 1, 2
KIND_NAMES = {SKIPPED: "skipped", DIAGONAL: "diagonal", FULL: "full"}


def paper_block_sizes(M: int, d: int) -> tuple[int, int]:
    """FlashAttention-1's block sizes for an SRAM of M elements and head dim d: (B_r, B_c).

    B_c = ceil(M / 4d) so that the K_j, V_j blocks and the Q_i, O_i blocks fit in SRAM together;
    B_r = min(B_c, d)."""
    if M < 1 or d < 1:
        raise ValueError(f"paper_block_sizes: M and d must be positive, got M={M}, d={d}")
    b_c = math.ceil(M / (4 * d))
    return min(b_c, d), b_c


def _check_sizes(n_q, n_k, block_m, block_n):
    for name, value in (("n_q", n_q), ("n_k", n_k), ("block_m", block_m), ("block_n", block_n)):
        if not (isinstance(value, (int, np.integer)) and value >= 1):
            raise ValueError(f"tile sizes must be positive integers; got {name}={value!r}")


def block_kind(i0: int, i1: int, j0: int, j1: int, causal: bool) -> int:
    """FULL, DIAGONAL or SKIPPED for the tile of query rows [i0, i1) and key rows [j0, j1)."""
    if not causal or j1 - 1 <= i0:  # every key <= the first query: nothing masked
        return FULL
    if j0 > i1 - 1:  # every key > the last query: everything masked
        return SKIPPED
    return DIAGONAL


def _edges(n: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Start and end (exclusive) row of every block of `block` rows in a sequence of n rows."""
    starts = np.arange(0, n, block)
    return starts, np.minimum(starts + block, n)


def block_map(n_q: int, n_k: int, block_m: int, block_n: int, causal: bool = False) -> np.ndarray:
    """(T_r, T_c) int array of block kinds, T_r = ceil(n_q / block_m), T_c = ceil(n_k / block_n)."""
    _check_sizes(n_q, n_k, block_m, block_n)
    i0, i1 = _edges(n_q, block_m)
    j0, j1 = _edges(n_k, block_n)
    kinds = np.full((len(i0), len(j0)), FULL)
    if causal:  # the same tests as `block_kind`, for all tiles at once
        skipped = j0[None, :] > (i1 - 1)[:, None]
        diagonal = ~skipped & ((j1 - 1)[None, :] > i0[:, None])
        kinds[diagonal] = DIAGONAL
        kinds[skipped] = SKIPPED
    return kinds


def block_counts(n_q: int, n_k: int, block_m: int, block_n: int, causal: bool = False) -> dict[str, int]:
    """How many tiles are full, diagonal and skipped: {'full': ..., 'diagonal': ..., 'skipped': ...}."""
    kinds = block_map(n_q, n_k, block_m, block_n, causal)
    return {name: int((kinds == kind).sum()) for kind, name in KIND_NAMES.items()}


def tile_schedule(
    n_q: int, n_k: int, block_m: int, block_n: int, causal: bool = False, order: str = "fa2"
) -> list[tuple[int, int]]:
    """The tiles (i, j) a forward pass computes, in loop order; skipped tiles are left out.

    order="fa2": outer loop over Q blocks i, inner over K/V blocks j (FlashAttention-2).
    order="fa1": outer loop over K/V blocks j, inner over Q blocks i (FlashAttention-1)."""
    kinds = block_map(n_q, n_k, block_m, block_n, causal)
    t_r, t_c = kinds.shape
    if order == "fa2":
        pairs = [(i, j) for i in range(t_r) for j in range(t_c)]
    elif order == "fa1":
        pairs = [(i, j) for j in range(t_c) for i in range(t_r)]
    else:
        raise ValueError(f"order must be 'fa1' or 'fa2', got {order!r}")
    return [(i, j) for i, j in pairs if kinds[i, j] != SKIPPED]


def hbm_elements(
    algorithm: str, n_q: int, n_k: int, d: int, block_m: int = 1, block_n: int = 1, causal: bool = False
) -> int:
    """Elements read from plus written to HBM by one attention forward pass (one batch entry, one head).

    "standard": read Q, K; write S; read S, write P; read P, V; write O  = 2 Nq d + 2 Nk d + 4 Nq Nk
                (the mask does not help: S and P are materialised whole).
    "fa1":      O, l, m initialised in HBM; each K_j, V_j read once; for every computed tile, Q_i, O_i,
                l_i, m_i read and O_i, l_i, m_i written back
                                               = Nq d + 2 Nq + 2 Nk d + sum over tiles of rows_i (3d + 4)
    "fa2":      each Q_i read once, O_i and L_i written once; for every computed tile, K_j and V_j read
                                               = 2 Nq d + Nq + sum over tiles of 2 cols_j d
    With `causal`, skipped tiles cost nothing in the tiled algorithms."""
    if algorithm == "standard":
        _check_sizes(n_q, n_k, 1, 1)
        return 2 * n_q * d + 2 * n_k * d + 4 * n_q * n_k
    if algorithm not in ("fa1", "fa2"):
        raise ValueError(f"algorithm must be 'standard', 'fa1' or 'fa2', got {algorithm!r}")
    computed = block_map(n_q, n_k, block_m, block_n, causal) != SKIPPED
    i0, i1 = _edges(n_q, block_m)
    j0, j1 = _edges(n_k, block_n)
    if algorithm == "fa1":
        tile_rows = int((computed * (i1 - i0)[:, None]).sum())
        return n_q * d + 2 * n_q + 2 * n_k * d + tile_rows * (3 * d + 4)
    tile_cols = int((computed * (j1 - j0)[None, :]).sum())
    return 2 * n_q * d + n_q + 2 * tile_cols * d


_COLOURS = {"skipped": "#f2f2f2", "pending": "#c6dbef", "computed": "#6baed6", "on chip": "#fd8d3c"}


def draw_block_map(
    ax,
    n_q: int,
    n_k: int,
    block_m: int,
    block_n: int,
    causal: bool = False,
    on_chip: tuple[int, int] | None = None,
    done=(),
    title: str | None = None,
    legend: bool = False,
):
    """Draw the tile grid on a matplotlib Axes: skipped tiles pale, computed tiles (`done`) blue, the
    tile on chip orange; diagonal tiles carry an 'M' (they need the mask). Rows = Q blocks, columns =
    K/V blocks. `legend` adds a colour key to the right of the grid. Returns ax."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    kinds = block_map(n_q, n_k, block_m, block_n, causal)
    state = np.where(kinds == SKIPPED, 0, 1)
    for i, j in done:
        state[i, j] = 2
    if on_chip is not None:
        state[on_chip] = 3
    names = ["skipped", "pending", "computed", "on chip"]
    ax.imshow(state, cmap=ListedColormap([_COLOURS[n] for n in names]), vmin=-0.5, vmax=3.5)
    t_r, t_c = kinds.shape
    for i, j in zip(*np.nonzero(kinds == DIAGONAL)):
        ax.text(j, i, "M", ha="center", va="center", fontsize=9, color="#333333")
    ax.set_xticks(np.arange(-0.5, t_c, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, t_r, 1), minor=True)
    ax.grid(which="minor", color="white", linewidth=1.5)
    ax.tick_params(which="minor", length=0)
    ax.set_xticks(range(t_c))
    ax.set_yticks(range(t_r))
    ax.set_xlabel("K/V block j")
    ax.set_ylabel("Q block i")
    if title:
        ax.set_title(title)
    if legend:  # only the states that appear in this picture
        shown = [n for code, n in enumerate(names) if (state == code).any()]
        ax.legend(
            handles=[Patch(color=_COLOURS[n], label=n) for n in shown],
            fontsize=10,
            loc="upper left",
            bbox_to_anchor=(1.02, 1.0),
        )
    return ax
