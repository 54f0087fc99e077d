"""Continuous batching: requests join and leave between steps, prefill and decode share a step (notebook 10).

The model interface (what a model must offer to be served by `ContinuousBatcher`; the capstone model in
`course_lib.models` implements it):

    model.num_layers    int    number of attention layers (one K/V page pool each)
    model.num_kv_heads  int    Hkv, the K/V heads per layer
    model.head_dim      int    d
    model.dtype         torch.dtype of the K/V cache (float16, bfloat16 or float32)
    model.device        torch.device where the cache lives
    model.forward_step(token_ids, positions, kv) -> logits
        token_ids  (T,) int64  the new tokens of this step, every running sequence's new tokens one
                               after another (a prefill chunk for some, one token for the others)
        positions  (T,) int64  each token's position in its own sequence (for RoPE)
        kv         PagedKV     the step's view of the paged cache; each attention layer `l` calls
                               o = kv.attend(l, q, k, v) with q (T, Hq, d) (after RoPE), k, v (T, Hkv, d);
                               attend writes k, v into the cache and returns o (T, Hq, d) in q's dtype:
                               causal attention of each new token over its sequence's cache.
        logits     (T, vocab)  float; the batcher reads the row of each sequence's last new token.

The model never sees pages, block tables or the batch layout: `PagedKV.attend` owns them.
"""
