"""Record SmolLM2's greedy generations with the top-k of every committed position, as a trace the simulator
replays (`topk` per record): what token recycling drafts from (`recycle`, `ngramspec-recycle`).

    .venv/bin/python scripts/record_topk.py --out out/smollm2_free_topk.jsonl.gz --set free --max-new-tokens 128

Plain greedy decoding on the reference engine (`ngramspec.engine`, CPU or CUDA), one prompt at a time; the
prompts are the engine's own sets (`ngramspec.engine.prompts`: `copy` = copy_heavy_prompts, `free` =
free_text_prompts).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="trace to write (.jsonl.gz)")
    ap.add_argument("--set", choices=["copy", "free"], default="free")
    ap.add_argument("--prompts", type=int, default=None, help="the first N prompts of the set (default: all)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--gguf", default=None)
    args = ap.parse_args(argv)

    import torch

    from ngramspec.engine.decode import SpecDecoder
    from ngramspec.engine.model import KVModel, load_model
    from ngramspec.engine.prompts import chat_tokens, copy_heavy_prompts, free_text_prompts
    from ngramspec.engine.trace import write_trace

    torch.set_grad_enabled(False)
    model, tokenizer = load_model(args.gguf, args.device, torch.float32)
    texts = copy_heavy_prompts() if args.set == "copy" else free_text_prompts()
    texts = texts[:args.prompts] if args.prompts else texts
    prompts = [chat_tokens(tokenizer, t) for t in texts]
    kv = KVModel(model, batch=1, max_len=max(map(len, prompts)) + args.max_new_tokens + 2)
    decoder = SpecDecoder(kv, record_topk=args.topk)
    outputs, topk = [], []
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        res = decoder.generate([p], args.max_new_tokens, eos_token_id=tokenizer.eos_token_id)
        outputs.append(res.outputs[0])
        topk.append(res.topk[0])
        print(f"  {i + 1}/{len(prompts)}: {len(res.outputs[0])} tokens ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr)
    write_trace(args.out, prompts, outputs, workload=args.set, topk=topk)
    print(f"wrote {args.out}: {len(prompts)} requests, {sum(map(len, outputs))} tokens, top-{args.topk} each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
