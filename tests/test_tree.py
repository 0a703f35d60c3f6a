"""Tree semantics in one place (ngramspec.layout): rows of one request agree with the batch layout, masks read
back to the parents they were built from, the batched greedy acceptance agrees with the single one."""
from __future__ import annotations

import numpy as np
import pytest

from ngramspec.layout import (
    accepted_length,
    accepted_lengths,
    accepted_path,
    mask_parents,
    tree_layout,
    tree_rows,
)


def random_tree(rng, n):
    parents = np.array([int(rng.integers(-1, j)) for j in range(n)], np.int32)
    tokens = np.zeros(n, np.int32)
    for j in range(n):  # siblings get distinct tokens
        used = {int(tokens[k]) for k in range(j) if parents[k] == parents[j]}
        tokens[j] = next(t for t in range(1, 10) if t not in used)
    return tokens, parents


@pytest.mark.parametrize("seed", range(20))
def test_rows_layout_and_mask_parents_agree(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 9))
    width = n + 1 + int(rng.integers(0, 3))
    tokens, parents = random_tree(rng, n)
    rows = tree_rows(tokens, parents, 7, width)
    lay = tree_layout([(tokens, parents)], [7], width)
    for got, want in zip(rows, (lay.tokens[0], lay.parents[0], lay.depths[0], lay.mask[0])):
        assert np.array_equal(got, want)
    assert np.array_equal(mask_parents(rows[3]), rows[1])
    assert np.array_equal(mask_parents(lay.mask)[0], lay.parents[0])


@pytest.mark.parametrize("seed", range(20))
def test_batched_acceptance_agrees_with_the_single_walk(seed):
    rng = np.random.default_rng(100 + seed)
    drafts = [random_tree(rng, int(rng.integers(0, 9))) for _ in range(5)]
    truths = [rng.integers(1, 4, int(rng.integers(0, 6))).astype(np.int32) for _ in drafts]
    offsets = np.cumsum([0] + [len(t) for t, _ in drafts]).astype(np.int64)
    t_off = np.cumsum([0] + [len(t) for t in truths]).astype(np.int64)
    out = np.zeros(len(drafts), np.int64)
    accepted_lengths(np.concatenate([t for t, _ in drafts]), np.concatenate([p for _, p in drafts]), offsets,
                     np.concatenate(truths), t_off, out)
    for (tokens, parents), truth, n in zip(drafts, truths, out):
        assert n == accepted_length(tokens, parents, truth, 0) == len(accepted_path(tokens, parents, truth))


def test_rows_reject_a_draft_too_wide_or_out_of_order():
    with pytest.raises(ValueError, match="does not fit"):
        tree_rows(np.array([1, 2]), np.array([-1, 0]), 0, 2)
    with pytest.raises(ValueError, match="precede"):
        tree_rows(np.array([1, 2]), np.array([-1, 1]), 0, 3)
