"""Drafting one step ahead, so that a drafting step never waits for the host.

Today a drafting step waits for the previous step's tokens on the host, drafts from them, and only then launches
its verify: the host's part sits on the critical path. Drafting ahead moves it off: while step t verifies draft
D_t, the host builds, from the cache as it stands and D_t alone, step t+1's drafts for the likely outcomes of
step t (`NgramCache.propose_ahead` -> `Lookahead`). When step t's verify ends, the outcome is known on the device:
the accepted node n and the bonus token b. The next draft is the table's entry for (n, b), found by a gather on the
device (`pick_torch`), or nothing (that request decodes plainly next step) when no entry matches. The cache and
the controller catch up with step t's tokens while step t+1 runs, one step behind.

The entries are what the trie predicts for the bonus token: at each node of D_t (and at the root) its
continuations less the draft's own children there, weighted by the draft's path probability times the
continuation's frequency. What drafting ahead costs in accepted tokens (an outcome the table did not foresee
drafts nothing) is measured by the simulator's `ngramspec-ahead` method against today's `ngramspec-tree`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ngramspec._lookahead import NO_ENTRY
from ngramspec.layout import accepted_path

__all__ = ["Lookahead", "NO_ENTRY", "outcome_node", "pick", "pick_torch"]


@dataclass(frozen=True)
class Lookahead:
    """Next-step drafts for a batch, per request i and entry e (most likely first): the outcome it stands for,
    ``node[i, e]`` (the accepted node of the draft in flight, -1 the root, NO_ENTRY unused) and ``token[i, e]``
    (the bonus token), its weight ``weight[i, e]``, and its draft: ``length[i, e]`` nodes in ``tokens[i, e, :]``,
    ``parents`` (-1: child of the root, which is then the bonus token) and ``probs``."""

    node: np.ndarray  # int32 [B, E]
    token: np.ndarray  # int32 [B, E]
    weight: np.ndarray  # float32 [B, E]
    tokens: np.ndarray  # int32 [B, E, L]
    parents: np.ndarray  # int32 [B, E, L]
    probs: np.ndarray  # float32 [B, E, L]
    length: np.ndarray  # int32 [B, E]

    def __len__(self) -> int:
        return int(self.node.shape[0])

    def coverage(self) -> np.ndarray:
        """Per request: the summed weight of its entries, an estimate of how often the next step finds its draft."""
        return self.weight.sum(axis=1)


def outcome_node(tokens: np.ndarray, parents: np.ndarray, accepted) -> int:
    """The draft node whose root path is ``accepted`` (the tokens a verify accepted), -1 for none accepted.
    ValueError when no such path exists."""
    path = accepted_path(tokens, parents, accepted)
    if len(path) != len(accepted):
        raise ValueError(f"accepted tokens {list(accepted)} are not a root path of the draft")
    return path[-1] if path else -1


def pick(ahead: Lookahead, nodes, bonus) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each request's next draft given step t's outcome (accepted node ``nodes[i]``, bonus token ``bonus[i]``):
    (entry index, -1 when none matches; tokens [B, L]; parents [B, L]; lengths [B], 0 when none matches)."""
    nodes = np.asarray(nodes).reshape(-1, 1)
    bonus = np.asarray(bonus).reshape(-1, 1)
    hit = (ahead.node == nodes) & (ahead.token == bonus)
    found = hit.any(axis=1)
    idx = np.where(found, hit.argmax(axis=1), -1)
    rows = np.arange(ahead.node.shape[0])
    safe = np.maximum(idx, 0)
    lengths = np.where(found, ahead.length[rows, safe], 0).astype(np.int32)
    return idx, ahead.tokens[rows, safe], ahead.parents[rows, safe], lengths


def pick_torch(node, token, tokens, parents, length, nodes, bonus):
    """`pick` on torch tensors, on their device and without a host synchronisation: the tables as tensors
    (``node``/``token``/``length`` [B, E], ``tokens``/``parents`` [B, E, L]), the outcome as [B] tensors.
    Returns (entry index or -1, tokens [B, L], parents [B, L], lengths [B])."""
    import torch

    hit = (node == nodes.view(-1, 1)) & (token == bonus.view(-1, 1))
    found = hit.any(dim=1)
    first = torch.argmax(hit.to(torch.int8), dim=1)  # the first hit (argmax returns the first maximum)
    idx = torch.where(found, first, torch.full_like(first, -1))
    rows = torch.arange(node.shape[0], device=node.device)
    lengths = torch.where(found, length[rows, first], torch.zeros_like(length[:, 0]))
    return idx, tokens[rows, first], parents[rows, first], lengths
