"""GPU smoke test of the engine's code paths with a small random-weight Llama (no model file needed).

    python scripts/engine_gpu_smoke.py

Checks on the current CUDA device: eager plain == eager tree speculation == CUDA-graph tree speculation, at
batch 1 and 4, and prints one line per check. Exit status 1 if any output differs or a path raises.
"""
from __future__ import annotations

import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ngramspec import NgramCache
    from ngramspec.engine.decode import FixedPolicy, SpecDecoder
    from ngramspec.engine.model import GraphRunner, KVModel

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    print("device", dev, torch.cuda.get_device_name(0) if dev == "cuda" else "", "torch", torch.__version__, flush=True)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    model = LlamaForCausalLM(cfg).to(dev).eval()
    # repetitive prompts, so the n-gram cache has something to draft
    gen = torch.Generator().manual_seed(1)
    base = torch.randint(0, 512, (24,), generator=gen).tolist()
    prompts = [base * 3 + [i + 1] for i in range(4)]
    failures = 0
    for batch in (1, 4):
        group = prompts[:batch]
        reference = None
        for mode in ("eager", "graph"):
            if mode == "graph" and dev != "cuda":
                continue
            for spec in (None, FixedPolicy(8, tree=True)):
                name = f"b{batch} {mode} {'tree:k=8' if spec else 'plain'}"
                try:
                    kv = KVModel(model, batch=batch, max_len=256)
                    runner = GraphRunner(kv) if mode == "graph" else None
                    dec = SpecDecoder(kv, runner)
                    res = dec.generate(group, 48, policy=spec, cache=NgramCache() if spec else None)
                except Exception:
                    traceback.print_exc()
                    print(name, "FAILED", flush=True)
                    failures += 1
                    continue
                if reference is None:
                    reference = res.outputs
                same = res.outputs == reference
                failures += not same
                print(f"{name:24s} same={same} accept={res.accept_length:.2f} tok/s={res.tokens_per_second:.0f}",
                      flush=True)
    print("SMOKE", "OK" if failures == 0 else f"{failures} FAILURES", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
