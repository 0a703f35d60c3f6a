"""The shared cache: finished outputs in a token ring (segments separated by -1) indexed by one trie.

Eviction is FIFO by whole segment: the oldest finished output leaves first, its occurrences are subtracted
from the counts (nodes that reach zero are freed), so counts always equal the n-gram counts of the segments
still held. A segment is evicted when the ring has no room for a new one, when the segment table is full, or
when the node pool runs low while indexing (an insertion needs at most D new nodes per token, and this is
guaranteed before each token so no occurrence is ever half-indexed).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ngramspec._trie import M_CAP, M_LIVE, insert_token, remove_occurrence

S_HEAD, S_COUNT, S_WRITE, S_EPOCH = range(4)


def new_ring(n_tokens: int, n_segments: int):
    arena = np.full(n_tokens, -1, dtype=np.int32)
    seg = np.zeros((n_segments, 3), dtype=np.int64)  # start, length, indexed starts
    state = np.zeros(4, dtype=np.int64)
    return arena, seg, state


@njit(cache=True)
def evict_oldest(nodes, table, meta, root, arena, seg, state, max_depth):
    h = state[S_HEAD]
    start, length, indexed = seg[h, 0], seg[h, 1], seg[h, 2]
    end = start + indexed  # occurrences were only ever extended up to here
    for s in range(start, end):
        remove_occurrence(nodes, table, meta, root, arena, arena.shape[0], s, end, max_depth)
    for q in range(start, start + length + 1):
        arena[q] = -1
    state[S_HEAD] = (h + 1) % seg.shape[0]
    state[S_COUNT] -= 1
    state[S_EPOCH] += 1


@njit(cache=True)
def share_tokens(nodes, table, meta, root, arena, seg, state, tokens, max_depth, active):
    """Add one finished output to the shared cache, evicting the oldest outputs as needed.
    Returns how many of its tokens were indexed."""
    A = arena.shape[0]
    n_seg = seg.shape[0]
    L = tokens.shape[0]
    if L > A - 1:
        tokens = tokens[L - (A - 1):]
        L = A - 1
    if L <= 0:
        return 0
    need = L + 1
    if state[S_COUNT] == n_seg:
        evict_oldest(nodes, table, meta, root, arena, seg, state, max_depth)
    while True:
        w = state[S_WRITE]
        if state[S_COUNT] == 0:
            if A - w < need:
                state[S_WRITE] = 0
            break
        o = seg[state[S_HEAD], 0]
        if w > o:
            if A - w >= need:
                break
            state[S_WRITE] = 0
        elif o - w >= need:
            break
        else:
            evict_oldest(nodes, table, meta, root, arena, seg, state, max_depth)
    w = state[S_WRITE]
    arena[w:w + L] = tokens
    arena[w + L] = -1
    t = (state[S_HEAD] + state[S_COUNT]) % n_seg
    seg[t, 0], seg[t, 1], seg[t, 2] = w, L, 0
    state[S_COUNT] += 1
    state[S_WRITE] = w + need
    state[S_EPOCH] += 1
    active[:] = -1
    for p in range(w, w + L):
        while meta[M_CAP] - meta[M_LIVE] < max_depth + 1 and state[S_COUNT] > 1:
            evict_oldest(nodes, table, meta, root, arena, seg, state, max_depth)
        if meta[M_CAP] - meta[M_LIVE] < max_depth + 1:
            # no room even after evicting every older output: keep only the indexed part of this one
            arena[p:w + L + 1] = -1
            seg[t, 1] = seg[t, 2]
            break
        # positions are ring offsets; the segment's -1 terminator bounds every tail
        insert_token(nodes, table, meta, root, active, arena, A, p, max_depth)
        seg[t, 2] += 1
    return seg[t, 2]
