"""SGLang's own tree code, loaded on CPU for comparison.

`sglang.srt.speculative.ngram_worker` and `sglang.kernels.ops.speculative.{reconstruct_tree,spec_tree}`
import `sgl_kernel` at module level, which needs libcuda. The functions we compare against do not:
`_derive_tree_links` is numpy, the two Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1,
numpy on CPU). So we copy those function definitions verbatim (by AST, from the installed sglang
files) into a scratch module and import that; nothing is rewritten. `run_reference` does this in a
child process (see below).
"""
from __future__ import annotations

import ast
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

NUMPY_HEADER = "import numpy as np\nimport torch\n"
TRITON_HEADER = (
    "import os\nos.environ['TRITON_INTERPRET'] = '1'\n"
    "import torch\nimport triton\nimport triton.language as tl\n"
)


def sglang_root() -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        raise ImportError("sglang is not installed")
    return Path(spec.origin).parent


def _function_source(source: str, tree: ast.Module, name: str) -> str:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            first = min([d.lineno for d in node.decorator_list] + [node.lineno])
            lines = source.splitlines()[first - 1: node.end_lineno]
            return "\n".join(lines)
    raise LookupError(f"{name} not found")


def load_sglang_functions(relpath: str, names: list[str], header: str, module_name: str):
    """Import `names` defined in sglang/`relpath` (verbatim) as a scratch module."""
    path = sglang_root() / relpath
    source = path.read_text()
    tree = ast.parse(source)
    body = header + "\n\n" + "\n\n\n".join(_function_source(source, tree, n) for n in names) + "\n"
    out_dir = Path(tempfile.mkdtemp(prefix="sglang_ref_"))
    out = out_dir / f"{module_name}.py"
    out.write_text(f"# copied from {path}\n" + body)
    spec = importlib.util.spec_from_file_location(module_name, out)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def derive_tree_links():
    """SGLang's host-side (retrieve_next_token, retrieve_next_sibling) from a tree mask."""
    mod = load_sglang_functions("srt/speculative/ngram_worker.py", ["_derive_tree_links"], NUMPY_HEADER,
                                "sglang_ref_ngram_worker")
    return mod._derive_tree_links


def reconstruct_kernel():
    """SGLang's Triton kernel that derives positions / retrieve arrays from a tree mask (NGRAM verify)."""
    mod = load_sglang_functions("kernels/ops/speculative/reconstruct_tree.py", ["_reconstruct_tree_mask_kernel"],
                                TRITON_HEADER, "sglang_ref_reconstruct_tree")
    return mod._reconstruct_tree_mask_kernel


def verify_greedy_kernel():
    """SGLang's Triton kernel for greedy tree verification (what eagle_sample runs for NGRAM)."""
    mod = load_sglang_functions("kernels/ops/speculative/spec_tree.py", ["verify_tree_greedy_kernel_triton"],
                                TRITON_HEADER, "sglang_ref_spec_tree")
    return mod.verify_tree_greedy_kernel_triton




# ---------------------------------------------------------------------------------------------------
# Triton's interpreter must be chosen before triton is first imported, and importing sglang imports
# triton. So the kernels run in a child process started with TRITON_INTERPRET=1; cases go in and
# results come back as .npz files. A case is a batch layout: tokens, mask, retrieve arrays [B, W],
# seq_lens [B] and target_predict [B, W] (the model's argmax at every row).

CASE_KEYS = ("tokens", "mask", "retrieve_index", "retrieve_next_token", "retrieve_next_sibling", "seq_lens", "target")


def _run_cases(in_path: str, out_path: str) -> None:
    import numpy as np
    import torch

    reconstruct = reconstruct_kernel()
    verify = verify_greedy_kernel()
    links = derive_tree_links()
    data = np.load(in_path)
    count = int(data["count"])
    out = {}
    for c in range(count):
        case = {k: data[f"{c}_{k}"] for k in CASE_KEYS}
        bs, n = case["tokens"].shape
        mask = torch.from_numpy(np.ascontiguousarray(case["mask"], dtype=np.bool_).reshape(-1))
        arrays = [torch.empty(bs * n, dtype=torch.int64) for _ in range(4)]
        block = 1 << max(0, (n - 1).bit_length())
        reconstruct[(bs,)](mask, torch.from_numpy(case["seq_lens"].astype(np.int64)), *arrays, n, block)
        for name, a in zip(("positions", "retrieve_index", "retrieve_next_token", "retrieve_next_sibling"), arrays):
            out[f"{c}_{name}"] = a.view(bs, n).numpy()
        host_next, host_sibling = links(case["mask"].reshape(-1), bs, n)
        out[f"{c}_host_next_token"] = host_next.numpy()
        out[f"{c}_host_next_sibling"] = host_sibling.numpy()
        predicts = torch.zeros(bs * n, dtype=torch.int32)
        accept_index = torch.full((bs, n), -1, dtype=torch.int32)
        accept_num = torch.zeros(bs, dtype=torch.int32)
        verify[(bs,)](
            predicts, accept_index, accept_num,
            torch.from_numpy(case["tokens"].astype(np.int64)),
            torch.from_numpy(case["retrieve_index"].astype(np.int64)),
            torch.from_numpy(case["retrieve_next_token"].astype(np.int64)),
            torch.from_numpy(case["retrieve_next_sibling"].astype(np.int64)),
            torch.from_numpy(case["target"].astype(np.int64)),
            batch_size=bs, num_speculative_tokens=n, num_draft_tokens=n,
        )
        out[f"{c}_accept_index"] = accept_index.numpy()
        out[f"{c}_accept_num"] = accept_num.numpy()
        out[f"{c}_predicts"] = predicts.view(bs, n).numpy()
    np.savez(out_path, **out)


def run_reference(cases: list[dict], timeout: float = 1200.0) -> list[dict]:
    """SGLang's kernels on each case (a dict with CASE_KEYS), in a TRITON_INTERPRET=1 child process."""
    import subprocess

    import numpy as np

    work = Path(tempfile.mkdtemp(prefix="sglang_cases_"))
    payload = {"count": np.array(len(cases))}
    for c, case in enumerate(cases):
        for k in CASE_KEYS:
            payload[f"{c}_{k}"] = np.asarray(case[k])
    np.savez(work / "in.npz", **payload)
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, str(work / "in.npz"), str(work / "out.npz")],
                          env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"reference process failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    data = np.load(work / "out.npz")
    names = sorted({k.split("_", 1)[1] for k in data.files})
    return [{name: data[f"{c}_{name}"] for name in names} for c in range(len(cases))]


if __name__ == "__main__":
    _run_cases(sys.argv[1], sys.argv[2])
