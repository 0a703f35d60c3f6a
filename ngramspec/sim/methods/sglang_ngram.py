"""`sglang-ngram`: SGLang's real `NgramCorpus` (sglang 0.5.23), fed exactly as its `NGRAMWorker` feeds it.

- The prompt is never inserted at prefill; only the last `depth` tokens of the sequence ever enter the trie.
- Each step `batch_get` sees the last `depth` tokens of the sequence (prompt + output so far) and the total
  length; after the step's verify the worker `batch_put`s the last `depth` tokens of the sequence as it was
  *before* that step (its overlap scheduler splices accepted tokens in one step late), asynchronously:
  `synchronize()` runs before the next `batch_get`.
- A draft is `D` rows, row 0 the root; padding rows (token 0 under the root, always after the real nodes) are
  not counted as drafted, but SGLang verifies the full width `D` every step, so the verify width is `D`.

Parameters: `d` (speculative_num_draft_tokens, 12), `match` (BFS or PROB), `depth` (max_trie_depth, 18),
`min_bfs` (1), `max_bfs` (10), `capacity` (10,000,000): SGLang's defaults.
"""
from __future__ import annotations

import numpy as np

from ngramspec.layout import mask_parents
from ngramspec.sim.methods import Method, positive_int, register_method


def _import_corpus():
    try:
        from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus
    except ImportError as exc:
        raise ImportError("sglang-ngram needs the real sglang package (pip install 'sglang==0.5.23'); "
                          f"import failed: {exc}") from exc
    return NgramCorpus


def split_sglang_drafts(ids: np.ndarray, mask: np.ndarray, batch: int, width: int):
    """SGLang's flat (tokens [B*D], mask [B*D*D]) -> per request (tokens, parents) without root and padding."""
    ids = ids.reshape(batch, width)
    parent_row = np.maximum(mask_parents(mask.reshape(batch, width, width)), 0)  # deepest ancestor; 0 when none
    drafts = []
    for b in range(batch):
        n = width
        while n > 1 and ids[b, n - 1] == 0 and parent_row[b, n - 1] == 0:
            n -= 1  # trailing padding: token 0 under the root
        drafts.append((ids[b, 1:n].astype(np.int32), (parent_row[b, 1:n] - 1).astype(np.int32)))
    return drafts


class SglangNgram(Method):
    def __init__(self, d: int = 12, match: str = "BFS", depth: int = 18, min_bfs: int = 1, max_bfs: int = 10,
                 capacity: int = 10_000_000):
        self.d = positive_int(d, "sglang-ngram d")
        if self.d < 2:
            raise ValueError("sglang-ngram d (draft tokens incl. the root) must be >= 2")
        if match not in ("BFS", "PROB"):
            raise ValueError(f"sglang-ngram match must be BFS or PROB, got {match!r}")
        self.depth = positive_int(depth, "sglang-ngram depth")
        self.corpus = _import_corpus()(
            max_trie_depth=self.depth, min_bfs_breadth=positive_int(min_bfs, "sglang-ngram min_bfs"),
            max_bfs_breadth=positive_int(max_bfs, "sglang-ngram max_bfs"), draft_token_num=self.d,
            match_type=match, capacity=positive_int(capacity, "sglang-ngram capacity"))
        self._tail: dict = {}  # rid -> last `depth` tokens of prompt + output so far
        self._length: dict = {}  # rid -> total sequence length
        self._puts: list = []  # tails to insert after this step's verify (one step late, as the worker does)

    def start(self, rid, prompt):
        self._tail[rid] = prompt[-self.depth:].tolist()
        self._length[rid] = len(prompt)

    def propose(self, rids):
        if self._puts:
            self.corpus.batch_put(self._puts)
            self._puts = []
        self.corpus.synchronize()
        ids, mask = self.corpus.batch_get([str(r) for r in rids], [self._tail[r] for r in rids],
                                          [self._length[r] for r in rids])
        return split_sglang_drafts(ids, mask, len(rids), self.d)

    def verify_width(self, rids, drafts):
        return self.d

    def update(self, rid, committed, n_accepted):
        tail = self._tail[rid]
        self._puts.append(tail)
        self._tail[rid] = (tail + committed.tolist())[-self.depth:]
        self._length[rid] += len(committed)

    def finish(self, rid):
        self.corpus.erase_match_state([str(rid)])
        del self._tail[rid], self._length[rid]


register_method("sglang-ngram", SglangNgram, "SGLang's NGRAM (its real NgramCorpus; needs sglang 0.5.23), "
                "d = verify width incl. the root")
