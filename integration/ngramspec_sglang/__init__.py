"""SGLang plugin: `--speculative-algorithm NGRAM_ADAPTIVE` (ngramspec's cache and adaptive controller).

SGLang calls `register()` in every process through the `sglang.srt.plugins` entry point
(installing ngramspec, from a checkout or its wheel, installs it; `SGLANG_PLUGINS=ngram_adaptive` selects it).
"""
from __future__ import annotations

from .config import ALGORITHM_NAME

__all__ = ["ALGORITHM_NAME", "register"]


def register() -> None:
    """Register NGRAM_ADAPTIVE with SGLang and install its hooks. Idempotent per process."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    from .algorithm import NgramAdaptiveAlgo, validate_server_args, worker_factory
    from .hooks import register_hooks

    if get_spec(ALGORITHM_NAME) is None:
        SpeculativeAlgorithm.register(
            ALGORITHM_NAME,
            supports_overlap=True,
            validate_server_args=validate_server_args,
            spec_class=NgramAdaptiveAlgo,
        )(worker_factory)
    register_hooks()
