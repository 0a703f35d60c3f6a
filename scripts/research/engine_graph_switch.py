"""Does a verify step of width 1 cost more right after a wider one? The engine's steps, one request, CUDA graphs.

    python scripts/research/engine_graph_switch.py [--gguf PATH] [--wide 9] [--reps 60]

Captures graphs for widths 1..16 (as the adaptive policy does) and times steps exactly as
`SpecDecoder.generate` does (host inputs, graph replay, argmax read back): a run of width-1 steps alone, then a
repeated pattern of one width-`wide` step followed by four width-1 steps, reporting the median of each position.
The draft tokens are arbitrary (nothing is committed: the same slots are rewritten each step).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--wide", type=int, default=9)
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--max-width", type=int, default=16)
    args = parser.parse_args(argv)

    import torch

    from ngramspec.engine.decode import SpecDecoder
    from ngramspec.engine.model import GraphRunner, KVModel, load_model
    from ngramspec.engine.prompts import chat_tokens, copy_heavy_prompts
    from ngramspec.layout import tree_rows

    model, tokenizer = load_model(args.gguf, None, torch.float32)
    prompt = chat_tokens(tokenizer, copy_heavy_prompts()[0])
    kv = KVModel(model, batch=1, max_len=len(prompt) + 256 + args.max_width + 1)
    runner = GraphRunner(kv)
    runner.prepare(range(1, args.max_width + 1))
    dec = SpecDecoder(kv, runner)
    dec._prefill(0, prompt[:-1])
    length = np.array([len(prompt) - 1], np.int64)
    draft = np.asarray(prompt[:args.wide - 1], np.int64)

    def step(width: int) -> float:
        t = time.perf_counter()
        n = width - 1
        tok, _, depth, anc = tree_rows(draft[:n], np.arange(-1, n - 1), prompt[-1], width)
        dec._verify(tok[None], depth[None], anc[None], length, int(length[0]) + width)
        return (time.perf_counter() - t) * 1e3

    for _ in range(20):
        step(1), step(args.wide)
    alone = [step(1) for _ in range(args.reps * 4)]
    pattern = [[step(args.wide)] + [step(1) for _ in range(4)] for _ in range(args.reps)]
    med = lambda xs: float(np.median(xs))  # noqa: E731
    print(f"width 1 alone: median {med(alone):.3f} ms over {len(alone)} steps")
    cols = list(zip(*pattern))
    print(f"width {args.wide}: median {med(cols[0]):.3f} ms; the width-1 steps after it: "
          + ", ".join(f"{k}: {med(c):.3f} ms" for k, c in enumerate(cols[1:], start=1)))
    plain = KVModel(model, batch=1, max_len=kv.max_len)
    runner1 = GraphRunner(plain)
    runner1.prepare([1])
    dec1 = SpecDecoder(plain, runner1)
    dec1._prefill(0, prompt[:-1])

    def step1() -> float:
        t = time.perf_counter()
        tok, _, depth, anc = tree_rows(draft[:0], np.zeros(0, np.int64), prompt[-1], 1)
        dec1._verify(tok[None], depth[None], anc[None], length, int(length[0]) + 1)
        return (time.perf_counter() - t) * 1e3

    for _ in range(20):
        step1()
    one = [step1() for _ in range(args.reps * 4)]
    print(f"width 1, one graph captured (plain decoding's runner): median {med(one):.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
