"""scripts/pad_model.py: the zero-padded models compute exactly what the source model computes.

A small random Llama shaped like SmolLM2 (9 query / 3 KV heads, head_dim = hidden / heads) is padded both ways with
small sizes, written as sparse safetensors, and loaded back by transformers in float32: the logits must equal the
source's. The MoE check also shows the routing really spreads tokens over the experts (so a wide verify reads more
of them), and a control with one expert's weights changed must differ (the test can fail)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from script_module import load_script

torch = pytest.importorskip("torch", reason="torch is missing: pip install '.[engine]'")
transformers = pytest.importorskip("transformers", reason="transformers is missing: pip install '.[engine]'")
pytest.importorskip("safetensors", reason="safetensors is missing: pip install '.[engine]'")


def _pad_module():
    return load_script("pad_model")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A random SmolLM2-shaped Llama (float32), saved as a Hugging Face folder."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=36, intermediate_size=24, num_hidden_layers=2,
                                   num_attention_heads=9, num_key_value_heads=3, head_dim=4,
                                   max_position_embeddings=128, rope_theta=100000.0, tie_word_embeddings=True,
                                   rms_norm_eps=1e-5)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms and peaked attention, so a wrong norm copy or rotary base shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "q_proj" in name or "k_proj" in name:
                p.mul_(30.0)
    folder = tmp_path_factory.mktemp("src")
    model.save_pretrained(folder, safe_serialization=True)
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    return str(folder), ids, ref


def _logits(folder, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model, model(ids).logits


def test_dense_padding_keeps_the_logits(source, tmp_path):
    src, ids, ref = source
    out = str(tmp_path / "dense")
    summary = _pad_module().build("dense", src, out, np.float32, intermediate=80, heads=36, kv_heads=9,
                                  extra_layers=1)
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["num_hidden_layers"],
            cfg["intermediate_size"]) == (36, 9, 4, 3, 80)
    model, logits = _logits(out, ids)
    assert summary["parameters"] == sum(p.numel() for p in model.parameters()) + (
        97 * 36 if not cfg.get("tie_word_embeddings", True) else 0)
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    # the padding is really there and really zero: 4 query heads per KV head, the 4th of each group zero
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.shape == (36 * 4, 36) and torch.all(q[3 * 4:4 * 4] == 0) and torch.any(q[4 * 4:5 * 4] != 0)
    assert torch.all(model.model.layers[2].mlp.down_proj.weight == 0)


@pytest.mark.parametrize("experts,top_k,spread", [(8, 2, 6), (64, 8, 40)])
def test_moe_padding_keeps_the_logits_and_spreads_the_tokens(source, tmp_path, experts, top_k, spread):
    src, ids, ref = source
    out = str(tmp_path / "moe")
    summary = _pad_module().build("moe", src, out, np.float32, experts=experts, top_k=top_k, intermediate=40,
                                  extra_layers=1, seed=0, router_std=0.5)
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["architectures"] == ["MixtralForCausalLM"] and cfg["num_local_experts"] == experts
    assert cfg["rope_parameters"]["rope_theta"] == cfg["rope_theta"] == 100000.0
    model, logits = _logits(out, ids)
    assert isinstance(model, transformers.MixtralForCausalLM)
    assert summary["parameters"] == sum(p.numel() for p in model.parameters())
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    # routing: the 22 tokens of the batch pick many different experts in every real layer
    picked = []
    hook = model.model.layers[0].mlp.gate.register_forward_hook(lambda m, i, o: picked.append(o))
    with torch.no_grad():
        model(ids)
    hook.remove()
    router_logits = picked[0][0] if isinstance(picked[0], tuple) else picked[0]
    top = torch.topk(router_logits.reshape(-1, experts), top_k, dim=-1).indices
    assert len(torch.unique(top)) >= spread
    # control: one expert changed -> the logits move (the check above can fail)
    with torch.no_grad():
        experts = model.model.layers[0].mlp.experts
        if hasattr(experts, "down_proj"):  # fused expert weights (newer transformers)
            experts.down_proj[int(top[0, 0])].add_(0.5)
        else:
            experts[int(top[0, 0])].w2.weight.add_(0.5)
        moved = model(ids).logits
    assert not torch.allclose(moved, ref, rtol=1e-4, atol=1e-4)


def test_sparse_file_leaves_the_zeros_as_holes(tmp_path):
    pad = _pad_module()
    big = pad.Block((4096, 1024), [(0, 0, np.ones((2, 1024), np.float32))])
    path = str(tmp_path / "m.safetensors")
    size = pad.write_sparse_safetensors(path, {"w": big}, np.float16)
    from safetensors.numpy import load_file

    w = load_file(path)["w"]
    assert w.shape == (4096, 1024) and w.dtype == np.float16
    assert w[:2].min() == 1 and not w[2:].any()
    assert os.path.getsize(path) == size
    assert os.stat(path).st_blocks * 512 < size // 4  # 8 MiB logical; a few pages written
