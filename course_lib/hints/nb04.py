"""Hints for notebook 04 (tiled attention in PyTorch: the forward pass), by exercise name."""

HINTS = {
    "online_step": [
        "l and O were both summed with weights exp(s - m_old). When the max grows to m_new, both must be "
        "multiplied by the same alpha = exp(m_old - m_new) before this block's share is added.",
        "m_new = max(m, rowmax(S)); P = exp(S - m_new); alpha = exp(m - m_new); the new l is alpha * l plus "
        "the row sums of P, the new O is alpha (one per row, so alpha[..., None]) times O plus P @ Vj.",
    ],
    "mask_padding": [
        "Build the key index of every column of the tile (j0 + 0, j0 + 1, ...) and compare it with n_k; "
        "masked_fill takes a boolean mask that broadcasts over the rows.",
        "cols = j0 + torch.arange(S.shape[-1]); the columns with cols >= n_k get -math.inf (not 0).",
    ],
    "causal_plan": [
        "Query row r sees keys 0..r. The block's last row is i1 - 1, so no key at or after i1 is ever seen: "
        "kv_stop is i1, clipped to n_k.",
        "A K/V block needs no mask when its last key is <= i0, the block's first row: it starts at or before "
        "i0 + 1 - B_c. So the first block that needs the mask starts at the multiple of B_c at or below i0 + 1.",
        "When n_k <= i0 + 1 even the block's first row sees every key: then no tile needs the mask, and "
        "first_masked = kv_stop.",
    ],
    "forward_fa2 (the whole forward)": [
        "Start without the mask: wrap section 3's inner loop (one row block: m = -inf, l = 0, O = 0, then "
        "one K/V block at a time) in a loop over row blocks i0 = 0, block_m, ...; clip i1 and j1 to n_q and "
        "n_k, and write O_i / l and m + log(l) into O and L. The first three cases have no mask.",
        "Causal: offset = N_k - N_q for 'bottom_right', 0 otherwise; row i sees keys j <= i + offset. The "
        "row block [i0, i1) sees no key at or after i1 + offset, so stop the K/V loop at min(n_k, i1 + "
        "offset) (it may be <= 0: no tile at all). A tile whose last key j1 - 1 is > i0 + offset crosses "
        "the diagonal: set its hidden scores to -inf with causal_mask_tile(i0, i1, j0, j1, device, offset).",
        "A row that has seen no key has m = -inf, and exp(S - m) = exp(-inf + inf) = NaN. Subtract "
        "m_safe = torch.where(torch.isinf(m_new), 0.0, m_new) in P and alpha instead (its exponentials are "
        "then exp(-inf) = 0), and divide O by l only where l > 0 (O stays 0 elsewhere); m + log(l) is then "
        "-inf by itself.",
    ],
    "paper block sizes": [
        "Algorithm 1 of the FlashAttention paper: B_c is M / 4d rounded up, and B_r is the smaller of B_c "
        "and d.",
    ],
    "causal tiles": [
        "With T = N / B tiles per side, the computed tiles are the diagonal and everything below it: a "
        "triangle of T rows.",
        "1 + 2 + ... + T = T (T + 1) / 2 tiles out of T * T.",
    ],
    "split-KV combine": [
        "With L = log(exp(L_A) + exp(L_B)), part A's share of each row's probability mass is exp(L_A - L); "
        "torch.logaddexp computes L without overflow.",
        "O is the two outputs weighted by their shares (one number per row: [..., None]), L the logaddexp.",
    ],
    "FA1 HBM elements": [
        "Count forward_fa1's io calls: O, l, m are written once at the start (N d + 2N); K_j and V_j are "
        "read once each over the outer loop (2 N d).",
        "For every tile, the inner loop reads Q_i, O_i, l_i, m_i and writes O_i, l_i, m_i: B_r (3d + 4) "
        "elements. Non-causal, the inner loops of the T_c = N / B_c outer steps visit every row once each.",
    ],
}
