"""The forwards a decode step of `NgramAdaptiveWorker` launches, once the plan chose its width.

Width 1 (`_forward_plain`): DECODE forwards of each request's last committed token through the decode graph and
the normal sampler, back to back. Wider (`_prepare_verify`, `_forward_verify`): the plan's tokens and tree mask
go to the device, a `TARGET_VERIFY` forward at that width, SGLang's tree sampling and KV moves of the accepted
tokens. Prefill (`_forward_extend`) runs on the start-up backend. `_result` packs what SGLang receives, at the
largest width's output stride.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
from sglang.kernels.ops.speculative.reconstruct_tree import reconstruct_indices_from_tree_mask_func
from sglang.srt.layers.logprob_processor import compute_spec_logprobs
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.observability.req_time_stats import set_time_batch
from sglang.srt.runtime_context import get_exec, get_spec
from sglang.srt.speculative.eagle_utils import eagle_sample
from sglang.srt.speculative.ngram_info import NgramVerifyInput
from sglang.srt.speculative.spec_utils import (
    GrammarTree,
    build_grammar_vocab_mask,
    commit_mamba_states_after_verify,
    move_accept_tokens_to_target_kvcache,
    prepare_mamba_track_for_verify,
)
from sglang.srt.utils import is_cpu

from .relay import (
    full_verify_mask,
    next_draft_input,
    padded_rows,
    prefill_verify_mask,
    relayed_last_tokens,
    scored_rows,
    write_tree_masks,
)

_is_cpu = is_cpu()
logger = logging.getLogger(__name__)


@dataclass
class PrePlan:
    """A verify prepared before the wait (`WorkerForward._preplan_verify`): its width, the `ForwardBatch` the CUDA
    graph runner loaded, the verify input and step buffers it reads, the backend's verify-mask buffer, the batch
    fields it replaced (forward mode, input ids, KV slots, the relayed spec info), and the mask's tree cells."""
    width: int
    forward_batch: ForwardBatch
    verify_input: NgramVerifyInput
    buffers: tuple
    mask_buffer: torch.Tensor
    saved: tuple
    mask_index: torch.Tensor | None = None  # the tree cells of the mask buffer, its ones written (None: not yet)


@dataclass
class DevicePlan:
    """What `_finish_verify` reads of a plan, for a step drafted on the device (`device_drafts`): its width."""
    width: int


def _restore(batch: ScheduleBatch, saved: tuple) -> None:
    """The batch fields a prepared verify replaces, put back (forward mode, input ids, KV slots, spec info)."""
    batch.forward_mode, batch.input_ids, batch.out_cache_loc, batch.spec_info = saved


class WorkerForward:
    """`NgramAdaptiveWorker`'s forwards (a mixin placed before `NGRAMWorker`)."""

    def _last_tokens(self, batch: ScheduleBatch, rids: tuple) -> torch.Tensor | None:
        """Each request's last committed token on the device, without waiting: what the previous plain step
        sampled if the batch holds the same requests in the same order, else read from the overlap relay."""
        known = self._next_roots
        if known is not None and known[0] == rids:
            return known[1]
        return relayed_last_tokens(batch.spec_info, len(rids))

    def _plain_decode_fits(self, batch: ScheduleBatch) -> bool:
        """Batches the plain decode path serves like SGLang's own decode; others take a 1-token verify."""
        return self._plain_ok and self._simple_batch(batch)

    def _simple_batch(self, batch: ScheduleBatch) -> bool:
        """No grammar, logprobs, watermark or mamba state: a batch whose step needs nothing but its tokens."""
        return not (
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
        self._fwd_marks[0] = self._dmark()
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
                self._keep_topk(input_ids, batch_result.logits_output, None)
                tokens = batch_result.next_token_ids
                predicts.append(tokens)
        finally:
            self._forward_s = time.perf_counter() - t
            self._fwd_marks[1] = self._dmark()
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

    def _verify_buffers(self, bs: int, w: int) -> tuple:
        """The step buffers a verify of ``bs`` requests at width ``w`` reads: draft tokens, positions, the three
        retrieve arrays and the tree mask (views of the preallocated ones)."""
        n = bs * w
        return (self.draft_tokens[:n], self.positions[:n], self.retrieve_indexes[:n].view(bs, w),
                self.retrieve_next_token[:n].view(bs, w), self.retrieve_next_sibling[:n].view(bs, w),
                self.tree_mask[: n * w])

    def _fill_drafts(self, batch: ScheduleBatch, plan, buffers: tuple, seq_lens_sum: int, mask_out=None,
                     mask_index=None):
        """The plan's tokens and tree mask to the device, positions and retrieve arrays derived there, and the
        full verify mask (into ``mask_out``, an attention backend's buffer, if given; with ``mask_index``, its
        ones are there already and only the tree masks are written, `prefill_verify_mask`). Returns the mask."""
        bs, w = len(batch.reqs), plan.width
        draft_tokens, positions, retrieve_index, retrieve_next_token, retrieve_next_sibling, tree_mask = buffers
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
        if _is_cpu:
            return tree_mask
        if mask_index is not None:
            write_tree_masks(mask_out, mask_index, tree_mask)
            return mask_out
        # full mask [w, seq_len + w] per request, as NGRAMWorker (USE_FULL_MASK), built on device
        return full_verify_mask(tree_mask.view(bs, w, w), batch.seq_lens[:bs], seq_lens_sum, out=mask_out)

    def _verify_batch(self, batch: ScheduleBatch, w: int, buffers: tuple, custom_mask) -> NgramVerifyInput:
        """Turn ``batch`` into a TARGET_VERIFY batch at width ``w`` over ``buffers``: inputs, KV slots (the
        scheduler reserved them), the verify input it carries."""
        bs = len(batch.reqs)
        draft_tokens, positions, retrieve_index, retrieve_next_token, retrieve_next_sibling, _ = buffers
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
        return batch.spec_info

    def _prepare_verify(self, batch: ScheduleBatch, plan, seq_lens_sum: int) -> None:
        buffers = self._verify_buffers(len(batch.reqs), plan.width)
        custom_mask = self._fill_drafts(batch, plan, buffers, seq_lens_sum)
        self._verify_batch(batch, plan.width, buffers, custom_mask)

    def _preplan_verify(self, batch: ScheduleBatch, width: int) -> PrePlan | None:
        """Before the wait for the previous step's tokens: everything of a verify at ``width`` that does not depend
        on them. The batch becomes a TARGET_VERIFY batch (its KV slots, positions and lengths are on the device
        already), its `ForwardBatch` is built and the CUDA graph runner loads it (attention metadata, graph inputs),
        as SGLang's EAGLE worker pre-plans its verify. The drafts, tree mask and positions written after the wait
        (`_forward_verify` with the returned plan) reach the graph: input ids and positions are copied at replay,
        the mask is written straight into the attention backend's verify-mask buffer, which the graph reads.
        None (the batch untouched) where that does not hold: no CUDA graph at this width or batch size, a backend
        without a verify-mask buffer, or a batch the plain path would not serve. If it raises, the batch is as it
        was too."""
        state = self._width_states.get(width)
        if state is None or state[1] is None or not self._simple_batch(batch):
            return None
        backend, runner = state
        bs = len(batch.reqs)
        mask = getattr(backend, "_verify_mask", None)
        buf = getattr(mask, "buffer", None)
        if buf is None or buf.dim() != 1 or not mask.fits(bs):
            return None
        saved = (batch.forward_mode, batch.input_ids, batch.out_cache_loc, batch.spec_info)
        self._activate(state, width)
        buffers = self._verify_buffers(bs, width)
        try:
            with get_spec().override(speculative_num_draft_tokens=width):
                # the graph runner copies the batch's mask into the buffer while loading: here the buffer onto itself
                verify_input = self._verify_batch(batch, width, buffers, buf[: width * width])
                forward_batch = ForwardBatch.init_new(batch, self.model_runner, capture_hidden_mode=None,
                                                      return_hidden_states_before_norm=False)
                if not runner.can_run_graph(forward_batch):
                    _restore(batch, saved)
                    return None
                runner.load_batch(forward_batch)
                forward_batch.mark_forward_metadata_ready()
                # the mask's ones and the tree cells too: a bound on each request's KV length from the host's
                # tokens (the previous step committed at most max_width more than the scheduler has processed)
                bound = (sum(len(req.origin_input_ids) + len(req.output_ids) for req in batch.reqs)
                         + bs * self.max_width)
                mask_index = prefill_verify_mask(buf, batch.seq_lens[:bs], width, width * bound + width * width * bs)
        except Exception:
            _restore(batch, saved)
            raise
        return PrePlan(width, forward_batch, verify_input, buffers, buf, saved, mask_index)

    def _drop_preplan(self, batch: ScheduleBatch, pre: PrePlan) -> None:
        """Give the batch back as it was before `_preplan_verify` (the plan chose another way to run the step)."""
        _restore(batch, pre.saved)

    def _forward_verify(self, batch: ScheduleBatch, plan, seq_lens_host: list, on_publish, pp_proxy_tensors,
                        pre: PrePlan | None = None):
        """A verify at ``plan.width``. ``seq_lens_host``: each request's tokens in the KV cache, known on the host
        from the exact tokens this step waited for (lent to the batch for this forward if the relay left it
        without host lengths). ``pre``: the verify `_preplan_verify` prepared at this width before the wait; only
        the drafts, the mask and the positions are left to write, then the graph replays."""
        width = plan.width
        if pre is not None and pre.width != width:
            raise ValueError(f"a plan at width {width} cannot run on a verify prepared at width {pre.width}")
        t_in = time.perf_counter()
        if pre is not None:
            try:
                with get_spec().override(speculative_num_draft_tokens=width):
                    self._fill_drafts(batch, plan, pre.buffers, int(sum(seq_lens_host)), mask_out=pre.mask_buffer,
                                      mask_index=pre.mask_index)
                    verify_input: NgramVerifyInput = pre.verify_input
                    batch_result, t, t_fwd = self._replay_prepared(batch, pre, pp_proxy_tensors)
            except Exception:
                # an SGLang the prepared path does not fit: this step runs unprepared (a forward it may have run
                # wrote the same tokens' KV at the same slots, which the unprepared one writes again), and the
                # option is off from now
                logger.exception("NGRAM_ADAPTIVE: a verify prepared before the wait failed; preplan is off from now")
                self._preplan_failed = True
                self._drop_preplan(batch, pre)
            else:
                return self._finish_verify(batch, plan, verify_input, batch_result, on_publish, t_in, t, t_fwd)
        self._activate(self._width_states[width], width)
        saved = batch.seq_lens_cpu, batch.seq_lens_sum
        if batch.seq_lens_cpu is None:
            batch.seq_lens_cpu = torch.tensor(seq_lens_host, dtype=torch.int64)
            batch.seq_lens_sum = int(sum(seq_lens_host))
        elif batch.seq_lens_sum is None:
            batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
        with get_spec().override(speculative_num_draft_tokens=width):
            try:
                self._prepare_verify(batch, plan, batch.seq_lens_sum)
                set_time_batch(batch.reqs, "set_spec_draft_end_time", trace_only=True)
                verify_input = batch.spec_info
                t = time.perf_counter()
                self._fwd_marks[0] = self._dmark()
                batch_result = self.target_worker.forward_batch_generation(
                    batch, pp_proxy_tensors=pp_proxy_tensors, is_verify=True
                )
                t_fwd = time.perf_counter()
                self._fwd_marks[1] = self._dmark()
                self._forward_s = t_fwd - t
            finally:
                batch.seq_lens_cpu, batch.seq_lens_sum = saved
        return self._finish_verify(batch, plan, verify_input, batch_result, on_publish, t_in, t, t_fwd)

    def _replay_prepared(self, batch: ScheduleBatch, pre: PrePlan, pp_proxy_tensors):
        """The forward of a verify prepared before the wait (its drafts and mask written): the CUDA graph replays
        the loaded `ForwardBatch`. Returns (the result, host clock before and after the call)."""
        set_time_batch(batch.reqs, "set_spec_draft_end_time", trace_only=True)
        t = time.perf_counter()
        self._fwd_marks[0] = self._dmark()
        batch_result = self.target_worker.forward_batch_generation(
            None, forward_batch=pre.forward_batch, pp_proxy_tensors=pp_proxy_tensors, is_verify=True)
        t_fwd = time.perf_counter()
        self._fwd_marks[1] = self._dmark()
        self._forward_s = t_fwd - t
        return batch_result, t, t_fwd

    def _finish_verify(self, batch: ScheduleBatch, plan, verify_input, batch_result, on_publish, t_in, t, t_fwd):
        """After a verify forward: tree sampling, KV moves of the accepted tokens, the result SGLang receives."""
        bs, width = len(batch.reqs), plan.width
        with get_spec().override(speculative_num_draft_tokens=width):
            logits_output, can_run_cuda_graph = batch_result.logits_output, batch_result.can_run_cuda_graph
            # before sampling, which may scale the logits in place: the rows of the root and the real drafts
            self._keep_topk(verify_input.draft_token, logits_output, plan)
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

    def _history_append(self, batch: ScheduleBatch) -> None:
        """`device_drafts`: the relayed tokens of the step before (every step's, whatever path ran it) into the
        requests' rows of the device token table, at their positions (rows the relay repeats are written again
        with the same tokens)."""
        relay = batch.spec_info
        tokens = getattr(relay, "accept_tokens", None)
        lens = getattr(relay, "accept_lens", None)
        bs = len(batch.reqs)
        if tokens is None or lens is None or bs == 0 or lens.numel() != bs:
            return
        self._history.append(batch.req_pool_indices, batch.seq_lens[:bs], tokens, lens)

    def _forward_device_drafts(self, batch: ScheduleBatch, rids: tuple, on_publish, pp_proxy_tensors, t0: float):
        """`device_drafts`: a step right after a drafting step that does not wait for that step's tokens on the
        host. The verify is prepared at the last drafting width (`_preplan_verify`); each request's root (its last
        committed token) is read from the relay and its chain of drafts made by prompt lookup over its row of the
        device token table; the positions and retrieve arrays come from SGLang's kernel, the mask is a chain's.
        None (the batch as it was) where the verify cannot be prepared: the step then runs as without the option."""
        width, bs = self._last_width, len(batch.reqs)
        relay = batch.spec_info
        roots = relayed_last_tokens(relay, bs)
        if roots is None:
            return None
        pre = self._maybe_preplan(batch, width)
        if pre is None:
            return None
        if pre.mask_index is None:
            self._drop_preplan(batch, pre)
            return None
        t_in = time.perf_counter()
        m0 = self._dmark()
        try:
            with get_spec().override(speculative_num_draft_tokens=width):
                draft_tokens, positions, retrieve_index, retrieve_next_token, retrieve_next_sibling, tree_mask = (
                    pre.buffers)
                drafts, _ = self._history.propose(batch.req_pool_indices, batch.seq_lens[:bs], width - 1)
                rows = draft_tokens.view(bs, width)
                rows[:, 0].copy_(roots)
                rows[:, 1:].copy_(drafts)
                tree_mask.copy_(self._history.chain_mask(width).repeat(bs))
                reconstruct_indices_from_tree_mask_func(tree_mask, batch.seq_lens, positions, retrieve_index,
                                                        retrieve_next_token, retrieve_next_sibling, bs, width)
                write_tree_masks(pre.mask_buffer, pre.mask_index, tree_mask)
                batch_result, t, t_fwd = self._replay_prepared(batch, pre, pp_proxy_tensors)
        except Exception:
            # as a failing prepared verify: this step runs as without the option, and the option is off from now
            logger.exception("NGRAM_ADAPTIVE: a step drafted on the device failed; device drafts are off from now")
            self._history = None
            self._drop_preplan(batch, pre)
            return None
        plan = DevicePlan(width)
        result = self._finish_verify(batch, plan, pre.verify_input, batch_result, on_publish, t_in, t, t_fwd)
        self._next_roots = None
        self._drafted_last = True
        self._device_streak += 1
        self.planner.forget_outcomes(rids)  # the next plan sees two steps' tokens: no accept count from them
        self._backoff.planned(width)
        self._step_launched(width, bs, 1)
        if self._check_lens:
            self._events.append(("decode, device drafts", rids, width, 1))
        if self._profile is not None:
            self._profile.add_device(width, bs, (m0, *self._fwd_marks, self._dmark()))
            self._profile.add(width, bs, False, 0.0, t_in - t0, time.perf_counter() - t_in, self._forward_s,
                              result.can_run_cuda_graph, verify_parts=self._verify_parts)
        return result

    def _forward_extend(self, batch: ScheduleBatch, on_publish, pp_proxy_tensors):
        bs = len(batch.reqs)
        if self._history is not None:  # device drafts: the prompts into the requests' rows
            self._history.write_prompts(batch.req_pool_indices[:bs].tolist(),  # a Req's row is not an attribute of it
                                        [req.origin_input_ids_unpadded for req in batch.reqs])
        self._relayed_rids = {req.rid for req in batch.reqs}
        state = self._prefill_state or self._width_states.get(self.max_width)
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

    def _keep_topk(self, tokens: torch.Tensor, logits_output, plan) -> None:
        """Token recycling (`recycle`): the top-k tokens after each scored row of this forward and the row's token,
        copied to the host as the forward ends (`_flush_topk` hands them to the table). ``plan``: a verify's (its
        padding rows are left out at the flush); None: a decode forward, one row per request."""
        if not self.config.recycle or logits_output is None or logits_output.next_token_logits is None:
            return
        logits = logits_output.next_token_logits
        rows = None
        if plan is not None:
            # the top-k of every row, the padding's too: the root's and the real drafts' rows are picked on the host
            # at the flush. An index of them sent to the device here would be a copy from pageable memory, which
            # makes the host wait for everything queued on the stream, this verify's forward included
            n = plan.width * len(plan.drafted)
            logits, tokens = logits[:n], tokens[:n]
            rows = scored_rows(plan.width, plan.drafted)
        else:
            tokens = tokens[: logits.shape[0]]
        k = min(self.config.recycle_topk, logits.shape[-1])
        ids = torch.topk(logits, k, dim=-1).indices
        if logits.device.type != "cuda":
            self._topk_pending.append((tokens.clone(), ids, rows, None))
            return
        # copied to pinned host memory at once, stream-ordered (before anything rewrites the tokens' buffer): the
        # flush, after a wait for a later step, finds them there without a copy of its own
        host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host_ids = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
        host_tokens.copy_(tokens, non_blocking=True)
        host_ids.copy_(ids, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._topk_pending.append((host_tokens, host_ids, rows, done))

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
