"""Real-model engine on CPU: speculation (chain, tree, adaptive) is lossless, batched too, and its trace
replays in the simulator to the same accept length. Needs torch, transformers, gguf and the SmolLM2 GGUF.

Tests marked `slow` (the other fixed policies, batching, KV moves through later tree branches, the simulator's
replay) each decode the four prompts again: `bash scripts/test.sh` runs them where CI=true or with --slow."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.model

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

from engine_oracle import OracleCache  # noqa: E402
from script_module import load_script  # noqa: E402

from ngramspec import NgramCache  # noqa: E402
from ngramspec.engine.decode import FixedPolicy, SpecDecoder  # noqa: E402
from ngramspec.engine.model import KVModel, load_model, locate_gguf  # noqa: E402
from ngramspec.engine.policy import make_policy  # noqa: E402
from ngramspec.engine.prompts import chat_tokens, demo_prompts  # noqa: E402

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def model_and_tokenizer():
    try:
        locate_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    torch.manual_seed(0)
    return load_model(device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts(model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    # code edit, code edit (rename), summary, chat
    return [chat_tokens(tokenizer, text) for _, text in demo_prompts()[:4]]


@pytest.fixture(scope="module")
def decoder(model_and_tokenizer, prompts):
    model, _ = model_and_tokenizer
    return SpecDecoder(KVModel(model, batch=1, max_len=max(map(len, prompts)) + NEW_TOKENS + 32))


@pytest.fixture(scope="module")
def plain_outputs(decoder, prompts):
    return [decoder.generate([p], NEW_TOKENS).outputs[0] for p in prompts]


def test_plain_loop_is_the_argmax_of_the_transformers_forward(model_and_tokenizer, prompts, plain_outputs):
    """Each token the loop emits is the argmax of the model's own (transformers) logits over prompt + the
    tokens before it, teacher-forced in one full forward without our KV cache."""
    model, _ = model_and_tokenizer
    for prompt, output in zip(prompts[1:3], plain_outputs[1:3]):
        assert len(output) == NEW_TOKENS
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1]
        assert logits.argmax(-1).tolist() == output


POLICIES = [pytest.param("chain:k=8", marks=pytest.mark.slow), "tree:k=8",
            pytest.param("tree:k=3", marks=pytest.mark.slow), "adaptive"]


@pytest.mark.parametrize("spec", POLICIES)
def test_speculation_is_token_identical_to_plain_greedy(decoder, prompts, plain_outputs, spec):
    policy = make_policy(spec)
    cache = NgramCache()
    drafted = accepted = steps = 0
    for i, (prompt, plain) in enumerate(zip(prompts, plain_outputs)):
        result = decoder.generate([prompt], NEW_TOKENS, policy=policy, cache=cache, rids=[i])
        assert result.outputs[0] == plain, f"prompt {i} diverged under {spec}"
        steps += sum(result.steps)
        drafted += sum(sum(r.kept) for r in result.records)
        accepted += sum(sum(r.accepted) for r in result.records)
    # the check is not vacuous: drafts were verified, some accepted, and steps were saved
    assert drafted > 0 and accepted > 0
    assert steps < len(prompts) * NEW_TOKENS


@pytest.mark.slow
def test_batched_speculation_matches_single_sequence_greedy(model_and_tokenizer, prompts, plain_outputs):
    model, _ = model_and_tokenizer
    decoder = SpecDecoder(KVModel(model, batch=len(prompts), max_len=max(map(len, prompts)) + NEW_TOKENS + 32))
    plain = decoder.generate(prompts, NEW_TOKENS)
    assert plain.outputs == plain_outputs
    fast = decoder.generate(prompts, NEW_TOKENS, policy=FixedPolicy(8, tree=True), cache=NgramCache())
    assert fast.outputs == plain_outputs
    assert fast.accept_length > 1.0
    # requests advance by different amounts per step: per-sequence cache lengths really diverge
    assert len(set(fast.steps)) > 1


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 4])
def test_accepted_path_through_later_branches_keeps_the_right_kv(model_and_tokenizer, prompts, plain_outputs, batch):
    model, _ = model_and_tokenizer
    decoder = SpecDecoder(KVModel(model, batch=batch, max_len=max(map(len, prompts)) + NEW_TOKENS + 32))
    cache = OracleCache({i: out for i, out in enumerate(plain_outputs)}, decoy_offset=7, depth=6, seed=batch)
    policy = FixedPolicy(13, tree=True)
    outputs, moved_steps = [], 0
    for start in range(0, len(prompts), batch):
        result = decoder.generate(prompts[start:start + batch], NEW_TOKENS, policy=policy, cache=cache,
                                  rids=list(range(start, start + batch)))
        outputs += result.outputs
        moved_steps += sum(1 for r in result.records if max(r.accepted) > 0)
    assert outputs == plain_outputs
    assert moved_steps > 0


def test_generate_rejects_bad_input(decoder, prompts):
    with pytest.raises(ValueError, match="empty prompt"):
        decoder.generate([[]], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        decoder.generate([prompts[0]], 0)
    with pytest.raises(ValueError, match="exceeds the KV cache"):
        decoder.generate([prompts[0]], 10_000)
    with pytest.raises(ValueError, match="together"):
        decoder.generate([prompts[0]], 4, policy=FixedPolicy(4, tree=True))
    with pytest.raises(ValueError, match="outside"):
        decoder.generate([[10 ** 9]], 4)
    with pytest.raises(ValueError, match="1..1 prompts"):
        decoder.generate([prompts[0], prompts[1]], 4)
    with pytest.raises(ValueError):
        make_policy("tree:k=0")
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("beam")


@pytest.mark.slow
@pytest.mark.parametrize("method,policy", [("ngramspec-tree:k=8", "tree:k=8"), ("ngramspec-chain:k=6", "chain:k=6")])
def test_simulator_replaying_the_engine_trace_predicts_its_accept_length(decoder, prompts, tmp_path, method, policy):
    """Engine at batch 1 (shared cache across requests, in order) vs the simulator replaying the engine's own
    greedy outputs with the same method: same steps, same accepted tokens."""
    pytest.importorskip("numba")
    from ngramspec.engine.trace import write_trace
    from ngramspec.sim.methods import make_method
    from ngramspec.sim.simulate import replay
    from ngramspec.sim.traces import load_trace

    cache, pol = NgramCache(), make_policy(policy)
    outputs, steps, accepted = [], 0, 0
    for i, prompt in enumerate(prompts):
        result = decoder.generate([prompt], NEW_TOKENS, policy=pol, cache=cache, rids=[i])
        outputs.append(result.outputs[0])
        steps += sum(result.steps)
        accepted += sum(sum(r.accepted) for r in result.records)
    path = write_trace(tmp_path / "engine.jsonl.gz", prompts, outputs, workload="engine-test")
    sim = replay(load_trace(str(path)), make_method(method), batch=1)
    assert sim.tokens == sum(map(len, outputs))
    assert (sim.steps, sim.accepted) == (steps, accepted)
    assert sim.tokens / sim.steps == pytest.approx(sum(map(len, outputs)) / steps)


def test_calibrate_writes_a_profile_the_simulator_accepts(model_and_tokenizer, tmp_path):
    from ngramspec.engine import calibrate
    from ngramspec.sim.profiles import TableProfile

    out = tmp_path / "cpu.json"
    assert calibrate.main(["-o", str(out), "--device", "cpu", "--batches", "1,2", "--widths", "1,2,4",
                           "--context", "32", "--repeats", "2"]) == 0
    data = json.loads(out.read_text())
    assert {(r["B"], r["k"], r["kind"]) for r in data["rows"]} == {
        (b, k, kind) for b in (1, 2) for k in (1, 2, 4) for kind in (("chain",) if k == 1 else ("chain", "tree"))}
    assert all(r["eager_ms"] > 0 and r["graph_ms"] is None and r["L"] == 32 for r in data["rows"])
    profile = TableProfile.from_json(out, "eager_ms")
    assert profile.cost_ms(2, 4) > 0


def test_demo_runs_and_reports_identical_outputs(model_and_tokenizer, tmp_path, capsys):
    from ngramspec.engine import demo

    trace = tmp_path / "demo.jsonl.gz"
    code = demo.main(["--device", "cpu", "--max-new-tokens", "24", "--policy", "tree:k=8",
                      "--prompt", "Repeat exactly: the quick brown fox jumps over the lazy dog. "
                                  "the quick brown fox jumps over the lazy dog.",
                      "--trace-out", str(trace)])
    out = capsys.readouterr().out
    assert code == 0
    assert "plain tok/s" in out and "yes" in out
    from ngramspec.engine.trace import read_trace

    records = read_trace(trace)
    assert len(records) == 1 and 0 < len(records[0]["output"]) <= 24


def test_demo_with_token_recycling_stays_exact_and_splits_the_accepted_tokens(model_and_tokenizer, tmp_path,
                                                                                capsys):
    """`--recycle`: the adaptive policy over both sources; every run of a prompt starts from the table the prompts
    before it taught (the second prompt's runs draft from what the first one's scores put there)."""
    from ngramspec.engine import demo

    out = tmp_path / "demo.json"
    code = demo.main(["--device", "cpu", "--max-new-tokens", "32", "--recycle", "--repeats", "1", "--show", "0",
                      "--prompt", "Name three colours.", "--prompt", "Name three colours, then three more.",
                      "--json-out", str(out)])
    text = capsys.readouterr().out
    assert code == 0 and "token recycling" in text and "recycled" in text
    data = json.loads(out.read_text())
    assert data["recycle"] and all(r["identical"] for r in data["rows"])
    for r in data["rows"]:  # every accepted draft token counted once, by one source: tokens - steps (the last
        # step, cut by the token budget or at EOS inside the accepted path, may have no bonus token: one more)
        steps = round(r["new_tokens"] / r["accept_length"])
        assert len(r["accepted_by_source"]) == 2 and min(r["accepted_by_source"]) >= 0
        assert 0 <= sum(r["accepted_by_source"]) - (r["new_tokens"] - steps) <= 1


@pytest.mark.slow
def test_recorded_topk_trace_replays_with_recycling(model_and_tokenizer, tmp_path):
    """scripts/record_topk.py writes a trace whose top-k the simulator's recycling methods replay."""
    from ngramspec.sim.methods import make_method
    from ngramspec.sim.simulate import replay
    from ngramspec.sim.traces import load_trace

    out = tmp_path / "free.jsonl.gz"
    assert load_script("record_topk").main(["--out", str(out), "--set", "free", "--prompts", "2",
                                        "--max-new-tokens", "16", "--topk", "4"]) == 0
    trace = load_trace(out)
    for r in trace.requests:
        assert r.topk.shape == (len(r.output), 4) and r.topk[:, 0].tolist() == r.output.tolist()
    run = replay(trace, make_method("ngramspec-recycle:k=8,topk=4,min_match=2"))
    assert run.tokens == trace.output_tokens


@pytest.mark.slow
def test_engine_recycling_script_reports_lossless_rows(model_and_tokenizer, tmp_path):
    out = tmp_path / "rows.json"
    assert load_script("engine_recycling").main(["--sets", "free", "--prompts", "2", "--max-new-tokens", "32",
                                             "--k", "8", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["config"] for r in rows] == ["ngram", "ngram+recycle", "recycle"]
    assert all(r["outputs_equal_to_plain"] == 2 and r["accept_length"] >= 1.0 for r in rows)
    assert rows[2]["steps_drafted_by_ngram"] == 0 and rows[2]["steps_drafted_by_recycling"] > 0
    assert rows[2]["accepted_from_ngram"] == 0 and rows[2]["accepted_from_recycling"] > 0
    # the adaptive controller over both sources, one row per minimum match
    assert load_script("engine_recycling").main(["--sets", "free", "--prompts", "2", "--max-new-tokens", "32",
                                                 "--k", "16", "--policy", "adaptive", "--configs", "ngram+recycle",
                                                 "--min-match", "1,3", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["policy"], r["min_match"]) for r in rows] == [("adaptive", 1), ("adaptive", 3)]
    assert all(r["outputs_equal_to_plain"] == 2 and r["speedup_vs_plain"] > 0 for r in rows)
