"""Controllers: each step, the verify width for the batch and how much of each request's draft to send.

- ``protocol``: the ``Controller`` protocol, ``Plan``, ``DEFAULT_WIDTHS``, the input validators and the static
  controllers (``FixedWidthController``, ``FixedBudgetController``);
- ``adaptive``: ``AdaptiveController``, which drafts only what pays (see its module docstring), combined from a
  module per phase of its step: ``observe``, ``estimate``, ``choose``; ``step`` (the whole host step with the
  cache) and ``persist`` (its learned state, saved and loaded);
- ``cost``: its cost model c(B, n) (``CostModel``) and calibration tables as priors;
- ``calibration``: its acceptance calibration (``Calibration``, the counts behind ``AdaptiveController.calibration``).
"""
from ngramspec.controller.adaptive import REMEASURE_RATIO, AdaptiveController
from ngramspec.controller.calibration import Calibration
from ngramspec.controller.cost import CostModel, CostTable, batch_bucket, default_prior, prior_from_calibration
from ngramspec.controller.protocol import (
    DEFAULT_WIDTHS,
    MAX_WIDTH,
    Controller,
    FixedBudgetController,
    FixedWidthController,
    Plan,
    check_positive,
    check_waiting,
    check_widths,
    is_int,
)

__all__ = ["AdaptiveController", "Calibration", "Controller", "CostModel", "CostTable", "DEFAULT_WIDTHS",
           "FixedBudgetController", "FixedWidthController", "MAX_WIDTH", "Plan", "REMEASURE_RATIO", "batch_bucket",
           "check_positive", "check_waiting", "check_widths", "default_prior", "is_int", "prior_from_calibration"]
