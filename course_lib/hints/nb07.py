"""Hints of notebook 07 (07_flash_backward): the FlashAttention-2 backward, tile by tile and in Triton."""

HINTS = {
    "tile_backward": [
        "P_ij = exp(S_ij - L_i) is already normalised: L is the log of each row's sum, so no max and no division.",
        "dP = dO V^T. The softmax's backward is dS = P * (dP - D), with D_i broadcast along row i.",
        "S = scale * Q K^T gives dQ = scale * dS K and dK = scale * dS^T Q; O = P V gives dV = P^T dO. "
        "Return the three in the order (dQ_i, dK_j, dV_j).",
    ],
    "tile_backward_fixed": [
        "exp(S - m) is the forward's *unnormalised* P: each of its rows sums to l, not 1 (the printed sums). "
        "Every gradient built from it is off by a factor per row.",
        "Divide each row of exp(S - m) by that row's l; equivalently, subtract L = m + log l instead of m: "
        "the logsumexp is one number per row instead of two.",
    ],
    "dkdv_bounds": [
        "Query row i sees key j when j <= i. The first row that sees key n0 is n0: the loop starts at the "
        "query block that holds it.",
        "Rows from n0 + block_n - 1 on see every key of the block: the masked stage ends at the first block "
        "boundary at or after that row, clipped to n_q.",
        "lo rounds n0 down to a multiple of block_m; hi_masked rounds n0 + block_n - 1 up to one "
        "(math.ceil of the quotient, times block_m), then takes the min with n_q.",
    ],
    "dkdv_kernel_loop": [
        "One iteration per query block: rows = start_m + offs_m; load Q and dO at "
        "z * N_Q * HEAD_DIM + rows[:, None] * HEAD_DIM + offs_d[None, :], and L, D at z * N_Q + rows, every "
        "load masked with rows < N_Q and other=0.0.",
        "The tiles are transposed, (BLOCK_N, BLOCK_M): S^T = tl.dot(k, tl.trans(q)); P^T = exp2(S^T * qk_scale "
        "- L * log2(e)) with L broadcast as [None, :] (one value per column, i.e. per query). Then dV += P^T dO, "
        "dP^T = V dO^T, dS^T = P^T * (dP^T - D[None, :]), dK += dS^T Q.",
        "In the MASK stage, before P^T is used: tl.where(rows[None, :] + offset >= cols[:, None], pT, 0.0). "
        "Convert P^T and dS^T with .to(q.dtype) before their tl.dot, give every tl.dot "
        "input_precision=DOT_PRECISION, and do not multiply by the scale (bwd_dkdv does, at the store).",
    ],
    "dkdv_kernel_loop (float16)": [
        "float32 passed and float16 did not: look at the dtypes entering each tl.dot. P^T and dS^T are float32 "
        "(computed from float32 scores); Q and dO are float16.",
        "Convert P^T and dS^T to the operands' dtype (.to(q.dtype) or .to(do.dtype)) before the products; "
        "keep dk and dv accumulating in float32.",
    ],
    "dq_kernel_loop": [
        "One iteration per K/V block: cols = start_n + offs_n; load K and V at "
        "z * N_K * HEAD_DIM + cols[:, None] * HEAD_DIM + offs_d[None, :], masked with cols[:, None] < N_K, "
        "other=0.0.",
        "S = tl.dot(q, tl.trans(k)), P = exp2(S * qk_scale - l2[:, None]) (l2 is already in base 2); "
        "dP = dO V^T; dS = P * (dP - delta[:, None]); dQ += dS K (tl.dot's third argument accumulates).",
        "In the MASK stage zero P where a key is not visible: cols[None, :] < N_K, and with CAUSAL also "
        "rows[:, None] + offset >= cols[None, :] (tl.where). Convert dS to K's dtype before its product, give "
        "every tl.dot input_precision=DOT_PRECISION, and leave the scale to bwd_dq.",
    ],
    "dq_kernel_loop (float16)": [
        "float32 passed and float16 did not: look at the dtypes entering each tl.dot. dS is float32; K is "
        "float16.",
        "Convert dS with .to(k.dtype) before dS K; dq keeps accumulating in float32.",
    ],
    "softmax_row_backward": [
        "With P = softmax(S): dS_i = sum over j of dP_j * (derivative of P_j by S_i), and that derivative is "
        "P_j (1 if i = j else 0) - P_j P_i.",
        "That sum is P_i (dP_i - sum_j P_j dP_j): the row's D is one scalar, the dot product of p and dp.",
    ],
    "backward_matmul_flops": [
        "A product of an (m x k) by a (k x n) matrix costs 2 m n k FLOPs; every product of the backward has "
        "m n k = Nq Nk d.",
        "Count the products per block pair from section 7's table: the two-kernel mode and the atomic mode "
        "differ by the S and dP that the dQ kernel computes again.",
    ],
    "dv_kernel": [
        "The dK/dV kernel's set-up and loop with only what dV needs: load the program's K block once, loop over "
        "query blocks loading Q, dO and L, rebuild P^T from L, accumulate P^T dO.",
        "Mask every load (rows < N_Q for Q, dO and L; cols < N_K for K) and the store; the inputs are float32, "
        'so give each tl.dot input_precision="ieee".',
    ],
}
