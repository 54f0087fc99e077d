"""Hints of notebook 14 (serving many requests), by exercise name: one more after each failed attempt."""

HINTS = {
    "prefix lookup": [
        "Walk the full pages in order, carrying the hash of the previous page (b'' before the first). Stop at "
        "the first page whose hash is not in the table.",
        "For page i: block = tuple(tokens[i * page_size : (i + 1) * page_size]); h = block_hash(parent, block). "
        "Only len(tokens) // page_size pages are full: a partial last page is never cached.",
        "A hit counts only if table[h] == (page, parent, block) in its last two fields: compare entry[1:] with "
        "(parent, block) before you append entry[0] and set parent = h.",
    ],
    "cascade merge": [
        "This is notebook 03's merge of two partial states: the new L is the log of the summed exponentials of "
        "the two Ls, and each O is weighted by its share of that sum.",
        "L = torch.logaddexp(lse_p, lse_s); each part's weight is exp(its L - L), with a last axis added so it "
        "multiplies the (..., d) output.",
        "Do the weighted sum in float32 (o_p.float(), o_s.float()) and convert back with .to(o_s.dtype).",
    ],
    "batching steps": [
        "Static: cut new_tokens into consecutive batches of max_batch (the last may be shorter) and add up each "
        "batch's max. Continuous: keep, for each of the max_batch slots, the step at which it frees up.",
        "Continuous: start every slot at 0; for each request in order, find the slot with the smallest free-up "
        "step (slots.index(min(slots)) takes the lowest on a tie) and add the request's steps to it.",
        "The continuous count is the step at which the last slot frees up: max(slots), not their sum.",
    ],
}
