"""Text request logs (tokenizers, record formats), the `ngramspec` command line, built-in profiles, the answer."""
from __future__ import annotations

import gzip
import json
import sys

import numpy as np
import pytest

from ngramspec import cli
from ngramspec.sim import simulate
from ngramspec.sim.profiles import BUILTIN_PROFILES, builtin_profile_info, get_profile
from ngramspec.sim.traces import data_dir, load_trace
from ngramspec.text import TiktokenTokenizer, load_tokenizer, text_record, tokenize_record

WORDS = ["<unk>", "hello", "world", "the", "cat", "sat", "on", "mat", "user", "assistant", ":", "a", "dog"]


@pytest.fixture
def word_tokenizer(tmp_path):
    """A real `tokenizers` WordLevel tokenizer, saved as tokenizer.json (no download)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = tokenizers.Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def write_jsonl(path, records, gz=False):
    opener = gzip.open if gz else open
    with opener(path, "wt") as fh:
        for rec in records:
            fh.write(json.dumps(rec) + "\n")


# --- record formats -----------------------------------------------------------------------------------------

def test_text_record_formats():
    chat = [{"role": "user", "content": "hi"}]
    assert text_record({"prompt": "p", "output": "o"}, "r") == ("p", "o")
    assert text_record({"prompt": "p", "completion": "o"}, "r") == ("p", "o")
    assert text_record({"messages": chat + [{"role": "assistant", "content": "yo"}]}, "r") == (chat, "yo")
    assert text_record({"messages": chat, "response": "yo"}, "r") == (chat, "yo")
    completion = {"choices": [{"message": {"role": "assistant", "content": [{"type": "text", "text": "y"},
                                                                           {"type": "text", "text": "o"}]}}]}
    assert text_record({"messages": chat, "response": completion}, "r") == (chat, "yo")
    batch_line = {"custom_id": "a", "request": {"body": {"messages": chat}}, "response": {"body": completion}}
    assert text_record(batch_line, "r") == (chat, "yo")
    tool = {"role": "assistant", "content": None,
            "tool_calls": [{"function": {"name": "ls", "arguments": "{\"path\": \".\"}"}}]}
    _, reply = text_record({"messages": chat + [tool]}, "r")
    assert "ls" in reply and "path" in reply
    with pytest.raises(ValueError, match="assistant's reply"):
        text_record({"messages": chat}, "line 3")
    with pytest.raises(ValueError, match="line 4"):
        text_record({"text": "no fields"}, "line 4")


def test_text_log_is_tokenized_with_a_tokenizer_json(tmp_path, word_tokenizer):
    tok = load_tokenizer(word_tokenizer)
    assert tok.encode("the cat sat") == [3, 4, 5]
    path = tmp_path / "log.jsonl"
    write_jsonl(path, [
        {"id": "x", "prompt": "the cat sat on the mat", "output": "the cat sat on a mat"},
        {"messages": [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "a dog sat"}]},
        {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": ""}]},  # skipped
    ])
    trace = load_trace(path, tok)
    assert [r.id for r in trace.requests] == ["x", "1"] and trace.skipped == 1
    assert trace.requests[0].prompt.tolist() == [3, 4, 5, 6, 3, 7]
    assert trace.requests[0].output.tolist() == [3, 4, 5, 6, 11, 7]
    # no chat template in a bare tokenizer.json: "role: content" lines, then "assistant:"
    assert trace.requests[1].prompt.tolist() == tok.encode("user: hello world\nassistant: ")
    assert trace.requests[1].output.tolist() == [11, 12, 5]
    assert load_trace(path, tok, max_requests=1).requests[0].id == "x"
    with pytest.raises(ValueError, match="tokenizer"):
        load_trace(path)  # text without a tokenizer: says what to pass


def test_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer not found"):
        load_tokenizer(tmp_path / "nope")
    odd = tmp_path / "mystery.bpe"
    odd.write_text("")
    pytest.importorskip("tiktoken")
    with pytest.raises(ValueError, match="cl100k_base"):
        load_tokenizer(odd)


TIKTOKEN_FILE = (data_dir() / "traces" / "cl100k_base.tiktoken") if data_dir() else None


@pytest.mark.skipif(TIKTOKEN_FILE is None or not TIKTOKEN_FILE.is_file(), reason="cl100k_base.tiktoken absent")
def test_tiktoken_file_reproduces_the_recorded_token_ids(tmp_path):
    """The dev traces are cl100k_base ids of real text: decode a trace to a text log, simulate it with
    --tokenizer cl100k_base.tiktoken, and get the very same ids and the very same results."""
    pytest.importorskip("tiktoken")
    tok = load_tokenizer(TIKTOKEN_FILE)
    assert isinstance(tok, TiktokenTokenizer)
    source = data_dir() / "traces" / "mtbench_vicuna7b.jsonl.gz"
    ids = load_trace(source, max_requests=12)
    path = tmp_path / "mtbench_text.jsonl"
    write_jsonl(path, [{"id": r.id, "prompt": tok._enc.decode(r.prompt.tolist()),
                        "output": tok._enc.decode(r.output.tolist())} for r in ids.requests])
    text = load_trace(path, tok)
    for a, b in zip(ids.requests, text.requests):
        assert np.array_equal(a.prompt, b.prompt) and np.array_equal(a.output, b.output)
    args = (["prompt-lookup:k=8", "ngramspec-tree:k=8"], ["seed-pcie8"], [1])
    strip = ("trace", "proposer_us_per_token", "replay_s")
    from_ids = simulate.run_all([source], *args, max_requests=12, progress=False)
    from_text = simulate.run_all([path], *args, progress=False, tokenizer=str(TIKTOKEN_FILE))
    assert [{k: v for k, v in r.items() if k not in strip} for r in from_ids] == \
        [{k: v for k, v in r.items() if k not in strip} for r in from_text]


# --- profiles -----------------------------------------------------------------------------------------------

def test_builtin_profiles_ship_with_the_package():
    assert {"seed-pcie8", "h200-llama8b"} <= set(BUILTIN_PROFILES)
    assert all(info["description"] and info["source"] for info in builtin_profile_info())
    h200 = get_profile("h200-llama8b")
    assert 4 < h200.cost_ms(1, 1) < h200.cost_ms(64, 16)  # a measured table, not the seed formula


def test_calibrate_output_plugs_in(tmp_path, capsys):
    """A file as `ngramspec calibrate --no-graphs` writes it (graph_ms null) is a profile, read from eager_ms."""
    rows = [{"B": b, "k": k, "kind": kind, "L": 64, "eager_ms": 1.0 + b + k, "graph_ms": None}
            for b in (1, 4) for k in (1, 2, 8) for kind in (("chain",) if k == 1 else ("chain", "tree"))]
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"device": "cpu", "rows": rows}))
    assert get_profile(str(path)).cost_ms(4, 2) == 7.0
    assert cli.main(["profiles", str(path)]) == 0
    assert "--profile" in capsys.readouterr().out
    assert cli.main(["profiles"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in BUILTIN_PROFILES)


# --- command line -------------------------------------------------------------------------------------------

def tiny_trace(tmp_path):
    rng = np.random.default_rng(0)
    phrase = rng.integers(0, 500, 40).tolist()
    path = tmp_path / "tiny.jsonl.gz"
    write_jsonl(path, [{"prompt": rng.integers(0, 500, 20).tolist() + phrase[:8], "output": phrase[8:] + [i]}
                       for i in range(5)], gz=True)
    return path


def test_cli_commands_version_and_errors(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["simulat"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice" in err and "simulate" in err and "profiles" in err
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("ngramspec ")


def test_simulate_help_lists_methods_and_parameters(capsys):
    with pytest.raises(SystemExit):
        cli.main(["simulate", "--help"])
    out = capsys.readouterr().out
    for text in ("prompt-lookup:k=8,min=2,max=5", "ngramspec-tree:k=8", "oracle:k=8", "--tokenizer",
                 "h200-llama8b", "messages"):
        assert text in out, text


def test_simulate_argument_errors(tmp_path, capsys):
    path = tiny_trace(tmp_path)
    with pytest.raises(SystemExit):
        cli.main(["simulate", str(path), "--method", "none", "--max-requests", "0"])
    assert "--max-requests" in capsys.readouterr().err
    same = tmp_path / "seed-pcie8.json"
    same.write_text(json.dumps({"linear": {"decode_ms": 1, "verify_base_ms": 1, "verify_per_token_ms": 1}}))
    assert cli.main(["simulate", str(path), "--method", "none", "--profile", "seed-pcie8", "--profile", str(same),
                     "--no-progress"]) == 2
    assert "both named 'seed-pcie8'" in capsys.readouterr().err


def test_missing_optional_package_is_one_line(tmp_path, capsys, monkeypatch):
    path = tiny_trace(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert cli.main(["simulate", str(path), "--method", "none", "--profile", "seed-pcie8", "--no-progress",
                     "--plot", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "matplotlib" in err and "pip install" in err


def test_answer_mode_one_screen(tmp_path, capsys):
    path = tiny_trace(tmp_path)
    assert cli.main(["simulate", str(path), "--profile", "h200-llama8b", "--no-progress",
                     "--json", str(tmp_path / "rows.json")]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) <= 25
    for text in ("NGRAM_ADAPTIVE", "prompt lookup", "oracle controller", "perfect drafter", "settings:",
                 "h200-llama8b"):
        assert text in out, text
    rows = json.loads((tmp_path / "rows.json").read_text())
    adaptive = next(r for r in rows if r["method"] == "ngramspec-adaptive")
    perfect = next(r for r in rows if r["method"].startswith("oracle:"))
    assert 1.0 < adaptive["accept_len"] <= perfect["accept_len"]
    # the trace repeats one phrase: speculation pays, and the answer says which flags to use
    assert adaptive["speedup"] > 1.05 and "--speculative-algorithm NGRAM_ADAPTIVE" in out


def test_suggested_width_rounds_up_to_a_plugin_width():
    assert simulate.suggested_width({"1": 50, "5": 40, "16": 10}) == 16
    assert simulate.suggested_width({"1": 500, "5": 400, "16": 1}) == 6
    assert simulate.suggested_width({"1": 10}) == 2


# --- demo helpers (no model needed) -------------------------------------------------------------------------

def test_demo_cache_after_holds_the_history_only():
    from ngramspec.engine.demo import cache_after

    cache = cache_after([([1, 2, 3], [4, 5, 6, 7])])
    assert cache.count([5, 6, 7], source="shared") == 1
    assert cache.count([9, 9], source="shared") == 0
    assert cache_after([]).count([5, 6], source="shared") == 0


def test_demo_busy_cpu_caveat():
    from ngramspec.engine.demo import busy_cpu_caveat

    steady = [[10.0, 10.2, 9.9], [30.0, 30.5, 29.8]]
    assert busy_cpu_caveat("cpu", steady, load=0.3, cpus=2) is None
    assert busy_cpu_caveat("cuda", [[1.0, 5.0]], load=9.0, cpus=2) is None
    line = busy_cpu_caveat("cpu", steady, load=3.5, cpus=2)
    assert line.startswith("caveat: busy CPU") and "\n" not in line
    assert "50%" in busy_cpu_caveat("cpu", [[10.0, 15.0]], load=0.1, cpus=2)


def test_hugging_face_tokenizer_folder_with_a_chat_template(tmp_path, word_tokenizer):
    """A tokenizer folder as `save_pretrained` writes it: read by AutoTokenizer, chats rendered by its template."""
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(word_tokenizer), unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}" \
                         "{% if add_generation_prompt %}assistant :{% endif %}"
    folder = tmp_path / "tok"
    fast.save_pretrained(str(folder))
    tok = load_tokenizer(folder)
    chat = [{"role": "user", "content": "the cat"}]
    assert tok.render_chat(chat) == [8, 10, 3, 4, 9, 10]  # user : the cat assistant :
    rec = tokenize_record({"messages": chat + [{"role": "assistant", "content": "a dog"}]}, tok, "r")
    assert rec == {"prompt": [8, 10, 3, 4, 9, 10], "output": [11, 12]}
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_text(word_tokenizer.read_text())
    assert load_tokenizer(bare).encode("the mat") == [3, 7]  # a folder with only tokenizer.json
