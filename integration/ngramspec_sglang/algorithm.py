"""The `NGRAM_ADAPTIVE` speculative algorithm as SGLang sees it (a `CustomSpecAlgo` subclass).

It answers `is_ngram()` True so SGLang's NGRAM plumbing applies unchanged: the verify CUDA graph
builds an `NgramVerifyInput` dummy, the overlap `FutureMap` relays `accept_tokens`/`accept_lens`,
and CPU seq-lens are published (the full tree mask needs them). It also supplies the methods
SGLang 0.5.23 calls on the builtin enum but `CustomSpecAlgo` lacks (`carries_draft_hidden_states`,
`create_future_map`, `need_topk`). Imports only CPU-safe SGLang modules.
"""
from __future__ import annotations

import logging
from typing import Any

from sglang.srt.arg_groups.overrides import resolving_view
from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from .config import (
    ALGORITHM_NAME,
    DEFAULT_MAX_RUNNING_REQUESTS,
    IGNORED_NGRAM_OPTIONS,
    UNSUPPORTED_OPTIONS,
    resolve_config,
)
from .host_seq_lens import cpu_seq_lens_need

logger = logging.getLogger(__name__)

WORKER_PATH = "ngramspec_sglang.worker:NgramAdaptiveWorker"


class NgramAdaptiveAlgo(CustomSpecAlgo):
    """SGLang-facing description of NGRAM_ADAPTIVE."""

    def is_ngram(self) -> bool:
        return True

    def has_draft_kv(self) -> bool:
        # Like NGRAM: the tree lives only in the verify mask, no draft KV chains.
        return False

    def carries_draft_hidden_states(self) -> bool:
        return False

    def need_topk(self) -> bool:
        return False

    def create_future_map(
        self,
        device,
        req_to_token_pool,
        needs_cpu_seq_lens: bool = True,
        needs_confidence_relay: bool = False,
    ):
        from sglang.srt.managers.overlap_utils import FutureMap

        need = cpu_seq_lens_need()  # the worker's answer (`host_seq_lens`), if it gave one
        if need is not None:
            needs_cpu_seq_lens = need
            logger.info("%s: overlap relay %s host sequence lengths", ALGORITHM_NAME,
                        "with" if needs_cpu_seq_lens else "without")
        return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)

    def resolve_max_speculative_num_draft_tokens(self, server_args) -> int:
        """The largest verify width: FutureMap rows, KV reservation and output strides use it."""
        return resolve_config(resolving_view(server_args)).max_width

    def handle_server_args(self, server_args) -> None:
        """Fill NGRAM_ADAPTIVE's defaults (runs on SGLang's recording stand-in: plain assignments)."""
        config = resolve_config(server_args)
        if server_args.device == "cpu" and not server_args.disable_overlap_schedule:
            server_args.disable_overlap_schedule = True
            logger.warning("Overlap schedule is not implemented for speculative decoding on CPU.")
        if server_args.max_running_requests is None and config.draft_max_batch is None:
            # (with draft_max_batch, SGLang's own default: larger batches decode plainly, as without speculation)
            server_args.max_running_requests = DEFAULT_MAX_RUNNING_REQUESTS
        server_args.enable_mixed_chunk = False
        server_args.speculative_num_draft_tokens = config.max_width
        # As NGRAM: topk is the tree breadth bound (it gates SGLang's paged-tree safety check), and
        # steps * topk stays within the width so KV reservation per decode step is the width.
        topk = max(1, int(server_args.speculative_ngram_max_bfs_breadth)) if config.tree else 1
        server_args.speculative_eagle_topk = topk
        if server_args.speculative_num_steps is None:
            server_args.speculative_num_steps = max(1, config.max_width // topk)
        page_size = getattr(server_args, "page_size", None) or 1
        backend = getattr(server_args, "attention_backend", None)
        if config.tree and page_size > 1 and backend not in (None, "flashinfer"):
            raise ValueError(
                f"{ALGORITHM_NAME} tree drafts with --page-size {page_size} > 1 need the flashinfer attention "
                f"backend (got {backend!r}); use --speculative-ngram-max-bfs-breadth 1 for chain drafts"
            )
        for name, reason in IGNORED_NGRAM_OPTIONS.items():
            if getattr(server_args, name, None) != _field_default(name):
                logger.warning("--%s is ignored by %s: %s", name.replace("_", "-"), ALGORITHM_NAME, reason)


def _field_default(name: str) -> Any:
    import msgspec
    from sglang.srt.server_args import ServerArgs

    for f in msgspec.structs.fields(ServerArgs):
        if f.name == name:
            return f.default
    raise KeyError(name)


def validate_server_args(server_args) -> None:
    """Reject configurations NGRAM_ADAPTIVE cannot serve, with the reason."""
    for name, reason in UNSUPPORTED_OPTIONS.items():
        if getattr(server_args, name, None) is not None:
            raise ValueError(f"--{name.replace('_', '-')}: {reason}")
    if getattr(server_args, "pp_size", 1) > 1:
        raise ValueError(f"{ALGORITHM_NAME} does not support pipeline parallelism (--pp-size > 1)")
    if getattr(server_args, "dp_size", 1) > 1 and getattr(server_args, "enable_dp_attention", False):
        raise ValueError(f"{ALGORITHM_NAME} does not support DP attention (same limit as NGRAM)")
    if getattr(server_args, "enable_lora", None) or getattr(server_args, "lora_paths", None):
        raise ValueError(
            f"{ALGORITHM_NAME} does not support LoRA: its per-width verify graphs do not rebuild LoRA "
            "cuda-graph metadata (the same limit as --speculative-adaptive)"
        )
    for flag in ("enable_two_batch_overlap", "enable_pdmux"):
        if getattr(server_args, flag, False):
            raise ValueError(
                f"{ALGORITHM_NAME} does not support --{flag.replace('_', '-')}: swapping the per-width "
                "attention backend would bypass its wrapper (the same limit as --speculative-adaptive)"
            )
    if server_args.device not in (None, "cuda", "cpu", "xpu"):
        raise ValueError(f"{ALGORITHM_NAME} supports CUDA, CPU or XPU devices, got {server_args.device!r}")
    resolve_config(server_args)  # raises on a bad --speculative-adaptive-config / width


def worker_factory(server_args) -> type:
    """The worker class, imported lazily: the algorithm registers in every process, the worker (which
    needs a CUDA build of sglang: sgl_kernel, libcuda) loads only in the scheduler."""
    from .worker import NgramAdaptiveWorker

    return NgramAdaptiveWorker
