"""Hints of notebook 10 (PagedAttention and serving memory), by exercise name: from a nudge to the formula,
never the whole answer (`course_lib.exercises.solution(name)` shows a worked one)."""

HINTS = {
    "paged cache: fork and copy-on-write": [
        "fork copies no page: the child's table is a new list holding the parent's page ids, its length the "
        "parent's, and each of those pages has one owner more (self.refs). append writes one value per slot: "
        "slot n % page_size of page table[n // page_size], for n from the sequence's length on.",
        "A new page is needed whenever n // page_size == len(table): take it with self.allocate() and append "
        "it to the table. A copy is needed only when there is something to write (values not empty), the "
        "last page is partly filled (length % page_size != 0) and shared (self.refs[table[-1]] > 1).",
        "The copy: new = self.allocate(); self.pool[new] = self.pool[table[-1]] (the whole row); then "
        "self.release(table[-1]), so the other owners keep the old page with one owner fewer; then "
        "table[-1] = new. Do this before writing the first value, and store the new length at the end.",
    ],
    "pages of a sequence": [
        "A partial last page still takes a whole page: pages = ceil(n / page_size). The empty slots are the "
        "last page's unused ones.",
        "pages = -(-n // page_size) (ceil division on integers); the empty slots are pages * page_size - n.",
    ],
    "slot of a token": [
        "Token j is on the sequence's page number j // page_size (a column of its block-table row), at offset "
        "j % page_size in that page; page p's rows start at p * page_size in the flattened pool.",
        "Read the physical page id from block_table[b, j // page_size] (an int), multiply it by page_size and "
        "add the offset j % page_size.",
    ],
    "reference counts": [
        "allocate() hands out a page with one reference; share(p) adds one for each sequence that forks it; "
        "release(p) drops one, and a page goes back to the free list only when its count reaches zero.",
        "In code: three allocate() calls for the prompt; for each of the 4 answers, share(p) on each prompt "
        "page; then release(p) on each prompt page once (the original); return [alloc.refs[p] for p in "
        "pages] and alloc.num_free.",
    ],
}
