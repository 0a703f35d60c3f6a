"""`arctic-suffix`: Arctic Inference's real `SuffixDecodingCache` (arctic-inference 0.3.0).

Fed as its integration does: `start_request(rid, prompt)`, `speculate(rid, last `depth` tokens, ...)` each
step, `add_active_response(rid, committed)` after it, `stop_request(rid)` at the end; the cache is shared
across requests and never evicts. Width = 1 + draft length (no padding).

Parameters: `k` (max_spec_tokens, 8), `tree` (0 = path speculation, Arctic's default; 1 = tree), `depth`
(max_tree_depth, 64), `factor` (max_spec_factor, 1.0), `offset` (max_spec_offset, 0.0), `min_prob`
(min_token_prob, 0.1).
"""
from __future__ import annotations

import numpy as np

from ngramspec.sim.methods import Method, flag, positive_int, register_method


class ArcticSuffix(Method):
    def __init__(self, k: int = 8, tree: int = 0, depth: int = 64, factor: float = 1.0, offset: float = 0.0,
                 min_prob: float = 0.1):
        try:
            from arctic_inference.suffix_decoding import SuffixDecodingCache
        except ImportError as exc:
            raise ImportError("arctic-suffix needs arctic-inference 0.3.0 (pip install arctic-inference==0.3.0); "
                              f"import failed: {exc}") from exc
        self.k = positive_int(k, "arctic-suffix k")
        self.tree = flag(tree, "arctic-suffix tree")
        self.depth = positive_int(depth, "arctic-suffix depth")
        self.factor, self.offset, self.min_prob = float(factor), float(offset), float(min_prob)
        self.cache = SuffixDecodingCache(max_tree_depth=self.depth, max_cached_requests=-1)
        self._tail: dict = {}

    def start(self, rid, prompt):
        tokens = prompt.tolist()
        self.cache.start_request(rid, tokens)
        self._tail[rid] = tokens[-self.depth:]

    def propose(self, rids):
        drafts = []
        for rid in rids:
            draft = self.cache.speculate(rid, self._tail[rid], max_spec_tokens=self.k,
                                         max_spec_factor=self.factor, max_spec_offset=self.offset,
                                         min_token_prob=self.min_prob, use_tree_spec=self.tree)
            drafts.append((np.asarray(draft.token_ids, dtype=np.int32), np.asarray(draft.parents, dtype=np.int32)))
        return drafts

    def update(self, rid, committed, n_accepted):
        tokens = committed.tolist()
        self.cache.add_active_response(rid, tokens)
        self._tail[rid] = (self._tail[rid] + tokens)[-self.depth:]

    def finish(self, rid):
        self.cache.stop_request(rid)
        del self._tail[rid]


register_method("arctic-suffix", ArcticSuffix,
                "Arctic Inference's suffix cache (needs arctic-inference 0.3.0); tree=1 for tree speculation")
