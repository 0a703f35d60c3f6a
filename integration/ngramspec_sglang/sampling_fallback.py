"""Sampled tree verification without flashinfer: torch stand-ins for the three flashinfer-backed ops that
`eagle_sample` uses.

SGLang 0.5.23's `sglang.srt.speculative.eagle_utils.eagle_sample` takes its sampling branch (any request with
temperature > 0, speculative rejection sampling off) through three names bound in `eagle_utils`' module globals:

- `top_k_renorm_prob` / `top_p_renorm_prob` (from `sglang.kernels.ops.sampling.renorm`): on CUDA a `LazyImport` of
  `flashinfer.sampling`, so ModuleNotFoundError when flashinfer is not installed;
- `tree_speculative_sampling_target_only` (`sglang.kernels.ops.speculative.sampling`): a JIT CUDA kernel built from
  `jit/include/sgl_kernel/speculative/sampling.cuh`, which includes flashinfer's headers ("Cannot find flashinfer").

Greedy verification (`verify_tree_greedy_func`) needs none of them. `install_if_needed` rebinds those three globals to
the functions here when `flashinfer` cannot be found, and does nothing otherwise. `eagle_sample` reads all three at
call time (`sampling_fn = tree_speculative_sampling_target_only` is inside the function), so rebinding the module
globals is enough; other modules that imported the names themselves (e.g. `dflash_utils`) are not touched.

The kernel, per request row (thresholds default 1.0):
- start at the root (draft node 0) with `coin = uniform_samples[b, 0]` and `prob_acc = 0`; for depth
  j = 1 .. num_speculative_tokens - 1 go to the node's first child and try the children in sibling order: with
  `q = target_probs[b, node_row, token(child)]`, `prob_acc += q`; accept the child when `q > 0` and
  (`coin < prob_acc / threshold_acc` or `q >= threshold_single`). Accepting writes the child's token into
  `predicts[retrive_index of the node]`, appends the child's retrive index to `accept_index`, resets `prob_acc`,
  moves `node_row` to the child and draws the next coin from `uniform_samples[b, child]`. Rejecting sets
  `draft_probs[b, node_row, token] = q` (in place) and moves to the next sibling. No child accepted -> stop.
  With thresholds 1 and distinct sibling tokens, one coin against cumulative intervals accepts child i with
  probability exactly q(t_i).
- `accept_token_num[b]` = accepted drafts; the bonus token is sampled from relu(q - p) at the last accepted node,
  p = draft_probs row there (the rejected siblings' tokens now hold q, so they are zeroed; p is not used when the
  depth limit was reached), by inverse CDF with `u = uniform_samples_for_final_sampling[b] * sum(relu)`: the first
  token with relu > 0 whose inclusive cumulative sum exceeds u, else the last token with relu > 0, else vocab - 1.
  It is written to `predicts[retrive index of the last accepted node]`. Other entries of `predicts` are untouched.
So the emitted sequence (`predicts[accept_index[b, :accept_token_num[b] + 1]]`) is distributed exactly as
autoregressive sampling from the target (lossless speculative sampling with a deterministic draft).

Renormalisation: on CUDA SGLang's own Triton kernels (`sglang.kernels.ops.sampling.renorm_triton`, what SGLang uses
on ROCm; flashinfer's threshold semantics, ties at the pivot kept); the torch versions here elsewhere, or on CUDA if
that module cannot be imported or its first call fails. Same semantics in both.
"""
from __future__ import annotations

import importlib.util
import logging
from typing import Union

import torch

FALLBACK_MARK = "_ngramspec_sampling_fallback"  # set on the patched module; holds the original bindings
PATCHED_NAMES = ("top_k_renorm_prob", "top_p_renorm_prob", "tree_speculative_sampling_target_only")

_log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- tree speculative sampling


def tree_speculative_sampling_target_only_torch(
    predicts: torch.Tensor,  # mutable, (bs * num_draft_tokens,) int32
    accept_index: torch.Tensor,  # mutable, (bs, num_speculative_tokens) int32
    accept_token_num: torch.Tensor,  # mutable, (bs,) int32
    candidates: torch.Tensor,  # (bs, num_draft_tokens) int64
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    uniform_samples: torch.Tensor,  # (bs, num_draft_tokens) float32
    uniform_samples_for_final_sampling: torch.Tensor,  # (bs,) float32
    target_probs: torch.Tensor,  # (bs, num_draft_tokens, vocab) float32
    draft_probs: torch.Tensor,  # (bs, num_draft_tokens, vocab) float32, mutable as in the kernel
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    deterministic: bool = True,  # accepted for signature compatibility; this version is always deterministic
) -> None:
    """Torch version of SGLang's `tree_speculative_sampling_target_only` (same arguments, outputs in place).

    Vectorised over the batch; one loop step per examined draft node (each row examines each node at most once, so
    num_draft_tokens - 1 steps), with no host synchronisation."""
    del deterministic
    bs, num_draft = candidates.shape
    num_spec = accept_index.shape[1]
    vocab = target_probs.shape[-1]
    if not (0.0 <= threshold_single <= 1.0 and 0.0 <= threshold_acc <= 1.0):
        raise ValueError(f"thresholds must lie in [0, 1], got {threshold_single}, {threshold_acc}")
    if bs == 0:
        return
    device = target_probs.device
    threshold_acc = max(float(threshold_acc), 1e-9)
    ar = torch.arange(bs, device=device)
    cands = candidates.long()
    r_index = retrive_index.long()
    r_next = retrive_next_token.long()
    r_sib = retrive_next_sibling.long()

    last_acc = r_index[:, 0].clone()  # flat index into predicts of the last accepted node
    accept_index[:, 0] = last_acc.to(accept_index.dtype)
    num_acc = torch.zeros(bs, dtype=torch.long, device=device)
    cur_row = torch.zeros(bs, dtype=torch.long, device=device)  # local index of the node whose probs are used
    coin = uniform_samples[:, 0].clone()
    prob_acc = torch.zeros(bs, dtype=target_probs.dtype, device=device)
    node = r_next[:, 0].clone() if num_spec > 1 else torch.full((bs,), -1, dtype=torch.long, device=device)

    for _ in range(num_draft - 1):
        active = node >= 0
        nc = node.clamp(min=0)
        tok = cands[ar, nc].clamp(0, vocab - 1)  # rows that are done read the root's entry: keep it in range
        q = target_probs[ar, cur_row, tok]
        prob_acc = torch.where(active, prob_acc + q, prob_acc)
        accept = active & (q > 0) & ((coin < prob_acc / threshold_acc) | (q >= threshold_single))
        reject = active & ~accept
        # rejection: the kernel stores q in draft_probs, so the final residual relu(q - p) drops that token
        draft_probs[ar, cur_row, tok] = torch.where(reject, q, draft_probs[ar, cur_row, tok])
        # acceptance (rows that do not accept write back what is there; every row's indices are its own)
        predicts[last_acc] = torch.where(accept, tok.to(predicts.dtype), predicts[last_acc])
        num_acc = num_acc + accept.long()
        draft_index = r_index[ar, nc]
        pos = num_acc.clamp(max=num_spec - 1)
        accept_index[ar, pos] = torch.where(accept, draft_index.to(accept_index.dtype), accept_index[ar, pos])
        last_acc = torch.where(accept, draft_index, last_acc)
        cur_row = torch.where(accept, nc, cur_row)
        coin = torch.where(accept, uniform_samples[ar, nc], coin)
        prob_acc = torch.where(accept, torch.zeros_like(prob_acc), prob_acc)
        child = torch.where(num_acc < num_spec - 1, r_next[ar, nc], torch.full_like(nc, -1))
        node = torch.where(accept, child, torch.where(reject, r_sib[ar, nc], node))

    accept_token_num.copy_(num_acc.to(accept_token_num.dtype))

    # bonus token from relu(q - p) at the last accepted node (no p once the depth limit is reached)
    q_row = target_probs[ar, cur_row]
    p_row = draft_probs[ar, cur_row] * (num_acc != num_spec - 1).unsqueeze(1).to(draft_probs.dtype)
    relu = (q_row - p_row).clamp_min(0)
    u = uniform_samples_for_final_sampling.to(relu.dtype) * relu.sum(-1)
    valid = relu > 0
    hit = (relu.cumsum(-1) > u.unsqueeze(1)) & valid
    first_hit = hit.to(torch.int8).argmax(-1)
    last_valid = (vocab - 1) - valid.flip(-1).to(torch.int8).argmax(-1)
    fallback = torch.where(valid.any(-1), last_valid, torch.full_like(last_valid, vocab - 1))
    sampled = torch.where(hit.any(-1), first_hit, fallback)
    predicts[last_acc] = sampled.to(predicts.dtype)


# --------------------------------------------------------------------------- top-k / top-p renormalisation


def _per_row(value, batch_size: int, device, dtype) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        rows = value.to(device=device, dtype=dtype).reshape(-1)
        if rows.numel() == 1:
            return rows.expand(batch_size)
        if rows.numel() != batch_size:
            raise ValueError(f"need one value per row or a scalar, got {rows.numel()} for {batch_size} rows")
        return rows
    return torch.full((batch_size,), value, device=device, dtype=dtype)


def _renorm_from_pivots(probs: torch.Tensor, pivots: torch.Tensor) -> torch.Tensor:
    kept = torch.where(probs >= pivots.unsqueeze(1), probs, torch.zeros_like(probs))
    return kept / kept.sum(-1, keepdim=True)


def top_k_renorm_prob_torch(probs: torch.Tensor, top_ks: Union[torch.Tensor, int]) -> torch.Tensor:
    """Keep each row's probabilities >= its k-th largest (ties at the pivot kept, as flashinfer) and renormalise."""
    probs = probs.float()
    batch_size, vocab = probs.shape
    if batch_size == 0 or vocab == 0:
        return probs
    ks = _per_row(top_ks, batch_size, probs.device, torch.int64)
    sorted_probs = torch.sort(probs, dim=-1, descending=True).values
    cutoff = (ks - 1).clamp(min=0, max=vocab - 1)
    return _renorm_from_pivots(probs, sorted_probs.gather(1, cutoff.unsqueeze(1)).squeeze(1))


def top_p_renorm_prob_torch(probs: torch.Tensor, top_ps: Union[torch.Tensor, float]) -> torch.Tensor:
    """Drop each row's smallest probabilities whose cumulative mass is below 1 - p (ties at the pivot kept, as
    flashinfer) and renormalise."""
    probs = probs.float()
    batch_size, vocab = probs.shape
    if batch_size == 0 or vocab == 0:
        return probs
    ps = _per_row(top_ps, batch_size, probs.device, torch.float32)
    sorted_probs = torch.sort(probs, dim=-1).values
    cdf = torch.cumsum(sorted_probs, dim=-1)
    cutoff = torch.searchsorted(cdf, (1.0 - ps).unsqueeze(1).contiguous(), right=False).squeeze(1)
    cutoff = cutoff.clamp(max=vocab - 1)
    return _renorm_from_pivots(probs, sorted_probs.gather(1, cutoff.unsqueeze(1)).squeeze(1))


_triton_renorms: list = []  # [] not tried yet; [None] unavailable; [(top_k_fn, top_p_fn)]


def _triton_renorm(which: int):
    if not _triton_renorms:
        try:
            from sglang.kernels.ops.sampling.renorm_triton import (
                top_k_renorm_probs_triton,
                top_p_renorm_probs_triton,
            )

            _triton_renorms.append((top_k_renorm_probs_triton, top_p_renorm_probs_triton))
        except Exception as exc:  # no triton, or a sglang without the module
            _log.warning("ngramspec sampling fallback: SGLang's Triton renorm kernels unavailable (%s); "
                         "using the torch versions", exc)
            _triton_renorms.append(None)
    return None if _triton_renorms[0] is None else _triton_renorms[0][which]


def _renorm(which: int, torch_fn, probs: torch.Tensor, value) -> torch.Tensor:
    fn = _triton_renorm(which) if probs.is_cuda else None
    if fn is not None:
        try:
            return fn(probs, value)
        except Exception as exc:  # e.g. a Triton compile failure: fall back for good
            _log.warning("ngramspec sampling fallback: SGLang's Triton renorm failed (%r); using the torch versions",
                         exc)
            _triton_renorms[0] = None
    return torch_fn(probs, value)


def top_k_renorm_prob(probs: torch.Tensor, top_ks) -> torch.Tensor:
    """`top_k_renorm_prob` without flashinfer: SGLang's Triton kernel on CUDA, torch elsewhere."""
    return _renorm(0, top_k_renorm_prob_torch, probs, top_ks)


def top_p_renorm_prob(probs: torch.Tensor, top_ps) -> torch.Tensor:
    """`top_p_renorm_prob` without flashinfer: SGLang's Triton kernel on CUDA, torch elsewhere."""
    return _renorm(1, top_p_renorm_prob_torch, probs, top_ps)


# --------------------------------------------------------------------------- installation


FALLBACKS = {
    "top_k_renorm_prob": top_k_renorm_prob,
    "top_p_renorm_prob": top_p_renorm_prob,
    "tree_speculative_sampling_target_only": tree_speculative_sampling_target_only_torch,
}


def install_if_needed(logger: logging.Logger | None = None, module=None) -> bool:
    """Rebind `eagle_utils`' sampling ops to the fallbacks here when flashinfer is not installed.

    Returns True when the fallbacks are (now or already) in place, False when flashinfer is found and nothing was
    changed. Idempotent: logs one INFO line on the call that installs them. `module` stands for
    `sglang.srt.speculative.eagle_utils` (tests pass a stand-in)."""
    if importlib.util.find_spec("flashinfer") is not None:
        return False
    if module is None:
        from sglang.srt.speculative import eagle_utils as module
    if getattr(module, FALLBACK_MARK, None) is not None:
        return True
    setattr(module, FALLBACK_MARK, {name: getattr(module, name, None) for name in PATCHED_NAMES})
    for name in PATCHED_NAMES:
        setattr(module, name, FALLBACKS[name])
    (logger or _log).info(
        "flashinfer is not installed: sampled speculative verification uses ngramspec's fallbacks "
        "(torch tree_speculative_sampling_target_only; top-k/top-p renorm via SGLang's Triton kernels on CUDA, "
        "torch elsewhere), patched into %s", module.__name__)
    return True
