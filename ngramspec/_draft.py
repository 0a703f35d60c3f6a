"""Numba kernels that turn trie matches into drafts (chain or best-first tree) and index whole batches."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from ngramspec._nrt import NO_REFCOUNT_LIST, REFCOUNT, list_item
from ngramspec._trie import (
    CHILD,
    CNT,
    DEP,
    M_CAP,
    M_LIVE,
    NEXT,
    TAIL,
    TOK,
    _arena_token,
    insert_token,
    longest_match,
)

SRC_LOCAL, SRC_SHARED = 0, 1
MAX_BRANCH = 32  # children considered per tree node: keeps scratch linear in the budget
SCRATCH_BUDGET = 32  # the largest per-request budget the cache's preallocated proposal scratch serves


class TreeScratch(NamedTuple):
    """`draft_tree`'s scratch (`tree_scratch`), held by the cache and reused (a batch whose budgets exceed it gets
    a larger one of its own). Candidates (``c_*``: token, parent draft node, trie position, path probability) live
    in a max-heap of candidate indices (``h_*``: probability, insertion sequence for deterministic ties, candidate
    index); ``t_*`` receives one node's continuations (only the first MAX_BRANCH entries are used)."""

    c_tok: np.ndarray
    c_par: np.ndarray
    c_node: np.ndarray
    c_off: np.ndarray
    c_prob: np.ndarray
    h_prob: np.ndarray
    h_seq: np.ndarray
    h_idx: np.ndarray
    t_tok: np.ndarray
    t_node: np.ndarray
    t_off: np.ndarray
    t_cnt: np.ndarray


class OwnState(NamedTuple):
    """A cache's per-request state, as the kernels take it: the per-request tries (one node pool, a root per
    request) and, per slot, the history length and the bookkeeping of incremental matching. (The histories
    themselves, a typed List, travel beside it: inside a tuple, numba's dispatcher types a typed List about 30
    times slower.)"""

    nodes: np.ndarray  # int32 [N, NODE_FIELDS]: the per-request tries' node pool
    table: np.ndarray  # int32 [H]: its hash table
    meta: np.ndarray  # int64 [5]: its free list and counters
    roots: np.ndarray  # int32 [R]: each slot's trie root (-1: free slot)
    hlens: np.ndarray  # int64 [R]: tokens in each history
    active: np.ndarray  # int32 [R, D]: each slot's open trie positions (insert_token's state)
    match_len: np.ndarray  # int64 [R, 2]: last match length in own history / in the shared cache
    since: np.ndarray  # int64 [R]: tokens appended since the last proposal
    epoch_seen: np.ndarray  # int64 [R]: the shared cache's epoch at the last proposal
    buf: np.ndarray  # int32: `propose_batch`'s context buffer, reused (budgets up to SCRATCH_BUDGET)
    sc: TreeScratch  # `draft_tree`'s scratch, reused (budgets up to SCRATCH_BUDGET)


class SharedState(NamedTuple):
    """The shared cache as the kernels read it: one trie over the token ring of finished outputs."""

    nodes: np.ndarray
    table: np.ndarray
    root: int
    arena: np.ndarray  # int32 token ring


@njit(cache=True)
def _scratch_cap(max_budget):
    """Candidates a tree of up to ``max_budget`` nodes may hold: each drafted node adds at most MAX_BRANCH."""
    return max_budget * (min(max_budget, MAX_BRANCH) + 1) + 1


@njit(cache=True)
def tree_scratch(max_budget):
    """Scratch for trees of up to ``max_budget`` nodes (and for chains)."""
    cap = _scratch_cap(max_budget)
    ci = np.empty((5, cap), np.int32)
    cf = np.empty((2, cap), np.float64)
    t = np.empty((4, MAX_BRANCH), np.int32)
    return TreeScratch(ci[0], ci[1], ci[2], ci[3], cf[0], cf[1], np.empty(cap, np.int64), ci[4],
                       t[0], t[1], t[2], t[3])


@njit(cache=True)
def continuations(nodes, arena, alen, n, off, max_out, o_tok, o_node, o_off, o_cnt):
    """The (up to ``max_out``) most frequent next tokens after position (n, off), most frequent first.

    Returns (k, total): how many were written and the total count over *all* continuations (the denominator
    of the empirical conditional probability). A tail counts as one occurrence.
    """
    if off > 0:
        t = _arena_token(arena, alen, nodes[n, TAIL] + off)
        if t < 0 or max_out <= 0:
            return 0, 0
        o_tok[0], o_node[0], o_off[0], o_cnt[0] = t, n, off + 1, 1
        return 1, 1
    k = 0
    total = 0
    t = _arena_token(arena, alen, nodes[n, TAIL])
    if t >= 0:
        total += 1
        if max_out > 0:
            o_tok[0], o_node[0], o_off[0], o_cnt[0] = t, n, 1, 1
            k = 1
    c = nodes[n, CHILD]
    while c >= 0:
        cnt = nodes[c, CNT]
        total += cnt
        # insertion into the top-k list, ties keep the earlier (deterministic)
        i = k
        if k < max_out:
            k += 1
        elif cnt <= o_cnt[k - 1]:
            c = nodes[c, NEXT]
            continue
        else:
            i = k - 1
        while i > 0 and o_cnt[i - 1] < cnt:
            o_tok[i], o_node[i], o_off[i], o_cnt[i] = o_tok[i - 1], o_node[i - 1], o_off[i - 1], o_cnt[i - 1]
            i -= 1
        o_tok[i], o_node[i], o_off[i], o_cnt[i] = nodes[c, TOK], c, 0, cnt
        c = nodes[c, NEXT]
    return k, total


@njit(cache=True)
def _pos_depth(nodes, n, off):
    return nodes[n, DEP] + off


@njit(cache=True)
def draft_chain(nodes, table, root, arena, alen, n, off, hist, hlen, budget, max_depth,
                buf, o_tok, o_par, o_prob, base, sc):
    """Most likely continuation from match position (n, off), up to ``budget`` tokens.

    When the trie path runs out (depth D, or an occurrence that ended) it backs off to the longest suffix of
    history + draft that still has a continuation, like a suffix link. Returns the number of tokens written.
    ``sc``: a `TreeScratch` (its ``t_*`` arrays hold the one continuation).
    """
    ctx = min(hlen, max_depth - 1)
    for i in range(ctx):
        buf[i] = hist[hlen - ctx + i]
    blen = ctx
    c_tok, c_node, c_off, c_cnt = sc.t_tok, sc.t_node, sc.t_off, sc.t_cnt
    prob = 1.0
    i = 0
    while i < budget:
        k, total = continuations(nodes, arena, alen, n, off, 1, c_tok, c_node, c_off, c_cnt)
        if k == 0:
            m_hi = min(_pos_depth(nodes, n, off) - 1, max_depth - 1)
            m, n2, off2 = longest_match(nodes, table, root, arena, alen, buf, blen, m_hi)
            if m == 0:
                break
            n, off = n2, off2
            continue
        prob *= c_cnt[0] / total
        o_tok[base + i] = c_tok[0]
        o_par[base + i] = i - 1
        o_prob[base + i] = prob
        buf[blen] = c_tok[0]
        blen += 1
        n, off = c_node[0], c_off[0]
        i += 1
    return i


@njit(cache=True)
def _heap_push(h_prob, h_seq, h_idx, size, prob, seq, idx):
    i = size
    h_prob[i], h_seq[i], h_idx[i] = prob, seq, idx
    while i > 0:
        p = (i - 1) // 2
        if h_prob[p] > h_prob[i] or (h_prob[p] == h_prob[i] and h_seq[p] < h_seq[i]):
            break
        h_prob[p], h_prob[i] = h_prob[i], h_prob[p]
        h_seq[p], h_seq[i] = h_seq[i], h_seq[p]
        h_idx[p], h_idx[i] = h_idx[i], h_idx[p]
        i = p
    return size + 1


@njit(cache=True)
def _heap_pop(h_prob, h_seq, h_idx, size):
    idx = h_idx[0]
    size -= 1
    h_prob[0], h_seq[0], h_idx[0] = h_prob[size], h_seq[size], h_idx[size]
    i = 0
    while True:
        lc, r, b = 2 * i + 1, 2 * i + 2, i
        if lc < size and (h_prob[lc] > h_prob[b] or (h_prob[lc] == h_prob[b] and h_seq[lc] < h_seq[b])):
            b = lc
        if r < size and (h_prob[r] > h_prob[b] or (h_prob[r] == h_prob[b] and h_seq[r] < h_seq[b])):
            b = r
        if b == i:
            break
        h_prob[b], h_prob[i] = h_prob[i], h_prob[b]
        h_seq[b], h_seq[i] = h_seq[i], h_seq[b]
        h_idx[b], h_idx[i] = h_idx[i], h_idx[b]
        i = b
    return idx, size


@njit(cache=True)
def draft_tree(nodes, table, root, arena, alen, n, off, hist, hlen, budget, max_depth,
               buf, o_tok, o_par, o_prob, base, sc):
    """Best-first tree: repeatedly add the frontier node of highest path probability (product of empirical
    conditional frequencies). Output is in that order, so parents precede children, probabilities never grow
    along a path, and every prefix of the output is the best tree of its size. Returns the node count.
    ``sc``: a `TreeScratch` for at least ``budget`` nodes."""
    c_tok, c_par, c_node, c_off, c_prob = sc.c_tok, sc.c_par, sc.c_node, sc.c_off, sc.c_prob
    h_prob, h_seq, h_idx = sc.h_prob, sc.h_seq, sc.h_idx
    t_tok, t_node, t_off, t_cnt = sc.t_tok, sc.t_node, sc.t_off, sc.t_cnt
    ctx = min(hlen, max_depth - 1)
    ncand = 0
    hsize = 0
    done = 0
    pn, poff, parent, pprob = n, off, -1, 1.0
    while True:
        # push the (at most MAX_BRANCH best) continuations of (pn, poff) as children of draft node `parent`
        want = min(budget - done, MAX_BRANCH)
        k, total = continuations(nodes, arena, alen, pn, poff, want, t_tok, t_node, t_off, t_cnt)
        if k == 0 and parent >= 0:
            # back off: longest suffix of history + path to `parent` that has a continuation
            depth = 0
            j = parent
            while j >= 0:
                depth += 1
                j = o_par[base + j]
            blen = ctx + depth
            for i in range(ctx):
                buf[i] = hist[hlen - ctx + i]
            j = parent
            p = blen - 1
            while j >= 0:
                buf[p] = o_tok[base + j]
                p -= 1
                j = o_par[base + j]
            m_hi = min(_pos_depth(nodes, pn, poff) - 1, max_depth - 1)
            m, n2, off2 = longest_match(nodes, table, root, arena, alen, buf, blen, m_hi)
            if m > 0:
                k, total = continuations(nodes, arena, alen, n2, off2, want, t_tok, t_node, t_off, t_cnt)
        for i in range(k):
            c_tok[ncand], c_par[ncand] = t_tok[i], parent
            c_node[ncand], c_off[ncand] = t_node[i], t_off[i]
            c_prob[ncand] = pprob * t_cnt[i] / total
            hsize = _heap_push(h_prob, h_seq, h_idx, hsize, c_prob[ncand], ncand, ncand)
            ncand += 1
        if hsize == 0 or done >= budget:
            break
        ci, hsize = _heap_pop(h_prob, h_seq, h_idx, hsize)
        o_tok[base + done] = c_tok[ci]
        o_par[base + done] = c_par[ci]
        o_prob[base + done] = c_prob[ci]
        pn, poff, parent, pprob = c_node[ci], c_off[ci], done, c_prob[ci]
        done += 1
    return done


@njit(cache=True, **NO_REFCOUNT_LIST)
def _propose(slots, budgets, tree, max_depth, use_shared, epoch, own, hists, shared, o_tok, o_par, o_prob, o_src,
             offsets, o_mlen, buf, sc):
    """`propose_batch` with the scratch given: a context buffer ``buf`` and a `TreeScratch` ``sc``, large enough
    for every budget. Compiled without reference counting (it allocates nothing)."""
    l_nodes, l_table, roots, hlens = own.nodes, own.table, own.roots, own.hlens
    match_len, since, epoch_seen = own.match_len, own.since, own.epoch_seen
    s_nodes, s_table, s_root, s_arena = shared.nodes, shared.table, shared.root, shared.arena
    B = slots.shape[0]
    s_alen = s_arena.shape[0]
    pos = 0
    offsets[0] = 0
    for i in range(B):
        r = slots[i]
        hist = list_item(hists, r)
        hlen = hlens[r]
        lim = max_depth - 1
        m_hi = min(match_len[r, 0] + since[r], lim)
        ml, ln, loff = longest_match(l_nodes, l_table, roots[r], hist, hlen, hist, hlen, m_hi)
        ms, sn, soff = 0, -1, 0
        if use_shared:
            m_hi = lim if epoch_seen[r] != epoch else min(match_len[r, 1] + since[r], lim)
            ms, sn, soff = longest_match(s_nodes, s_table, s_root, s_arena, s_alen, hist, hlen, m_hi)
        match_len[r, 0] = ml
        match_len[r, 1] = ms
        o_mlen[i] = ml if ml >= ms else ms
        since[r] = 0
        epoch_seen[r] = epoch
        k = 0
        src = SRC_LOCAL
        if ml > 0 and ml >= ms:
            if tree:
                k = draft_tree(l_nodes, l_table, roots[r], hist, hlen, ln, loff, hist, hlen, budgets[i],
                               max_depth, buf, o_tok, o_par, o_prob, pos, sc)
            else:
                k = draft_chain(l_nodes, l_table, roots[r], hist, hlen, ln, loff, hist, hlen, budgets[i],
                                max_depth, buf, o_tok, o_par, o_prob, pos, sc)
        elif ms > 0:
            src = SRC_SHARED
            if tree:
                k = draft_tree(s_nodes, s_table, s_root, s_arena, s_alen, sn, soff, hist, hlen, budgets[i],
                               max_depth, buf, o_tok, o_par, o_prob, pos, sc)
            else:
                k = draft_chain(s_nodes, s_table, s_root, s_arena, s_alen, sn, soff, hist, hlen, budgets[i],
                                max_depth, buf, o_tok, o_par, o_prob, pos, sc)
        for j in range(pos, pos + k):
            o_src[j] = src
        pos += k
        offsets[i + 1] = pos
    return pos


@njit(cache=True, **NO_REFCOUNT_LIST)
def propose_own(slots, budgets, tree, max_depth, use_shared, epoch, own, hists, shared, o_tok, o_par, o_prob, o_src,
                offsets, o_mlen):
    """`propose_batch` on the cache's own scratch (``own.buf``, ``own.sc``), compiled without reference counting:
    returns -1, having changed nothing, when a budget exceeds that scratch (`propose_batch` then allocates)."""
    maxb = 1
    for i in range(slots.shape[0]):
        maxb = max(maxb, budgets[i])
    buf, sc = own.buf, own.sc
    if buf.shape[0] < max_depth + maxb + 1 or sc.h_idx.shape[0] < _scratch_cap(maxb):
        return -1
    return _propose(slots, budgets, tree, max_depth, use_shared, epoch, own, hists, shared, o_tok, o_par, o_prob,
                    o_src, offsets, o_mlen, buf, sc)


@njit(cache=True, **REFCOUNT)
def propose_batch(slots, budgets, tree, max_depth, use_shared, epoch, own, hists, shared,
                  o_tok, o_par, o_prob, o_src, offsets, o_mlen):
    """Draft for every request of a batch in one call. Output is flat; request i owns offsets[i]:offsets[i+1].
    ``own``: `OwnState`; ``hists``: the token histories (typed List, by slot); ``shared``: `SharedState`, used
    when ``use_shared``; ``epoch``: the shared cache's.

    Source choice: the longer match wins (own history vs shared cache); on a tie, own history. Match lengths are
    found incrementally: a match can grow by at most the number of tokens added since the last proposal (also
    in a trie that dropped occurrences: an indexed n-gram's prefixes were indexed when it was), so only the
    shared cache's changes (new finished requests) force a full-depth search. The bound only saves work: a
    draft is a function of the tokens fed, never of when or how often ``propose`` was called.
    """
    n = propose_own(slots, budgets, tree, max_depth, use_shared, epoch, own, hists, shared, o_tok, o_par, o_prob,
                    o_src, offsets, o_mlen)
    if n >= 0:
        return n
    maxb = 1  # a budget exceeds the cache's scratch: a larger one for this call
    for i in range(slots.shape[0]):
        maxb = max(maxb, budgets[i])
    return _propose(slots, budgets, tree, max_depth, use_shared, epoch, own, hists, shared, o_tok, o_par, o_prob,
                    o_src, offsets, o_mlen, np.empty(max_depth + maxb + 1, np.int32), tree_scratch(maxb))


@njit(cache=True, **NO_REFCOUNT_LIST)
def append_own(slots, flat, offsets, max_depth, own, hists):
    """`append_batch`, compiled without reference counting (for compiled callers)."""
    hlens = own.hlens
    for j in range(flat.shape[0]):
        if flat[j] < 0:
            return -1 - j
    for i in range(slots.shape[0]):
        r = slots[i]
        if hlens[r] + offsets[i + 1] - offsets[i] > list_item(hists, r).shape[0]:
            return 1 + i
    size = own.table.shape[0]  # a view smaller than 2 x capacity is a prefix of a larger buffer: it can grow
    if 2 * (own.meta[M_LIVE] + flat.shape[0] * max_depth) > size and size < 2 * own.meta[M_CAP]:
        return 1 + slots.shape[0]
    for i in range(slots.shape[0]):
        r = slots[i]
        hist = list_item(hists, r)
        for j in range(offsets[i], offsets[i + 1]):
            p = hlens[r]
            hist[p] = flat[j]
            hlens[r] = p + 1
            insert_token(own.nodes, own.table, own.meta, own.roots[r], own.active[r], hist, p + 1, p, max_depth)
        own.since[r] += offsets[i + 1] - offsets[i]
    return 0


@njit(cache=True)
def append_batch(slots, flat, offsets, max_depth, own, hists):
    """Append each request's new tokens ``flat[offsets[i]:offsets[i+1]]`` to its history and index them in its
    own trie (O(D) per token); ``own``: `OwnState`, ``hists``: the histories. Checks first and changes nothing
    when a check fails: returns -1 - j when ``flat[j]`` is negative (not a token id), 1 + i for the first
    request i whose history array has no room for its new tokens (the caller grows it and calls again), 1 + B
    (B requests) when the trie's hash view could end up more than half full (at most D new nodes a token; the
    caller grows the view, `_trie.table_for`, and calls again), 0 when the tokens were appended."""
    return append_own(slots, flat, offsets, max_depth, own, hists)
