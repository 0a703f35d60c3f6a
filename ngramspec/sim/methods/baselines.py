"""Baselines: `none` (plain decode), `prompt-lookup` (vLLM's n-gram rule) and the perfect drafter `oracle`."""
from __future__ import annotations

import numpy as np

from ngramspec.sim.methods import EMPTY_DRAFT, Method, chain, positive_int, register_method


class NoDraft(Method):
    """Plain decoding: never drafts, every step is width 1."""

    def propose(self, rids):
        return [EMPTY_DRAFT] * len(rids)


class PromptLookup(Method):
    """vLLM's prompt-lookup rule, per request only.

    The longest n-gram (n in [min_n, max_n]) ending at the current position that occurred earlier in the same
    request (prompt + output so far; earliest occurrence) is followed by up to k copied tokens, never past
    the current end. Occurrences are kept in a dict from n-gram to the end position of its first occurrence;
    an n-gram ending at position p is indexed once p is no longer the last position, so a suffix never
    matches itself.
    """

    def __init__(self, k: int = 8, min_n: int = 2, max_n: int = 5):
        self.k = positive_int(k, "prompt-lookup k")
        self.min_n = positive_int(min_n, "prompt-lookup min")
        self.max_n = positive_int(max_n, "prompt-lookup max")
        if self.min_n > self.max_n:
            raise ValueError(f"prompt-lookup needs min <= max, got {min_n} > {max_n}")
        self._tokens: dict = {}
        self._first_end: dict = {}
        self._indexed: dict = {}

    def start(self, rid, prompt):
        self._tokens[rid] = prompt.tolist()
        self._first_end[rid] = {}
        self._indexed[rid] = 0

    def _index(self, rid, upto: int) -> None:
        tokens, first_end = self._tokens[rid], self._first_end[rid]
        for end in range(self._indexed[rid], upto):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                first_end.setdefault(tuple(tokens[end - n + 1: end + 1]), end)
        self._indexed[rid] = upto

    def propose_one(self, rid):
        tokens = self._tokens[rid]
        total = len(tokens)
        self._index(rid, total - 1)
        first_end = self._first_end[rid]
        for n in range(min(self.max_n, total), self.min_n - 1, -1):
            end = first_end.get(tuple(tokens[total - n:]))
            if end is not None:
                begin = end + 1
                return chain(tokens[begin: begin + min(self.k, total - begin)])
        return EMPTY_DRAFT

    def propose(self, rids):
        return [self.propose_one(rid) for rid in rids]

    def update(self, rid, committed, n_accepted):
        self._tokens[rid].extend(committed.tolist())

    def finish(self, rid):
        del self._tokens[rid], self._first_end[rid], self._indexed[rid]


class PerfectDrafter(Method):
    """The perfect drafter (`oracle:k=K`): drafts the true next k tokens, all accepted.

    An upper bound on tokens per step for any drafter at verify width k + 1. It never drafts the request's
    last token (that one is the bonus of the final step), so every step is accepted + 1 tokens.
    """

    needs_future = True

    def __init__(self, k: int = 8):
        self.k = positive_int(k, "oracle k")
        self._future: dict = {}
        self._pos: dict = {}

    def see_future(self, rid, output: np.ndarray) -> None:
        self._future[rid] = output
        self._pos[rid] = 0

    def propose(self, rids):
        drafts = []
        for rid in rids:
            output, pos = self._future[rid], self._pos[rid]
            drafts.append(chain(output[pos: pos + min(self.k, len(output) - pos - 1)]))
        return drafts

    def update(self, rid, committed, n_accepted):
        self._pos[rid] += len(committed)

    def finish(self, rid):
        del self._future[rid], self._pos[rid]


def _prompt_lookup(k: int = 8, min: int = 2, max: int = 5) -> PromptLookup:  # noqa: A002 (spec names)
    return PromptLookup(k=k, min_n=min, max_n=max)


register_method("none", NoDraft, "plain decoding, no speculation (the speedup baseline)")
register_method("prompt-lookup", _prompt_lookup, "vLLM's prompt lookup: copy what followed the longest matching n-gram "
                "(min..max tokens) of the request's own text")
register_method("oracle", PerfectDrafter, "bound: the perfect drafter, k true next tokens every step, all accepted")
register_method("perfect", PerfectDrafter, "same as oracle")
