"""Draft trees: the arrays a verifier needs, and greedy acceptance. Every module that lays out a tree, reads one
back from a mask or walks the accepted path uses these.

Layout (SGLang's NGRAM convention): per request, ``width`` rows; row 0 is the root (the last committed token),
row j+1 is draft node j. ``mask[i, j]`` is True iff j is i or an ancestor of i. ``depths`` are position offsets
from the root. ``retrieve_index[b, i] = b * width + i``; ``retrieve_next_token[b, i]`` is i's first child (lowest
row), ``retrieve_next_sibling[b, i]`` the next child of i's parent (next higher row); -1 for none. Unused rows are
padding: token 0 as a child of the root, exactly as SGLang pads (a verifier may accept such a token only if the
model really predicts it, so padding never costs correctness).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from numba import njit


@dataclass(frozen=True)
class TreeLayout:
    tokens: np.ndarray  # [B, W] int64
    parents: np.ndarray  # [B, W] int64, row index of the parent (-1 for the root)
    mask: np.ndarray  # [B, W, W] bool
    depths: np.ndarray  # [B, W] int64
    retrieve_index: np.ndarray  # [B, W] int64
    retrieve_next_token: np.ndarray  # [B, W] int64
    retrieve_next_sibling: np.ndarray  # [B, W] int64
    num_nodes: np.ndarray  # [B] real draft nodes per request (padding excluded)


def _tokens_parents(d):
    if hasattr(d, "tokens"):
        return np.asarray(d.tokens), np.asarray(d.parents)
    t, p = d
    return np.asarray(t), np.asarray(p)


def check_tree(tokens, parents) -> None:
    """Raise ValueError unless parents[j] < j, parents >= -1 and no parent has two children with one token."""
    tokens, parents = np.asarray(tokens), np.asarray(parents)
    if tokens.shape != parents.shape or tokens.ndim != 1:
        raise ValueError("tokens and parents must be 1-D arrays of one length")
    seen = set()
    for j, (t, p) in enumerate(zip(tokens.tolist(), parents.tolist())):
        if not -1 <= p < j:
            raise ValueError(f"node {j}: parent {p} must be in [-1, {j})")
        if (p, t) in seen:
            raise ValueError(f"node {j}: parent {p} already has a child with token {t}")
        seen.add((p, t))


@njit(cache=True)
def _layout(tokens, parents, offsets, lengths, roots, W):
    """The layout arrays for drafts ``offsets[b]:offsets[b] + lengths[b]`` (allocated here: one call)."""
    B = lengths.shape[0]
    o_tok = np.zeros((B, W), np.int64)
    o_par = np.zeros((B, W), np.int64)
    o_mask = np.zeros((B, W, W), np.bool_)
    o_dep = np.zeros((B, W), np.int64)
    o_nt = np.full((B, W), -1, np.int64)
    o_ns = np.full((B, W), -1, np.int64)
    o_num = np.zeros(B, np.int64)
    o_idx = np.arange(B * W).reshape(B, W)
    last_child = np.empty(W, np.int64)
    for b in range(B):
        a = offsets[b]
        n = min(lengths[b], W - 1)
        o_num[b] = n
        o_tok[b, 0] = roots[b]
        o_par[b, 0] = -1
        o_mask[b, 0, 0] = True
        for j in range(n):
            o_tok[b, j + 1] = tokens[a + j]
            o_par[b, j + 1] = parents[a + j] + 1  # rows: root is 0, node j is j + 1; padding hangs off the root
        for i in range(W):
            last_child[i] = -1
        for i in range(1, W):
            p = o_par[b, i]
            for k in range(i):
                o_mask[b, i, k] = o_mask[b, p, k]
            o_mask[b, i, i] = True
            o_dep[b, i] = o_dep[b, p] + 1
            if last_child[p] < 0:
                o_nt[b, p] = i
            else:
                o_ns[b, last_child[p]] = i
            last_child[p] = i
    return o_tok, o_par, o_mask, o_dep, o_idx, o_nt, o_ns, o_num


def layout_flat(tokens: np.ndarray, parents: np.ndarray, offsets: np.ndarray, lengths: np.ndarray,
                roots: np.ndarray, width: int) -> TreeLayout:
    """``tree_layout`` for drafts in flat arrays (a ``DraftBatch``'s ``tokens``, ``parents``, ``offsets``),
    request b keeping its first ``lengths[b]`` nodes (at most ``width - 1``): one kernel call for the batch."""
    B = lengths.shape[0]
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    if roots.shape[0] != B or offsets.shape[0] != B + 1:
        raise ValueError(f"{B} lengths but {roots.shape[0]} roots and {offsets.shape[0] - 1} drafts")
    return TreeLayout(*_layout(tokens, parents, offsets, lengths, roots, int(width)))


def tree_rows(tokens, parents, root: int, width: int):
    """One request's verify block: (tokens [width], parent rows [width], depths [width], mask [width, width]),
    the ``TreeLayout`` convention. ValueError if the draft does not fit ``width`` or a parent does not precede
    its child."""
    count = len(tokens)
    if count > width - 1:
        raise ValueError(f"draft of {count} nodes does not fit width {width}")
    parents = np.asarray(parents, np.int64)
    for j in range(count):
        if not -1 <= parents[j] < j:
            raise ValueError(f"draft node {j} has parent {parents[j]}: parents must precede children")
    lay = layout_flat(np.asarray(tokens, np.int64).reshape(count), parents.reshape(count),
                      np.array([0, count], np.int64), np.array([count], np.int64), np.array([root], np.int64), width)
    return lay.tokens[0], lay.parents[0], lay.depths[0], lay.mask[0]


def mask_parents(mask: np.ndarray) -> np.ndarray:
    """Parent rows from ancestor masks ``[..., W, W]`` (``mask[i, j]``: j is i or an ancestor of i): each row's
    deepest strict ancestor, -1 for a row without one (the root)."""
    mask = np.asarray(mask).astype(bool)
    rows = np.arange(mask.shape[-1])
    ancestors = mask & (rows[None, :] < rows[:, None])
    return np.where(ancestors.any(-1), (ancestors * rows).argmax(-1), -1)


def tree_layout(drafts: Sequence, roots: Sequence[int], width: int) -> TreeLayout:
    """Lay out a batch of drafts (``Draft`` objects or (tokens, parents) pairs) at a fixed verify width.

    Drafts longer than ``width - 1`` nodes are cut to their first ``width - 1`` nodes (a valid subtree, since
    drafts are in best-first order)."""
    B = len(drafts)
    if len(roots) != B:
        raise ValueError(f"{B} drafts but {len(roots)} roots")
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    pairs = [_tokens_parents(d) for d in drafts]
    lengths = np.array([min(len(t), int(width) - 1) for t, _ in pairs], np.int64)
    offsets = np.zeros(B + 1, np.int64)
    np.cumsum([len(t) for t, _ in pairs], out=offsets[1:])
    tokens = np.concatenate([np.asarray(t, np.int64) for t, _ in pairs]) if B else np.zeros(0, np.int64)
    parents = np.concatenate([np.asarray(p, np.int64) for _, p in pairs]) if B else np.zeros(0, np.int64)
    return layout_flat(tokens, parents, offsets, lengths, np.asarray(roots, np.int64).reshape(B), width)


def warm_up() -> None:
    """Compile the layout kernel for the dtypes the cache's drafts have."""
    for dt in (np.int32, np.int64):
        layout_flat(np.array([5], dt), np.array([-1], dt), np.array([0, 1], np.int64), np.array([1], np.int64),
                    np.array([1], np.int64), 3)


@njit(cache=True)
def accepted_length(tokens, parents, output, pos):
    """Draft nodes greedy verification accepts against `output[pos:]`: from the root, step to the first child
    (in node order) whose token is the next true token, as a tree verify kernel walks it."""
    remaining = output.shape[0] - pos
    current = -1
    depth = 0
    for j in range(tokens.shape[0]):
        parent = parents[j]
        if parent >= j or parent < -1:
            raise ValueError("draft parents must satisfy -1 <= parents[j] < j")
        # the children of `current` all come after it, so one forward pass finds the path
        if parent == current and depth < remaining and tokens[j] == output[pos + depth]:
            current = j
            depth += 1
    return depth


@njit(cache=True)
def accepted_lengths(tokens, parents, offsets, truth, truth_offsets, out):
    """``accepted_length`` for every draft of flat arrays: draft i (``offsets[i]:offsets[i+1]``) against its
    true continuation ``truth[truth_offsets[i]:truth_offsets[i+1]]``, into ``out[i]``."""
    for i in range(offsets.shape[0] - 1):
        a, b = offsets[i], offsets[i + 1]
        out[i] = accepted_length(tokens[a:b], parents[a:b], truth[truth_offsets[i]:truth_offsets[i + 1]], 0)


def accepted_path(tokens, parents, truth) -> list[int]:
    """Draft nodes accepted by greedy verification when the model's true continuation is ``truth``: the longest
    root path whose tokens equal a prefix of ``truth`` (first matching child in node order at each depth)."""
    tokens = np.asarray(tokens)
    parents = np.asarray(parents)
    path: list[int] = []
    cur = -1
    for t in truth:
        nxt = -1
        for j in range(len(tokens)):
            if parents[j] == cur and tokens[j] == t:
                nxt = j
                break
        if nxt < 0:
            break
        path.append(nxt)
        cur = nxt
    return path


def greedy_walk(row_tokens: np.ndarray, row_parent: np.ndarray, count: int, predicted: np.ndarray) -> list[int]:
    """Rows accepted by greedy verification of a laid-out block (``tree_rows``): from the root, follow the child
    whose token the model predicted after its parent row (``predicted[row]``); the first such child in row order."""
    path, r = [], 0
    while True:
        want = predicted[r]
        nxt = -1
        for c in range(1, count + 1):
            if row_parent[c] == r and row_tokens[c] == want:
                nxt = c
                break
        if nxt < 0:
            return path
        path.append(nxt)
        r = nxt
