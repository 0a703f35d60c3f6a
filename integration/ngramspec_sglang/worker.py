"""`NgramAdaptiveWorker`: SGLang's NGRAM worker with ngramspec drafts and a per-step verify width.

Needs a CUDA build of sglang (importing `sglang.srt.speculative.ngram_worker` loads `sgl_kernel`).

What it reuses from SGLang unchanged: `TARGET_VERIFY` through the target worker, `eagle_sample`
(greedy tree verification and sampling), the KV move of accepted tokens, mamba/grammar/logprob
handling, the overlap relay of `NgramVerifyInput`, and SGLang's own tree-mask kernel for positions
and retrieve arrays on device.

What it changes: drafts come from `ngramspec.NgramCache` via `DraftPlanner`; each step verifies at
the width the controller picked, using a target attention backend and a `TARGET_VERIFY` CUDA graph
runner captured for that width (built at start-up like `EAGLEWorkerV2.build_adaptive_runtime_state`,
swapped by assignment). Width 1 runs SGLang's plain decode path: a DECODE forward through a decode-mode
CUDA graph captured at start-up (as a server without speculation captures it) and the normal sampler, no
tree mask, no verify kernels. Output rows (`accept_tokens`, the overlap `FutureMap`, `prev_token_ids`) keep the
stride of the largest width; `speculative_num_draft_tokens` on the result is the active width.
"""
from __future__ import annotations

import json
import logging
import os
import time
import zlib
from typing import Optional

import numpy as np
import torch
from sglang.kernels.ops.speculative.cache_locs import (
    assign_extend_cache_locs_func,
    fill_front_out_cache_loc_func,
)
from sglang.kernels.ops.speculative.reconstruct_tree import reconstruct_indices_from_tree_mask_func
from sglang.srt.layers.logprob_processor import compute_spec_logprobs
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, check_cuda_graph_backend
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.observability.req_time_stats import set_time_batch
from sglang.srt.runtime_context import (
    get_device,
    get_exec,
    get_observability,
    get_parallel,
    get_schedule,
    get_spec,
)
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.eagle_utils import eagle_sample
from sglang.srt.speculative.ngram_info import NgramVerifyInput
from sglang.srt.speculative.ngram_worker import NGRAMWorker
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_utils import (
    GrammarTree,
    build_grammar_vocab_mask,
    commit_mamba_states_after_verify,
    move_accept_tokens_to_target_kvcache,
    prepare_mamba_track_for_verify,
    record_stream_for_v2_verify,
)
from sglang.srt.utils import is_cpu

from .backoff import PlanBackoff, plain_forwards
from .config import resolve_config
from .drafting import DraftPlanner
from .host_seq_lens import set_cpu_seq_lens_need
from .relay import full_verify_mask, next_draft_input, padded_rows, relayed_last_tokens, request_views
from .sched_profile import dump_periodically
from .state import StateKeeper
from .timing import StepTimer

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
        # the requests of the last forward (decode or prefill): only their tokens are still on the device when
        # the next decode step starts (the scheduler processed every earlier result): `request_views`
        self._relayed_rids: set = set()
        self._tp_group = get_parallel().tp_group
        self._max_requests = 2 * max(1024, get_schedule().max_running_requests or 0)
        self.planner = self._new_planner()
        # start warm from the controller's saved state (every rank loads it; rank 0 writes it)
        self._state = StateKeeper.from_config(self.config, self._tp_group.rank_in_group)
        if self._state is not None:
            self._state.attach(lambda: self.planner.controller)
        self.waiting_requests: int | None = None  # set by the Scheduler.run_batch hook (hooks.py)
        self._width_states: dict[int, tuple] = {}
        self._decode_state: tuple | None = None  # (attention backend, DECODE-mode graph runner) for width 1
        self._profile = _HostProfile.from_env(self._tp_group.rank_in_group)
        if self._profile is not None:
            self._profile.forwards_summary = lambda: (self.planner.forwards.summary()
                                                      if self.planner.forwards is not None else None)
        self._timer = StepTimer.for_device(
            self._record_duration, None if _is_cpu else torch.get_device_module(self.device),
            record_wait=self._record_wait if self.config.charge_waits_to_drafts else None,
            record_plain=self._record_plain,
        )
        self._drafted_last = False  # the last decode step drafted: the next one waits for its tokens
        self._backoff = PlanBackoff()  # plan less often while plans draft nothing
        self._next_roots: tuple | None = None  # (request ids, their last committed tokens on the device)
        self._forward_s = 0.0
        self._verify_parts = (0.0, 0.0, 0.0)  # the last verify's host seconds: prepare, sample, after (profile)
        self._draft_log = _DraftLog.from_env(self._tp_group.rank_in_group)
        set_cpu_seq_lens_need(self._backends_need_cpu_seq_lens)
        self._gauges = None
        if get_observability().enable_metrics and self._tp_group.rank_in_group == 0:
            from .metrics import NgramspecGauges

            self._gauges = NgramspecGauges()
        t0 = time.perf_counter()
        self.planner.warm_up()  # compile every numba kernel now, not inside the first request
        logger.info("NGRAM_ADAPTIVE: widths %s, tree=%s, max_depth=%d, controller=%s (kernels ready in %.1f s)",
                    self.config.widths, self.config.tree, self.config.max_depth,
                    type(self.planner.controller).__name__, time.perf_counter() - t0)

    def _new_planner(self) -> DraftPlanner:
        tp = self._tp_group
        return DraftPlanner(
            self.config,
            is_timing_rank=tp.rank_in_group == 0,
            broadcast=lambda obj: tp.broadcast_object(obj, src=0),
            max_requests=self._max_requests,
        )

    def _record_wait(self, batch_size: int, seconds: float) -> None:
        self.planner.record_wait(batch_size, seconds)

    def _record_plain(self, batch_size: int, forwards: int, seconds: float) -> None:
        self.planner.record_plain(batch_size, forwards, seconds)

    def _record_duration(self, width: int, batch_size: int, seconds: float) -> None:
        self.planner.record_duration(width, batch_size, seconds)
        if self._profile is not None:
            self._profile.add_duration(width, batch_size, seconds)

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
        # accept lengths of plain steps: row k-1 holds k for every request (never written to downstream)
        self._plain_lens = torch.arange(1, w + 1, dtype=torch.int32, device=self.device)[:, None].repeat(1, bs)
        self.draft_tokens = torch.empty(bs * w, **long)
        self.positions = torch.empty(bs * w, **long)
        self.retrieve_indexes = torch.empty(bs * w, **long)
        self.retrieve_next_token = torch.empty(bs * w, **long)
        self.retrieve_next_sibling = torch.empty(bs * w, **long)
        self.tree_mask = torch.empty(bs * w * w, dtype=torch.bool, device=self.device)
        self._plain_ok = not _is_cpu and not hasattr(self.req_to_token_pool, "mamba_pool")

    def init_cuda_graphs(self):
        """Capture one TARGET_VERIFY graph (and attention backend) per candidate width, and a DECODE graph.

        The target worker already captured the largest width (SGLang's startup
        `speculative_num_draft_tokens`); the other widths are built here under a scoped override. Width 1 gets
        what a server without speculation captures: an attention backend and a decode-mode graph runner (built
        while the model runner reports no speculative algorithm, which is what selects the DECODE capture).
        """
        super().init_cuda_graphs()
        runner = self.model_runner
        self._width_states[self.max_width] = (runner.attn_backend, runner.decode_cuda_graph_runner)
        graphs_enabled = not check_cuda_graph_backend(Phase.DECODE, Backend.DISABLED)
        for width in self.config.widths[:-1]:
            steps = max(1, width // max(1, self.topk))  # as resolved for the largest width
            with get_spec().override(speculative_num_draft_tokens=width, speculative_num_steps=steps):
                backend = self._new_attention_backend()
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
            for bs in (s for s in sizes if s < 2 * max(1, self.max_batch_size)):
                zeros = torch.zeros(bs, **long)
                for w in windows:
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
            for size in sizes:  # accepted-token moves are specialised on the window's power of two
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

    # -------------------------------------------------------------------- SGLang callbacks
    def clear_cache_pool(self):
        self.planner = self._new_planner()
        if self._state is not None:
            self._state.load(self.planner.controller)
        self._prev_decode_rids = set()
        self._relayed_rids = set()
        self._timer.interrupt()
        self._drafted_last = False
        self._backoff.reset()
        self._next_roots = None

    def add_external_corpus(self, corpus_id, token_chunks):
        raise NotImplementedError("NGRAM_ADAPTIVE has no external corpus; use --speculative-algorithm NGRAM")

    def commit_corpus_load(self, corpus_id, loaded_token_count):
        raise NotImplementedError("NGRAM_ADAPTIVE has no external corpus")

    def remove_external_corpus(self, corpus_id):
        raise NotImplementedError("NGRAM_ADAPTIVE has no external corpus")

    def list_external_corpora(self):
        return {}

    def on_verify_complete_cpu(self, num_correct_drafts_per_req, batch_size: int = 0) -> None:
        # Acceptance is learnt from committed-length growth at the next draft (DraftPlanner._collect).
        return None

    # ------------------------------------------------------------------------------ stepping
    def forward_batch_generation(self, batch: ScheduleBatch, on_publish=None, pp_proxy_tensors=None):
        """One decode step. Under the overlap schedule the previous step's tokens are still on the device when
        this runs. Waiting for them idles the GPU, so a step first plans on what the host already has (the
        requests' tokens up to the step before): if that plan drafts nothing, the step runs as a plain decode
        of the relayed last tokens, without waiting, exactly as SGLang's own decode overlaps. Only a step that
        drafts (or follows one: its accepted tokens are needed to draft on) waits, and plans on exact tokens.
        While plans keep drafting nothing, planning backs off (`PlanBackoff`): after n such plans in a row the next
        min(n, 3) steps run plain without planning (the cache catches up on their tokens at the next plan)."""
        if not batch.forward_mode.is_decode():
            self._timer.interrupt()
            return self._forward_extend(batch, on_publish, pp_proxy_tensors)
        t0 = time.perf_counter()
        if self._state is not None:
            self._state.maybe_save(self.planner.controller)  # rank 0, every state_save_minutes
        fwd_stream = torch.get_device_module(self.device).current_stream()
        record_stream_for_v2_verify(batch, None, fwd_stream)
        set_time_batch(batch.reqs, "set_spec_draft_start_time", trace_only=True)
        bs = len(batch.reqs)
        rids = tuple(req.rid for req in batch.reqs)
        current_rids = set(rids)
        self.planner.release(self._prev_decode_rids - current_rids)
        self._prev_decode_rids = current_rids
        relayed_rids, self._relayed_rids = self._relayed_rids, current_rids
        self._timer.harvest()
        relayed = self.enable_overlap and not batch.grammar_needs_sync()  # previous tokens still on the device
        plain_fits = self._decode_state is not None and self._plain_decode_fits(batch)
        lagging = relayed and plain_fits and not self._drafted_last
        waited = 0.0
        roots = None
        if lagging and (self.config.fixed_width == 1 or self._backoff.to_skip > 0):  # no planner, no host tokens
            roots = self._last_tokens(batch, rids)
            if roots is not None:
                self._backoff.skip_planning()
                t_plan = time.perf_counter()
                forwards = plain_forwards(self.planner.forwards_limit(bs), batch)
                result = self._forward_plain(batch, roots, on_publish, pp_proxy_tensors, rids, forwards)
                self.planner.plain_stepped(bs, forwards)
                self._timer.step_launched(1, bs, forwards)
                if self._profile is not None:
                    self._profile.add(1, bs, True, 0.0, t_plan - t0, time.perf_counter() - t_plan,
                                      self._forward_s, result.can_run_cuda_graph, forwards=forwards)
                return result
        t_pre = time.perf_counter()
        if relayed and not lagging and self.config.prefetch:
            # the views wait for the previous step's tokens: meanwhile warm the CPU caches for planning on them
            self.planner.prefetch(rids)
        t_views = time.perf_counter()
        views = request_views(batch, relayed and not lagging, relayed_rids)
        t_planner = time.perf_counter()
        # the scheduler's queue length, set by the run_batch hook (hooks.py); None if the hook did not run
        plan = self.planner.plan(views, waiting=self.waiting_requests, after_draft=self._drafted_last)
        t_planned = time.perf_counter()
        if lagging and plan.width == 1:
            roots = self._last_tokens(batch, rids)
        if lagging and roots is None:  # drafting looks worth it (or no relay): wait for exact tokens, plan again
            t1 = time.perf_counter()
            views = request_views(batch, True, relayed_rids)
            waited = time.perf_counter() - t1
            plan = self.planner.plan(views, waiting=self.waiting_requests, after_draft=self._drafted_last)
            lagging = False
        t_plan = time.perf_counter()
        forwards = 1
        if plan.width == 1 and plain_fits:
            if roots is None:
                roots = torch.from_numpy(np.ascontiguousarray(plan.tokens[:, 0], dtype=np.int64))
            # the step right after a drafting step stays one forward: it waited, and its period is that wait's
            if not self._drafted_last:
                forwards = plain_forwards(self.planner.forwards_limit(bs), batch)
                self.planner.plain_stepped(bs, forwards)
            result = self._forward_plain(batch, roots, on_publish, pp_proxy_tensors, rids, forwards)
        else:
            # the root is the last committed token, not yet in the KV cache
            seq_lens_host = [v.committed_len - 1 for v in views]
            result = self._forward_verify(batch, plan, seq_lens_host, on_publish, pp_proxy_tensors)
            self._next_roots = None
        self._drafted_last = plan.width > 1
        self._backoff.planned(plan.width)
        self._timer.step_launched(plan.width, bs, forwards)
        if self._profile is not None:
            self._profile.add(plan.width, bs, lagging, waited, t_plan - t0 - waited, time.perf_counter() - t_plan,
                              self._forward_s, result.can_run_cuda_graph, plan, self.planner.controller, forwards,
                              parts=(t_views - t_pre, t_planner - t_views, t_planned - t_planner),
                              verify_parts=self._verify_parts if plan.width > 1 else None)
        if self._draft_log is not None:
            self._draft_log.write(plan)
        return result

    def _last_tokens(self, batch: ScheduleBatch, rids: tuple) -> torch.Tensor | None:
        """Each request's last committed token on the device, without waiting: what the previous plain step
        sampled if the batch holds the same requests in the same order, else read from the overlap relay."""
        known = self._next_roots
        if known is not None and known[0] == rids:
            return known[1]
        return relayed_last_tokens(batch.spec_info, len(rids))

    def _plain_decode_fits(self, batch: ScheduleBatch) -> bool:
        """Batches the plain decode path serves like SGLang's own decode; others take a 1-token verify."""
        return self._plain_ok and not (
            batch.has_grammar
            or batch.return_logprob
            or (self.model_runner.watermark_state is not None and batch.sampling_info.has_watermark_candidates)
            or get_exec().mamba.enable_mamba_extra_buffer
        )

    def _forward_plain(self, batch: ScheduleBatch, roots: torch.Tensor, on_publish, pp_proxy_tensors, rids: tuple,
                       forwards: int = 1):
        """Width 1: ``forwards`` DECODE forwards back to back, each of the last token (the first of each request's
        last committed token, every later one of the token the forward before sampled, on the device) through the
        decode graph and the normal sampler. To SGLang the step is a verify that accepted ``forwards`` tokens per
        request (none of them a draft): it commits them, drops any past a request's stop, and its per-step host
        work (scheduling, relay, result processing) is paid once for all of them. KV slots for up to the largest
        width per request are reserved before every step, so ``forwards`` (at most that width) always fits.

        Under speculation the batch's `seq_lens` count the tokens already in the KV cache and the last committed
        token is not among them (a verify writes it first); a decode forward counts the token it writes. So forward
        i runs over `seq_lens + i + 1`, writing at slot `seq_lens + i`, and the batch gets its lengths back after."""
        bs = len(batch.reqs)
        self._activate(self._decode_state, 1)
        seq_lens, seq_lens_cpu, seq_lens_sum, orig_seq_lens = (
            batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum, batch.orig_seq_lens)
        cache_locs = assign_extend_cache_locs_func(
            req_pool_indices=batch.req_pool_indices,
            req_to_token=batch.req_to_token_pool.req_to_token,
            start_offset=seq_lens,
            end_offset=seq_lens + forwards,
            batch_size=bs,
            draft_token_num=forwards,
            device=self.device,
        )
        if forwards > 1:  # row i: every request's slot for forward i
            cache_locs = cache_locs.view(bs, forwards).t().contiguous()
        batch.forward_mode = ForwardMode.DECODE
        batch.spec_info = None
        input_ids = self.draft_tokens[:bs]
        tokens, predicts = roots, []
        set_time_batch(batch.reqs, "set_spec_draft_end_time", trace_only=True)
        t = time.perf_counter()
        try:
            for i in range(forwards):
                input_ids.copy_(tokens, non_blocking=True)  # stream-ordered after the forward that sampled them
                batch.input_ids = input_ids
                batch.out_cache_loc = cache_locs[i] if forwards > 1 else cache_locs
                batch.seq_lens = seq_lens + (i + 1)
                if seq_lens_cpu is not None:
                    batch.seq_lens_cpu = seq_lens_cpu + (i + 1)
                if seq_lens_sum is not None:
                    batch.seq_lens_sum = seq_lens_sum + bs * (i + 1)
                if orig_seq_lens is not None:
                    batch.orig_seq_lens = orig_seq_lens + (i + 1)
                batch_result = self.target_worker.forward_batch_generation(batch, pp_proxy_tensors=pp_proxy_tensors)
                tokens = batch_result.next_token_ids
                predicts.append(tokens)
        finally:
            self._forward_s = time.perf_counter() - t
            new_seq_lens = batch.seq_lens
            batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum, batch.orig_seq_lens = (
                seq_lens, seq_lens_cpu, seq_lens_sum, orig_seq_lens)
        self._next_roots = (rids, tokens)
        rows = predicts[0].view(bs, 1) if forwards == 1 else torch.stack(predicts, dim=1)
        accept_tokens = padded_rows(rows, self.max_width, torch.int32)
        accept_lens = self._plain_lens[forwards - 1, :bs]
        if on_publish is not None:
            on_publish(new_seq_lens)
        batch.forward_mode = ForwardMode.DECODE
        result = self._result(batch_result.logits_output, accept_tokens, accept_lens, new_seq_lens,
                              batch_result.can_run_cuda_graph, 1)
        result.num_non_draft_tokens_per_req = forwards  # SGLang's accept rate counts drafts only
        return result

    def _prepare_verify(self, batch: ScheduleBatch, plan, seq_lens_sum: int) -> None:
        bs, w = len(batch.reqs), plan.width
        draft_tokens = self.draft_tokens[: bs * w]
        positions = self.positions[: bs * w]
        retrieve_index = self.retrieve_indexes[: bs * w].view(bs, w)
        retrieve_next_token = self.retrieve_next_token[: bs * w].view(bs, w)
        retrieve_next_sibling = self.retrieve_next_sibling[: bs * w].view(bs, w)
        tree_mask = self.tree_mask[: bs * w * w]
        mask_host = np.ascontiguousarray(plan.mask, dtype=np.bool_).reshape(-1)
        if not mask_host.flags.writeable:  # a width-1 plan's shared mask: torch wants arrays it may write
            mask_host = mask_host.copy()
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
        if not _is_cpu:  # full mask [w, seq_len + w] per request, as NGRAMWorker (USE_FULL_MASK), built on device
            custom_mask = full_verify_mask(tree_mask.view(bs, w, w), batch.seq_lens[:bs], seq_lens_sum)
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

    def _forward_verify(self, batch: ScheduleBatch, plan, seq_lens_host: list, on_publish, pp_proxy_tensors):
        """A verify at ``plan.width``. ``seq_lens_host``: each request's tokens in the KV cache, known on the host
        from the exact tokens this step waited for (lent to the batch for this forward if the relay left it
        without host lengths)."""
        bs, width = len(batch.reqs), plan.width
        self._activate(self._width_states[width], width)
        saved = batch.seq_lens_cpu, batch.seq_lens_sum
        if batch.seq_lens_cpu is None:
            batch.seq_lens_cpu = torch.tensor(seq_lens_host, dtype=torch.int64)
            batch.seq_lens_sum = int(sum(seq_lens_host))
        elif batch.seq_lens_sum is None:
            batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
        t_in = time.perf_counter()
        with get_spec().override(speculative_num_draft_tokens=width):
            try:
                self._prepare_verify(batch, plan, batch.seq_lens_sum)
                set_time_batch(batch.reqs, "set_spec_draft_end_time", trace_only=True)
                verify_input: NgramVerifyInput = batch.spec_info
                t = time.perf_counter()
                batch_result = self.target_worker.forward_batch_generation(
                    batch, pp_proxy_tensors=pp_proxy_tensors, is_verify=True
                )
                t_fwd = time.perf_counter()
                self._forward_s = t_fwd - t
            finally:
                batch.seq_lens_cpu, batch.seq_lens_sum = saved
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
            t_sampled = time.perf_counter()
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
        result = self._result(logits_output, accept_tokens, accept_lens, new_seq_lens, can_run_cuda_graph, width)
        # host seconds before the forward (mask, indices, cache locations), around the sampling, and after it
        # (accepted tokens, KV moves, the result), for the profile
        self._verify_parts = (t - t_in, t_sampled - t_fwd, time.perf_counter() - t_sampled)
        return result

    def _forward_extend(self, batch: ScheduleBatch, on_publish, pp_proxy_tensors):
        bs = len(batch.reqs)
        self._relayed_rids = {req.rid for req in batch.reqs}
        state = self._width_states.get(self.max_width)
        if state is not None:  # prefill runs on the start-up backend (a decode step may have swapped it)
            self._activate(state, self.max_width)
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


class _HostProfile:
    """Host seconds per decode step by phase (NGRAMSPEC_PROFILE=FILE): waiting for the previous step's tokens,
    drafting and width choice, then launching the forward (mask, indices, model, sampling), per kind of step
    (plain without waiting, plain after waiting, verify), with the controller's reasons, expected tokens, measured
    step durations and cost estimates. Rank 0 rewrites FILE with the running sums four times a second while steps
    run (readers difference two snapshots); for diagnosis, off by default."""

    def __init__(self, path: str):
        self.path = path
        self.steps = 0
        self.rows: dict[str, list[float]] = {}
        self.reasons: dict[str, int] = {}  # why each planned step got its width
        self.expected = [0, 0.0, 0.0]  # planned requests, expected committed tokens (all, drafting steps only)
        self.durations: dict[str, list[float]] = {}  # "width/batch" -> [samples, seconds, min, max]
        self.controller = None
        self.batches: set = set()
        self.forwards_summary = None  # () -> the "auto" plain-forwards choice per batch size, or None
        dump_periodically(lambda: self.steps, self.dump, "ngramspec-profile")

    @classmethod
    def from_env(cls, rank: int):
        path = os.environ.get("NGRAMSPEC_PROFILE")
        return cls(path) if path and rank == 0 else None

    def add_duration(self, width: int, batch_size: int, seconds: float) -> None:
        row = self.durations.setdefault(f"{width}/{batch_size}", [0, 0.0, float("inf"), 0.0])
        row[0] += 1
        row[1] += seconds
        row[2] = min(row[2], seconds)
        row[3] = max(row[3], seconds)

    def add(self, width: int, batch_size: int, lagging: bool, wait_s: float, plan_s: float, launch_s: float,
            forward_s: float, graph: bool, plan=None, controller=None, forwards: int = 1, parts=None,
            verify_parts=None) -> None:
        """One step; ``parts``: seconds of plan_s spent in (prefetch, the request views: waiting for the previous
        step's tokens when the step needs them, the first planner call); ``verify_parts``: of a verify's launch_s,
        the seconds before its forward call (mask, indices, cache locations), in its sampling and after it
        (accepted tokens, KV moves, the result)."""
        key = ("plain-overlapped" if lagging else "plain") if width == 1 else "verify"
        if plan is not None:
            self.reasons[plan.reason] = self.reasons.get(plan.reason, 0) + 1
            self.expected[0] += batch_size
            self.expected[1] += float(plan.expected_tokens)
            if width > 1:
                self.expected[2] += float(plan.expected_tokens)
            self.controller = controller
            self.batches.add(batch_size)
        row = self.rows.setdefault(key, [0, 0, 0.0, 0.0, 0.0, 0, 0.0, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
        if parts is not None:
            row[9] += parts[0]
            row[10] += parts[1]
            row[11] += parts[2]
        if verify_parts is not None:
            row[12] += verify_parts[0]
            row[13] += verify_parts[1]
            row[14] += verify_parts[2]
        row[6] += forward_s
        row[7] += bool(graph)
        row[8] += forwards
        row[0] += 1
        row[1] += batch_size
        row[2] += wait_s
        row[3] += plan_s
        row[4] += launch_s
        row[5] += width
        self.steps += 1

    def dump(self) -> None:
        out = {k: {"steps": r[0], "requests": r[1], "width": r[5], "wait_s": r[2], "plan_s": r[3], "launch_s": r[4],
                   "forward_s": r[6], "graph_steps": r[7], "forwards": r[8], "prefetch_s": r[9], "views_s": r[10],
                   "planner_s": r[11], "verify_prepare_s": r[12], "verify_sample_s": r[13], "verify_after_s": r[14]}
               for k, r in self.rows.items()}
        costs = {}
        estimates = getattr(getattr(self.controller, "costs", None), "row", None)
        if estimates is not None:
            widths = self.controller.costs.widths
            for b in sorted(self.batches)[:8]:
                row = estimates(b)
                costs[str(b)] = {str(w): [round(float(c), 4), bool(m)] for w, c, m in zip(widths, row[0], row[1])}
        out["_diag"] = {"reasons": self.reasons, "planned_requests": self.expected[0],
                        "expected_tokens": self.expected[1], "expected_tokens_drafting": self.expected[2],
                        "durations": self.durations, "cost_estimates_ms": costs,
                        "plain_forwards": self.forwards_summary() if self.forwards_summary is not None else None}
        with open(self.path, "w") as f:
            json.dump(out, f, indent=1)


class _DraftLog:
    """One line per decode step: width and a CRC32 of the verified tokens and tree mask
    (NGRAMSPEC_DRAFT_LOG=PREFIX writes PREFIX.rank<N> on every TP rank; identical files show the ranks drafted
    identical trees). For checks, off by default."""

    def __init__(self, path: str):
        self.file = open(path, "w", buffering=1)

    @classmethod
    def from_env(cls, rank: int):
        prefix = os.environ.get("NGRAMSPEC_DRAFT_LOG")
        return cls(f"{prefix}.rank{rank}") if prefix else None

    def write(self, plan) -> None:
        tokens = np.ascontiguousarray(plan.tokens, dtype=np.int64)
        mask = np.ascontiguousarray(plan.mask, dtype=np.bool_)
        crc = zlib.crc32(mask.tobytes(), zlib.crc32(tokens.tobytes()))
        self.file.write(f"{plan.width} {tokens.shape[0]} {crc:08x}\n")
