"""Drafts are pinned: a deterministic synthetic workload, fed through every path into the cache (public verbs
with each kind of token input, the controller's private fast path `_append_flat` + `_propose_slots`), hashes
to digests recorded with the code before the host-path rework. A speed-up of the host path must leave every
draft bit-identical; a change that means to alter drafts updates the digests on purpose."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from ngramspec import NgramCache

SMALL = dict(max_depth=6, max_requests=16, local_nodes=250, shared_nodes=150, shared_tokens=200,
             shared_segments=4)  # pools that fill up: dropped occurrences, shared-cache eviction
LARGE = dict(max_depth=12, max_requests=32)


def _workload(seed: int, n_requests: int):
    """Prompts and outputs over a small vocabulary with copied spans (repetitive, like code or chat)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 40, 400)
    reqs = []
    for _ in range(n_requests):
        parts = []
        for _ in range(int(rng.integers(2, 6))):
            a = int(rng.integers(0, 350))
            parts.append(base[a:a + int(rng.integers(5, 50))] if rng.random() < 0.7 else rng.integers(0, 60, 20))
        seq = np.concatenate(parts).astype(np.int64)
        cut = max(1, int(rng.integers(1, max(2, seq.size - 10))))
        reqs.append((seq[:cut], seq[cut:cut + 60]))
    return reqs


def _as_kind(tokens: np.ndarray, kind: int):
    """The same tokens as a list of ints, an int32 array, an int64 array, a read-only view or a strided view."""
    if kind == 0:
        return tokens.tolist()
    if kind == 1:
        return tokens.astype(np.int32)
    if kind == 2:
        return tokens.astype(np.int64)
    if kind == 3:
        ro = tokens.astype(np.int32)
        ro.flags.writeable = False
        return ro
    return np.repeat(tokens.astype(np.int32), 2)[::2]


def _replay(path: str, kw: dict, batch: int, tree: bool, seed: int) -> str:
    """Closed-loop replay: each step commits the draft's longest correct chain prefix plus one true token."""
    reqs = _workload(seed, 3 * batch + 2)
    cache = NgramCache(**kw)
    h = hashlib.sha256()
    pos, active, upcoming, committed, step = {}, [], 0, {}, 0
    while active or upcoming < len(reqs):
        while len(active) < batch and upcoming < len(reqs):
            prompt = reqs[upcoming][0]
            cache.start_request(upcoming, _as_kind(prompt, upcoming % 3))
            pos[upcoming] = 0
            active.append(upcoming)
            upcoming += 1
        commits = [committed.pop(r, np.zeros(0, np.int64)) for r in active]
        if path == "private":  # what AdaptiveController.step does
            slots = np.array(cache._slots(active), np.int64)
            flat = np.concatenate(commits).astype(np.int32)
            offsets = np.zeros(len(active) + 1, np.int64)
            np.cumsum([c.size for c in commits], out=offsets[1:])
            if flat.size:
                cache._append_flat(slots, flat, offsets)
            b = cache._propose_slots(slots, 7, tree)
        else:
            new = [(r, c) for r, c in zip(active, commits) if c.size]
            if path == "single":
                for r, c in new:
                    cache.add_tokens(r, _as_kind(c, (r + step) % 5))
            elif new:
                cache.add_tokens_batch([r for r, _ in new], [_as_kind(c, (r + step) % 5) for r, c in new])
            budgets = 7 if step % 2 else [1 + (r + step) % 9 for r in active]
            b = cache.propose(active, budgets, tree=tree)
        for a in (b.tokens, b.parents, b.probs, b.sources, b.offsets, b.match_lens):
            h.update(np.ascontiguousarray(a).tobytes())
        step += 1
        for i, rid in enumerate(active[:]):
            seq, p = reqs[rid][1], pos[rid]
            toks = b.tokens[b.offsets[i]:b.offsets[i + 1]]
            pars = b.parents[b.offsets[i]:b.offsets[i + 1]]
            n, j = 0, -1  # walk the draft tree along the true continuation
            while p + n < seq.size:
                kids = [k for k in range(toks.size) if pars[k] == j and toks[k] == seq[p + n]]
                if not kids:
                    break
                j, n = kids[0], n + 1
            n = min(n + 1, seq.size - p)
            committed[rid], pos[rid] = seq[p:p + n], p + n
            if pos[rid] == seq.size:
                active.remove(rid)
                committed.pop(rid, None)
                h.update(cache.history(rid).tobytes())
                h.update(str(cache.match_length(rid, source="shared")).encode())
                cache.finish_request(rid, share=rid % 4 != 0)
    h.update(repr(sorted((k, v) for k, v in cache.stats().items() if k != "bytes_allocated")).encode())
    return h.hexdigest()[:20]


CASES = {  # name: (path, cache sizes, batch, tree, seed) -> digest recorded before the host-path rework
    "batch tree small pools": (("batch", SMALL, 4, True, 1), "9b1a61f430334fc90903"),
    "batch chain": (("batch", LARGE, 8, False, 2), "d67a7b0af65822055b11"),
    "single tree": (("single", LARGE, 1, True, 3), "def6265b573a0673c9dd"),
    "single chain small pools": (("single", SMALL, 3, False, 4), "ea449ef20693b82b0c22"),
    "private tree": (("private", LARGE, 8, True, 5), "ae9d5b49fab3814898ec"),
    "private chain small pools": (("private", SMALL, 5, False, 6), "8bace15cea1ae9be3107"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_drafts_match_the_recorded_digest(name):
    args, digest = CASES[name]
    assert _replay(*args) == digest


def test_every_input_kind_and_path_drafts_alike():
    """One workload, fed as lists, int32 / int64 / read-only / strided arrays, one request or a batch at a time,
    or through the private fast path: the same drafts (chains of 7, the budget all paths share)."""
    digests = set()
    for path in ("batch", "single", "private"):
        reqs = _workload(7, 6)
        cache = NgramCache(**LARGE)
        h = hashlib.sha256()
        for rid, (prompt, out) in enumerate(reqs):
            cache.start_request(rid, prompt)
        for k in range(0, 60, 3):
            rids = [r for r, (_, out) in enumerate(reqs) if out.size > k]
            chunks = [reqs[r][1][k:k + 3] for r in rids]
            if path == "batch":
                cache.add_tokens_batch(rids, [_as_kind(c, (r + k) % 5) for r, c in zip(rids, chunks)])
            elif path == "single":
                for r, c in zip(rids, chunks):
                    cache.add_tokens(r, _as_kind(c, (r + k) % 5))
            else:
                slots = np.array(cache._slots(rids), np.int64)
                offsets = np.zeros(len(rids) + 1, np.int64)
                np.cumsum([c.size for c in chunks], out=offsets[1:])
                cache._append_flat(slots, np.concatenate(chunks).astype(np.int32), offsets)
            b = cache._propose_slots(np.array(cache._slots(rids), np.int64), 7, False) if path == "private" \
                else cache.propose(rids, 7, tree=False)
            for a in (b.tokens, b.parents, b.probs, b.sources, b.offsets, b.match_lens):
                h.update(np.ascontiguousarray(a).tobytes())
        digests.add(h.hexdigest())
    assert len(digests) == 1


def test_kernel_arguments_of_other_types_are_converted_not_misread():
    """The private fast path takes whatever integer arrays a caller hands it (int32 slots, int64 tokens,
    strided or read-only views): they are converted to the kernels' one argument type, drafts unchanged."""
    reqs = _workload(11, 4)
    a, b = NgramCache(**LARGE), NgramCache(**LARGE)
    for rid, (prompt, _) in enumerate(reqs):
        a.start_request(rid, prompt)
        b.start_request(rid, prompt)
    rids = list(range(len(reqs)))
    for k in range(0, 30, 3):
        chunks = [reqs[r][1][k:k + 3] for r in rids]
        a.add_tokens_batch(rids, chunks)
        slots = np.array(b._slots(rids), np.int64)
        offsets = np.zeros(len(rids) + 1, np.int64)
        np.cumsum([c.size for c in chunks], out=offsets[1:])
        ro = np.concatenate(chunks).astype(np.int64)  # int64 tokens, read-only offsets, strided int32 slots
        offsets.flags.writeable = False
        b._append_flat(np.repeat(slots.astype(np.int32), 2)[::2], ro, offsets)
        budgets = np.repeat(np.arange(3, 3 + len(rids), dtype=np.int64), 2)[::2]  # strided per-request budgets
        da, db = a.propose(rids, budgets.tolist()), b.propose(rids, budgets)
        for x, y in zip((da.tokens, da.parents, da.probs, da.sources, da.offsets, da.match_lens),
                        (db.tokens, db.parents, db.probs, db.sources, db.offsets, db.match_lens)):
            np.testing.assert_array_equal(x, y)
        pa = a._propose_slots(np.array(a._slots(rids), np.int64), 5, True)
        pb = b._propose_slots(np.array(b._slots(rids), np.int32)[::-1][::-1], 5, True)
        np.testing.assert_array_equal(pa.tokens, pb.tokens)
        np.testing.assert_array_equal(pa.parents, pb.parents)
    np.testing.assert_array_equal(a.history(0), b.history(0))


def test_direct_kernel_call_falls_back_to_the_dispatcher():
    """Without numba's compiled overloads to call (a plain function here), `Direct` calls the kernel itself."""
    from ngramspec._cache_api import Direct

    class Owner:
        pass

    calls, owner = [], Owner()

    def kernel(*args):
        calls.append(args)
        return len(calls)

    owner.k = Direct(owner, "k", kernel)
    assert (owner.k(1, 2), owner.k(3), owner.k()) == (1, 2, 3)
    assert calls == [(1, 2), (3,), ()] and owner.k is kernel


def test_direct_kernel_call_goes_to_the_entry_point():
    """After its first call, a cache's kernel attribute is the compiled entry point (and drafts are as before)."""
    cache = NgramCache(**LARGE)
    cache.start_request(0, [1, 2, 3, 1, 2, 3, 1, 2])
    first = cache.propose([0], 4)
    assert type(cache._propose_kernel).__name__ != "Direct" and type(cache._append_kernel).__name__ != "Direct"
    again = cache.propose([0], 4)
    assert first.tokens.tolist() == again.tokens.tolist() == [3, 1, 2, 3]
