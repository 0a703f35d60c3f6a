"""GPU time of a verify's parts against a decode step's, kernel by kernel (needs CUDA and SGLang's Triton kernels).

1. Attention, one layer: SGLang's prefill kernel on a tree verify (what the Triton backend runs for a verify),
   `split_kv_verify`'s two kernels on the same inputs (and their largest difference from it), the same with its
   grouped first kernel (`split_kv_verify` "grouped"), and SGLang's decode kernel for one token, over widths, prefix
   lengths and batch sizes.
2. The weight GEMMs (`F.linear`, float16) of 32 layers at M tokens: the cost-padded SmolLM2's shapes and
   Llama-3.1-8B's.

Times are CUDA-event means over many launches after a warm-up, replayed from a CUDA graph (GPU time, no host
time; the first version of this script launched eagerly, so its small kernels were timed at the host's rate).
Prints as it goes and writes JSON to ``--out``.

    python scripts/verify_kernels_bench.py --out kernels.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))


DEV = "cuda"


def timed(fn, reps: int = 50, warm: int = 5, graph: bool = True) -> float:
    """Mean GPU milliseconds of ``fn()`` over ``reps`` launches: replayed from one CUDA graph where it captures (as
    the server replays a step), so that small kernels are not timed at the host's launch rate; else launched
    eagerly. On the CPU, a dry run through Triton's interpreter: wall-clock milliseconds of one launch."""
    if DEV == "cpu":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    run = fn
    if graph:
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(reps):
                    fn()
            run = g.replay
        except Exception as e:  # noqa: BLE001 - time it eagerly instead
            print("no graph, eager:", repr(e)[:200], flush=True)
            torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    if run is fn:
        for _ in range(reps):
            fn()
    else:
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def tree_mask(width: int, prefix: int, gen) -> torch.Tensor:
    tree = torch.eye(width, dtype=torch.bool)
    for i in range(1, width):
        tree[i] |= tree[int(torch.randint(0, i, (1,), generator=gen))]
    full = torch.ones(width, prefix + width, dtype=torch.bool)
    full[:, prefix:] = tree
    return full.reshape(-1)


def attention(h_q: int, h_kv: int, d: int, widths, prefixes, batches, dtype=torch.float16):
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    from ngramspec_sglang.verify_attention import SplitKvVerify

    dev = DEV
    gen = torch.Generator().manual_seed(0)
    rows = []
    kernel = SplitKvVerify(max(batches), h_q, d, max(widths), dev)
    grouped = SplitKvVerify(max(batches), h_q, d, max(widths), dev, grouped=True)
    for bs in batches:
        for n in prefixes:
            pool = bs * n + 16
            k_buf = torch.randn(pool, h_kv, d, generator=gen).to(dev, dtype)
            v_buf = torch.randn(pool, h_kv, d, generator=gen).to(dev, dtype)
            kv_indices = torch.randperm(pool, generator=gen)[: bs * n].to(dev)
            kv_indptr = torch.arange(0, (bs + 1) * n, n, dtype=torch.int32).to(dev)
            scale = 1.0 / d ** 0.5
            # decode: one token per request, SGLang's default 8 splits
            q1 = torch.randn(bs, h_q, d, generator=gen).to(dev, dtype)
            o1 = torch.empty_like(q1)
            splits = 8
            logits = torch.empty(bs, h_q, splits, d, dtype=torch.float32, device=dev)
            lse = torch.empty(bs, h_q, splits, dtype=torch.float32, device=dev)
            nsplit = torch.full((bs,), splits, dtype=torch.int32, device=dev)
            dec_ms = timed(lambda: decode_attention_fwd(q1, k_buf, v_buf, o1, kv_indptr, kv_indices, logits, lse,
                                                        nsplit, splits, scale, 1.0, 1.0))
            for w in widths:
                q = torch.randn(bs * w, h_q, d, generator=gen).to(dev, dtype)
                k = torch.randn(bs * w, h_kv, d, generator=gen).to(dev, dtype)
                v = torch.randn(bs * w, h_kv, d, generator=gen).to(dev, dtype)
                qo_indptr = torch.arange(0, (bs + 1) * w, w, dtype=torch.int32).to(dev)
                mask = torch.cat([tree_mask(w, n, gen) for _ in range(bs)]).to(dev)
                mask_indptr = torch.arange(0, (bs + 1) * w * (n + w), w * (n + w), dtype=torch.int64).to(dev)
                o_ref, o_ours, o_grp = torch.empty_like(q), torch.empty_like(q), torch.empty_like(q)
                ref_ms = timed(lambda: extend_attention_fwd(q, k, v, o_ref, k_buf, v_buf, qo_indptr, kv_indptr,
                                                            kv_indices, mask, True, mask_indptr, w, 1.0, 1.0, scale))
                ours_ms = timed(lambda: kernel.launch(q, k, v, o_ours, k_buf, v_buf, qo_indptr, kv_indptr,
                                                      kv_indices, mask, mask_indptr, w, sm_scale=scale))
                grp_ms = timed(lambda: grouped.launch(q, k, v, o_grp, k_buf, v_buf, qo_indptr, kv_indptr,
                                                      kv_indices, mask, mask_indptr, w, sm_scale=scale))
                diff = float((o_ref.float() - o_ours.float()).abs().max())
                diff_g = float((o_ref.float() - o_grp.float()).abs().max())
                row = dict(bs=bs, prefix=n, width=w, decode_ms=round(dec_ms, 4), sglang_verify_ms=round(ref_ms, 4),
                           split_kv_ms=round(ours_ms, 4), max_diff=round(diff, 5),
                           split_kv_grouped_ms=round(grp_ms, 4), max_diff_grouped=round(diff_g, 5))
                print("attention", json.dumps(row), flush=True)
                rows.append(row)
    return rows


SHAPES = {  # one layer's weight GEMMs: (in, out)
    "smollm2-dense8b": [(576, 3072), (2048, 576), (576, 266240), (133120, 576)],
    "llama-3.1-8b": [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)],
}


def gemms(ms_tokens, layers: int = 32, dtype=torch.float16):
    """Every layer's own weights (as in a model: nothing stays in L2 between layers), each GEMM type timed over all
    layers."""
    rows = []
    for name, shapes in SHAPES.items():
        weights = [[torch.randn(o, i, device=DEV, dtype=dtype) for i, o in shapes] for _ in range(layers)]
        nbytes = sum(w.numel() for ws in weights for w in ws) * 2
        for m in ms_tokens:
            xs = [torch.randn(m, i, device=DEV, dtype=dtype) for i, _ in shapes]

            def one_type(j, xs=xs, weights=weights):
                for ws in weights:
                    F.linear(xs[j], ws[j])
            per = [timed(lambda j=j: one_type(j), reps=10, warm=2) for j in range(len(shapes))]
            total = sum(per)
            row = dict(model=name, m=m, per_gemm_type_ms=[round(p, 4) for p in per], ms_all_layers=round(total, 3),
                       tb_per_s=round(nbytes / (total / 1e3) / 1e12, 2))
            print("gemm", json.dumps(row), flush=True)
            rows.append(row)
        del weights
        torch.cuda.empty_cache() if DEV == "cuda" else None
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--widths", type=int, nargs="+", default=[2, 4, 8, 12, 16])
    ap.add_argument("--prefixes", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 32, 64, 128, 256])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run (TRITON_INTERPRET=1, small sizes)")
    args = ap.parse_args(argv)
    global DEV
    DEV = args.device
    t0 = time.time()
    result = dict(device=torch.cuda.get_device_name() if DEV == "cuda" else DEV, torch=torch.__version__)
    print(result, flush=True)
    try:  # the cost-padded model's heads: 32 query, 8 KV, 64 wide (Llama-3.1-8B: 32, 8, 128)
        result["attention_smollm2_dense8b"] = attention(32, 8, 64, args.widths, args.prefixes, args.batches)
        result["attention_llama_8b"] = attention(32, 8, 128, args.widths, args.prefixes, args.batches)
    except Exception as e:  # noqa: BLE001 - report and go on to the GEMMs
        result["attention_error"] = repr(e)
        print("attention failed:", repr(e), flush=True)
    result["gemms"] = gemms(args.m, layers=args.layers)
    result["seconds"] = round(time.time() - t0, 1)
    args.out.write_text(json.dumps(result, indent=1))
    print("done", result["seconds"], "s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
