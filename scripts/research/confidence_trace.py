"""A trace of SmolLM2's own greedy outputs with the model's confidence in every output token.

    python scripts/research/confidence_trace.py OUT.jsonl.gz [--mtbench TRACE.jsonl.gz] [--max-new-tokens 384]
                                       [--batch 64] [--device cuda] [--gguf SmolLM2.gguf]

Prompts: the engine's 16 copy-heavy and 16 free-text prompts and, with ``--mtbench``, the prompts of a dev trace
in cl100k (decoded to text, each sent as one user turn). Each record is a trace record (``prompt``, ``output``:
SmolLM2 token ids) plus ``conf`` (the softmax probability of each output token, the model's top-1) and
``margin`` (top-1 minus top-2). Batched greedy `generate` with left padding; outputs stop at the end-of-turn
token. ``scripts/research/acceptance_events.py TRACE ... --conf`` then asks whether the confidence of the tokens just
committed tells which drafts will be accepted (one GPU minute for the 192 prompts at 384 tokens; on a 2-core
CPU about 13 tokens a second).
"""
from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

import torch

from ngramspec.engine.model import load_model
from ngramspec.engine.prompts import chat_tokens, copy_heavy_prompts, free_text_prompts
from ngramspec.text import load_tokenizer


def prompts(mtbench: str | None, cl100k: str | None) -> list[tuple[str, str]]:
    out = [("copy", p) for p in copy_heavy_prompts()] + [("free", p) for p in free_text_prompts()]
    if mtbench:
        enc = load_tokenizer(cl100k)._enc
        with gzip.open(mtbench, "rt") as f:
            out += [("mtbench", enc.decode(json.loads(line)["prompt"])) for line in f]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--mtbench")
    ap.add_argument("--cl100k", help="the cl100k_base.tiktoken file (default: beside --mtbench)")
    ap.add_argument("--max-new-tokens", type=int, default=384)
    ap.add_argument("--max-prompt-tokens", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--device")
    ap.add_argument("--gguf")
    args = ap.parse_args()
    cl100k = args.cl100k or (args.mtbench and str(Path(args.mtbench).parent / "cl100k_base.tiktoken"))
    model, tok = load_model(args.gguf, device=args.device)
    device = next(model.parameters()).device
    eos = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    recs = [{"id": f"{kind}-{i}", "workload": kind, "prompt": chat_tokens(tok, text)[-args.max_prompt_tokens:]}
            for i, (kind, text) in enumerate(prompts(args.mtbench, cl100k))]
    recs.sort(key=lambda r: len(r["prompt"]))  # batches of similar lengths: less padding
    t0, n = time.perf_counter(), 0
    with gzip.open(args.out, "wt") as fo:
        for b in range(0, len(recs), args.batch):
            chunk = recs[b:b + args.batch]
            width = max(len(r["prompt"]) for r in chunk)
            x = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, r in enumerate(chunk):
                x[i, width - len(r["prompt"]):] = torch.tensor(r["prompt"])
                mask[i, width - len(r["prompt"]):] = 1
            with torch.no_grad():
                g = model.generate(x.to(device), attention_mask=mask.to(device), max_new_tokens=args.max_new_tokens,
                                   do_sample=False, output_logits=True, return_dict_in_generate=True,
                                   pad_token_id=pad)
                top = torch.topk(torch.softmax(torch.stack(g.logits, 1).float(), -1), 2, dim=-1).values.cpu()
            seq = g.sequences[:, width:].cpu()
            for i, r in enumerate(chunk):
                out = seq[i].tolist()
                k = next((j for j, t in enumerate(out) if t in eos), len(out))
                if k == 0:
                    continue
                n += k
                fo.write(json.dumps({**r, "generator": "SmolLM2-135M-Instruct, greedy", "source": "ngramspec",
                                     "output": out[:k], "conf": [round(float(v), 4) for v in top[i, :k, 0]],
                                     "margin": [round(float(v), 4) for v in top[i, :k, 0] - top[i, :k, 1]]}) + "\n")
            print(f"{b + len(chunk)}/{len(recs)} prompts, {n} tokens, {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
