"""What a tensor's sizes and strides say about its memory layout."""

from __future__ import annotations


def is_dense(shape, stride) -> bool:
    """Non-overlapping and dense: some permutation of the dims is contiguous."""
    dims = sorted((st, sz) for sz, st in zip(shape, stride) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True
