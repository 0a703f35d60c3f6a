"""Split-KV attention for a verify step (`split_kv_verify`, "grouped" by default): chains and trees.

On the Triton backend SGLang runs a verify's attention through its prefill kernel (`extend_attention_fwd`). That
kernel gives each (request, head) one program, which walks the request's whole prefix alone: at batch 1 a model with
32 query heads runs 32 programs, a fraction of the GPU, and the walk grows with the context. A decode step's kernel
splits the prefix across many programs instead. This module does the same for a verify, after SGLang 0.5.23's
`verify_splitkv.py` (Apache-2.0; there enabled on AMD only, for EAGLE's pure chains):

* stage 1 splits each request's prefix over ``N_SPLITS`` programs per head; every draft token sees the whole prefix,
  so no mask is read there; each program writes its partial output and log-sum-exp (``grouped``: one program per KV
  head takes all the query heads that share it, so each KV block is read once per GQA group, not once per head);
* stage 2 merges the splits and adds the attention among the draft tokens, where the tree's mask applies: it reads
  the draft-by-draft cells of SGLang's verify mask (request b's row i starts at ``mask_indptr[b] + i * (prefix_b +
  L)``, its draft cells after the ``prefix_b`` prefix cells), or, without a mask, the causal chain.

`SplitKvVerify` is a drop-in for ``TritonAttnBackend.verify_splitkv_fwd`` (same arguments). It declines (returns
False, and SGLang runs its own kernel) whatever it is not built for: sliding windows, sinks, logit caps, MLA, ragged
verifies, a batch above the one its buffers were sized for. Its buffers are allocated once, so CUDA graphs capture it.
Sums run in another order than the prefill kernel's, so results match it to float rounding, not bit for bit.
"""
from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

MIN_BLOCK_KV = 32
BLOCK_N = 32
NUM_WARPS = 4
MIN_ROWS = 16  # the draft rows are padded to at least this (tl.dot's smallest tile)
SELF_CHECK_TOLERANCE = 0.02  # the start-up check's largest difference from SGLang's kernel (float16 outputs of ~1)

logger = logging.getLogger(__name__)


@triton.jit
def _draft_rows(qo_indptr, cur_batch, L_EXT: tl.constexpr):
    """Request ``cur_batch``'s draft rows: their offsets (padded to L_EXT), first row, count, and which are real."""
    offs_l = tl.arange(0, L_EXT)
    q_start = tl.load(qo_indptr + cur_batch)
    l_ext = tl.load(qo_indptr + cur_batch + 1) - q_start
    return offs_l, q_start, l_ext, offs_l < l_ext


@triton.jit
def _prefix_split(
    Q, K_Buffer, V_Buffer, sm_scale, k_scale, v_scale, kv_indptr, kv_indices, Att_Out, Att_Lse,
    stride_qbs, stride_qh, stride_buf_kbs, stride_buf_kh, stride_buf_vbs, stride_buf_vh,
    stride_ob, stride_oh, stride_os, stride_ol, stride_lb, stride_lh, stride_ls,
    cur_batch, cur_kv_head, split_id, q_start, heads, offs_l, mask_r,
    ROWS: tl.constexpr, N_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, V_HEAD_DIM: tl.constexpr,
    BLOCK_DMODEL: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, MIN_BLOCK_KV: tl.constexpr,
):
    """One split of one request's prefix against ``ROWS`` query rows that share KV head ``cur_kv_head``: row r is
    draft row ``offs_l[r]`` of query head ``heads[r]`` (``mask_r``: real rows). Writes each row's partial output and
    log-sum-exp; every draft token sees the whole prefix, so no mask is read."""
    offs_d = tl.arange(0, BLOCK_DMODEL)
    offs_dv = tl.arange(0, BLOCK_DV)
    kv_start = tl.load(kv_indptr + cur_batch)
    seq_len = tl.load(kv_indptr + cur_batch + 1) - kv_start
    per_split = tl.cdiv(tl.cdiv(seq_len, N_SPLITS), MIN_BLOCK_KV) * MIN_BLOCK_KV
    split_start = per_split * split_id
    split_end = tl.minimum(split_start + per_split, seq_len)
    offs_lse = cur_batch * stride_lb + heads * stride_lh + split_id * stride_ls + offs_l

    if split_end > split_start:
        offs_q = (q_start + offs_l)[:, None] * stride_qbs + heads[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(Q + offs_q, mask=mask_r[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
        q = q.to(K_Buffer.dtype.element_ty)
        e_max = tl.zeros([ROWS], dtype=tl.float32) - float("inf")
        e_sum = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, BLOCK_DV], dtype=tl.float32)
        for start_n in tl.range(split_start, split_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_mask = offs_n < split_end
            kv_loc = tl.load(kv_indices + kv_start + offs_n, mask=n_mask, other=0)
            k = tl.load(K_Buffer + kv_loc[None, :] * stride_buf_kbs + cur_kv_head * stride_buf_kh + offs_d[:, None],
                        mask=(offs_d[:, None] < HEAD_DIM) & n_mask[None, :], other=0.0)
            qk = tl.dot(q, k) * (sm_scale * k_scale)  # [ROWS, BLOCK_N]
            qk = tl.where(n_mask[None, :], qk, float("-inf"))
            v = tl.load(V_Buffer + kv_loc[:, None] * stride_buf_vbs + cur_kv_head * stride_buf_vh + offs_dv[None, :],
                        mask=n_mask[:, None] & (offs_dv[None, :] < V_HEAD_DIM), other=0.0)
            n_e_max = tl.maximum(tl.max(qk, 1), e_max)
            re_scale = tl.exp(e_max - n_e_max)
            p = tl.exp(qk - n_e_max[:, None])
            acc = acc * re_scale[:, None] + tl.dot(p.to(v.dtype), v)
            e_sum = e_sum * re_scale + tl.sum(p, 1)
            e_max = n_e_max
        acc *= v_scale
        offs_o = (cur_batch * stride_ob + heads[:, None] * stride_oh + split_id * stride_os
                  + offs_l[:, None] * stride_ol + offs_dv[None, :])
        tl.store(Att_Out + offs_o, acc / e_sum[:, None], mask=mask_r[:, None] & (offs_dv[None, :] < V_HEAD_DIM))
        tl.store(Att_Lse + offs_lse, e_max + tl.log(e_sum), mask=mask_r)
    else:  # an empty split: a sentinel the merge ignores
        tl.store(Att_Lse + offs_lse, tl.zeros([ROWS], tl.float32) - float("inf"), mask=mask_r)


@triton.jit
def _prefix_stage1(
    Q, K_Buffer, V_Buffer, sm_scale, k_scale, v_scale, qo_indptr, kv_indptr, kv_indices, Att_Out, Att_Lse,
    stride_qbs, stride_qh, stride_buf_kbs, stride_buf_kh, stride_buf_vbs, stride_buf_vh,
    stride_ob, stride_oh, stride_os, stride_ol, stride_lb, stride_lh, stride_ls,
    kv_group_num: tl.constexpr, N_SPLITS: tl.constexpr, L_EXT: tl.constexpr, HEAD_DIM: tl.constexpr,
    V_HEAD_DIM: tl.constexpr, BLOCK_DMODEL: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    MIN_BLOCK_KV: tl.constexpr,
):
    """One program per (request, query head, split): the head's draft rows against its split of the prefix."""
    cur_batch = tl.program_id(0)
    cur_head = tl.program_id(1)
    offs_l, q_start, l_ext, mask_l = _draft_rows(qo_indptr, cur_batch, L_EXT)
    _prefix_split(
        Q, K_Buffer, V_Buffer, sm_scale, k_scale, v_scale, kv_indptr, kv_indices, Att_Out, Att_Lse,
        stride_qbs, stride_qh, stride_buf_kbs, stride_buf_kh, stride_buf_vbs, stride_buf_vh,
        stride_ob, stride_oh, stride_os, stride_ol, stride_lb, stride_lh, stride_ls,
        cur_batch, cur_head // kv_group_num, tl.program_id(2), q_start, cur_head + offs_l * 0, offs_l, mask_l,
        L_EXT, N_SPLITS, HEAD_DIM, V_HEAD_DIM, BLOCK_DMODEL, BLOCK_DV, BLOCK_N, MIN_BLOCK_KV,
    )


@triton.jit
def _prefix_stage1_grouped(
    Q, K_Buffer, V_Buffer, sm_scale, k_scale, v_scale, qo_indptr, kv_indptr, kv_indices, Att_Out, Att_Lse,
    stride_qbs, stride_qh, stride_buf_kbs, stride_buf_kh, stride_buf_vbs, stride_buf_vh,
    stride_ob, stride_oh, stride_os, stride_ol, stride_lb, stride_lh, stride_ls,
    kv_group_num: tl.constexpr, GROUP_PAD: tl.constexpr, N_SPLITS: tl.constexpr, L_EXT: tl.constexpr,
    HEAD_DIM: tl.constexpr, V_HEAD_DIM: tl.constexpr, BLOCK_DMODEL: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, MIN_BLOCK_KV: tl.constexpr,
):
    """One program per (request, KV head, split) for all ``kv_group_num`` query heads that share the KV head (GQA):
    each KV block is read once for the group, as SGLang's grouped decode kernel does, and multiplied with the
    group's ``kv_group_num x L_EXT`` draft rows in one tile. Row r is head ``r // L_EXT`` of the group (padded to
    GROUP_PAD) and draft row ``r % L_EXT``; the outputs land where `_prefix_stage1` puts them."""
    cur_batch = tl.program_id(0)
    cur_kv_head = tl.program_id(1)
    offs_r = tl.arange(0, GROUP_PAD * L_EXT)
    head_in_group = offs_r // L_EXT
    offs_l = offs_r % L_EXT
    q_start = tl.load(qo_indptr + cur_batch)
    l_ext = tl.load(qo_indptr + cur_batch + 1) - q_start
    _prefix_split(
        Q, K_Buffer, V_Buffer, sm_scale, k_scale, v_scale, kv_indptr, kv_indices, Att_Out, Att_Lse,
        stride_qbs, stride_qh, stride_buf_kbs, stride_buf_kh, stride_buf_vbs, stride_buf_vh,
        stride_ob, stride_oh, stride_os, stride_ol, stride_lb, stride_lh, stride_ls,
        cur_batch, cur_kv_head, tl.program_id(2), q_start, cur_kv_head * kv_group_num + head_in_group, offs_l,
        (offs_l < l_ext) & (head_in_group < kv_group_num),
        GROUP_PAD * L_EXT, N_SPLITS, HEAD_DIM, V_HEAD_DIM, BLOCK_DMODEL, BLOCK_DV, BLOCK_N, MIN_BLOCK_KV,
    )


@triton.jit
def _merge_stage2(
    Att_Out, Att_Lse, Q, K_Extend, V_Extend, O_Out, Mask, mask_indptr, kv_indptr, sm_scale, qo_indptr,
    stride_ob, stride_oh, stride_os, stride_ol, stride_lb, stride_lh, stride_ls,
    stride_qbs, stride_qh, stride_kebs, stride_keh, stride_vebs, stride_veh, stride_oobs, stride_ooh,
    kv_group_num: tl.constexpr, N_SPLITS: tl.constexpr, L_EXT: tl.constexpr, HEAD_DIM: tl.constexpr,
    V_HEAD_DIM: tl.constexpr, BLOCK_DMODEL: tl.constexpr, BLOCK_DV: tl.constexpr, USE_MASK: tl.constexpr,
):
    cur_batch = tl.program_id(0)
    cur_head = tl.program_id(1)
    cur_kv_head = cur_head // kv_group_num
    offs_d = tl.arange(0, BLOCK_DMODEL)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_l, q_start, l_ext, mask_l = _draft_rows(qo_indptr, cur_batch, L_EXT)
    dv_ok = offs_dv < V_HEAD_DIM

    # (a) the prefix: merge the splits by their log-sum-exp, one split at a time (few registers at any head size)
    m_p = tl.zeros([L_EXT], dtype=tl.float32) - float("inf")
    denom_p = tl.zeros([L_EXT], dtype=tl.float32)
    o_prefix = tl.zeros([L_EXT, BLOCK_DV], dtype=tl.float32)
    for s in tl.static_range(N_SPLITS):
        lse_s = tl.load(Att_Lse + cur_batch * stride_lb + cur_head * stride_lh + s * stride_ls + offs_l,
                        mask=mask_l, other=float("-inf"))
        ran = lse_s > float("-inf")  # an empty split wrote no output: whatever is there stays out
        ao = tl.load(Att_Out + cur_batch * stride_ob + cur_head * stride_oh + s * stride_os
                     + offs_l[:, None] * stride_ol + offs_dv[None, :],
                     mask=(mask_l & ran)[:, None] & dv_ok[None, :], other=0.0)
        n_m = tl.maximum(m_p, lse_s)
        n_m_safe = tl.where(n_m == float("-inf"), 0.0, n_m)
        scale = tl.exp(m_p - n_m_safe)
        w = tl.where(ran, tl.exp(lse_s - n_m_safe), 0.0)
        o_prefix = o_prefix * scale[:, None] + ao * w[:, None]
        denom_p = denom_p * scale + w
        m_p = n_m
    o_prefix = o_prefix / tl.where(denom_p == 0.0, 1.0, denom_p)[:, None]
    lse_prefix = tl.where(m_p == float("-inf"), 0.0, m_p) + tl.log(denom_p)

    # (b) among the draft tokens: the tree's mask (or the causal chain)
    rows = (q_start + offs_l)[:, None]
    q = tl.load(Q + rows * stride_qbs + cur_head * stride_qh + offs_d[None, :],
                mask=mask_l[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    ke = tl.load(K_Extend + rows * stride_kebs + cur_kv_head * stride_keh + offs_d[None, :],
                 mask=mask_l[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    ve = tl.load(V_Extend + rows * stride_vebs + cur_kv_head * stride_veh + offs_dv[None, :],
                 mask=mask_l[:, None] & dv_ok[None, :], other=0.0)
    qk = tl.dot(q.to(ke.dtype), tl.trans(ke)) * sm_scale  # [L_EXT, L_EXT]
    valid = mask_l[:, None] & mask_l[None, :]
    if USE_MASK:
        kv_start = tl.load(kv_indptr + cur_batch)
        seq_len = tl.load(kv_indptr + cur_batch + 1) - kv_start
        base = tl.load(mask_indptr + cur_batch) + seq_len
        cells = tl.load(Mask + base + offs_l[:, None] * (seq_len + l_ext) + offs_l[None, :], mask=valid, other=0)
        allowed = valid & (cells != 0)
    else:
        allowed = valid & (offs_l[None, :] <= offs_l[:, None])
    qk = tl.where(allowed, qk, float("-inf"))
    m_d = tl.max(qk, 1)
    m_d = tl.where(m_d == float("-inf"), 0.0, m_d)  # a row that sees no draft (padding): no NaN
    pd = tl.exp(qk - m_d[:, None])
    denom_d = tl.sum(pd, 1)
    o_draft = tl.dot(pd.to(ve.dtype), ve) / tl.where(denom_d == 0.0, 1.0, denom_d)[:, None]
    lse_draft = m_d + tl.log(denom_d)

    # (c) the two parts by their log-sum-exp
    m = tl.maximum(lse_prefix, lse_draft)
    wp = tl.exp(lse_prefix - m)
    wd = tl.exp(lse_draft - m)
    o = (o_prefix * wp[:, None] + o_draft * wd[:, None]) / (wp + wd)[:, None]
    tl.store(O_Out + rows * stride_oobs + cur_head * stride_ooh + offs_dv[None, :], o.to(O_Out.dtype.element_ty),
             mask=mask_l[:, None] & dv_ok[None, :])


def n_splits_for(bs: int, h_q: int) -> int:
    """Prefix splits per (request, head): enough programs to fill the GPU at small batches, few at large ones (a
    static function of the batch's shape, so a captured graph keeps it)."""
    programs = bs * h_q
    return 16 if programs <= 64 else 8 if programs <= 256 else 4


def rows_padded(width: int) -> int:
    return max(MIN_ROWS, triton.next_power_of_2(max(1, int(width))))


class SplitKvVerify:
    """Buffers for up to ``max_bs`` requests of ``h_q`` query heads (value head size ``v_head_dim``) and verifies of
    up to ``max_width`` tokens, allocated once; call it as SGLang calls ``verify_splitkv_fwd``. ``grouped``: stage 1
    as `_prefix_stage1_grouped` (one program per KV head, reading each KV block once for its GQA group) instead of
    one program per query head."""

    def __init__(self, max_bs: int, h_q: int, v_head_dim: int, max_width: int, device, grouped: bool = False):
        self.max_bs, self.h_q, self.v_head_dim = int(max_bs), int(h_q), int(v_head_dim)
        self.grouped = bool(grouped)
        self.max_rows = rows_padded(max_width)
        # the largest bs * n_splits over the batch sizes served (n_splits shrinks as the batch grows)
        lanes = max(bs * n_splits_for(bs, self.h_q) for bs in range(1, self.max_bs + 1))
        self._out = torch.empty(lanes * self.h_q * self.max_rows * self.v_head_dim, dtype=torch.float32,
                                device=device)
        self._lse = torch.empty(lanes * self.h_q * self.max_rows, dtype=torch.float32, device=device)
        self.launches = 0  # calls it served from Python (eager steps and graph captures; replays do not call it)

    @property
    def nbytes(self) -> int:
        return (self._out.numel() + self._lse.numel()) * 4

    def can_handle(self, q, k, v, k_buffer, v_buffer, qo_indptr, is_causal, max_len_extend, sliding_window_size,
                   sinks, logit_cap, xai_temperature_len) -> bool:
        if sinks is not None or (sliding_window_size is not None and sliding_window_size > 0):
            return False
        if (logit_cap and logit_cap > 0) or (xai_temperature_len is not None and xai_temperature_len > 0):
            return False
        if not is_causal or q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            return False
        h_q, h_kv, d, dv = q.shape[1], k.shape[1], q.shape[2], v.shape[2]
        if h_q != self.h_q or dv != self.v_head_dim or h_kv == 0 or h_q % h_kv:
            return False
        if k.shape[2] != d or k_buffer.shape[1] != h_kv or v_buffer.shape[1] != h_kv or k_buffer.shape[2] != d \
                or v_buffer.shape[2] != dv or d != dv:  # MLA's shared latent layout is not served
            return False
        bs = qo_indptr.shape[0] - 1
        try:
            width = int(max_len_extend)
        except (TypeError, ValueError):
            return False
        return 1 <= bs <= self.max_bs and 1 <= width and rows_padded(width) <= self.max_rows \
            and q.shape[0] == bs * width

    def __call__(self, q, k, v, o, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, is_causal,
                 mask_indptr, max_len_extend, k_scale=1.0, v_scale=1.0, sm_scale=None, logit_cap=0.0,
                 skip_prefix_custom_mask=True, sliding_window_size=-1, sinks=None, window_kv_offsets=None,
                 xai_temperature_len=-1, max_bs=None) -> bool:
        if not self.can_handle(q, k, v, k_buffer, v_buffer, qo_indptr, is_causal, max_len_extend,
                               sliding_window_size, sinks, logit_cap, xai_temperature_len):
            return False
        self.launch(q, k, v, o, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr,
                    max_len_extend, k_scale, v_scale, sm_scale)
        self.launches += 1
        return True

    def launch(self, q, k, v, o, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr,
               max_len_extend, k_scale=1.0, v_scale=1.0, sm_scale=None) -> None:
        """The two kernels, on a verify `can_handle` accepted."""
        bs, h_q, d, dv = qo_indptr.shape[0] - 1, q.shape[1], q.shape[2], v.shape[2]
        kv_group = h_q // k.shape[1]
        rows = rows_padded(int(max_len_extend))
        splits = n_splits_for(bs, h_q)
        if sm_scale is None:
            sm_scale = 1.0 / (d ** 0.5)
        k_scale = _as_float(k_scale)
        v_scale = _as_float(v_scale)
        att_out = self._out[: bs * h_q * splits * rows * dv].view(bs, h_q, splits, rows, dv)
        att_lse = self._lse[: bs * h_q * splits * rows].view(bs, h_q, splits, rows)
        k, v = k.contiguous(), v.contiguous()
        block_d, block_dv = triton.next_power_of_2(d), triton.next_power_of_2(dv)
        stage1_args = (q, k_buffer, v_buffer, sm_scale, k_scale, v_scale, qo_indptr, kv_indptr, kv_indices, att_out,
                       att_lse, q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0),
                       v_buffer.stride(1), *att_out.stride()[:4], *att_lse.stride()[:3])
        if self.grouped:
            group_pad = triton.next_power_of_2(kv_group)
            _prefix_stage1_grouped[(bs, k.shape[1], splits)](
                *stage1_args, kv_group_num=kv_group, GROUP_PAD=group_pad, N_SPLITS=splits, L_EXT=rows, HEAD_DIM=d,
                V_HEAD_DIM=dv, BLOCK_DMODEL=block_d, BLOCK_DV=block_dv, BLOCK_N=BLOCK_N, MIN_BLOCK_KV=MIN_BLOCK_KV,
                num_warps=NUM_WARPS if group_pad * rows <= 64 else 2 * NUM_WARPS, num_stages=1,
            )
        else:
            _prefix_stage1[(bs, h_q, splits)](
                *stage1_args, kv_group_num=kv_group, N_SPLITS=splits, L_EXT=rows, HEAD_DIM=d, V_HEAD_DIM=dv,
                BLOCK_DMODEL=block_d, BLOCK_DV=block_dv, BLOCK_N=BLOCK_N, MIN_BLOCK_KV=MIN_BLOCK_KV,
                num_warps=NUM_WARPS, num_stages=1,
            )
        use_mask = custom_mask is not None
        mask, mask_ptr = (custom_mask, mask_indptr) if use_mask else (qo_indptr, qo_indptr)  # unread without a mask
        _merge_stage2[(bs, h_q)](
            att_out, att_lse, q, k, v, o, mask, mask_ptr, kv_indptr, sm_scale, qo_indptr,
            *att_out.stride()[:4], *att_lse.stride()[:3],
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1),
            kv_group_num=kv_group, N_SPLITS=splits, L_EXT=rows, HEAD_DIM=d, V_HEAD_DIM=dv, BLOCK_DMODEL=block_d,
            BLOCK_DV=block_dv, USE_MASK=use_mask, num_warps=NUM_WARPS, num_stages=1,
        )


def _as_float(x) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return 1.0


def has_hook(backend) -> bool:
    """Whether ``backend`` has SGLang's split-KV verify hook (its Triton attention backend does)."""
    return hasattr(backend, "use_verify_splitkv")


def install(backend, kernel: SplitKvVerify) -> bool:
    """Route ``backend``'s verify attention through ``kernel``, by SGLang's own hook for its split-KV verify
    (``use_verify_splitkv`` and ``verify_splitkv_fwd`` on the Triton backend; a case the kernel declines runs SGLang's
    kernel). False, and nothing changed, for a backend without that hook."""
    if not has_hook(backend):
        return False
    backend.use_verify_shared_kv = False
    backend.use_verify_splitkv = True
    backend.verify_splitkv_fwd = torch.compiler.disable(kernel)
    return True


def checked_kernel(setting, layer, max_bs: int, max_width: int, dtype, device, reference=None):
    """The kernel `split_kv_verify` ``setting`` (true, or "grouped") names, sized by an attention ``layer`` as the
    backend sees it (``tp_q_head_num``, ``tp_k_head_num``, ``qk_head_dim``, ``v_head_dim``), after `self_check` on
    this device; None (logged) if the check raises or differs by more than SELF_CHECK_TOLERANCE."""
    kernel = SplitKvVerify(max_bs, layer.tp_q_head_num, layer.v_head_dim, max_width, device,
                           grouped=setting == "grouped")
    try:  # the kernels on this GPU beside SGLang's prefill kernel, once, before any graph captures them
        diff = self_check(kernel, layer.tp_k_head_num, layer.qk_head_dim, dtype, device, reference=reference)
    except Exception:
        logger.exception("NGRAM_ADAPTIVE: split_kv_verify failed its start-up check; off")
        return None
    if not diff <= SELF_CHECK_TOLERANCE:
        logger.warning("NGRAM_ADAPTIVE: split_kv_verify differs from SGLang's kernel by %.3g at start-up; off", diff)
        return None
    logger.info("NGRAM_ADAPTIVE: split-KV verify attention on%s, up to %d requests (%.1f MB of buffers; start-up "
                "check: within %.2g of SGLang's kernel)", " (grouped)" if kernel.grouped else "", max_bs,
                kernel.nbytes / 2**20, diff)
    return kernel


def self_check(kernel: SplitKvVerify, h_kv: int, head_dim: int, dtype, device, reference=None,
               width: int = 8, prefix_lens: tuple = (45, 300)) -> float:
    """Run ``kernel`` once on a small random verify (two requests, a random tree each, paged prefixes) beside
    SGLang's prefill kernel (``reference``, default `extend_attention_fwd`) and return the largest absolute
    difference of their outputs. The worker runs it at start-up and turns the option off if it raises or differs."""
    if reference is None:
        from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd as reference
    gen = torch.Generator(device="cpu").manual_seed(0)
    bs, h_q, width = len(prefix_lens), kernel.h_q, min(width, kernel.max_rows)
    pool = sum(prefix_lens) + 8

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    k_buffer, v_buffer = rand(pool, h_kv, head_dim), rand(pool, h_kv, head_dim)
    q, k, v = rand(bs * width, h_q, head_dim), rand(bs * width, h_kv, head_dim), rand(bs * width, h_kv, head_dim)
    kv_indices = torch.randperm(pool, generator=gen)[: sum(prefix_lens)].to(device)
    lens = torch.tensor(prefix_lens)
    kv_indptr = torch.zeros(bs + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(lens, 0)
    qo_indptr = torch.arange(0, (bs + 1) * width, width, dtype=torch.int32)
    rows = []
    for n in prefix_lens:  # SGLang's verify mask: prefix cells visible, then a random tree among the drafts
        tree = torch.eye(width, dtype=torch.bool)
        for i in range(1, width):
            tree[i] |= tree[int(torch.randint(0, i, (1,), generator=gen))]
        full = torch.ones(width, n + width, dtype=torch.bool)
        full[:, n:] = tree
        rows.append(full.reshape(-1))
    mask = torch.cat(rows).to(device)
    mask_indptr = torch.zeros(bs + 1, dtype=torch.int64)
    mask_indptr[1:] = torch.cumsum(width * (lens + width), 0)
    qo_indptr, kv_indptr, mask_indptr = qo_indptr.to(device), kv_indptr.to(device), mask_indptr.to(device)
    if not kernel.can_handle(q, k, v, k_buffer, v_buffer, qo_indptr, True, width, -1, None, 0.0, -1):
        raise RuntimeError("the split-KV kernel declines its own check")
    ours, theirs = torch.empty_like(q), torch.empty_like(q)
    scale = 1.0 / head_dim ** 0.5
    kernel.launch(q, k, v, ours, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, mask, mask_indptr, width,
                  sm_scale=scale)
    reference(q, k, v, theirs, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, mask, True, mask_indptr, width,
              1.0, 1.0, scale)
    return float((ours.float() - theirs.float()).abs().max())
