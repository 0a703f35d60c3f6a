"""Numba kernels of the suffix trie: flat int32 state, small jitted functions, no Python objects.

A trie is three arrays:

- ``nodes[N, 8]`` int32, one row per node, columns below. Row-major so a node's fields share a cache line.
- ``table[H]`` int32, an open-addressing hash (linear probing) from (parent, token) to node id; the key is read
  back from ``nodes`` so a slot costs 4 bytes. ``H`` is a power of two. `new_trie` allocates ``2N`` slots (at
  least) but the kernels take a prefix of them, sized to the live nodes (`table_for`): a pool sized for a whole
  server is mostly empty, and probing a hash of its full size would miss the CPU's caches on every lookup.
- ``meta[5]`` int64: free-list head, high-water mark, live nodes, capacity, nodes reserved for roots (a
  non-root allocation never takes those, so a full pool still admits new requests).

Depth is bounded by ``D``. Unique tails are *not* materialized: a node may carry a ``TAIL`` position into a token
arena (the request's own history, or the shared arena of finished outputs) meaning "exactly one more occurrence
of this n-gram continues with arena[TAIL], arena[TAIL+1], ...". A tail is materialized one node at a time, only
when a second occurrence follows it. So a token that extends only never-seen contexts costs O(1) nodes and
O(1) work, and repeated material costs O(D). Invariant: a tail's first token differs from every child's token.

Positions in the trie are (node, off): off == 0 is the node itself; off > 0 is ``off`` tokens into its tail.

A full pool drops occurrences (they are simply not indexed). Then a longer n-gram may be indexed while its
suffix is not (``count([1, 0]) == 1``, ``count([0]) == 0``), so "the suffix of length m has a match" is no
longer monotone in m. A root carries no token, so its TOK column records this: ``COMPLETE`` (-1, as allocated)
until its trie first drops an occurrence, ``PARTIAL`` from then on; ``longest_match`` searches accordingly.
"""
from __future__ import annotations

import numpy as np
from numba import njit

TOK, PAR, CNT, TAIL, CHILD, NEXT, PREV, DEP = range(8)
NODE_FIELDS = 8
M_FREE, M_HIGH, M_LIVE, M_CAP, M_RESERVE = range(5)
COMPLETE, PARTIAL = -1, -2  # a root's TOK: has its trie ever dropped an occurrence?
DROPPED = -2  # extend(): the occurrence was dropped (no free node)


def new_trie(capacity: int):
    """Allocate an empty trie with room for ``capacity`` nodes (roots included)."""
    nodes = np.full((capacity, NODE_FIELDS), -1, dtype=np.int32)
    size = 1
    while size < 2 * capacity:
        size *= 2
    table = np.full(size, -1, dtype=np.int32)
    meta = np.array([-1, 0, 0, capacity, 0], dtype=np.int64)
    return nodes, table, meta


MIN_TABLE = 1 << 12  # slots of a trie's first hash view


def table_for(full, nodes, meta, view, extra: int):
    """The view of the hash buffer ``full`` to use before adding up to ``extra`` nodes: ``view`` itself while live
    nodes plus ``extra`` fill at most half of it, else the smallest large enough power-of-two prefix of ``full``
    (all of it at most), rebuilt from the live nodes."""
    need = 2 * (int(meta[M_LIVE]) + extra)
    size = view.shape[0]
    if need <= size or size >= full.shape[0]:
        return view
    while size < need and size < full.shape[0]:
        size *= 2
    view = full[:size]
    rehash(nodes, view, meta)
    return view


@njit(cache=True, inline="always")
def _slot(parent, token, mask):
    h = (np.uint64(parent) * np.uint64(0x9E3779B97F4A7C15)) ^ (np.uint64(token) * np.uint64(0xC2B2AE3D27D4EB4F))
    h ^= h >> np.uint64(29)
    return np.int64(h & np.uint64(mask))


@njit(cache=True)
def find_child(nodes, table, parent, token):
    mask = table.shape[0] - 1
    s = _slot(parent, token, mask)
    while True:
        n = table[s]
        if n < 0:
            return -1
        if nodes[n, PAR] == parent and nodes[n, TOK] == token:
            return n
        s = (s + 1) & mask


@njit(cache=True)
def _table_remove(nodes, table, n):
    mask = table.shape[0] - 1
    i = _slot(nodes[n, PAR], nodes[n, TOK], mask)
    while table[i] != n:
        i = (i + 1) & mask
    table[i] = -1
    j = i
    while True:  # backward-shift deletion keeps probe chains intact without tombstones
        j = (j + 1) & mask
        m = table[j]
        if m < 0:
            return
        k = _slot(nodes[m, PAR], nodes[m, TOK], mask)
        if i <= j:
            stays = i < k <= j
        else:
            stays = k > i or k <= j
        if not stays:
            table[i] = m
            table[j] = -1
            i = j


@njit(cache=True)
def alloc_node(nodes, table, meta, parent, token, depth):
    """A new node (count 0, no tail) linked under ``parent``; -1 when the trie is full. parent -1 makes a root."""
    if parent >= 0 and meta[M_LIVE] >= meta[M_CAP] - meta[M_RESERVE]:
        return -1
    n = meta[M_FREE]
    if n >= 0:
        meta[M_FREE] = nodes[n, NEXT]
    elif meta[M_HIGH] < meta[M_CAP]:
        n = meta[M_HIGH]
        meta[M_HIGH] += 1
    else:
        return -1
    meta[M_LIVE] += 1
    nodes[n, TOK] = token
    nodes[n, PAR] = parent
    nodes[n, CNT] = 0
    nodes[n, TAIL] = -1
    nodes[n, CHILD] = -1
    nodes[n, PREV] = -1
    nodes[n, DEP] = depth
    nodes[n, NEXT] = -1
    if parent >= 0:
        first = nodes[parent, CHILD]
        nodes[n, NEXT] = first
        if first >= 0:
            nodes[first, PREV] = n
        nodes[parent, CHILD] = n
        mask = table.shape[0] - 1
        s = _slot(parent, token, mask)
        while table[s] >= 0:
            s = (s + 1) & mask
        table[s] = n
    return n


@njit(cache=True)
def rehash(nodes, table, meta):
    """Rebuild ``table`` from the live nodes (every node with a parent; roots are not hashed)."""
    table[:] = -1
    mask = table.shape[0] - 1
    for n in range(meta[M_HIGH]):
        p = nodes[n, PAR]
        if p >= 0:
            s = _slot(p, nodes[n, TOK], mask)
            while table[s] >= 0:
                s = (s + 1) & mask
            table[s] = n


@njit(cache=True)
def free_node(nodes, table, meta, n):
    """Unlink a childless node from its parent and the hash, and return it to the free list."""
    parent = nodes[n, PAR]
    if parent >= 0:
        _table_remove(nodes, table, n)
        prev, nxt = nodes[n, PREV], nodes[n, NEXT]
        if prev >= 0:
            nodes[prev, NEXT] = nxt
        else:
            nodes[parent, CHILD] = nxt
        if nxt >= 0:
            nodes[nxt, PREV] = prev
    nodes[n, PAR] = -1
    nodes[n, TOK] = -1
    nodes[n, CNT] = 0
    nodes[n, TAIL] = -1
    nodes[n, CHILD] = -1
    nodes[n, PREV] = -1
    nodes[n, DEP] = -1  # marks a free node
    nodes[n, NEXT] = meta[M_FREE]
    meta[M_FREE] = n
    meta[M_LIVE] -= 1


@njit(cache=True)
def free_subtree(nodes, table, meta, root, stack):
    """Free ``root`` and everything below it (``stack`` is scratch of at least the trie's capacity)."""
    stack[0] = root
    top = 1
    order = 0
    # collect in DFS preorder into the stack's tail, then free children before parents (reverse order)
    while top > 0:
        top -= 1
        n = stack[top]
        stack[stack.shape[0] - 1 - order] = n
        order += 1
        c = nodes[n, CHILD]
        while c >= 0:
            stack[top] = c
            top += 1
            c = nodes[c, NEXT]
    for i in range(order):
        free_node(nodes, table, meta, stack[stack.shape[0] - order + i])


@njit(cache=True, inline="always")
def _arena_token(arena, alen, q):
    if q < 0 or q >= alen:
        return -1
    return arena[q]


@njit(cache=True)
def extend(nodes, table, meta, n, token, pos, arena, alen, max_depth):
    """One occurrence standing at node ``n`` continues with ``token`` (at arena position ``pos``).

    Returns the node the occurrence now stands at, or -1 when it needs no more work: it reached depth D, or it
    now rides a tail whose later tokens the arena supplies by itself. A full trie drops the occurrence (DROPPED).
    """
    c = find_child(nodes, table, n, token)
    if c >= 0:
        nodes[c, CNT] += 1
        return c if nodes[c, DEP] < max_depth else -1
    tl = nodes[n, TAIL]
    tail_tok = _arena_token(arena, alen, tl)
    depth = nodes[n, DEP] + 1
    if tail_tok == token:  # second occurrence after a unique tail: materialize one node
        c = alloc_node(nodes, table, meta, n, token, depth)
        if c < 0:
            return DROPPED
        nodes[c, CNT] = 2
        nodes[n, TAIL] = -1
        if depth < max_depth:
            # the earlier occurrence keeps riding from tl + 1, unless its segment ended there
            if _arena_token(arena, alen, tl + 1) >= 0:
                nodes[c, TAIL] = tl + 1
            return c
        return -1
    if tail_tok < 0:  # no (live) tail: this occurrence becomes the tail
        nodes[n, TAIL] = pos
        return -1
    c = alloc_node(nodes, table, meta, n, token, depth)
    if c < 0:
        return DROPPED
    nodes[c, CNT] = 1
    # ride our own continuation: in a request's history it is still to come (pos + 1 == alen); in the shared
    # ring a -1 there means this output ended, and no pointer may outlive its segment
    if depth < max_depth and (pos + 1 >= alen or arena[pos + 1] >= 0):
        nodes[c, TAIL] = pos + 1
    return -1


@njit(cache=True)
def insert_token(nodes, table, meta, root, active, arena, alen, pos, max_depth):
    """Index the token at arena[pos]: extend every active suffix ending at pos-1, start a new one at pos.

    ``active[D]`` holds, for each start s with pos-s < D, the node its occurrence stands at (slot s % D), -1 if
    it needs no more work. O(D) in the worst case, O(1) for text never seen before. An occurrence dropped for
    want of nodes stays dropped, and marks the trie ``PARTIAL``.
    """
    token = arena[pos]
    nodes[root, CNT] += 1
    dropped = False
    for s in range(max(0, pos - max_depth + 1), pos):
        k = s % max_depth
        n = active[k]
        if n >= 0:
            n = extend(nodes, table, meta, n, token, pos, arena, alen, max_depth)
            if n == DROPPED:
                dropped = True
                n = -1
            active[k] = n
    n = extend(nodes, table, meta, root, token, pos, arena, alen, max_depth)
    if n == DROPPED:
        dropped = True
        n = -1
    active[pos % max_depth] = n
    if dropped:
        nodes[root, TOK] = PARTIAL


@njit(cache=True)
def remove_occurrence(nodes, table, meta, root, arena, alen, start, end, max_depth):
    """Undo the occurrence of arena[start:end] (capped at D tokens) inserted from ``root``; free emptied nodes."""
    n = root
    nodes[root, CNT] -= 1
    stop = min(end, start + max_depth)
    for q in range(start, stop):
        t = arena[q]
        if nodes[n, TAIL] == q:  # the rest of this occurrence lives in n's tail
            nodes[n, TAIL] = -1
            return
        c = find_child(nodes, table, n, t)
        if c < 0:  # the occurrence was dropped when the trie was full
            return
        nodes[c, CNT] -= 1
        if nodes[c, CNT] <= 0:
            # only this occurrence passed through c: its whole subtree is this occurrence's chain
            while c >= 0:
                nxt = nodes[c, CHILD]
                free_node(nodes, table, meta, c)
                c = nxt
            return
        n = c
    if nodes[n, TAIL] == stop:  # our own continuation past the indexed part
        nodes[n, TAIL] = -1


@njit(cache=True)
def walk(nodes, table, root, arena, alen, seq, start, end):
    """Follow seq[start:end] from root. Returns (node, off), or (-1, 0) when that n-gram is not in the trie."""
    n = root
    off = 0
    for i in range(start, end):
        t = seq[i]
        if off == 0:
            c = find_child(nodes, table, n, t)
            if c >= 0:
                n = c
                continue
            if _arena_token(arena, alen, nodes[n, TAIL]) == t:
                off = 1
                continue
            return -1, 0
        if _arena_token(arena, alen, nodes[n, TAIL] + off) == t:
            off += 1
            continue
        return -1, 0
    return n, off


@njit(cache=True)
def has_continuation(nodes, arena, alen, n, off):
    if off > 0:
        return _arena_token(arena, alen, nodes[n, TAIL] + off) >= 0
    return nodes[n, CHILD] >= 0 or _arena_token(arena, alen, nodes[n, TAIL]) >= 0


@njit(cache=True)
def longest_match(nodes, table, root, arena, alen, seq, slen, m_hi):
    """Longest m <= m_hi such that seq[slen-m:slen] is indexed in the trie with a continuation.

    In a complete trie this is monotone in m (a longer match implies every shorter one), so try m_hi, then
    binary search. In a ``PARTIAL`` trie (one that dropped occurrences) it is not, so every length is tried from
    m_hi down: the answer is the same function of the indexed n-grams either way, whatever m_hi was (as long as
    it bounds the answer). Returns (m, node, off); m == 0 means no match.
    """
    m_hi = min(m_hi, slen)
    if m_hi <= 0:
        return 0, -1, 0
    n, off = walk(nodes, table, root, arena, alen, seq, slen - m_hi, slen)
    if n >= 0 and has_continuation(nodes, arena, alen, n, off):
        return m_hi, n, off
    if nodes[root, TOK] == PARTIAL:
        for m in range(m_hi - 1, 0, -1):
            n, off = walk(nodes, table, root, arena, alen, seq, slen - m, slen)
            if n >= 0 and has_continuation(nodes, arena, alen, n, off):
                return m, n, off
        return 0, -1, 0
    lo, hi = 0, m_hi - 1
    best_n, best_off = -1, 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        n, off = walk(nodes, table, root, arena, alen, seq, slen - mid, slen)
        if n >= 0 and has_continuation(nodes, arena, alen, n, off):
            lo = mid
            best_n, best_off = n, off
        else:
            hi = mid - 1
    if lo > 0 and best_n < 0:
        best_n, best_off = walk(nodes, table, root, arena, alen, seq, slen - lo, slen)
    return lo, best_n, best_off


@njit(cache=True)
def count_ngram(nodes, table, root, arena, alen, seq, start, end):
    """Occurrences of seq[start:end] in the trie (a tail stands for exactly one)."""
    n, off = walk(nodes, table, root, arena, alen, seq, start, end)
    if n < 0:
        return 0
    if off > 0:
        return 1
    return nodes[n, CNT]
