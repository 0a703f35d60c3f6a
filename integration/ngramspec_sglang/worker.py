"""`NgramAdaptiveWorker`: SGLang's NGRAM worker with ngramspec drafts and a per-step verify width.

Needs a CUDA build of sglang (importing `sglang.srt.speculative.ngram_worker` loads `sgl_kernel`).

What it reuses from SGLang unchanged: `TARGET_VERIFY` through the target worker, `eagle_sample`
(greedy tree verification and sampling), the KV move of accepted tokens, mamba/grammar/logprob
handling, the overlap relay of `NgramVerifyInput`, and SGLang's own tree-mask kernel for positions
and retrieve arrays on device.

What it changes: drafts come from `ngramspec.NgramCache` via `DraftPlanner`; each step verifies at
the width the controller picked, using a target attention backend and a `TARGET_VERIFY` CUDA graph
runner captured for that width (built at start-up like `EAGLEWorkerV2.build_adaptive_runtime_state`,
swapped by assignment). Width 1 verifies the root only, i.e. a plain decode step (as EAGLE's
steps=0 state). Output rows (`accept_tokens`, the overlap `FutureMap`, `prev_token_ids`) keep the
stride of the largest width; `speculative_num_draft_tokens` on the result is the active width.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Optional

import numpy as np
import torch

from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
from sglang.kernels.ops.speculative.reconstruct_tree import reconstruct_indices_from_tree_mask_func
from sglang.srt.layers.logprob_processor import compute_spec_logprobs
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, check_cuda_graph_backend
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.observability.req_time_stats import set_time_batch
from sglang.srt.runtime_context import get_device, get_observability, get_parallel, get_schedule, get_spec
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.eagle_utils import eagle_sample
from sglang.srt.speculative.ngram_info import NgramVerifyInput
from sglang.srt.speculative.ngram_worker import NGRAMWorker
from sglang.srt.speculative.spec_utils import (
    GrammarTree,
    build_grammar_vocab_mask,
    commit_mamba_states_after_verify,
    move_accept_tokens_to_target_kvcache,
    prepare_mamba_track_for_verify,
    record_stream_for_v2_verify,
)
from sglang.srt.utils import is_cpu

from .config import resolve_config
from .drafting import DraftPlanner
from .relay import full_verify_mask, next_draft_input, padded_rows, request_views

logger = logging.getLogger(__name__)
_is_cpu = is_cpu()


class NgramAdaptiveWorker(NGRAMWorker):
    """Speculative worker for `--speculative-algorithm NGRAM_ADAPTIVE`."""

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        # NGRAMWorker.__init__ would build SGLang's C++ corpus; we set its fields ourselves.
        BaseSpecWorker.__init__(self)
        self.server_args = server_args
        self.enable_overlap = not get_schedule().disable_overlap_schedule
        self._target_worker = target_worker
        self.model_runner = target_worker.model_runner
        self.page_size = get_schedule().page_size
        self.device = get_device().device
        self.config = resolve_config(get_spec())
        self.max_width = self.config.max_width
        self.draft_token_num = self.max_width  # output stride (NGRAMWorker helpers read it)
        self.speculative_num_draft_tokens = self.max_width  # active width; SGLang's gauge reads it
        self.speculative_num_steps = get_spec().speculative_num_steps
        self.topk = get_spec().speculative_eagle_topk  # tree breadth bound, as NGRAM
        self.max_trie_depth = self.config.max_depth
        self.adaptive_controller = None
        self.grammar_tree_host: Optional[tuple] = None
        self._prev_decode_rids: set = set()
        self._tp_group = get_parallel().tp_group
        self._max_requests = 2 * max(1024, get_schedule().max_running_requests or 0)
        self.planner = self._new_planner()
        self.waiting_requests: int | None = None  # set by the Scheduler.run_batch hook (hooks.py)
        self._width_states: dict[int, tuple] = {}
        self._timings: deque = deque()
        self._gauges = None
        if get_observability().enable_metrics and self._tp_group.rank_in_group == 0:
            from .metrics import NgramspecGauges

            self._gauges = NgramspecGauges()
        logger.info("NGRAM_ADAPTIVE: widths %s, tree=%s, max_depth=%d, controller=%s",
                    self.config.widths, self.config.tree, self.config.max_depth,
                    type(self.planner.controller).__name__)

    def _new_planner(self) -> DraftPlanner:
        tp = self._tp_group
        return DraftPlanner(
            self.config,
            is_timing_rank=tp.rank_in_group == 0,
            broadcast=lambda obj: tp.broadcast_object(obj, src=0),
            max_requests=self._max_requests,
        )

    @property
    def interval_stats(self):
        return self.planner.stats

    def ngramspec_on_decode_log(self) -> None:
        """Called by the decode-report hook after SGLang logged: publish gauges, start a new interval."""
        if self._gauges is not None and self.planner.stats.verified_requests:
            self._gauges.publish(self.planner.stats.summary())
        self.planner.stats.reset()

    # ------------------------------------------------------------------------------ start-up
    def _init_preallocated_tensors(self):
        bs, w = self.max_batch_size, self.max_width
        long = dict(dtype=torch.int64, device=self.device)
        self.draft_tokens = torch.empty(bs * w, **long)
        self.positions = torch.empty(bs * w, **long)
        self.retrieve_indexes = torch.empty(bs * w, **long)
        self.retrieve_next_token = torch.empty(bs * w, **long)
        self.retrieve_next_sibling = torch.empty(bs * w, **long)
        self.tree_mask = torch.empty(bs * w * w, dtype=torch.bool, device=self.device)

    def init_cuda_graphs(self):
        """Capture one TARGET_VERIFY graph (and attention backend) per candidate width.

        The target worker already captured the largest width (SGLang's startup
        `speculative_num_draft_tokens`); the other widths are built here under a scoped override.
        """
        super().init_cuda_graphs()
        runner = self.model_runner
        self._width_states[self.max_width] = (runner.attn_backend, runner.decode_cuda_graph_runner)
        graphs_enabled = not check_cuda_graph_backend(Phase.DECODE, Backend.DISABLED)
        for width in self.config.widths[:-1]:
            steps = max(1, width // max(1, self.topk))  # as resolved for the largest width
            with get_spec().override(speculative_num_draft_tokens=width, speculative_num_steps=steps):
                saved = runner.init_new_workspace
                try:
                    backend = runner._get_attention_backend(init_new_workspace=True)
                finally:
                    runner.init_new_workspace = saved
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

    def _activate_width(self, width: int) -> None:
        backend, graph_runner = self._width_states[width]
        self.model_runner.attn_backend = backend
        self.model_runner.decode_cuda_graph_runner = graph_runner
        self.speculative_num_draft_tokens = width

    # -------------------------------------------------------------------- SGLang callbacks
    def clear_cache_pool(self):
        self.planner = self._new_planner()
        self._prev_decode_rids = set()

    def add_external_corpus(self, corpus_id, token_chunks):
        raise NotImplementedError("NGRAM_ADAPTIVE has no external corpus; use --speculative-algorithm NGRAM")

    def commit_corpus_load(self, corpus_id, loaded_token_count):
        raise NotImplementedError("NGRAM_ADAPTIVE has no external corpus")

    def remove_external_corpus(self, corpus_id):
        raise NotImplementedError("NGRAM_ADAPTIVE has no external corpus")

    def list_external_corpora(self):
        return {}

    def on_verify_complete_cpu(self, num_correct_drafts_per_req, batch_size: int = 0) -> None:
        # Acceptance is learnt from committed-length growth at the next draft (DraftPlanner._sync).
        return None

    # ------------------------------------------------------------------------------ stepping
    def _harvest_timings(self) -> None:
        while self._timings and self._timings[0][3].query():
            width, bs, start, end = self._timings.popleft()
            self.planner.record_duration(width, bs, start.elapsed_time(end) / 1000.0)

    def _prepare_verify(self, batch: ScheduleBatch, plan) -> None:
        bs, w = len(batch.reqs), plan.width
        draft_tokens = self.draft_tokens[: bs * w]
        positions = self.positions[: bs * w]
        retrieve_index = self.retrieve_indexes[: bs * w].view(bs, w)
        retrieve_next_token = self.retrieve_next_token[: bs * w].view(bs, w)
        retrieve_next_sibling = self.retrieve_next_sibling[: bs * w].view(bs, w)
        tree_mask = self.tree_mask[: bs * w * w]
        mask_host = np.ascontiguousarray(plan.mask, dtype=np.bool_).reshape(-1)
        tokens_host = np.ascontiguousarray(plan.tokens, dtype=np.int64).reshape(-1)
        tree_mask.copy_(torch.from_numpy(mask_host), non_blocking=True)
        draft_tokens.copy_(torch.from_numpy(tokens_host), non_blocking=True)
        self.grammar_tree_host = plan if batch.has_grammar else None
        # SGLang's own kernel derives positions and retrieve arrays from the mask on device
        # (tests check our host arrays equal what it derives).
        reconstruct_indices_from_tree_mask_func(
            tree_mask, batch.seq_lens, positions, retrieve_index, retrieve_next_token,
            retrieve_next_sibling, bs, w,
        )
        custom_mask = tree_mask
        if not _is_cpu:  # full mask [w, seq_len + w] per request, as NGRAMWorker (USE_FULL_MASK)
            custom_mask = full_verify_mask(tree_mask.view(bs, w, w), batch.seq_lens_cpu[:bs])
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        batch.input_ids = draft_tokens
        batch.out_cache_loc = assign_extend_cache_locs_func(
            req_pool_indices=batch.req_pool_indices,
            req_to_token=batch.req_to_token_pool.req_to_token,
            start_offset=batch.seq_lens,
            end_offset=batch.seq_lens + w,
            batch_size=bs,
            draft_token_num=w,
            device=self.device,
        )
        prepare_mamba_track_for_verify(batch)
        batch.spec_info = NgramVerifyInput(
            draft_token=draft_tokens,
            custom_mask=custom_mask,
            positions=positions,
            retrieve_index=retrieve_index,
            retrieve_next_token=retrieve_next_token,
            retrieve_next_sibling=retrieve_next_sibling,
            draft_token_num=w,
        )

    def forward_batch_generation(self, batch: ScheduleBatch, on_publish=None, pp_proxy_tensors=None):
        if not batch.forward_mode.is_decode():
            return self._forward_extend(batch, on_publish, pp_proxy_tensors)
        fwd_stream = torch.get_device_module(self.device).current_stream()
        record_stream_for_v2_verify(batch, None, fwd_stream)
        bs = len(batch.reqs)

        set_time_batch(batch.reqs, "set_spec_draft_start_time", trace_only=True)
        current_rids = {req.rid for req in batch.reqs}
        self.planner.release(self._prev_decode_rids - current_rids)
        self._prev_decode_rids = current_rids
        self._harvest_timings()
        use_prev_tokens = self.enable_overlap and not batch.grammar_needs_sync()
        # the scheduler's queue length, set by the run_batch hook (hooks.py); None if the hook did not run
        plan = self.planner.plan(request_views(batch, use_prev_tokens), waiting=self.waiting_requests)
        width = plan.width
        self._activate_width(width)
        with get_spec().override(speculative_num_draft_tokens=width):
            self._prepare_verify(batch, plan)
            set_time_batch(batch.reqs, "set_spec_draft_end_time", trace_only=True)
            timing = None
            if self.planner.is_timing_rank and not _is_cpu:
                device_module = torch.get_device_module(self.device)
                timing = (device_module.Event(enable_timing=True), device_module.Event(enable_timing=True))
                timing[0].record()
            verify_input: NgramVerifyInput = batch.spec_info
            batch_result = self.target_worker.forward_batch_generation(
                batch, pp_proxy_tensors=pp_proxy_tensors, is_verify=True
            )
            logits_output, can_run_cuda_graph = batch_result.logits_output, batch_result.can_run_cuda_graph
            grammar_mask = None
            if batch.has_grammar:
                host = self.grammar_tree_host
                grammar_mask = build_grammar_vocab_mask(
                    reqs=batch.reqs,
                    tree=GrammarTree.from_host(
                        torch.from_numpy(np.asarray(host.retrieve_next_token, dtype=np.int64)),
                        torch.from_numpy(np.asarray(host.retrieve_next_sibling, dtype=np.int64)),
                        torch.from_numpy(np.asarray(host.tokens, dtype=np.int64)).view(bs, -1),
                    ),
                    sampling_info=batch.sampling_info,
                    device=verify_input.retrieve_next_token.device,
                    barrier=None,
                )
            predict, accept_lens, accept_index = eagle_sample(
                verify_input, batch, logits_output, grammar_mask,
                watermark_state=self.model_runner.watermark_state,
            )
            if timing is not None:
                timing[1].record()
                self._timings.append((width, bs, timing[0], timing[1]))
            new_seq_lens = batch.seq_lens + accept_lens
            commit_mamba_states_after_verify(self.target_worker, batch, accept_lens, accept_index, width)
            accept_tokens = predict[accept_index]
            if self.model_runner.watermark_state is not None and batch.sampling_info.has_watermark_candidates:
                self.model_runner.watermark_state.append_speculative(batch.req_pool_indices, accept_tokens, accept_lens)
            accept_tokens = padded_rows(accept_tokens, self.max_width)  # SGLang's fixed output stride
            move_accept_tokens_to_target_kvcache(batch, accept_index, accept_lens - 1, self.token_to_kv_pool_allocator)
            if batch.return_logprob:
                compute_spec_logprobs(batch, logits_output, predict, accept_index=accept_index)
        if on_publish is not None:
            on_publish(new_seq_lens)
        batch.forward_mode = ForwardMode.DECODE
        return self._result(logits_output, accept_tokens, accept_lens, new_seq_lens, can_run_cuda_graph, width)

    def _forward_extend(self, batch: ScheduleBatch, on_publish, pp_proxy_tensors):
        bs = len(batch.reqs)
        batch_result = self.target_worker.forward_batch_generation(batch, pp_proxy_tensors=pp_proxy_tensors)
        predict = batch_result.next_token_ids
        new_seq_lens = batch.seq_lens.clone()
        accept_tokens = padded_rows(predict.to(torch.int32).view(bs, 1), self.max_width)
        accept_lens = torch.ones(bs, dtype=torch.int32, device=self.device)
        if on_publish is not None:
            on_publish(new_seq_lens)
        result = self._result(batch_result.logits_output, accept_tokens, accept_lens, new_seq_lens,
                              batch_result.can_run_cuda_graph, self.max_width)
        result.next_token_ids = predict
        return result

    def _result(self, logits_output, accept_tokens, accept_lens, new_seq_lens, can_run_cuda_graph, width):
        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=accept_tokens,
            can_run_cuda_graph=can_run_cuda_graph,
            accept_lens=accept_lens,
            new_seq_lens=new_seq_lens,
            next_draft_input=next_draft_input(accept_tokens, accept_lens, new_seq_lens, self.max_width),
            speculative_num_draft_tokens=width,
            speculative_output_stride=self.max_width,
        )
