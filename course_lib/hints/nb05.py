"""Hints of notebook 05 (the Triton primer), by exercise name: from a nudge to the formula, never the whole
answer (`course_lib.exercises.solution(name)` shows a worked one)."""

_MASKS = (
    "Mask every load and store whose lanes can fall past the end: offsets < n for a vector; for a tile, the "
    "row mask [:, None] & the column mask [None, :]."
)

HINTS = {
    "softmax_kernel": [
        "One program owns one row: its BLOCK_SIZE lanes are tl.arange(0, BLOCK_SIZE), and the lanes at or past "
        "n_cols are padding. Row `row` starts at x_ptr + row * stride_x (and out_ptr + row * stride_out).",
        "Load with mask=cols < n_cols and other=-float('inf'): a padding lane then adds nothing to the max, "
        "and exp(-inf) = 0 nothing to the sum. Convert to float32 right after the load.",
        "Subtract tl.max(x, axis=0) before tl.exp (large values overflow float32 otherwise), divide by "
        "tl.sum(..., axis=0), and store with the same mask, converted with .to(out_ptr.dtype.element_ty).",
    ],
    "softmax_bytes": [
        "Add up the elements read and written in the comments of naive_softmax (M-element vectors included); "
        "the fused kernel reads x once and writes the result once.",
        "Naive: 5MN + 2M elements read and 3MN + 2M written; fused: 2MN. Multiply by bytes_per_element.",
    ],
    "axpy": [
        "Copy add_kernel of section 2 and change what it stores.",
        _MASKS,
        "Store alpha * x + y, with the same mask as the loads.",
    ],
    "add_bias": [
        "Two program ids: rows = tl.program_id(0) * BLOCK_M + arange(BLOCK_M), columns likewise with axis 1.",
        _MASKS + " The bias needs only the column mask.",
        "Element (r, c) of x is at x_ptr + r * stride_m + c; broadcast the bias over the rows with [None, :].",
    ],
    "add_bias on rows 96 apart": [
        "Row r starts stride_m elements after row r - 1, which here is not N: use stride_m for the rows of x "
        "and of out alike.",
        _MASKS,
    ],
}
