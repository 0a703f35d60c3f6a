"""A draft source for engine tests that knows the greedy output: true tokens with decoy siblings first."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np


class OracleCache:
    """Drafts from the known greedy output, with wrong siblings placed first, so the accepted path runs through
    later rows and the engine must move its keys/values (the keep-the-accepted-path code). `decoy_offset=None`:
    plain chains of exactly `depth` true tokens (an int, or a dict per request id)."""

    def __init__(self, truth: dict, decoy_offset: int | None, depth, seed: int, vocab: int = 49152):
        self.truth, self.decoy, self.depth, self.vocab = truth, decoy_offset, depth, vocab
        self.pos = {}
        self.rng = np.random.default_rng(seed)

    def start_request(self, rid, prompt):
        self.pos[rid] = 0

    def add_tokens(self, rid, tokens):
        self.pos[rid] += len(tokens)

    def finish_request(self, rid, share=True):
        del self.pos[rid]

    def propose(self, rids, budgets, tree=True):
        tokens, parents, offsets = [], [], [0]
        for rid in rids:
            if self.decoy is None:                 # chains of exactly `depth` (per rid if a dict) true tokens
                n = self.depth[rid] if isinstance(self.depth, dict) else self.depth
            else:
                n = int(self.rng.integers(0, self.depth + 1))
            future = self.truth[rid][self.pos[rid]:][:n]
            t, p = [], []
            parent = -1
            for d, tok in enumerate(future):
                if self.decoy is None:             # plain chain of true tokens
                    t.append(tok)
                    p.append(parent)
                    parent = len(t) - 1
                    continue
                decoy = (tok + self.decoy) % self.vocab
                t += [decoy, tok]                  # decoy first: the true child is the later row
                p += [parent, parent]
                parent = len(t) - 1
                if self.rng.random() < 0.2:       # sometimes stop with a wrong token at the tip
                    t.append(decoy)
                    p.append(parent)
                    break
            tokens += t
            parents += p
            offsets.append(len(tokens))
        return OracleBatch(np.array(tokens, np.int32), np.array(parents, np.int32), np.array(offsets, np.int64))


class OracleBatch:
    def __init__(self, tokens, parents, offsets):
        self.tokens, self.parents, self.offsets = tokens, parents, offsets

    def draft(self, i):
        sl = slice(self.offsets[i], self.offsets[i + 1])
        return SimpleNamespace(tokens=self.tokens[sl], parents=self.parents[sl])


