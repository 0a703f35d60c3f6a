"""End to end on a GPU: a real SGLang engine with NGRAM_ADAPTIVE. Skipped without CUDA.

Run on a GPU machine (docs/sglang.md):

    pip install -e '.[sglang,test]'
    NGRAMSPEC_SGLANG_MODEL=HuggingFaceTB/SmolLM2-135M-Instruct pytest tests/integration/test_sglang_gpu.py -m sglang -v

`NGRAMSPEC_SGLANG_DTYPE` (default float32) and `NGRAMSPEC_SGLANG_ENGINE_ARGS` (a JSON object of extra
`sglang.Engine` arguments, e.g. '{"attention_backend": "triton", "sampling_backend": "pytorch"}' where FA3 or
flashinfer are not installed) adapt it to the machine.
"""
import json
import os

import pytest

pytest.importorskip("sglang")
torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
MODEL = os.environ.get("NGRAMSPEC_SGLANG_MODEL", "HuggingFaceTB/SmolLM2-135M-Instruct")
DTYPE = os.environ.get("NGRAMSPEC_SGLANG_DTYPE", "float32")
ENGINE_ARGS = json.loads(os.environ.get("NGRAMSPEC_SGLANG_ENGINE_ARGS") or "{}")
PASSAGE = (
    "def merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
    "            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n"
)
PROMPTS = [
    "Copy this code exactly, then stop:\n" + PASSAGE + "\nCopy:\n",
    "Repeat the sentence three times: the quick brown fox jumps over the lazy dog.\n",
    "Write one short sentence about the sea.",
    "List the numbers from 1 to 30 separated by commas: 1, 2, 3,",
]
SAMPLING = {"temperature": 0, "max_new_tokens": 96}


def generate(**engine_args):
    import sglang

    engine = sglang.Engine(model_path=MODEL, dtype=DTYPE, mem_fraction_static=0.5,
                           max_running_requests=8, log_level="error", **{**ENGINE_ARGS, **engine_args})
    try:
        return engine.generate(PROMPTS, SAMPLING)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def plain():
    return generate()


def test_greedy_outputs_equal_plain_decode_and_speculation_pays(plain):
    spec = generate(speculative_algorithm="NGRAM_ADAPTIVE", speculative_num_draft_tokens=8)
    assert [o["text"] for o in spec] == [o["text"] for o in plain]
    copy = spec[0]["meta_info"]
    assert copy["completion_tokens"] > copy.get("spec_verify_ct", copy["completion_tokens"])  # > 1 token per step


def test_fixed_width_and_chain_knobs_run(plain, tmp_path):
    cfg = tmp_path / "ngram.json"
    cfg.write_text(json.dumps({"widths": [1, 4], "fixed_width": 4}))
    spec = generate(speculative_algorithm="NGRAM_ADAPTIVE", speculative_num_draft_tokens=4,
                    speculative_adaptive_config=str(cfg), speculative_ngram_max_bfs_breadth=1)
    assert [o["text"] for o in spec] == [o["text"] for o in plain]


def test_overlap_off_gives_the_same_outputs(plain):
    spec = generate(speculative_algorithm="NGRAM_ADAPTIVE", speculative_num_draft_tokens=8,
                    disable_overlap_schedule=True, disable_cuda_graph=True)
    assert [o["text"] for o in spec] == [o["text"] for o in plain]
