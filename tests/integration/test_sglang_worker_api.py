"""The SGLang API the GPU worker relies on, checked statically against the installed sglang (CPU).

`ngramspec_sglang.worker` cannot be imported without libcuda, so these tests read the installed sglang sources:
every name the worker's modules (`WORKER_MODULES`) import exists, and the methods, parameters and fields it calls
are there. They guard the pinned range (sglang>=0.5.23,<0.6) against drift; behaviour on a GPU is tested by
test_sglang_gpu.py.
"""
import ast
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("sglang")

pytestmark = pytest.mark.sglang
PLUGIN = Path(__file__).resolve().parents[2] / "integration" / "ngramspec_sglang"
# the worker class and the modules its phases live in (start-up, forwards, diagnostics)
WORKER_MODULES = [PLUGIN / name for name in ("worker.py", "worker_startup.py", "worker_forward.py", "diagnostics.py")]


def module_file(module: str) -> Path:
    root = Path(importlib.util.find_spec("sglang").origin).parent.parent
    base = root / module.replace(".", "/")
    path = base.with_suffix(".py")
    return path if path.is_file() else base / "__init__.py"


def top_level_names(module: str, seen=None) -> set:
    """Names a module defines or imports at top level (following `from x import *`, and if/try blocks)."""
    seen = set() if seen is None else seen
    if module in seen:
        return set()
    seen.add(module)
    tree = ast.parse(module_file(module).read_text())
    names = set()
    nodes = list(tree.body)
    while nodes:
        node = nodes.pop()
        if isinstance(node, (ast.If, ast.Try)):
            nodes.extend(node.body + node.orelse + getattr(node, "finalbody", []) +
                         [h for hs in getattr(node, "handlers", []) for h in hs.body])
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                if a.name == "*" and node.module:
                    names |= top_level_names(node.module, seen)
                else:
                    names.add(a.asname or a.name)
    return names


def class_node(module: str, name: str) -> ast.ClassDef:
    for node in ast.walk(ast.parse(module_file(module).read_text())):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise LookupError(f"{module}.{name} not found")


def method_params(module: str, cls: str, method: str) -> list[str]:
    for node in class_node(module, cls).body:
        if isinstance(node, ast.FunctionDef) and node.name == method:
            args = node.args
            return [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    raise LookupError(f"{cls}.{method} not found in {module}")


def test_the_worker_modules_are_all_checked():
    """WORKER_MODULES is worker.py, the modules of NgramAdaptiveWorker's mixins (imported by worker.py from the
    plugin) and diagnostics.py: a new mixin module must be added to it."""
    tree = ast.parse(WORKER_MODULES[0].read_text())
    worker = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "NgramAdaptiveWorker")
    bases = {b.id for b in worker.bases if isinstance(b, ast.Name)}
    mixins = {PLUGIN / f"{node.module}.py" for node in tree.body if isinstance(node, ast.ImportFrom)
              and node.level == 1 and bases & {a.name for a in node.names}}
    assert len(mixins) == 2 and {WORKER_MODULES[0], PLUGIN / "diagnostics.py"} | mixins == set(WORKER_MODULES)


@pytest.mark.parametrize("path", WORKER_MODULES, ids=lambda p: p.name)
def test_every_sglang_name_the_worker_imports_exists(path):
    checked = 0
    for node in ast.walk(ast.parse(path.read_text())):  # lazy imports inside methods included
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sglang"):
            names = top_level_names(node.module)
            for alias in node.names:
                assert alias.name in names, f"{path.name}: {node.module} has no {alias.name}"
                checked += 1
    assert checked >= 5 or path.name == "diagnostics.py"  # (which imports no sglang module today)


def test_the_worker_modules_import_at_least_what_worker_py_imported():
    """Together they import at least 20 sglang names (worker.py alone did before the split)."""
    names = {(node.module, a.name) for path in WORKER_MODULES for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sglang")
             for a in node.names}
    assert len(names) >= 20


@pytest.mark.parametrize("module, cls, method, params", [
    ("sglang.srt.model_executor.model_runner", "ModelRunner", "_get_attention_backend", ["init_new_workspace"]),
    ("sglang.srt.model_executor.model_runner", "ModelRunner", "_decode_cuda_graph_runner_cls", []),
    ("sglang.srt.model_executor.runner.decode_cuda_graph_runner", "DecodeCudaGraphRunner", "__init__",
     ["model_runner", "attn_backend", "speculative_num_steps", "speculative_num_draft_tokens"]),
    ("sglang.srt.managers.tp_worker", "TpModelWorker", "forward_batch_generation", ["batch", "is_verify"]),
    ("sglang.srt.distributed.parallel_state", "GroupCoordinator", "broadcast_object", ["obj", "src"]),
    ("sglang.srt.managers.schedule_batch", "ScheduleBatch", "grammar_needs_sync", []),
    ("sglang.srt.speculative.ngram_worker", "NGRAMWorker", "alloc_memory_pool", []),
    ("sglang.srt.speculative.ngram_worker", "NGRAMWorker", "forward_batch_generation",
     ["batch", "on_publish", "pp_proxy_tensors"]),
    ("sglang.srt.speculative.base_spec_worker", "BaseSpecWorker", "init_cuda_graphs", []),
    ("sglang.srt.runtime_context", "_ConfigBag", "override", []),
    # the verify prepared before the wait (`preplan`): built, loaded by the graph runner, replayed without a batch
    ("sglang.srt.managers.tp_worker", "TpModelWorker", "forward_batch_generation",
     ["batch", "forward_batch", "pp_proxy_tensors", "is_verify"]),
    ("sglang.srt.model_executor.forward_batch_info", "ForwardBatch", "init_new",
     ["batch", "model_runner", "capture_hidden_mode", "return_hidden_states_before_norm"]),
    ("sglang.srt.model_executor.forward_batch_info", "ForwardBatch", "mark_forward_metadata_ready", []),
    ("sglang.srt.model_executor.runner.decode_cuda_graph_runner", "DecodeCudaGraphRunner", "load_batch",
     ["forward_batch"]),
    ("sglang.srt.model_executor.runner.decode_cuda_graph_runner", "DecodeCudaGraphRunner", "can_run_graph",
     ["forward_batch"]),
    ("sglang.srt.layers.attention.verify_mask", "VerifyMask", "fits", ["bs"]),
])
def test_methods_the_worker_calls_exist(module, cls, method, params):
    have = method_params(module, cls, method)
    assert set(params) <= set(have), f"{cls}.{method}{tuple(have)} lacks {set(params) - set(have)}"


def test_ngram_worker_allocates_through_the_hook_we_override():
    """NGRAMWorker.alloc_memory_pool sets max_batch_size and calls _init_preallocated_tensors (ours)."""
    source = ast.get_source_segment(
        module_file("sglang.srt.speculative.ngram_worker").read_text(),
        next(n for n in class_node("sglang.srt.speculative.ngram_worker", "NGRAMWorker").body
             if isinstance(n, ast.FunctionDef) and n.name == "alloc_memory_pool"),
    )
    assert "self.max_batch_size" in source and "self._init_preallocated_tensors()" in source


@pytest.mark.sglang_server
def test_result_and_verify_input_fields():
    import inspect

    from sglang.srt.speculative.ngram_info import NgramVerifyInput

    result = class_node("sglang.srt.managers.utils", "GenerationBatchResult")
    fields = {n.target.id for n in result.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert {"speculative_num_draft_tokens", "speculative_output_stride", "next_draft_input", "accept_lens",
            "new_seq_lens", "can_run_cuda_graph", "next_token_ids", "logits_output",
            "num_non_draft_tokens_per_req"} <= fields
    params = inspect.signature(NgramVerifyInput.__init__).parameters
    assert {"draft_token", "custom_mask", "positions", "retrieve_index", "retrieve_next_token",
            "retrieve_next_sibling", "draft_token_num", "new_seq_lens", "accept_tokens", "accept_lens"} <= set(params)


def test_a_prepared_verify_finds_the_mask_buffer_where_it_writes_the_mask():
    """`preplan` writes the verify mask into the Triton backend's `_verify_mask.buffer` (a `VerifyMask`), which the
    target-verify graph reads, and the graph runner copies the batch's own mask into that buffer while loading
    (so the prepared batch hands it a slice of the buffer itself); the pre-planned load is skipped at replay
    except for the input ids and positions, which it copies then."""
    triton = module_file("sglang.srt.layers.attention.triton_backend").read_text()
    assert "self._verify_mask = maybe_create_verify_mask(" in triton
    assert "custom_mask[: spec_info.custom_mask.shape[0]] = spec_info.custom_mask" in triton
    fields = {n.target.id for n in class_node("sglang.srt.layers.attention.verify_mask", "VerifyMask").body
              if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert {"buffer", "max_bs"} <= fields
    runner = module_file("sglang.srt.model_executor.runner.decode_cuda_graph_runner").read_text()
    assert "if not forward_batch.needs_forward_metadata_init():" in runner
    assert "self.buffers.input_ids[: self.raw_num_token].copy_(forward_batch.input_ids)" in runner
    assert "self.buffers.positions[: self.raw_num_token].copy_(forward_batch.positions)" in runner


def test_the_split_kv_verify_hook_is_where_split_kv_verify_plugs_in():
    """`split_kv_verify` sets the Triton backend's `use_verify_splitkv` and `verify_splitkv_fwd` (SGLang's own hook,
    gated on AMD there): the verify path must still consult them, in this order, with the arguments our kernel takes
    positionally; the start-up check calls SGLang's prefill kernel; the sizes come from the attention layers."""
    import inspect

    from ngramspec_sglang.verify_attention import SplitKvVerify

    triton = module_file("sglang.srt.layers.attention.triton_backend").read_text()
    assert "elif self.use_verify_splitkv:\n            verify_fwd = self.verify_splitkv_fwd" in triton
    assert "if self.use_verify_shared_kv:" in triton  # checked first: the plugin turns it off
    call = triton[triton.index("and verify_fwd(") : triton.index("):\n            return o")]
    positional = [line.strip().rstrip(",") for line in call.splitlines()[1:] if line.strip()
                  and "=" not in line.split("(")[0]][:16]
    assert positional[9] == "self.forward_metadata.custom_mask" and positional[12].endswith("max_extend_len")
    assert positional[15] == "layer.scaling"
    ours = list(inspect.signature(SplitKvVerify.__call__).parameters)[1:]
    assert ours[9] == "custom_mask" and ours[12] == "max_len_extend" and ours[15] == "sm_scale"
    keywords = {line.strip().split("=")[0] for line in call.splitlines() if "=" in line and "(" not in line}
    assert keywords <= set(ours), keywords - set(ours)
    assert "extend_attention_fwd" in top_level_names("sglang.kernels.ops.attention.extend_attention")
    init = ast.get_source_segment(module_file("sglang.srt.layers.radix_attention").read_text(), next(
        n for n in class_node("sglang.srt.layers.radix_attention", "RadixAttention").body
        if isinstance(n, ast.FunctionDef) and n.name == "__init__"))
    for field in ("self.tp_q_head_num", "self.tp_k_head_num", "self.qk_head_dim", "self.v_head_dim"):
        assert field in init


def test_buffers_a_prepared_verify_hands_to_a_graph_are_initialised():
    """`preplan` loads a width's CUDA graph with rows of the draft-token and position buffers before the drafts are
    written; a dropped preplan leaves them in the graph's input ids, whose padded rows SGLang keeps (FOREACH_COPY)
    and still embeds at a later replay of a smaller batch. Rows the worker never wrote must therefore hold a valid id:
    allocated with zeros, not `torch.empty`, whose leftovers can be ids far outside the vocabulary (a device-side
    assert in the embedding)."""
    tree = ast.parse((PLUGIN / "worker_startup.py").read_text())
    init = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_init_preallocated_tensors")
    allocs = {}
    for node in ast.walk(init):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Attribute)
                and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute)):
            allocs[node.targets[0].attr] = node.value.func.attr
    for name in ("draft_tokens", "positions", "retrieve_indexes", "retrieve_next_token", "retrieve_next_sibling",
                 "tree_mask"):
        assert allocs.get(name) == "zeros", f"self.{name} is allocated with torch.{allocs.get(name)}, not zeros"
