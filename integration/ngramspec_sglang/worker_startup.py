"""Start-up of `NgramAdaptiveWorker`: what is built once, before the first request.

Preallocated step buffers; an attention backend and a `TARGET_VERIFY` CUDA graph runner per candidate width (the
largest one is the target worker's own, unless `split_kv_verify` needs one of its own); for width 1 a decode-mode
backend and graph runner, as a server without speculation captures them; the Triton and JIT kernels a step runs
outside the graphs, built now rather than inside the first request; and `_activate`, which swaps a width's state in
before a forward.
"""
from __future__ import annotations

import contextlib
import logging
import time

import torch
from sglang.kernels.ops.speculative.cache_locs import (
    assign_extend_cache_locs_func,
    fill_front_out_cache_loc_func,
)
from sglang.kernels.ops.speculative.reconstruct_tree import reconstruct_indices_from_tree_mask_func
from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, check_cuda_graph_backend
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.runtime_context import get_exec, get_spec
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.utils import is_cpu

from .device_drafts import DeviceHistory
from .graph_sizes import capped_capture_sizes
from .relay import full_verify_mask

logger = logging.getLogger(__name__)
_is_cpu = is_cpu()


class WorkerStartup:
    """`NgramAdaptiveWorker`'s start-up methods (a mixin placed before `NGRAMWorker`: `super()` here is SGLang's)."""

    def _init_preallocated_tensors(self):
        bs, w = self.max_batch_size, self.max_width
        long = dict(dtype=torch.int64, device=self.device)
        # accept lengths of plain steps: row k-1 holds k for every request (never written to downstream)
        self._plain_lens = torch.arange(1, w + 1, dtype=torch.int32, device=self.device)[:, None].repeat(1, bs)
        # zeros, not empty: `preplan` hands rows of these to a CUDA graph runner before the drafts are written, and a
        # dropped preplan leaves them in the graph's input ids, whose padded rows SGLang never resets but still embeds
        # (a later replay at a smaller batch size): every row a graph may read must hold a valid token id
        self.draft_tokens = torch.zeros(bs * w, **long)
        self.positions = torch.zeros(bs * w, **long)
        self.retrieve_indexes = torch.zeros(bs * w, **long)
        self.retrieve_next_token = torch.zeros(bs * w, **long)
        self.retrieve_next_sibling = torch.zeros(bs * w, **long)
        self.tree_mask = torch.zeros(bs * w * w, dtype=torch.bool, device=self.device)
        self._plain_ok = not _is_cpu and not hasattr(self.req_to_token_pool, "mamba_pool")
        self._history = None
        if self.config.device_drafts and not _is_cpu:  # device drafts: a token row per request slot
            rows, row_len = self.req_to_token_pool.req_to_token.shape
            self._history = DeviceHistory(rows, row_len, self.device)
            self._history.warm_up(self.config.widths,  # device drafts run only in batches that may draft
                                  min(self.config.draft_max_batch or self.max_batch_size, self.max_batch_size))
            logger.info("NGRAM_ADAPTIVE: device drafts on, up to %d step(s) in a row; token table %.1f MB",
                        self.config.device_drafts, self._history.nbytes / 2**20)

    def init_cuda_graphs(self):
        """Capture one TARGET_VERIFY graph (and attention backend) per candidate width, and a DECODE graph.

        The target worker already captured the largest width (SGLang's startup
        `speculative_num_draft_tokens`); the other widths are built here under a scoped override, and with
        `split_kv_verify` the largest width too (SGLang's capture ran its own verify attention), while prefill keeps
        the start-up backend. Width 1 gets
        what a server without speculation captures: an attention backend and a decode-mode graph runner (built
        while the model runner reports no speculative algorithm, which is what selects the DECODE capture).
        """
        runner = self.model_runner
        self._split_kv = None
        if self.config.split_kv_verify and not _is_cpu:
            from .verify_attention import has_hook

            if has_hook(runner.attn_backend):  # SGLang's Triton attention
                self._split_kv = self._new_split_kv()
            else:
                logger.info("NGRAM_ADAPTIVE: split_kv_verify needs the Triton attention backend, not %s; off",
                            type(runner.attn_backend).__name__)
        self._install_split_kv(runner.attn_backend)  # its eager verifies (batches beyond the captured sizes)
        super().init_cuda_graphs()
        self._prefill_state = (runner.attn_backend, runner.decode_cuda_graph_runner)
        self._width_states[self.max_width] = self._prefill_state
        graphs_enabled = not check_cuda_graph_backend(Phase.DECODE, Backend.DISABLED)
        widths = self.config.widths[:-1]
        if self._split_kv is not None:
            # the target worker captured the largest width's graphs when it started, before this worker existed, with
            # SGLang's verify attention: that width gets a backend and graphs of its own too, through the split kernel
            widths = self.config.widths
        for width in widths:
            steps = max(1, width // max(1, self.topk))  # as resolved for the largest width
            with get_spec().override(speculative_num_draft_tokens=width, speculative_num_steps=steps), \
                    self._verify_capture_sizes(width):
                backend = self._new_attention_backend()
                self._install_split_kv(backend)
                graph_runner = None
                if graphs_enabled:
                    graph_runner = runner._decode_cuda_graph_runner_cls()(
                        runner,
                        attn_backend=backend,
                        speculative_num_steps=steps,
                        speculative_num_draft_tokens=width,
                    )
            self._width_states[width] = (backend, graph_runner)
            logger.info("NGRAM_ADAPTIVE: verify state for width %d ready (cuda graph: %s)", width, graphs_enabled)
        self._warm_step_kernels()
        if self._plain_ok:
            try:
                self._decode_state = self._build_decode_state(graphs_enabled)
                logger.info("NGRAM_ADAPTIVE: plain decode state for width 1 ready (cuda graph: %s)", graphs_enabled)
            except Exception:  # the server still runs: width 1 then verifies the root alone
                logger.exception("NGRAM_ADAPTIVE: no plain decode state; width 1 runs as a 1-token verify")
                self._decode_state = None

    def _new_split_kv(self):
        """`split_kv_verify`: one set of buffers for every width's backend (steps run one after another), sized by the
        model's attention layers as the backend sees them (query heads on this TP rank, value head size)."""
        from sglang.srt.layers.radix_attention import RadixAttention

        from .verify_attention import checked_kernel

        layer = next((m for m in self.model_runner.model.modules() if isinstance(m, RadixAttention)), None)
        if layer is None:
            logger.warning("NGRAM_ADAPTIVE: split_kv_verify needs attention layers; off")
            return None
        max_bs = min(self.config.draft_max_batch or self.max_batch_size, self.max_batch_size)
        return checked_kernel(self.config.split_kv_verify, layer, max_bs, self.max_width, self.model_runner.dtype,
                              self.device)

    def _install_split_kv(self, backend) -> None:
        """`split_kv_verify`: ``backend``'s verifies through `SplitKvVerify` (`verify_attention.install`)."""
        from .verify_attention import install

        if self._split_kv is not None and not install(backend, self._split_kv):
            logger.warning("NGRAM_ADAPTIVE: split_kv_verify needs the Triton attention backend, not %s; off for it",
                           type(backend).__name__)

    def _verify_capture_sizes(self, width: int):
        """The batch sizes a verify graph of ``width`` is captured for: with draft_max_batch, up to it (larger batches
        never draft; width 1 keeps them all, the fallback of plain steps), else SGLang's list."""
        if width == 1 or self.config.draft_max_batch is None:
            return contextlib.nullcontext()
        try:
            return capped_capture_sizes(get_exec().graph, self.config.draft_max_batch)
        except Exception:  # an SGLang whose config differs: capture them all, as without the option
            logger.exception("NGRAM_ADAPTIVE: could not cap the verify graphs' batch sizes; capturing them all")
            return contextlib.nullcontext()

    def _warm_step_kernels(self) -> None:
        """Build now the kernels a decode step runs outside the captured graphs, which SGLang would otherwise
        JIT-compile inside the first request that needs each one (a stall of seconds per kernel and shape class):
        the greedy-verify module, and the Triton kernels specialised on the verify width (tree indices from the
        mask; the accepted tokens' cache locations, packed from the verify window) or on the batch size's or the
        verify window's power of two (cache locations, accepted-token moves, KV moves of the accepted tokens).
        Dummy inputs only address the KV pool's padding slot 0."""
        if _is_cpu:
            return
        from sglang.kernels.ops.speculative.eagle import fill_accept_out_cache_loc_func
        from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_func

        t0 = time.perf_counter()
        dev, w_max = self.device, self.max_width
        long = dict(dtype=torch.int64, device=dev)
        req_to_token = self.req_to_token_pool.req_to_token
        kv = self.token_to_kv_pool_allocator.get_kvcache()
        sizes, n = [], 1
        while n < 2 * self.max_batch_size * w_max:
            sizes.append(n)
            n *= 2
        try:
            # the front fill of accepted tokens' KV moves runs the cache-location kernel over the verify window
            # (bs x width), specialised on the width: every width of the config, every batch size's power of two
            windows = sorted(set(self.config.widths) | {1, w_max})
            # with draft_max_batch, larger batches only decode: one token per request
            verify_bs = self.max_batch_size if self.config.draft_max_batch is None else min(
                self.max_batch_size, self.config.draft_max_batch)
            for bs in (s for s in sizes if s < 2 * max(1, self.max_batch_size)):
                zeros = torch.zeros(bs, **long)
                for w in (windows if bs < 2 * max(1, verify_bs) else (1,)):
                    locs = assign_extend_cache_locs_func(
                        req_pool_indices=zeros, req_to_token=req_to_token, start_offset=zeros,
                        end_offset=zeros + w, batch_size=bs, draft_token_num=w, device=dev)
                    fill_front_out_cache_loc_func(torch.ones(bs, dtype=torch.int32, device=dev), locs,
                                                  torch.zeros(bs * w, **long))
                # Triton also specialises each pointer on 16-byte alignment: a batch's request indices or lengths
                # can be views that start 8 bytes into a buffer
                odd = torch.zeros(bs + 1, **long)[1:]
                for indices, starts in ((odd, zeros), (zeros, odd), (odd, odd)):
                    assign_extend_cache_locs_func(
                        req_pool_indices=indices, req_to_token=req_to_token, start_offset=starts,
                        end_offset=zeros + 1, batch_size=bs, draft_token_num=1, device=dev)
            for size in (s for s in sizes if s < 2 * max(1, verify_bs) * w_max):  # accepted-token moves: specialised
                # on the window's power of two
                fill_accept_out_cache_loc_func(torch.full((size,), -1, dtype=torch.int32, device=dev),
                                               torch.zeros(size, **long), torch.zeros(size, **long), size)
            # KV moves of accepted tokens: specialised on the count's power of two and, as every integer
            # argument of a Triton kernel, on whether the count is a multiple of 16
            cap = int((getattr(kv, "_kv_copy_config", None) or {}).get("num_locs_upper", 256))
            for size in (s for s in sizes if s <= cap):
                for count in (size, size - 1) if size >= 16 else (size,):
                    kv.move_kv_cache(torch.zeros(count, **long), torch.zeros(count, **long))
            bs = 2
            seq = torch.ones(bs, **long)
            widths = [x for x in self.config.widths if x > 1] or [min(2, w_max)]
            for w in widths:  # the tree-index kernel is specialised on the width
                mask = torch.ones((bs, w, w), dtype=torch.bool, device=dev).tril().reshape(-1)
                positions = torch.empty(bs * w, **long)
                r_index, r_next, r_sib = (torch.empty((bs, w), **long) for _ in range(3))
                reconstruct_indices_from_tree_mask_func(mask, seq, positions, r_index, r_next, r_sib, bs, w)
                full_verify_mask(mask.view(bs, w, w), seq, bs)
            verify_tree_greedy_func(
                predicts=torch.zeros(bs * w, dtype=torch.int32, device=dev),
                accept_index=torch.full((bs, w), -1, dtype=torch.int32, device=dev),
                accept_token_num=torch.zeros(bs, dtype=torch.int32, device=dev),
                candidates=torch.zeros((bs, w), **long), retrieve_index=r_index, retrieve_next_token=r_next,
                retrieve_next_sibling=r_sib, target_predict=torch.zeros((bs, w), **long), topk=-1)
            torch.get_device_module(dev).synchronize()
            logger.info("NGRAM_ADAPTIVE: step kernels built in %.1f s", time.perf_counter() - t0)
        except Exception:  # a missing warm-up costs a stall later, never a failed start
            logger.exception("NGRAM_ADAPTIVE: could not pre-build the step kernels; they build on first use")

    def _backends_need_cpu_seq_lens(self) -> bool:
        backends = [self.model_runner.attn_backend] + [state[0] for state in self._width_states.values()]
        if self._decode_state is not None:
            backends.append(self._decode_state[0])
        return any(getattr(b, "needs_cpu_seq_lens", True) for b in backends if b is not None)

    @property
    def spec_v2_attn_backends(self) -> tuple:
        return tuple(state[0] for state in self._width_states.values()) or (self.model_runner.attn_backend,)

    def _new_attention_backend(self):
        runner = self.model_runner
        saved = runner.init_new_workspace
        try:
            return runner._get_attention_backend(init_new_workspace=True)
        finally:
            runner.init_new_workspace = saved

    def _build_decode_state(self, graphs_enabled: bool) -> tuple:
        runner = self.model_runner
        saved_algorithm = runner.spec_algorithm
        runner.spec_algorithm = SpeculativeAlgorithm.NONE
        try:
            with get_spec().override(speculative_num_draft_tokens=1, speculative_num_steps=0):
                backend = self._new_attention_backend()
                graph_runner = None
                if graphs_enabled:
                    graph_runner = runner._decode_cuda_graph_runner_cls()(
                        runner, attn_backend=backend, speculative_num_steps=0, speculative_num_draft_tokens=1,
                    )
        finally:
            runner.spec_algorithm = saved_algorithm
        if graph_runner is not None and graph_runner.capture_forward_mode != ForwardMode.DECODE:
            raise RuntimeError(f"decode graph captured in {graph_runner.capture_forward_mode}, not DECODE")
        return backend, graph_runner

    def _activate(self, state: tuple, width: int) -> None:
        backend, graph_runner = state
        self.model_runner.attn_backend = backend
        self.model_runner.decode_cuda_graph_runner = graph_runner
        self.speculative_num_draft_tokens = width
