"""`NgramCache`: the request-facing API over the numba suffix tries.

Two sources of drafts, bounded separately:

- **own history**: each request's prompt + output so far, indexed in a per-request trie (all per-request tries
  share one node pool of ``local_nodes``). Catches copies, code edits, RAG, self-repetition.
- **shared cache**: the outputs of finished requests (``finish_request(rid, share=True)``), in a token ring of
  ``shared_tokens`` indexed by one trie of ``shared_nodes``. Catches cross-request patterns. FIFO eviction of
  whole outputs (see ``_shared.py``); counts stay exact for what is held.

A draft comes from the source with the longer suffix match; a tie goes to the request's own history.

Capacity policy: the shared cache evicts its oldest outputs and never exceeds its bounds. The per-request pool
never evicts a live request: when it is full, new occurrences are simply not indexed (counts under-count,
drafts continue from what is indexed) until finishing requests free nodes. Nothing ever grows past the sizes
given at construction except each request's token history (4 bytes per token, freed at finish).

Thread safety: none. Use one cache per process (per tensor-parallel rank, fed identical tokens, it produces
identical drafts: everything here is deterministic).
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from itertools import accumulate

import numpy as np
from numba import typed

from ngramspec import _draft, _shared, _trie
from ngramspec._cache_api import I32, I64, Direct, fix

F32 = np.dtype(np.float32)

MAX_TOKEN = 2**31 - 1  # the largest token id: ids lie in [0, 2**31) (int32 storage; -1 marks "none")
MAX_BUDGET = 4096  # draft nodes per request and step
_PROMPT_CHUNK = 4096  # prompt tokens indexed per kernel call (the hash view grows between calls)


@dataclass(frozen=True)
class Draft:
    """One request's draft. ``parents[j] < j`` (-1: child of the root, the last committed token)."""

    tokens: np.ndarray
    parents: np.ndarray
    probs: np.ndarray
    sources: np.ndarray

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def prefix(self, n: int) -> "Draft":
        """The first ``n`` nodes: again a valid draft (nodes are in best-first order)."""
        return Draft(self.tokens[:n], self.parents[:n], self.probs[:n], self.sources[:n])


@dataclass(frozen=True)
class DraftBatch:
    """Drafts of a batch in flat arrays; request i owns ``offsets[i]:offsets[i+1]``."""

    tokens: np.ndarray
    parents: np.ndarray
    probs: np.ndarray
    sources: np.ndarray
    offsets: np.ndarray
    match_lens: np.ndarray  # per request: length of the suffix match the draft grew from (0: no draft)

    def __len__(self) -> int:
        return int(self.offsets.shape[0] - 1)

    def draft(self, i: int) -> Draft:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return Draft(self.tokens[a:b], self.parents[a:b], self.probs[a:b], self.sources[a:b])

    @classmethod
    def of(cls, tokens: Sequence, parents: Sequence, probs: Sequence | None = None) -> "DraftBatch":
        """A batch of drafts given per request (``tokens[i]``, ``parents[i]``, optionally ``probs[i]``; else 0),
        e.g. drafts from another source or picked from a `Lookahead`; sources 0 and match lengths 0."""
        lens = [len(t) for t in tokens]
        offsets = np.zeros(len(lens) + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        n = int(offsets[-1])
        def cat(parts, dt):
            return np.concatenate(parts).astype(dt) if len(parts) else np.zeros(0, dt)

        return cls(cat(tokens, np.int32), cat(parents, np.int32),
                   cat(probs, np.float32) if probs is not None else np.zeros(n, np.float32),
                   np.zeros(n, np.int8), offsets, np.zeros(len(lens), np.int64))


_new_batch = object.__new__


def _draft_batch(tokens, parents, probs, sources, offsets, match_lens) -> DraftBatch:
    """``DraftBatch(...)`` without the frozen dataclass's per-field ``object.__setattr__`` (a third of the cost on
    the per-step path); the result is an ordinary, equal DraftBatch."""
    b = _new_batch(DraftBatch)
    b.__dict__.update(tokens=tokens, parents=parents, probs=probs, sources=sources, offsets=offsets,
                      match_lens=match_lens)
    return b


def _is_int(t) -> bool:
    return type(t) is int or (isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_)))


def as_tokens(tokens, what: str = "tokens", allow_empty: bool = True) -> np.ndarray:
    """Validate token ids and return them as a contiguous int32 array.

    TypeError: not an ordered 1-D sequence of integers (floats, bools, strings, None, nested lists, object
    arrays; sets and dicts, whose order is not a token order). ValueError: wrong shape, empty when not allowed,
    or an id outside [0, 2**31)."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise ValueError(f"{what} must be one-dimensional, got shape {tokens.shape}")
        if tokens.dtype.kind not in "iu":
            raise TypeError(f"{what} must hold integer token ids, got dtype {tokens.dtype}")
        arr = tokens
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
    else:
        if isinstance(tokens, (str, bytes, Set, Mapping)) or not isinstance(tokens, Iterable):
            raise TypeError(f"{what} must be a list, tuple or 1-D array of integer token ids, got "
                            f"{type(tokens).__name__}")
        items = tokens if isinstance(tokens, list) else list(tokens)
        for t in items:
            if not _is_int(t):
                raise TypeError(f"{what} must hold integer token ids, found {t!r} ({type(t).__name__})")
        if items:
            lo, hi = min(items), max(items)
        arr = items
    if not len(arr):
        if not allow_empty:
            raise ValueError(f"{what} must not be empty")
        return np.zeros(0, dtype=np.int32)
    if lo < 0 or hi > MAX_TOKEN:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{what}: token id {bad} is out of range [0, {MAX_TOKEN + 1})")
    return np.ascontiguousarray(arr, dtype=np.int32)


class NgramCache:
    """Suffix-trie n-gram cache. Verbs: start_request, add_tokens, propose, finish_request."""

    def __init__(
        self,
        max_depth: int = 16,
        max_requests: int = 1024,
        local_nodes: int = 1 << 21,
        shared_nodes: int = 1 << 21,
        shared_tokens: int = 1 << 21,
        shared_segments: int = 1 << 16,
        use_shared: bool = True,
    ):
        if not _is_int(max_depth) or not 2 <= max_depth <= 127:
            raise ValueError(f"max_depth must be an integer in [2, 127], got {max_depth!r}")
        for name, v, lo in (("max_requests", max_requests, 1), ("local_nodes", local_nodes, max_requests + 1),
                            ("shared_nodes", shared_nodes, 2 * max_depth + 2), ("shared_tokens", shared_tokens, 2),
                            ("shared_segments", shared_segments, 1)):
            if not _is_int(v) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v}")
        self.max_depth = int(max_depth)
        self.max_requests = int(max_requests)
        self.use_shared = bool(use_shared)
        D = self.max_depth
        self._l_nodes, self._l_hash, self._l_meta = _trie.new_trie(int(local_nodes))
        self._s_nodes, self._s_hash, self._s_meta = _trie.new_trie(int(shared_nodes))
        # the kernels' views of the hash buffers, grown with the live nodes (`_trie.table_for`)
        self._l_table = self._l_hash[: min(_trie.MIN_TABLE, self._l_hash.size)]
        self._s_table = self._s_hash[: min(_trie.MIN_TABLE, self._s_hash.size)]
        self._s_root = int(_trie.alloc_node(self._s_nodes, self._s_table, self._s_meta, -1, -1, 0))
        self._l_meta[_trie.M_RESERVE] = int(max_requests)  # a root for every request that may still start
        self._arena, self._seg, self._ring = _shared.new_ring(int(shared_tokens), int(shared_segments))
        R = self.max_requests
        self._roots = np.full(R, -1, dtype=np.int32)
        self._hlens = np.zeros(R, dtype=np.int64)
        self._prompt_len = np.zeros(R, dtype=np.int64)
        self._active = np.full((R, D), -1, dtype=np.int32)
        self._match = np.zeros((R, 2), dtype=np.int64)
        self._since = np.zeros(R, dtype=np.int64)
        self._epoch_seen = np.full(R, -1, dtype=np.int64)
        empty = np.zeros(1, dtype=np.int32)
        self._hists = typed.List([empty for _ in range(R)])  # for the jitted kernels
        self._hist_arrays = [empty] * R  # the same arrays: typed.List is slow to index from Python
        self._scratch = np.empty(int(local_nodes), dtype=np.int32)
        self._share_active = np.full(D, -1, dtype=np.int32)
        self._slot_of: dict[Hashable, int] = {}
        self._slots_gen = 0  # counts changes of _slot_of (a caller's cached slots of a batch are valid while it holds)
        self._free_slots = list(range(R - 1, -1, -1))
        self._out = None  # reused output buffers of _propose_slots, grown on demand
        self._out_views: dict[tuple[int, int], tuple] = {}  # views of them per (batch size, budget)
        self._out_batches: dict[tuple[int, int], DraftBatch] = {}  # DraftBatches of them per (batch size, nodes)
        self._own_state = _draft.OwnState(self._l_nodes, self._l_table, self._l_meta, self._roots, self._hlens,
                                          self._active, self._match, self._since, self._epoch_seen,
                                          np.empty(D + _draft.SCRATCH_BUDGET + 1, np.int32),
                                          _draft.tree_scratch(_draft.SCRATCH_BUDGET))
        self._shared_state = _draft.SharedState(self._s_nodes, self._s_table, self._s_root, self._arena)
        self._append_kernel = Direct(self, "_append_kernel", _draft.append_batch)  # (see Direct: these
        self._propose_kernel = Direct(self, "_propose_kernel", _draft.propose_batch)  # skip numba's dispatch)
        self._budgets: dict[int, np.ndarray] = {}  # budget -> an array of it (read-only use), grown on demand
        self._one_slot = np.zeros(1, np.int64)  # kernel arguments of single-request calls, reused
        self._one_offsets = np.zeros(2, np.int64)

    # ----------------------------------------------------------------------------------------------- verbs
    def start_request(self, rid: Hashable, prompt) -> None:
        """Register a request and index its prompt in its own trie."""
        if rid in self._slot_of:
            raise ValueError(f"request {rid!r} is already active")
        toks = as_tokens(prompt, "prompt", allow_empty=False)
        if not self._free_slots:
            raise RuntimeError(f"too many active requests (max_requests={self.max_requests}); finish some first")
        root = _trie.alloc_node(self._l_nodes, self._l_table, self._l_meta, -1, -1, 0)
        if root < 0:  # cannot happen: roots are reserved
            raise RuntimeError("the per-request node pool has no room for a root")
        self._l_meta[_trie.M_RESERVE] -= 1
        slot = self._free_slots.pop()
        self._slot_of[rid] = slot
        self._slots_gen += 1
        self._roots[slot] = root
        self._hlens[slot] = 0
        self._prompt_len[slot] = toks.size
        self._active[slot] = -1
        self._match[slot] = 0
        self._since[slot] = 0
        self._epoch_seen[slot] = -1
        self._set_hist(slot, np.empty(max(64, 2 * toks.size), dtype=np.int32))
        slots = np.array((slot,), np.int64)
        for start in range(0, toks.size, _PROMPT_CHUNK):  # chunks: the hash grows with what the prompt needs
            part = toks[start:start + _PROMPT_CHUNK]
            self._append_flat(slots, part, np.array((0, part.size), np.int64))

    def add_tokens(self, rid: Hashable, tokens) -> None:
        """Append tokens the model committed for ``rid`` (accepted draft tokens + the bonus token)."""
        self.add_tokens_batch([rid], [tokens])

    def add_tokens_batch(self, rids: Sequence[Hashable], token_lists: Sequence) -> None:
        """``add_tokens`` for a whole batch in one jitted call. Validates everything before changing anything."""
        slots = self._slots(rids)
        if type(token_lists) is not list and (isinstance(token_lists, (str, bytes))
                                              or not isinstance(token_lists, (Sequence, np.ndarray))):
            raise TypeError(f"token_lists must be a list with one token list per request, got "
                            f"{type(token_lists).__name__}")
        B = len(slots)
        if B != len(token_lists):
            raise ValueError(f"{len(rids)} request ids but {len(token_lists)} token lists")
        if B > 1 and len(set(slots)) != B:
            raise ValueError("a request id appears twice in one batch")
        slots_arr = self._slot_array(slots)
        flat = _flatten(token_lists)  # the common cases, checked in one pass over the whole batch
        if flat is not None:
            try:
                return self._append(slots_arr, flat, self._offsets([len(t) for t in token_lists]))
            except _NegativeToken:
                pass  # nothing changed: validate below, for an error that names the request
        arrays = [as_tokens(t, f"tokens of request {rid!r}") for rid, t in zip(rids, token_lists)]
        flat = arrays[0] if B == 1 else np.concatenate(arrays) if arrays else np.zeros(0, np.int32)
        self._append_flat(slots_arr, flat, self._offsets([a.size for a in arrays]))

    def propose(self, rids: Sequence[Hashable], budgets=8, tree: bool = True) -> DraftBatch:
        """Draft up to ``budgets[i]`` tokens for each request (a chain when ``tree`` is False)."""
        slots = self._slots(rids)
        B = len(slots)
        if B > 1 and len(set(slots)) != B:
            raise ValueError("a request id appears twice in one batch")
        if type(budgets) is int and 1 <= budgets <= MAX_BUDGET:  # the common case: one budget for all
            bud = self._uniform_budgets(budgets, B)
            total = budgets * B
        else:
            if np.ndim(budgets) == 0:
                budgets = [budgets] * B
            if np.ndim(budgets) != 1 or len(budgets) != B:
                raise ValueError(f"budgets must be one integer or one per request ({B}), got {budgets!r}")
            if not all(_is_int(b) and 1 <= b <= MAX_BUDGET for b in budgets):
                raise ValueError(f"budgets must be integers in [1, {MAX_BUDGET}], got {list(budgets)!r}")
            bud = fix(np.asarray(budgets, dtype=np.int64).reshape(B), I64)
            total = int(bud.sum())
        o_tok = np.empty(total, np.int32)
        o_par = np.empty(total, np.int32)
        o_prob = np.empty(total, np.float32)
        o_src = np.empty(total, np.int8)
        offsets = np.empty(B + 1, np.int64)
        mlens = np.empty(B, np.int64)
        n = self._propose_kernel(self._slot_array(slots), bud, bool(tree), self.max_depth, self.use_shared,
                                 int(self._ring[_shared.S_EPOCH]), self._own_state, self._hists, self._shared_state,
                                 o_tok, o_par, o_prob, o_src, offsets, mlens)
        return _draft_batch(o_tok[:n], o_par[:n], o_prob[:n], o_src[:n], offsets, mlens)

    def propose_ahead(self, rids: Sequence[Hashable], drafts: DraftBatch, entries: int = 4, budget: int = 8,
                      tree: bool = True):
        """The next step's drafts for the likely outcomes of verifying ``drafts`` (this step's, as `propose` gave
        them, or prefixes of them: a request's draft may be cut to any length, 0 included, through the offsets):
        ``entries`` outcomes per request, each with a draft of up to ``budget`` nodes. Changes nothing; see
        `ngramspec.lookahead`."""
        from ngramspec import _lookahead
        from ngramspec.lookahead import Lookahead

        slots = self._slots(rids)
        B = len(slots)
        if B > 1 and len(set(slots)) != B:
            raise ValueError("a request id appears twice in one batch")
        for name, v, hi in (("entries", entries, 256), ("budget", budget, MAX_BUDGET)):
            if not _is_int(v) or not 1 <= v <= hi:
                raise ValueError(f"{name} must be an integer in [1, {hi}], got {v!r}")
        offsets = np.asarray(drafts.offsets, dtype=np.int64)
        if offsets.shape != (B + 1,):
            raise ValueError(f"drafts hold {offsets.shape[0] - 1} requests, not {B}")
        E, L = int(entries), int(budget)
        node, tok = np.empty((B, E), np.int32), np.empty((B, E), np.int32)
        weight, src = np.empty((B, E), np.float64), np.empty((B, E), np.int8)
        c_tok, c_par = np.full((B, E, L), -1, np.int32), np.full((B, E, L), -1, np.int32)
        c_prob, c_len = np.zeros((B, E, L), np.float32), np.zeros((B, E), np.int32)
        _lookahead.outcomes_batch(self._slot_array(slots), fix(drafts.tokens, I32),
                                  fix(drafts.parents, I32),
                                  fix(drafts.probs, F32), fix(offsets, I64), E, L,
                                  bool(tree), self.max_depth, self.use_shared, self._own_state, self._hists,
                                  self._shared_state, node, tok, weight, src, c_tok, c_par, c_prob, c_len)
        return Lookahead(node, tok, weight.astype(np.float32), c_tok, c_par, c_prob, c_len)

    def finish_request(self, rid: Hashable, share: bool = True) -> None:
        """Free the request's state; with ``share`` its output (tokens after the prompt) joins the shared cache."""
        slot = self._slots([rid])[0]
        if share and self.use_shared:
            out = np.array(self._hist_arrays[slot][self._prompt_len[slot]:self._hlens[slot]], dtype=np.int32)
            if out.size:
                self._share_active[:] = -1
                self._reserve_shared(out.size)
                _shared.share_tokens(self._s_nodes, self._s_table, self._s_meta, self._s_root, self._arena,
                                     self._seg, self._ring, out, self.max_depth, self._share_active)
        _trie.free_subtree(self._l_nodes, self._l_table, self._l_meta, int(self._roots[slot]), self._scratch)
        self._l_meta[_trie.M_RESERVE] += 1
        self._roots[slot] = -1
        self._set_hist(slot, np.zeros(1, dtype=np.int32))
        self._hlens[slot] = 0
        del self._slot_of[rid]
        self._slots_gen += 1
        self._free_slots.append(slot)

    # ------------------------------------------------------------------------------------------ inspection
    def __contains__(self, rid: Hashable) -> bool:
        return rid in self._slot_of

    @property
    def active_requests(self) -> int:
        return len(self._slot_of)

    def history(self, rid: Hashable) -> np.ndarray:
        slot = self._slots([rid])[0]
        return np.array(self._hist_arrays[slot][: self._hlens[slot]])

    def count(self, ngram, source: str = "own", rid: Hashable | None = None) -> int:
        """Occurrences of ``ngram`` (length <= max_depth) in a request's own history or in the shared cache."""
        seq = as_tokens(ngram, "ngram", allow_empty=False)
        if seq.size > self.max_depth:
            raise ValueError(f"ngram longer than max_depth={self.max_depth}")
        if source == "own":
            slot = self._slots([rid])[0]
            hist = self._hist_arrays[slot]
            return int(_trie.count_ngram(self._l_nodes, self._l_table, int(self._roots[slot]), hist,
                                         int(self._hlens[slot]), seq, 0, seq.size))
        if source == "shared":
            return int(_trie.count_ngram(self._s_nodes, self._s_table, self._s_root, self._arena,
                                         self._arena.size, seq, 0, seq.size))
        raise ValueError(f"source must be 'own' or 'shared', got {source!r}")

    def match_length(self, rid: Hashable, source: str = "own") -> int:
        """Length of the longest suffix of the request's history seen before with a continuation (<= D-1)."""
        slot = self._slots([rid])[0]
        hist, hlen = self._hist_arrays[slot], int(self._hlens[slot])
        if source == "own":
            m, _, _ = _trie.longest_match(self._l_nodes, self._l_table, int(self._roots[slot]), hist, hlen,
                                          hist, hlen, self.max_depth - 1)
        elif source == "shared":
            m, _, _ = _trie.longest_match(self._s_nodes, self._s_table, self._s_root, self._arena,
                                          self._arena.size, hist, hlen, self.max_depth - 1)
        else:
            raise ValueError(f"source must be 'own' or 'shared', got {source!r}")
        return int(m)

    def stats(self) -> dict:
        """Node and token usage, and the bytes held by the cache's arrays."""
        nbytes = sum(a.nbytes for a in (self._l_nodes, self._l_hash, self._s_nodes, self._s_hash, self._arena,
                                        self._scratch))
        nbytes += sum(int(self._hist_arrays[s].nbytes) for s in self._slot_of.values())
        return {
            "active_requests": len(self._slot_of),
            "local_nodes_live": int(self._l_meta[_trie.M_LIVE]),
            "local_nodes_capacity": int(self._l_meta[_trie.M_CAP]),
            "shared_nodes_live": int(self._s_meta[_trie.M_LIVE]),
            "shared_nodes_capacity": int(self._s_meta[_trie.M_CAP]),
            "shared_segments": int(self._ring[_shared.S_COUNT]),
            "shared_tokens_held": int(self._seg[self._held_segments(), 1].sum()),
            "bytes_allocated": int(nbytes),
            "bytes_per_node": (_trie.NODE_FIELDS * 4 + 4 * self._l_hash.size / self._l_nodes.shape[0]),
        }

    # ----------------------------------------------------------------------------------------------- inner
    def _held_segments(self) -> np.ndarray:
        n_seg = self._seg.shape[0]
        return (int(self._ring[_shared.S_HEAD]) + np.arange(int(self._ring[_shared.S_COUNT]))) % n_seg

    def _slots(self, rids: Sequence[Hashable]) -> list[int]:
        if type(rids) is not list and (isinstance(rids, (str, bytes)) or not isinstance(rids, (Sequence, np.ndarray))
                                       or (isinstance(rids, np.ndarray) and rids.ndim != 1)):
            raise TypeError(f"request ids must come as a list (one per request, e.g. [rid]), got "
                            f"{type(rids).__name__} {rids!r}")
        try:
            return [self._slot_of[r] for r in rids]
        except KeyError as e:
            raise KeyError(f"unknown request id {e.args[0]!r} (never started, or already finished)") from None
        except TypeError as e:
            raise TypeError(f"request ids must be hashable: {e}") from None

    def _set_hist(self, slot: int, arr: np.ndarray) -> None:
        self._hists[slot] = arr
        self._hist_arrays[slot] = arr

    def _slot_array(self, slots: list[int]) -> np.ndarray:
        """``slots`` as an int64 array; a single slot in a kept buffer (valid until the next call)."""
        if len(slots) == 1:
            self._one_slot[0] = slots[0]
            return self._one_slot
        return np.array(slots, np.int64)

    def _offsets(self, lengths: list[int]) -> np.ndarray:
        """Offsets of consecutive ``lengths`` (int64, from 0); for one length in a kept buffer."""
        if len(lengths) == 1:
            self._one_offsets[1] = lengths[0]
            return self._one_offsets
        return np.array((0, *accumulate(lengths)), np.int64)

    def _append_flat(self, slots: np.ndarray, flat: np.ndarray, offsets: np.ndarray) -> None:
        """Append tokens ``flat[offsets[i]:offsets[i+1]]`` (int32, validated but for negative ids: those raise
        ValueError and change nothing) to slot ``slots[i]``. One kernel call, and one more per history array
        that has to grow first."""
        self._append(fix(slots, I64), fix(flat, I32), fix(offsets, I64))

    def _reserve(self, n_tokens: int) -> None:
        """Make the own tries' hash view large enough for ``n_tokens`` more tokens (at most D new nodes each)."""
        view = _trie.table_for(self._l_hash, self._l_nodes, self._l_meta, self._l_table, n_tokens * self.max_depth)
        if view is not self._l_table:
            self._l_table = view
            self._own_state = self._own_state._replace(table=view)

    def _reserve_shared(self, n_tokens: int) -> None:
        """`_reserve` for the shared trie."""
        view = _trie.table_for(self._s_hash, self._s_nodes, self._s_meta, self._s_table, n_tokens * self.max_depth)
        if view is not self._s_table:
            self._s_table = view
            self._shared_state = self._shared_state._replace(table=view)

    def _append(self, slots: np.ndarray, flat: np.ndarray, offsets: np.ndarray) -> None:
        """`_append_flat` for `fixed` arrays."""
        while True:
            code = self._append_kernel(slots, flat, offsets, self.max_depth, self._own_state, self._hists)
            if code == 0:
                return
            if code < 0:
                raise _NegativeToken(f"tokens: token id {int(flat[-1 - code])} is out of range "
                                     f"[0, {MAX_TOKEN + 1})")
            if code == slots.shape[0] + 1:  # nothing was appended: the trie's hash view needs to grow first
                self._reserve(flat.shape[0])
                continue
            # nothing was appended: request code - 1 lacks room; grow its history (doubling) and try again
            i = code - 1
            slot = int(slots[i])
            n, k = int(self._hlens[slot]), int(offsets[i + 1] - offsets[i])
            hist = self._hist_arrays[slot]
            grown = np.empty(max(n + k, 2 * hist.size), dtype=np.int32)
            grown[:n] = hist[:n]
            self._set_hist(slot, grown)

    def _uniform_budgets(self, budget: int, B: int) -> np.ndarray:
        """An int64 array of ``B`` times ``budget``: a view of a kept array (the kernels only read it)."""
        bud = self._budgets.get(budget)
        if bud is None or bud.shape[0] < B:
            if len(self._budgets) >= 64:
                self._budgets.clear()
            bud = self._budgets[budget] = np.full(max(B, 64), budget, np.int64)
        return bud[:B]

    def _propose_buffers(self, B: int, budget: int) -> tuple:
        """The reused output buffers of a proposal for ``B`` requests and one ``budget``: (tokens, parents,
        probabilities, sources: room for B x budget nodes; offsets, match lengths: B + 1 and B entries; the
        budgets: B times ``budget``). The next proposal overwrites them."""
        views = self._out_views.get((B, budget))
        if views is None:
            out = self._out
            if out is None or out[0].shape[0] < B * budget or out[4].shape[0] < B + 1:
                n, m = max(B * budget, 1024), max(B + 1, 64)
                out = self._out = (np.empty(n, np.int32), np.empty(n, np.int32), np.empty(n, np.float32),
                                   np.empty(n, np.int8), np.empty(m, np.int64), np.empty(m, np.int64))
                self._out_views = {}
                self._out_batches = {}
            if len(self._out_views) >= 256:
                self._out_views.clear()
            views = self._out_views[B, budget] = (*out[:4], out[4][: B + 1], out[5][:B],
                                                  self._uniform_budgets(budget, B))
        return views

    def _batch_view(self, B: int, n: int) -> DraftBatch:
        """The `DraftBatch` of the last proposal into the reused buffers (``B`` requests, ``n`` nodes): views of
        them, one object per (B, n), kept until the buffers are replaced."""
        b = self._out_batches.get((B, n))
        if b is None:
            out = self._out
            if len(self._out_batches) >= 4096:
                self._out_batches.clear()
            b = self._out_batches[B, n] = _draft_batch(out[0][:n], out[1][:n], out[2][:n], out[3][:n],
                                                       out[4][:B + 1], out[5][:B])
        return b

    def _propose_slots(self, slots: np.ndarray, budget: int, tree: bool) -> DraftBatch:
        """``propose`` for validated, distinct slots and one budget, into reused output buffers: the returned
        arrays are views that the next call overwrites (the controller's ``step`` copies what it keeps)."""
        o_tok, o_par, o_prob, o_src, offsets, mlens, bud = self._propose_buffers(slots.shape[0], budget)
        n = self._propose_kernel(fix(slots, I64), bud, bool(tree), self.max_depth, self.use_shared,
                                 int(self._ring[_shared.S_EPOCH]), self._own_state, self._hists, self._shared_state,
                                 o_tok, o_par, o_prob, o_src, offsets, mlens)
        return self._batch_view(slots.shape[0], n)


class _NegativeToken(ValueError):
    """A negative token id reached the append kernel (which then changed nothing)."""


def _flatten(token_lists) -> np.ndarray | None:
    """The common kinds of batch input (lists of Python ints; 1-D integer arrays) as one `fixed` int32 array,
    checked but for negative ids (the append kernel checks those). None for other kinds or for invalid tokens."""
    if len(token_lists) == 1 and type(token_lists[0]) is np.ndarray:
        t = token_lists[0]
        if t.dtype is I32 and t.ndim == 1 and t.flags.carray:
            return t  # (the kernel only reads it)
    if all(type(t) is list for t in token_lists):
        items = [x for t in token_lists for x in t]
        if not items:
            return np.zeros(0, np.int32)
        if all(type(x) is int for x in items):
            return np.array(items, np.int32) if min(items) >= 0 and max(items) <= MAX_TOKEN else None
        try:
            return as_tokens(items, "tokens")
        except (TypeError, ValueError):
            return None
    if token_lists and all(isinstance(t, np.ndarray) and t.ndim == 1 and t.dtype.kind in "iu" for t in token_lists):
        flat = np.concatenate(token_lists)
        if flat.dtype is I32:
            return flat
        try:
            return as_tokens(flat, "tokens")
        except ValueError:
            return None
    return None


def warm_up() -> None:
    """Compile (or load from numba's cache) every kernel of the cache, on a throwaway cache: the first real
    ``start_request``, ``add_tokens``, ``propose`` and ``finish_request`` are then fast. Touches no other state.
    `ngramspec.warmup.warm_up` compiles the controller's and the verify layout's kernels as well."""
    c = NgramCache(max_depth=4, max_requests=2, local_nodes=64, shared_nodes=64, shared_tokens=64)
    c.start_request(0, [1, 2, 3, 1, 2])
    c.add_tokens_batch([0], [[3]])
    c.propose([0], 2, tree=True)
    c.propose([0], 2, tree=False)
    c.count([1, 2], rid=0)
    c.match_length(0)
    _trie.rehash(c._l_nodes, c._l_table, c._l_meta)  # what a hash view's growth runs (these pools never grow)
    c.finish_request(0, share=True)
