"""Per-step tensors in SGLang's NGRAM formats: the verify attention mask, the fixed-stride outputs, and
the request views read back from the relay.

Imports only CPU-safe sglang modules (tested on CPU with SGLang's real `FutureMap` relay). SGLang sizes the
overlap relay buffer from the first payload it sees and reshapes every later one by `draft_token_num`, so
every step's accepted tokens are padded to the largest width, whatever width it verified at.
"""
from __future__ import annotations

import numpy as np
import torch
from sglang.srt.speculative.ngram_info import NgramVerifyInput

from .drafting import RequestView


def full_verify_mask(tree_mask: torch.Tensor, seq_lens, seq_lens_sum: int | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """NGRAM's flat verify mask: per request `[width, seq_len + width]` rows (all prefix tokens visible, then
    the tree mask), concatenated; what `NgramVerifyInput.generate_attn_arg_prefill` indexes. One scatter on
    the mask's device instead of NGRAMWorker's per-request concatenation.

    ``seq_lens`` may live on the mask's device (no host round trip: pass ``seq_lens_sum``, the host-known sum,
    to size the output without a sync) or on the host. ``out``: write the mask into the first cells of this flat
    tensor (bool or uint8; an attention backend's own mask buffer) and return that prefix."""
    if tree_mask.dim() != 3 or tree_mask.shape[1] != tree_mask.shape[2]:
        raise ValueError(f"tree_mask must be [bs, width, width], got shape {tuple(tree_mask.shape)}")
    bs, width = tree_mask.shape[0], tree_mask.shape[1]
    device = tree_mask.device
    seq = torch.as_tensor(seq_lens).reshape(-1)
    if seq.numel() != bs:
        raise ValueError(f"{bs} trees but {seq.numel()} sequence lengths")
    if seq_lens_sum is None:
        seq_lens_sum = int(seq.sum())
    total = int(seq_lens_sum) * width + width * width * bs
    index = verify_mask_index(seq.to(device=device, non_blocking=True), width)
    if out is None:
        out = torch.ones(total, dtype=torch.bool, device=device)
    else:
        if out.dim() != 1 or out.numel() < total:
            raise ValueError(f"out must be a flat tensor of at least {total} cells, got shape {tuple(out.shape)}")
        out = out[:total]
        out.fill_(1)
    out[index] = tree_mask.reshape(-1).to(out.dtype)
    return out


def verify_mask_index(seq_lens: torch.Tensor, width: int) -> torch.Tensor:
    """The cells of the tree part of `full_verify_mask`'s layout, flat, in the tree masks' order: cell (i, r, c)
    is request i's row r, column seq_len_i + c. Computed where ``seq_lens`` lives (no host round trip)."""
    seq = seq_lens.reshape(-1).to(torch.int64)
    row_len = seq + width
    starts = torch.cumsum(row_len * width, 0) - row_len * width
    rows = torch.arange(width, dtype=torch.int64, device=seq.device)
    index = (starts[:, None, None] + rows[None, :, None] * row_len[:, None, None] + seq[:, None, None]
             + rows[None, None, :])
    return index.reshape(-1)


def prefill_verify_mask(out: torch.Tensor, seq_lens: torch.Tensor, width: int, cells: int) -> torch.Tensor | None:
    """Before the drafts are known: ones over the first ``cells`` of ``out`` (a bound on the mask's size: every
    prefix column is visible) and the tree part's cells (`verify_mask_index`), to be written once the tree masks
    are known (`write_tree_masks`). None (nothing written) where ``out`` is smaller than ``cells``."""
    if out.dim() != 1 or out.numel() < cells:
        return None
    out[:cells].fill_(1)
    return verify_mask_index(seq_lens, width)


def write_tree_masks(out: torch.Tensor, index: torch.Tensor, tree_mask: torch.Tensor) -> None:
    """The tree masks ``[bs, width, width]`` into the cells `prefill_verify_mask` left for them."""
    out[index] = tree_mask.reshape(-1).to(out.dtype)


def scored_rows(width: int, drafted) -> "np.ndarray":
    """The rows of a verify's ``len(drafted) x width`` scores that hold a request's root or one of its real draft
    nodes (request i's rows ``i * width .. i * width + drafted[i]``), flat and in order: what token recycling keeps
    of a verify (the rest is padding)."""
    d = np.asarray(drafted, dtype=np.int64).reshape(-1)
    return np.flatnonzero(np.arange(width)[None, :] <= d[:, None])


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


def request_views(batch, use_prev_tokens: bool, relayed_rids=None, relay=None) -> list[RequestView]:
    """One view per request of a decode batch. Under overlap the previous step's tokens are still on the device:
    ``use_prev_tokens`` waits for them and adds them as pending; without it the views end one step behind.

    Only the previous forward's requests (``relayed_rids``, a set; None: every request) have tokens the scheduler
    has not processed yet. A request that joins them from another batch (the running requests when a prefill ran
    in between) already has its relayed tokens in its output: its row of the relay repeats them. ``relay``: the
    relayed `NgramVerifyInput` when the batch no longer carries it (a verify prepared before the wait replaced it)."""
    bs = len(batch.reqs)
    pending = [()] * bs
    if use_prev_tokens:
        relay = batch.spec_info if relay is None else relay
        tokens = relay.accept_tokens.cpu().tolist()
        lens = relay.accept_lens.cpu().tolist()
        stride = len(tokens) // bs
        pending = [tokens[i * stride: i * stride + lens[i]]
                   if relayed_rids is None or req.rid in relayed_rids else ()
                   for i, req in enumerate(batch.reqs)]
    return [
        RequestView(req.rid, req.origin_input_ids_unpadded, req.output_ids, pending[i])
        for i, req in enumerate(batch.reqs)
    ]
