"""Verify CUDA graphs captured only up to a batch size (`draft_max_batch`): a scoped override of SGLang's decode
capture list. Imports only CPU-safe SGLang modules."""
from __future__ import annotations

from contextlib import nullcontext


def capped_capture_sizes(graph_bag, max_bs: int | None):
    """A context manager under which SGLang's decode CUDA graph capture list (``graph_bag.cuda_graph_config``, the
    ``exec.graph`` namespace of its runtime context) holds only its batch sizes up to ``max_bs``, and ``max_bs``
    itself where the list goes past it (a batch up to ``max_bs`` pads to a captured size). A null context for
    ``max_bs`` None or a list not resolved yet."""
    if max_bs is None:
        return nullcontext()
    cfg = graph_bag.cuda_graph_config
    sizes = list(cfg.decode.bs or ())
    if not sizes:
        return nullcontext()
    kept = sorted({b for b in sizes if b <= max_bs} | ({max_bs} if max(sizes) > max_bs else set()))
    from sglang.srt.model_executor.cuda_graph_config import Phase, with_phase

    return graph_bag.override(cuda_graph_config=with_phase(cfg, Phase.DECODE, bs=kept, max_bs=max(kept)))
