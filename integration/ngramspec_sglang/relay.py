"""Step outputs in SGLang's fixed-stride NGRAM format, and the request views read back from them.

Imports only CPU-safe sglang modules (tested on CPU with SGLang's real `FutureMap` relay). SGLang sizes the
overlap relay buffer from the first payload it sees and reshapes every later one by `draft_token_num`, so
every step's accepted tokens are padded to the largest width, whatever width it verified at.
"""
from __future__ import annotations

import torch

from sglang.srt.speculative.ngram_info import NgramVerifyInput

from .drafting import RequestView


def padded_rows(accept_tokens: torch.Tensor, stride: int) -> torch.Tensor:
    """`[bs, width]` accepted tokens -> flat `[bs * stride]`, each row zero-padded to `stride`."""
    if accept_tokens.dim() != 2:
        raise ValueError(f"accept_tokens must be [bs, width], got shape {tuple(accept_tokens.shape)}")
    bs, width = accept_tokens.shape
    if width > stride:
        raise ValueError(f"width {width} exceeds the output stride {stride}")
    if width == stride:
        return accept_tokens.flatten()
    out = torch.zeros((bs, stride), dtype=accept_tokens.dtype, device=accept_tokens.device)
    out[:, :width] = accept_tokens
    return out.flatten()


def next_draft_input(accept_tokens_flat, accept_lens, new_seq_lens, stride: int) -> NgramVerifyInput:
    """What the next step (and the overlap relay) receives: strided at the largest width."""
    return NgramVerifyInput(
        draft_token_num=stride,
        new_seq_lens=new_seq_lens,
        accept_tokens=accept_tokens_flat,
        accept_lens=accept_lens,
    )


def request_views(batch, use_prev_tokens: bool) -> list[RequestView]:
    """One view per request of a decode batch; under overlap the relayed tokens are still pending."""
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
