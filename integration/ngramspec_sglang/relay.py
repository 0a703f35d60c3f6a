"""Per-step tensors in SGLang's NGRAM formats: the verify attention mask, the fixed-stride outputs, and
the request views read back from the relay.

Imports only CPU-safe sglang modules (tested on CPU with SGLang's real `FutureMap` relay). SGLang sizes the
overlap relay buffer from the first payload it sees and reshapes every later one by `draft_token_num`, so
every step's accepted tokens are padded to the largest width, whatever width it verified at.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit
from sglang.srt.speculative.ngram_info import NgramVerifyInput

from .drafting import RequestView


def full_verify_mask(tree_mask: torch.Tensor, seq_lens, seq_lens_sum: int | None = None) -> torch.Tensor:
    """NGRAM's flat verify mask: per request `[width, seq_len + width]` rows (all prefix tokens visible, then
    the tree mask), concatenated; what `NgramVerifyInput.generate_attn_arg_prefill` indexes. One scatter on
    the mask's device instead of NGRAMWorker's per-request concatenation.

    ``seq_lens`` may live on the mask's device (no host round trip: pass ``seq_lens_sum``, the host-known sum,
    to size the output without a sync) or on the host."""
    if tree_mask.dim() != 3 or tree_mask.shape[1] != tree_mask.shape[2]:
        raise ValueError(f"tree_mask must be [bs, width, width], got shape {tuple(tree_mask.shape)}")
    bs, width = tree_mask.shape[0], tree_mask.shape[1]
    device = tree_mask.device
    seq = torch.as_tensor(seq_lens).reshape(-1)
    if seq.numel() != bs:
        raise ValueError(f"{bs} trees but {seq.numel()} sequence lengths")
    if seq_lens_sum is None:
        seq_lens_sum = int(seq.sum())
    seq = seq.to(device=device, dtype=torch.int64, non_blocking=True)
    row_len = seq + width
    starts = torch.cumsum(row_len * width, 0) - row_len * width
    total = int(seq_lens_sum) * width + width * width * bs
    rows = torch.arange(width, dtype=torch.int64, device=device)
    index = (starts[:, None, None] + rows[None, :, None] * row_len[:, None, None] + seq[:, None, None]
             + rows[None, None, :])
    out = torch.ones(total, dtype=torch.bool, device=device)
    out[index.reshape(-1)] = tree_mask.to(torch.bool).reshape(-1)
    return out


@njit(cache=True)
def fill_verify_inputs(tokens, mask, depths, retrieve_index, retrieve_next_token, retrieve_next_sibling, seq_lens,
                       full, out_long, out_mask):
    """A verify step's device inputs, written on the host into two flat buffers for one copy each: ``out_long``
    (int64, at least 5 x bs x width) gets the draft tokens, positions (``seq_lens`` + depth), retrieve index, next
    token and next sibling, each bs x width, in that order; ``out_mask`` (bool) the attention mask, either
    `full_verify_mask`'s (``full``: per request `[width, seq_len + width]` rows) or the `[bs, width, width]` tree
    mask. The layout arrays are `layout_flat`'s (bs x width; mask bs x width x width), which equal what SGLang's
    tree-mask kernel derives on the device. Returns the mask's length."""
    bs, w = tokens.shape
    n = bs * w
    for b in range(bs):
        s = seq_lens[b]
        for j in range(w):
            k = b * w + j
            out_long[k] = tokens[b, j]
            out_long[n + k] = depths[b, j] + s
            out_long[2 * n + k] = retrieve_index[b, j]
            out_long[3 * n + k] = retrieve_next_token[b, j]
            out_long[4 * n + k] = retrieve_next_sibling[b, j]
    p = 0
    for b in range(bs):
        s = seq_lens[b] if full else 0
        for i in range(w):
            out_mask[p: p + s] = True
            p += s
            for j in range(w):
                out_mask[p + j] = mask[b, i, j]
            p += w
    return p


def host_verify_inputs(plan, seq_lens, full: bool, out_long: np.ndarray, out_mask: np.ndarray) -> int:
    """`fill_verify_inputs` for a `StepPlan` and the requests' sequence lengths (host ints): the arrays as the
    kernel takes them (no copies for a plan's own arrays). Returns the mask's length."""
    i64 = np.int64
    return fill_verify_inputs(np.ascontiguousarray(plan.tokens, i64), np.ascontiguousarray(plan.mask, np.bool_),
                              np.ascontiguousarray(plan.depths, i64), np.ascontiguousarray(plan.retrieve_index, i64),
                              np.ascontiguousarray(plan.retrieve_next_token, i64),
                              np.ascontiguousarray(plan.retrieve_next_sibling, i64),
                              np.asarray(seq_lens, i64), bool(full), out_long, out_mask)


def warm_up_verify_inputs() -> None:
    """Compile `fill_verify_inputs` (a worker calls this at start-up, not inside the first verify)."""
    tokens = np.zeros((1, 2), np.int64)
    mask = np.ones((1, 2, 2), np.bool_)
    fill_verify_inputs(tokens, mask, tokens, tokens, tokens, tokens, np.ones(1, np.int64), True,
                       np.empty(10, np.int64), np.empty(6, np.bool_))


def padded_rows(accept_tokens: torch.Tensor, stride: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`[bs, width]` accepted tokens -> flat `[bs * stride]`, each row zero-padded to `stride`; with ``dtype``
    (other than the tokens'), cast to it in the same pass: zeros, then one copy that casts."""
    if accept_tokens.dim() != 2:
        raise ValueError(f"accept_tokens must be [bs, width], got shape {tuple(accept_tokens.shape)}")
    bs, width = accept_tokens.shape
    if width > stride:
        raise ValueError(f"width {width} exceeds the output stride {stride}")
    if dtype is not None and dtype != accept_tokens.dtype:
        out = torch.zeros((bs, stride), dtype=dtype, device=accept_tokens.device)
        out[:, :width].copy_(accept_tokens)
        return out.view(-1)
    if width == stride:
        return accept_tokens.flatten()
    return torch.nn.functional.pad(accept_tokens, (0, stride - width)).flatten()  # one kernel


def next_draft_input(accept_tokens_flat, accept_lens, new_seq_lens, stride: int) -> NgramVerifyInput:
    """What the next step (and the overlap relay) receives: strided at the largest width."""
    return NgramVerifyInput(
        draft_token_num=stride,
        new_seq_lens=new_seq_lens,
        accept_tokens=accept_tokens_flat,
        accept_lens=accept_lens,
    )


def relayed_last_tokens(spec_info, batch_size: int) -> torch.Tensor | None:
    """Each request's last committed token, read on the device from the relayed accepted tokens (no host wait);
    None if the batch carries no relay."""
    tokens = getattr(spec_info, "accept_tokens", None)
    lens = getattr(spec_info, "accept_lens", None)
    if tokens is None or lens is None or batch_size == 0 or tokens.numel() % batch_size:
        return None
    stride = tokens.numel() // batch_size
    last = (lens.to(torch.int64) - 1).clamp_(min=0).view(batch_size, 1)
    return tokens.view(batch_size, stride).gather(1, last).view(batch_size).to(torch.int64)


def request_views(batch, use_prev_tokens: bool) -> list[RequestView]:
    """One view per request of a decode batch. Under overlap the previous step's tokens are still on the device:
    ``use_prev_tokens`` waits for them and adds them as pending; without it the views end one step behind."""
    bs = len(batch.reqs)
    pending = [()] * bs
    if use_prev_tokens:
        tokens = batch.spec_info.accept_tokens.cpu().tolist()
        lens = batch.spec_info.accept_lens.cpu().tolist()
        stride = len(tokens) // bs
        pending = [tokens[i * stride: i * stride + lens[i]] for i in range(bs)]
    return [
        RequestView(req.rid, req.origin_input_ids_unpadded, req.output_ids, pending[i])
        for i, req in enumerate(batch.reqs)
    ]
