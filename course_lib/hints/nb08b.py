"""Hints for the exercises of notebook 08b_attention_in_real_models (see `course_lib.hints`)."""

HINTS = {
    "visible keys per query row": [
        "Query i sees key j when j <= i + offset: count the j in [0, n_k) that pass.",
        "The offset is 0 for top-left and Nk − Nq for bottom-right.",
        "Row i sees i + offset + 1 keys, clipped to [0, Nk].",
    ],
    "fake attention shapes and dtypes": [
        "A fake implementation only makes empty tensors of the right shape, dtype and device; it never "
        "reads q's values.",
        "O has q's shape and dtype; L has q.shape[:-1] and dtype torch.float32.",
        "`q.new_empty(shape, dtype=...)` makes a tensor on q's device (meta included) with no data.",
    ],
    "grouped-query attention from the reference": [
        "G = Hq / Hkv query heads share one K/V head: query head h reads K/V head h // G.",
        "Build the index of the K/V head of every query head, torch.arange(Hq) // G, and select those heads "
        "of k and v along dimension 1.",
        "k[:, heads] and v[:, heads] have Hq heads: pass them with q to mha_attention.",
    ],
    "KV cache bytes per token": [
        "Every token stores one K vector and one V vector per K/V head per layer.",
        "Per token: 2 (K and V) · K/V heads · d · bytes per element · layers.",
        "Without GQA the K/V heads are as many as the query heads; the ratio is 40 / 8.",
    ],
    "rows of packed sequences": [
        "cu_seqlens[b] is the sum of the lengths before sequence b; it has one more entry than lengths.",
        "Row r belongs to the last non-empty sequence whose first row is at most r.",
        "i is r − cu_seqlens[b].",
    ],
}
