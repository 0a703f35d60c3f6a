"""Numba kernels of drafting one step ahead: the next step's drafts for every likely outcome of the step in flight.

A step verifies a draft (a tree of nodes under the root, the last committed token). Its outcome is the accepted
node n (the root when nothing is accepted) and the bonus token b the model gives after n's path; the next step
drafts from history + path(n) + b. While the step runs, `outcomes_batch` enumerates likely outcomes (n, b): for
each node (and the root) the trie's continuations after its path, less the draft's own children of that node
(were b one of them, the verify would have accepted further), weighted by

    P(outcome) ~ p_reach(n) * count(b) / total        (p_reach: the draft's path probability, 1 at the root)

(the same empirical conditionals the draft itself was built from). The best `entries` outcomes each get a draft
of up to `budget` nodes from their context, written into dense per-request tables. Nothing in the cache changes.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ngramspec._draft import MAX_BRANCH, SRC_LOCAL, SRC_SHARED, continuations, draft_chain, draft_tree, tree_scratch
from ngramspec._nrt import REFCOUNT, list_item
from ngramspec._trie import longest_match

NO_ENTRY = -2  # an unused entry's node (-1 is the root)


@njit(cache=True)
def _path_context(hist, hlen, d_tok, d_par, a, n, ctx_keep, ctx):
    """ctx = the last ``ctx_keep`` tokens of the history, then the draft's path to node ``n`` (a-relative; -1: the
    root). Returns its length."""
    keep = min(hlen, ctx_keep)
    for i in range(keep):
        ctx[i] = hist[hlen - keep + i]
    depth = 0
    j = n
    while j >= 0:
        depth += 1
        j = d_par[a + j]
    p = keep + depth - 1
    j = n
    while j >= 0:
        ctx[p] = d_tok[a + j]
        p -= 1
        j = d_par[a + j]
    return keep + depth


@njit(cache=True)
def _match(r, ctx, clen, max_depth, use_shared, own, hist, hlen, shared):
    """The longer of the own-history and shared-cache matches of ctx's suffix (a tie: own).
    Returns (length, source, node, off)."""
    lim = max_depth - 1
    ml, ln, loff = longest_match(own.nodes, own.table, own.roots[r], hist, hlen, ctx, clen, lim)
    ms, sn, soff = 0, -1, 0
    if use_shared:
        ms, sn, soff = longest_match(shared.nodes, shared.table, shared.root, shared.arena, shared.arena.shape[0],
                                     ctx, clen, lim)
    if ml > 0 and ml >= ms:
        return ml, SRC_LOCAL, ln, loff
    if ms > 0:
        return ms, SRC_SHARED, sn, soff
    return 0, SRC_LOCAL, -1, 0


@njit(cache=True)
def _is_child(d_tok, d_par, a, k, n, tok):
    for j in range(k):
        if d_par[a + j] == n and d_tok[a + j] == tok:
            return True
    return False


@njit(cache=True, **REFCOUNT)
def outcomes_batch(slots, d_tok, d_par, d_prob, d_off, entries, budget, tree, max_depth, use_shared, own, hists,
                   shared, e_node, e_tok, e_w, e_src, c_tok, c_par, c_prob, c_len):
    """For request i (cache slot ``slots[i]``) with the draft in flight ``d_*[d_off[i]:d_off[i+1]]``: up to
    ``entries`` outcomes, most likely first, in ``e_node[i, e]`` (-1: the root; NO_ENTRY: unused), ``e_tok``
    (the bonus token), ``e_w`` (the weight above) and ``e_src`` (the source of the continuation), and each one's
    draft of up to ``budget`` nodes in ``c_tok[i, e]``, ``c_par``, ``c_prob`` (parents and path probabilities as
    `propose` gives them), ``c_len[i, e]`` nodes. Returns the number of entries written over the batch."""
    B = slots.shape[0]
    lim = max_depth - 1
    maxk = 0
    for i in range(B):
        maxk = max(maxk, d_off[i + 1] - d_off[i])
    ctx = np.empty(lim + maxk + 2, np.int32)
    buf = np.empty(lim + budget + 2, np.int32)
    sc = tree_scratch(max(budget, 1))
    t_tok, t_node, t_off, t_cnt = sc.t_tok, sc.t_node, sc.t_off, sc.t_cnt
    cap = (maxk + 1) * MAX_BRANCH
    k_node = np.empty(cap, np.int32)
    k_tok = np.empty(cap, np.int32)
    k_w = np.empty(cap, np.float64)
    used = np.zeros(cap, np.bool_)
    written = 0
    for i in range(B):
        r = slots[i]
        hist = list_item(hists, r)
        hlen = own.hlens[r]
        a = d_off[i]
        k = d_off[i + 1] - a
        for e in range(entries):
            e_node[i, e] = NO_ENTRY
            e_tok[i, e] = -1
            e_w[i, e] = 0.0
            e_src[i, e] = SRC_LOCAL
            c_len[i, e] = 0
        # candidate outcomes: the continuations after each node's path that the draft did not take
        ncand = 0
        for n in range(-1, k):
            clen = _path_context(hist, hlen, d_tok, d_par, a, n, lim, ctx)
            m, src, pn, poff = _match(r, ctx, clen, max_depth, use_shared, own, hist, hlen, shared)
            if m == 0:
                continue
            if src == SRC_LOCAL:
                nk, total = continuations(own.nodes, hist, hlen, pn, poff, MAX_BRANCH, t_tok, t_node, t_off, t_cnt)
            else:
                nk, total = continuations(shared.nodes, shared.arena, shared.arena.shape[0], pn, poff, MAX_BRANCH,
                                          t_tok, t_node, t_off, t_cnt)
            reach = 1.0 if n < 0 else d_prob[a + n]
            for j in range(nk):
                if _is_child(d_tok, d_par, a, k, n, t_tok[j]):
                    continue
                k_node[ncand], k_tok[ncand] = n, t_tok[j]
                k_w[ncand] = reach * t_cnt[j] / total
                ncand += 1
        # the best `entries` of them (ties: the earlier candidate, i.e. the shallower node, the more frequent token)
        used[:ncand] = False
        for e in range(min(entries, ncand)):
            best = -1
            for q in range(ncand):
                if not used[q] and (best < 0 or k_w[q] > k_w[best]):
                    best = q
            used[best] = True
            n, tok = k_node[best], k_tok[best]
            e_node[i, e], e_tok[i, e], e_w[i, e] = n, tok, k_w[best]
            clen = _path_context(hist, hlen, d_tok, d_par, a, n, lim, ctx)
            ctx[clen] = tok
            clen += 1
            m, src, pn, poff = _match(r, ctx, clen, max_depth, use_shared, own, hist, hlen, shared)
            e_src[i, e] = src
            got = 0
            if m > 0:
                o_tok, o_par, o_prob = c_tok[i, e], c_par[i, e], c_prob[i, e]
                if src == SRC_LOCAL:
                    nodes, table, root, arena, alen = own.nodes, own.table, own.roots[r], hist, hlen
                else:
                    nodes, table, root, arena, alen = shared.nodes, shared.table, shared.root, shared.arena, \
                        shared.arena.shape[0]
                if tree:
                    got = draft_tree(nodes, table, root, arena, alen, pn, poff, ctx, clen, budget, max_depth, buf,
                                     o_tok, o_par, o_prob, 0, sc)
                else:
                    got = draft_chain(nodes, table, root, arena, alen, pn, poff, ctx, clen, budget, max_depth, buf,
                                      o_tok, o_par, o_prob, 0, sc)
            c_len[i, e] = got
            written += 1
    return written
