"""Token recycling's adjacency table: each token's latest top-k successors, from the model's own distributions.

Every decode or verify step computes a distribution over the next token at each position it scores and keeps only
the argmax. Token Recycling (Luo et al., ACL 2025, arXiv 2408.08696) keeps the top-k candidates instead: for the
token at each scored position, the k most likely tokens after it, overwriting what that token had before. A draft
for a request is then grown from its last token by a fixed breadth-first template: node j is the ``rank[j]``-th
candidate after its parent's token. Where the n-gram tries have nothing, this drafts from what the model itself
predicted the last time it saw the token.

State is one int32 array of ``vocab_size x k`` (-1: no candidate yet): bounded by construction (1.5 MB for a
49,152-token vocabulary at k = 8), no eviction needed. The kernels are small numba functions over it:
`RecycleTable.update` writes the rows of one step's scored positions, `RecycleTable.draft` expands the template
from a root token into the (tokens, parents) form of the other drafts (`ngramspec.layout`: parents[j] < j, -1 for
the root's children; no parent with two children of one token).

Used by the simulator's `recycle`, `ngramspec-recycle` and `ngramspec-adaptive-recycle` methods on traces that carry
the model's top-k (`scripts/record_topk.py`). With the adaptive controller, `with_recycled` puts recycling's drafts
into the n-gram cache's `DraftBatch` as source 2 (`ngramspec.controller.calibration.N_SOURCES`), each node with a
raw conditional by its rank (`RANK_CONDITIONAL`), so that the controller calibrates their acceptance apart from the
n-gram drafts' and picks width and prefix over both. The SGLang plugin's `recycle` option does the same in the server.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from numba import njit

DEFAULT_K = 8


def bfs_template(branching: Sequence[int] = (4, 2, 2, 1, 1, 1)) -> tuple[np.ndarray, np.ndarray]:
    """A breadth-first tree template: every node at depth d (the root's children are depth 0) has
    ``branching[d + 1]`` children, the root ``branching[0]``; child i of a node takes its parent token's candidate
    of rank i. Returns (parents, ranks), int32, parents[j] < j (-1: a child of the root)."""
    widths = [int(b) for b in branching]
    if not widths or any(b < 1 for b in widths):
        raise ValueError(f"branching must be a non-empty list of ints >= 1, got {list(branching)!r}")
    parents: list[int] = []
    ranks: list[int] = []
    level = [-1]
    for b in widths:
        nxt = []
        for p in level:
            for r in range(b):
                parents.append(p)
                ranks.append(r)
                nxt.append(len(parents) - 1)
        level = nxt
    return np.asarray(parents, np.int32), np.asarray(ranks, np.int32)


@njit(cache=True)
def _update(succ, tokens, topk):
    k = succ.shape[1]
    kk = min(k, topk.shape[1])
    for i in range(tokens.shape[0]):
        t = tokens[i]
        for r in range(kk):
            succ[t, r] = topk[i, r]
        for r in range(kk, k):
            succ[t, r] = -1


@njit(cache=True)
def _draft(succ, root, tpl_parents, tpl_ranks, max_nodes, out_tokens, out_parents):
    """Expand the template from ``root``; a node whose candidate is missing (-1) is left out with its subtree.
    Returns the number of nodes written (at most ``max_nodes``)."""
    slot = np.empty(tpl_parents.shape[0], np.int64)  # `_expand` clears it
    return _expand(succ, root, tpl_parents, tpl_ranks, max_nodes, out_tokens, out_parents, slot)


@njit(cache=True)
def _expand(succ, root, tpl_parents, tpl_ranks, max_nodes, out_tokens, out_parents, slot):
    """`_draft` into the caller's ``slot`` (one entry per template node): template node -> output index, -1 where
    left out. Output node m is template node j where slot[j] == m (so its rank is tpl_ranks[j])."""
    n_tpl = tpl_parents.shape[0]
    for j in range(n_tpl):
        slot[j] = -1
    n = 0
    k = succ.shape[1]
    for j in range(n_tpl):
        if n >= max_nodes:
            break
        p = tpl_parents[j]
        if p >= 0:
            q = slot[p]
            if q < 0:
                continue
            prev = out_tokens[q]
        else:
            q = -1
            prev = root
        r = tpl_ranks[j]
        if r >= k:
            continue
        t = succ[prev, r]
        if t < 0:
            continue
        dup = False  # a row written with a token twice: one child per token under a parent
        for m in range(n):
            if out_parents[m] == q and out_tokens[m] == t:
                dup = True
                break
        if dup:
            continue
        out_tokens[n] = t
        out_parents[n] = q
        slot[j] = n
        n += 1
    return n


class RecycleTable:
    """Each token's latest top-k successors (``k`` per token, ``vocab_size`` tokens)."""

    def __init__(self, vocab_size: int, k: int = DEFAULT_K, template: tuple[np.ndarray, np.ndarray] | None = None):
        if not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        if not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"k must be an int >= 1, got {k!r}")
        self.vocab_size, self.k = int(vocab_size), int(k)
        self.succ = np.full((self.vocab_size, self.k), -1, np.int32)
        parents, ranks = template if template is not None else bfs_template()
        self.tpl_parents = np.ascontiguousarray(parents, np.int32)
        self.tpl_ranks = np.ascontiguousarray(ranks, np.int32)
        if self.tpl_parents.shape != self.tpl_ranks.shape or self.tpl_parents.ndim != 1:
            raise ValueError("template: parents and ranks must be 1-D arrays of one length")
        if any(not -1 <= p < j for j, p in enumerate(self.tpl_parents.tolist())) or (self.tpl_ranks < 0).any():
            raise ValueError("template: parents[j] must be in [-1, j) and ranks >= 0")
        self._tokens = np.zeros(self.tpl_parents.shape[0], np.int32)
        self._parents = np.zeros(self.tpl_parents.shape[0], np.int32)

    @property
    def nbytes(self) -> int:
        return int(self.succ.nbytes)

    def _check_ids(self, a: np.ndarray, what: str) -> None:
        if a.size and (a.min() < 0 or a.max() >= self.vocab_size):
            bad = int(a[(a < 0) | (a >= self.vocab_size)].flat[0])
            raise ValueError(f"{what}: token id {bad} is outside 0..{self.vocab_size - 1}")

    def update(self, tokens, topk) -> None:
        """``topk[i]``: the candidates (most likely first) for the token after ``tokens[i]``; row ``tokens[i]`` of
        the table becomes them (a later position of the same token wins). Fewer than k columns leave the rest -1."""
        tokens = np.asarray(tokens)
        topk = np.asarray(topk)
        if tokens.ndim != 1 or topk.ndim != 2 or topk.shape[0] != tokens.shape[0]:
            raise ValueError(f"tokens must be 1-D and topk 2-D with one row per token, got shapes {tokens.shape} "
                             f"and {topk.shape}")
        if not (np.issubdtype(tokens.dtype, np.integer) and np.issubdtype(topk.dtype, np.integer)):
            raise ValueError("tokens and topk must hold integer token ids")
        self._check_ids(tokens, "tokens")
        self._check_ids(topk, "topk")
        _update(self.succ, np.ascontiguousarray(tokens, np.int64), np.ascontiguousarray(topk, np.int32))

    def draft(self, root: int, max_nodes: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The template expanded from ``root`` (the request's last token): (tokens, parents) copies, at most
        ``max_nodes`` nodes (default: the template's size), breadth-first."""
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self.vocab_size:
            raise ValueError(f"root must be a token id in 0..{self.vocab_size - 1}, got {root!r}")
        cap = self._tokens.shape[0] if max_nodes is None else max(0, min(int(max_nodes), self._tokens.shape[0]))
        n = _draft(self.succ, int(root), self.tpl_parents, self.tpl_ranks, cap, self._tokens, self._parents)
        return self._tokens[:n].copy(), self._parents[:n].copy()


RECYCLED = 2  # the DraftBatch source of recycling's nodes
# a recycled node's raw conditional by the rank of its token among its parent token's candidates (the controller
# learns the real acceptance per source, conditional bin and depth; these only separate the ranks into its bins)
RANK_CONDITIONAL = np.array([0.6, 0.3, 0.15, 0.08], np.float64)


def with_recycled(batch, table: "RecycleTable", roots, budget: int, min_match: int = 1, widen: bool = False):
    """``batch`` (an `NgramCache` proposal) where every request whose draft is empty or grew from a match shorter
    than ``min_match`` drafts from ``table`` instead, from its last token ``roots[i]``, up to ``budget`` nodes:
    source `RECYCLED`, probabilities the products of `RANK_CONDITIONAL` along each path, match length 0. With
    ``widen``, every other request's n-gram draft is followed by recycling's nodes whose first token is none of the
    n-gram draft's first tokens (with their subtrees): a controller that keeps a prefix of a draft reaches them
    only past the n-gram nodes. Returns (the new `DraftBatch`, how many requests drafted from recycling). Requests
    kept as they were keep their arrays unchanged."""
    from ngramspec.cache import _draft_batch

    B = len(batch)
    budget = max(0, int(budget))
    roots = np.ascontiguousarray(roots, np.int64)
    if roots.shape != (B,):
        raise ValueError(f"roots: one token per request ({B}), got shape {roots.shape}")
    if B and (roots.min() < 0 or roots.max() >= table.vocab_size):
        raise ValueError(f"roots must be token ids in 0..{table.vocab_size - 1}")
    n_in = int(batch.offsets[B])
    cap = n_in + B * min(budget, table.tpl_parents.shape[0])
    tokens, parents = np.empty(cap, np.int32), np.empty(cap, np.int32)
    probs, sources = np.empty(cap, np.float32), np.empty(cap, np.int8)
    offsets, mlens = np.empty(B + 1, np.int64), np.asarray(batch.match_lens, np.int64).copy()
    used = _merge_recycled(batch.tokens, batch.parents, batch.probs, batch.sources, batch.offsets, table.succ,
                           table.tpl_parents, table.tpl_ranks, RANK_CONDITIONAL, roots, budget, int(min_match),
                           bool(widen), tokens, parents, probs, sources, offsets, mlens)
    n = int(offsets[B])
    return _draft_batch(tokens[:n], parents[:n], probs[:n], sources[:n], offsets, mlens), int(used)


@njit(cache=True)
def _merge_recycled(b_tokens, b_parents, b_probs, b_sources, b_offsets, succ, tpl_parents, tpl_ranks, rank_q, roots,
                    budget, min_match, widen, tokens, parents, probs, sources, offsets, mlens):
    """`with_recycled`'s work in one call: writes the merged batch into the output arrays (room for the input
    nodes plus ``budget`` per request), ``offsets`` and ``mlens`` (the input match lengths, 0 where recycling
    replaced the draft); returns how many requests drafted from recycling."""
    B = b_offsets.shape[0] - 1
    n_tpl = tpl_parents.shape[0]
    t = np.empty(n_tpl, np.int32)
    p = np.empty(n_tpl, np.int32)
    slot = np.empty(n_tpl, np.int64)
    rank = np.empty(n_tpl, np.int64)
    path = np.empty(n_tpl, np.float64)
    new_index = np.empty(n_tpl, np.int64)
    nq = rank_q.shape[0]
    out = 0
    used = 0
    offsets[0] = 0
    for i in range(B):
        a, b = b_offsets[i], b_offsets[i + 1]
        keep = b > a and mlens[i] >= min_match
        if keep:  # the n-gram draft first
            for j in range(a, b):
                tokens[out + j - a] = b_tokens[j]
                parents[out + j - a] = b_parents[j]
                probs[out + j - a] = b_probs[j]
                sources[out + j - a] = b_sources[j]
        if keep and not widen:
            out += b - a
            offsets[i + 1] = out
            continue
        m = _expand(succ, roots[i], tpl_parents, tpl_ranks, min(budget, n_tpl), t, p, slot)
        for j in range(n_tpl):
            if slot[j] >= 0:
                rank[slot[j]] = tpl_ranks[j]
        for j in range(m):
            q = rank_q[min(rank[j], nq - 1)]
            path[j] = q * (path[p[j]] if p[j] >= 0 else 1.0)
        if keep:  # widen: recycling's other first tokens and their subtrees, after the n-gram draft
            n = b - a
            added = 0
            for j in range(m):
                new_index[j] = -1
                if p[j] < 0:
                    dup = False
                    for k in range(a, b):
                        if b_parents[k] < 0 and b_tokens[k] == t[j]:
                            dup = True
                            break
                    if dup:
                        continue
                elif new_index[p[j]] < 0:
                    continue
                new_index[j] = n + added
                w = out + n + added
                tokens[w] = t[j]
                parents[w] = -1 if p[j] < 0 else new_index[p[j]]
                probs[w] = path[j]
                sources[w] = RECYCLED
                added += 1
            out += n + added
            offsets[i + 1] = out
            if added > 0:
                used += 1
            continue
        for j in range(m):
            tokens[out + j] = t[j]
            parents[out + j] = p[j]
            probs[out + j] = path[j]
            sources[out + j] = RECYCLED
        out += m
        offsets[i + 1] = out
        mlens[i] = 0
        if m > 0:
            used += 1
    return used


def order_by_value(batch, values):
    """``batch`` with the nodes of every request that mixes recycled and n-gram nodes (`with_recycled`'s widen)
    reordered by ``values`` (each node's calibrated P(accepted), `AdaptiveController.node_values`), highest first,
    ties in their order: a controller that keeps a prefix of each draft then keeps the draft's best nodes,
    whichever source drafted them, where the merge put recycling's nodes after the whole n-gram draft. P falls along
    every path (a product of conditionals), so parents stay before their children. Requests with one source keep
    their order; the input is not modified."""
    from ngramspec.cache import _draft_batch

    values = np.ascontiguousarray(values, np.float64)
    n = int(batch.offsets[len(batch)])
    if values.shape != (n,):
        raise ValueError(f"values: one per draft node ({n}), got shape {values.shape}")
    tokens, parents = np.empty(n, np.int32), np.empty(n, np.int32)
    probs, sources = np.empty(n, np.float32), np.empty(n, np.int8)
    _order(batch.tokens, batch.parents, batch.probs, batch.sources, batch.offsets, values, tokens, parents, probs,
           sources)
    return _draft_batch(tokens, parents, probs, sources, batch.offsets, batch.match_lens)


@njit(cache=True)
def _order(b_tokens, b_parents, b_probs, b_sources, offsets, values, tokens, parents, probs, sources):
    """`order_by_value`'s work: a stable insertion sort per mixed request (drafts are at most a few dozen nodes)."""
    B = offsets.shape[0] - 1
    longest = 0
    for i in range(B):
        longest = max(longest, offsets[i + 1] - offsets[i])
    idx = np.empty(longest, np.int64)
    inv = np.empty(longest, np.int64)
    v = np.empty(longest, np.float64)  # the values capped by the parent's: parents first whatever the rounding
    for i in range(B):
        a, b = offsets[i], offsets[i + 1]
        n = b - a
        mixed = False
        for j in range(a, b):
            if (b_sources[j] == RECYCLED) != (b_sources[a] == RECYCLED):
                mixed = True
                break
        for k in range(n):
            idx[k] = k
            p = b_parents[a + k]
            v[k] = values[a + k] if p < 0 else min(values[a + k], v[p])
        if mixed:
            for k in range(1, n):
                x = idx[k]
                m = k - 1
                while m >= 0 and v[idx[m]] < v[x]:
                    idx[m + 1] = idx[m]
                    m -= 1
                idx[m + 1] = x
        for k in range(n):
            inv[idx[k]] = k
        for k in range(n):
            j = a + idx[k]
            tokens[a + k] = b_tokens[j]
            probs[a + k] = b_probs[j]
            sources[a + k] = b_sources[j]
            p = b_parents[j]
            parents[a + k] = -1 if p < 0 else inv[p]
