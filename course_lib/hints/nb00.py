"""Hints for the exercises of notebook 00_setup (see `course_lib.hints`)."""

HINTS = {
    "score matrix bytes": [
        "There is one score matrix per (sequence, head): count the matrices first.",
        "Each matrix has n rows and n columns, and every entry takes bytes_per_element bytes.",
        "Multiply the number of matrices, the entries per matrix and the bytes per entry.",
    ],
    "score matrix bytes (fp32)": [
        "The same function as the check above, with 4 bytes per entry: if that one passed, this one should too.",
        "b * h matrices of n * n entries, each of bytes_per_element bytes.",
    ],
}
