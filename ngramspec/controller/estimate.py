"""The adaptive controller's second phase, **estimate**: what each width would be worth in this step.

- the benefit: each draft node's calibrated P(accepted) (its calibration cell's counts, ``calibration``), each
  request's expected accepted nodes at each width (``G``) and the batch's expected tokens at each width
  (`_estimate`, into the `Scratch`);
- the cost: c(B, n) of each width at this batch size, from the cost model (``cost``), plus what drafting costs
  beyond its own step (`_estimate_costs`, into the ``CostRow``).

`Estimating` is the controller's Python side of it (`node_values`, and the scratch it sizes).
"""
from __future__ import annotations

import math
from typing import Hashable, NamedTuple, Sequence

import numpy as np
from numba import njit

from ngramspec.cache import DraftBatch
from ngramspec.controller.calibration import _node_cells, _node_values, node_cells, node_values
from ngramspec.controller.cost import _cost_row_all


class Scratch(NamedTuple):
    """Per-step scratch of the width choice, grown on demand."""

    cells: np.ndarray  # [nodes] int64: each draft node's calibration cell
    P: np.ndarray  # [nodes] float64: each node's calibrated P(accepted)
    G: np.ndarray  # [requests, widths] float64: expected accepted nodes per request and width
    values: np.ndarray  # [widths] float64: each width's value (-inf: not considered)
    expected: np.ndarray  # [widths] float64: expected tokens of the step at each width
    depth: np.ndarray  # [nodes] int64: `node_cells`' scratch (each node's depth)
    kids: np.ndarray  # [nodes + 1] int64: `node_cells`' scratch (children per parent)
    cols: np.ndarray  # [6] int64: the logistic correction's scratch
    limit: np.ndarray  # [2] int64: the most tokens one step may verify (batch size x width), the largest batch
    #                    that may draft at all (0: no limit)


REQUEST_Z = 2.326  # a request's drafts fall short when even this upper quantile (one-sided 99%) of the ratio is < 1


@njit(cache=True)
def request_factor(predicted, realized):
    """Whether a request's own drafts fall short of their calibrated prediction, and by how much: the ratio
    accepted / expected nodes of its decided drafts has a Gamma posterior (accepted ~ Poisson(ratio x expected),
    the prior a Gamma of mean 1 whose pseudo-count both sums start from). Only where its upper quantile
    (``REQUEST_Z``, Wilson-Hilferty) is below 1 are the request's predictions scaled down, by the posterior mean
    (realized / predicted); else 1: never up, and not for a shortfall within noise. ``predicted`` < 0: no check."""
    if predicted <= 0.0 or realized >= predicted:
        return 1.0
    mean = realized / predicted
    c = 1.0 / (9.0 * max(realized, 1e-9))
    upper = mean * (1.0 - c + REQUEST_Z * math.sqrt(c)) ** 3
    return mean if upper < 1.0 else 1.0


@njit(cache=True)
def _estimate(parents, probs, sources, offsets, mlens, slots, success, run, predicted, realized, cal, prior_mean,
              strength, widths, sc):
    """The benefit of each width for the drafts of one step: fills the scratch ``sc``'s cells, P, G and
    expected (the batch's tokens at each width: one per request plus its expected accepted nodes, each request's
    scaled by its `request_factor`; P stays the calibrated one)."""
    B = offsets.shape[0] - 1
    W = widths.shape[0]
    cells, G, expected = sc.cells, sc.G, sc.expected
    _node_cells(parents, probs, sources, offsets, mlens, slots, success, cells, run, sc.depth, sc.kids)
    _node_values(parents, offsets, cells, cal, prior_mean, strength, widths, sc.P, G, sc.cols)
    for i in range(B):
        f = request_factor(predicted[slots[i]], realized[slots[i]])
        if f < 1.0:
            for w in range(W):
                G[i, w] *= f
    for w in range(W):
        acc = 0.0
        for i in range(B):
            acc += G[i, w]
        expected[w] = B + acc


@njit(cache=True)
def _estimate_costs(cstate, B, widths, clock, stale_after, row, tmp, switch):
    """The cost of each width at batch size ``B`` (the cost row, into ``row``; ``tmp``: scratch), every width > 1
    costing ``switch`` more."""
    _cost_row_all(cstate, B, widths, clock, stale_after, row.costs, row.measured, row.stale, row.implied, tmp)
    if switch > 0.0:
        for w in range(widths.shape[0]):
            if widths[w] > 1:
                row.costs[w] += switch


class Estimating:
    """`AdaptiveController`'s estimate phase: the calibrated value of a batch's draft nodes, and the per-step
    scratch (``_sc``, a `Scratch`) sized for the batch. Reads the calibration (``calibration``, ``prior_mean``,
    ``prior_strength``), the requests' recent success (``_pend``) and ``widths``."""

    def _scratch(self, B: int, n: int) -> None:
        sc = self._sc
        if n > sc.cells.shape[0]:
            m = max(n, 2 * sc.cells.shape[0])
            sc = sc._replace(cells=np.zeros(m, np.int64), P=np.zeros(m), depth=np.zeros(m, np.int64),
                             kids=np.zeros(m + 1, np.int64))
        if B > sc.G.shape[0]:
            sc = sc._replace(G=np.zeros((max(B, 2 * sc.G.shape[0]), len(self.widths))))
        self._sc = sc

    @staticmethod
    def _check_batch(B: int, batch: DraftBatch) -> None:
        if not isinstance(batch, DraftBatch):
            raise TypeError(f"batch must be a DraftBatch (from NgramCache.propose), got {type(batch).__name__}")
        if len(batch) != B:
            raise ValueError(f"{B} request ids but {len(batch)} drafts")

    def node_values(self, rids: Sequence[Hashable], batch: DraftBatch) -> tuple[np.ndarray, np.ndarray]:
        """Calibrated P(accepted) of every node of the batch, and each node's calibration cell."""
        slots = self._slots(rids)
        self._check_batch(len(slots), batch)
        n = batch.parents.shape[0]
        cells, P, G = np.zeros(n, np.int64), np.zeros(n), np.zeros((len(slots), len(self.widths)))
        node_cells(batch.parents, batch.probs, batch.sources, batch.offsets, batch.match_lens, slots,
                   self._pend.success, cells, self._pend.run)
        node_values(batch.parents, batch.offsets, cells, self.calibration, self.prior_mean, self.prior_strength,
                    self._widths, P, G)
        return P, cells
