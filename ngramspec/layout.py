"""Draft trees -> the arrays a verifier needs, and greedy acceptance.

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


def tree_layout(drafts: Sequence, roots: Sequence[int], width: int) -> TreeLayout:
    """Lay out a batch of drafts (``Draft`` objects or (tokens, parents) pairs) at a fixed verify width.

    Drafts longer than ``width - 1`` nodes are cut to their first ``width - 1`` nodes (a valid subtree, since
    drafts are in best-first order)."""
    B = len(drafts)
    if len(roots) != B:
        raise ValueError(f"{B} drafts but {len(roots)} roots")
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    W = int(width)
    tokens = np.zeros((B, W), np.int64)
    parents = np.zeros((B, W), np.int64)
    mask = np.zeros((B, W, W), bool)
    depths = np.zeros((B, W), np.int64)
    nxt_tok = np.full((B, W), -1, np.int64)
    nxt_sib = np.full((B, W), -1, np.int64)
    num = np.zeros(B, np.int64)
    for b, d in enumerate(drafts):
        dt, dp = _tokens_parents(d)
        n = min(len(dt), W - 1)
        num[b] = n
        tokens[b, 0] = roots[b]
        parents[b, 0] = -1
        mask[b, 0, 0] = True
        tokens[b, 1:n + 1] = dt[:n]
        parents[b, 1:n + 1] = dp[:n] + 1  # rows: root is 0, node j is j + 1; padding hangs off the root
        last_child = np.full(W, -1, np.int64)
        for i in range(1, W):
            p = parents[b, i]
            mask[b, i] = mask[b, p]
            mask[b, i, i] = True
            depths[b, i] = depths[b, p] + 1
            if last_child[p] < 0:
                nxt_tok[b, p] = i
            else:
                nxt_sib[b, last_child[p]] = i
            last_child[p] = i
    retrieve_index = np.arange(B * W, dtype=np.int64).reshape(B, W)
    return TreeLayout(tokens, parents, mask, depths, retrieve_index, nxt_tok, nxt_sib, num)


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
