"""Hints for the exercises of notebook 13_ring_attention (see `course_lib.hints`). The merge exercise's hints
come with its check, `course_lib.testing.check_merge`."""

HINTS = {
    "ring forward loop": [
        "Start from O = zeros like q and L = -inf of shape q.shape[:-1] (no key yet). At step s this rank holds "
        "the K/V of rank src = (rank - s) % world; after `world` steps every block has passed by.",
        "Each step: attention(q, k_s, v_s, causal=..., return_lse=True) gives (O_s, L_s); "
        "merge_attention_states(O, L, O_s, L_s) gives the new (O, L). Under a causal mask: src < rank no "
        "mask, src == rank causal=True, src > rank skip the block.",
        "The transfer: dist.isend(block, (rank + 1) % world) and dist.irecv(next_block, (rank - 1) % world), "
        "both started before the step's compute, then .wait() on both; the received block is the next step's. "
        "torch.stack([k, v]) makes one buffer; no transfer after the last step. A run that hangs until the "
        "timeout usually has a blocking send on every rank, or a receive without a matching send.",
    ],
    "bytes one rank sends per ring step": [
        "Only K and V travel; Q stays.",
        "Each of K and V: B x H_kv x (N / P) x d elements of `elem` bytes.",
    ],
    "zigzag assignment": [
        "Cut n into 2 * world chunks of c = n / (2 * world) tokens.",
        "Rank r holds chunks r and 2 * world - 1 - r, in that order.",
    ],
    "busiest rank's share, contiguous": [
        "work_per_rank(p, 'contiguous', n) gives the pairs per rank and step.",
        "Rank P - 1: P - 1 full blocks and one diagonal block, out of N (N + 1) / 2 pairs.",
    ],
}
