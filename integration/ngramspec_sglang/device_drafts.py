"""Drafts made on the device (`device_drafts`): each request's committed tokens kept in a device table, and prompt
lookup over them, so a step right after a drafting step can draft without waiting for that step's tokens on the
host.

`DeviceHistory` holds one row per request slot (SGLang's `req_pool_idx`, the row of its token-to-KV table): the
prompt, written at prefill, then every step's accepted tokens, written from the overlap relay at the start of the
next step at their positions (a request's committed tokens number its KV length + 1, the root not being in the KV
cache yet), so a row the relay repeats is written again with the same tokens. `propose` drafts a chain per request:
the last n tokens (n from ``max_n`` down to ``min_n``) matched in the row's last ``window`` tokens, the latest match's
continuation. All of it is torch on the device: a fixed number of kernels per step, no host sync, the same on every
TP rank (the same tokens in the same order).

A draft is only a guess the verify checks: a row that misses tokens (a path that did not write them) drafts worse,
never wrongly.
"""
from __future__ import annotations

import numpy as np
import torch

WINDOW = 2048  # the tokens of a request searched for its last n-gram (the most recent ones)


class DeviceHistory:
    """Committed tokens per request slot on the device, and prompt-lookup drafts from them."""

    def __init__(self, rows: int, max_len: int, device, window: int = WINDOW, max_n: int = 3, min_n: int = 1):
        if rows < 1 or max_len < 2:
            raise ValueError(f"need rows >= 1 and max_len >= 2, got {rows}, {max_len}")
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_len = int(max_len)
        self.window = int(min(window, max_len))
        self.max_n, self.min_n = int(max_n), int(min_n)
        self.device = device
        # one spare column: writes that fall outside a row go there (never read)
        self.tokens = torch.zeros((rows, self.max_len + 1), dtype=torch.int32, device=device)
        self._ar = torch.arange(self.window, device=device)
        self._chain: dict[int, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return self.tokens.numel() * self.tokens.element_size()

    def write_prompts(self, rows: list[int], prompts: list) -> None:
        """Each prompt at the start of its row (prefill; one copy for all, from pinned memory)."""
        lens = [min(len(p), self.max_len) for p in prompts]
        n = sum(lens)
        if not n:
            return
        flat = np.empty(n, dtype=np.int32)
        r = np.empty(n, dtype=np.int64)
        c = np.empty(n, dtype=np.int64)
        at = 0
        for row, prompt, k in zip(rows, prompts, lens):
            flat[at:at + k] = np.asarray(prompt[:k], dtype=np.int64).astype(np.int32)
            r[at:at + k] = row
            c[at:at + k] = np.arange(k)
            at += k
        pin = self.tokens.is_cuda
        host = [torch.from_numpy(a) for a in (flat, r, c)]
        if pin:
            host = [t.pin_memory() for t in host]
        values, r_dev, c_dev = (t.to(self.device, non_blocking=True) for t in host)
        self.tokens[r_dev, c_dev] = values

    def append(self, rows: torch.Tensor, seq_lens: torch.Tensor, accept_tokens: torch.Tensor,
               accept_lens: torch.Tensor) -> None:
        """A step's accepted tokens (the relay's: ``accept_tokens`` flat at a fixed stride per request, the first
        ``accept_lens`` of each row) into each request's row, ending at its committed length (``seq_lens`` + 1)."""
        bs = rows.numel()
        if bs == 0 or accept_tokens.numel() % bs:
            return
        stride = accept_tokens.numel() // bs
        j = torch.arange(stride, device=rows.device)
        count = accept_lens.to(torch.int64).view(bs, 1)
        pos = (seq_lens.to(torch.int64).view(bs, 1) + 1 - count) + j.view(1, stride)
        ok = (j.view(1, stride) < count) & (pos >= 0) & (pos < self.max_len)
        pos = torch.where(ok, pos, torch.full_like(pos, self.max_len))  # the spare column
        r = rows.to(torch.int64).view(bs, 1).expand(bs, stride)
        self.tokens[r, pos] = accept_tokens.view(bs, stride).to(torch.int32)

    def propose(self, rows: torch.Tensor, seq_lens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per request, ``k`` draft tokens after its last committed token (int64, ``[bs, k]``), and whether a match
        was found (``[bs]``; rows without one hold their last token repeated: a guess like any other)."""
        bs, L = rows.numel(), self.window
        committed = seq_lens.to(torch.int64).view(bs, 1) + 1
        start = (committed - L).clamp(min=0)
        pos = start + self._ar.view(1, L)
        inside = pos < committed
        r = rows.to(torch.int64).view(bs, 1)
        win = self.tokens[r.expand(bs, L), pos.clamp(max=self.max_len - 1)].to(torch.int64)
        win = torch.where(inside, win, torch.full_like(win, -1))
        last = self.tokens[r.view(bs), (committed.view(bs) - 1).clamp(min=0)].to(torch.int64)
        best = torch.full((bs,), -1, dtype=torch.int64, device=rows.device)  # position after the match
        for n in range(self.max_n, self.min_n - 1, -1):
            if n >= L:
                continue
            key_pos = (committed - n) + torch.arange(n, device=rows.device).view(1, n)
            key = self.tokens[r.expand(bs, n), key_pos.clamp(min=0, max=self.max_len - 1)].to(torch.int64)
            hits = (win.unfold(1, n, 1) == key.view(bs, 1, n)).all(-1)  # [bs, L - n + 1]: match starting at s
            s = torch.arange(L - n + 1, device=rows.device).view(1, -1)
            after = start + s + n  # the first continuation token's position
            hits &= (after < committed) & (committed > n)  # not the key itself; at least one token follows
            latest = torch.where(hits, after, torch.full_like(after, -1)).amax(-1)
            best = torch.where(best < 0, latest, best)
        found = best >= 0
        cont = best.clamp(min=0).view(bs, 1) + torch.arange(k, device=rows.device).view(1, k)
        known = found.view(bs, 1) & (cont < committed)
        drafts = self.tokens[r.expand(bs, k), cont.clamp(max=self.max_len - 1)].to(torch.int64)
        drafts = torch.where(known, drafts, last.view(bs, 1).expand(bs, k))
        return drafts, found

    def warm_up(self, widths, max_bs: int) -> None:
        """Run every kernel of `append` and `propose` once per batch size's power of two up to ``max_bs`` and every
        draft length, and build the chain masks of ``widths``, before serving, so that no served step pays for
        loading them (the controller would read that as the cost of the step's width). Row 0 is used and zeroed
        again."""
        widths = sorted({int(w) for w in widths if int(w) > 1})
        bs = 1
        while True:
            rows = torch.zeros(bs, dtype=torch.int64, device=self.device)
            seq = torch.full((bs,), min(8, self.max_len - 2), dtype=torch.int64, device=self.device)
            for w in widths or [2]:
                tokens = torch.ones(bs * w, dtype=torch.int32, device=self.device)
                self.append(rows, seq, tokens, torch.full((bs,), w, dtype=torch.int32, device=self.device))
                self.propose(rows, seq, w - 1)
            if bs >= max_bs:
                break
            bs = min(2 * bs, max_bs)
        for w in widths:
            self.chain_mask(w)
        self.tokens[0].zero_()

    def chain_mask(self, width: int) -> torch.Tensor:
        """A chain's tree mask, ``[width, width]`` flat (bool): each node sees itself and the nodes before it."""
        mask = self._chain.get(width)
        if mask is None:
            mask = torch.ones((width, width), dtype=torch.bool, device=self.device).tril().reshape(-1)
            self._chain[width] = mask
        return mask


def lookup_reference(tokens, k: int, max_n: int = 3, min_n: int = 1, window: int = WINDOW):
    """`DeviceHistory.propose` for one request, on the host (tests): (k drafts, found)."""
    t = list(tokens)
    c = len(t)
    lo = max(0, c - window)
    for n in range(max_n, min_n - 1, -1):
        if n >= window or c <= n:
            continue
        key = t[c - n:]
        for p in range(c - n - 1, lo - 1, -1):  # latest start first; the continuation begins at p + n < c
            if p + n < c and t[p:p + n] == key:
                out = [t[p + n + j] if p + n + j < c else t[-1] for j in range(k)]
                return out, True
    return [t[-1]] * k, False
