"""Bad input on the command line: every one gets one line on stderr that names the file or option and what is
wrong, exit status 2, no traceback, and nothing is lost (output paths are checked before the run). A few run as
real subprocesses (the `no traceback` claim end to end); the rest call `ngramspec.cli.main` in-process."""
from __future__ import annotations

import codecs
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ngramspec import cli

TESTS = Path(__file__).resolve().parent
RECORD = {"prompt": [1, 2, 3, 4], "output": [5, 6, 7, 8, 5, 6, 7, 8]}
SIM = ["--method", "none", "--profile", "seed-pcie8", "--no-progress"]
WORDS = ["<unk>", "hello", "world", "the", "cat", "sat", "on", "mat", "a", "dog"]


def jsonl(records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def run(*args, cwd=None) -> subprocess.CompletedProcess:
    """`python -m ngramspec ARGS` in a subprocess."""
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}
    return subprocess.run([sys.executable, "-m", "ngramspec", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=120)


def one_line(err: str, *needles: str) -> str:
    """The single stderr line of a refused command, checked for `needles`."""
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def refused(capsys, *args, needles=()) -> str:
    """`ngramspec ARGS` in-process: exit status 2 and one line on stderr holding `needles`."""
    assert cli.main([str(a) for a in args]) == 2
    return one_line(capsys.readouterr().err, *needles)


@pytest.fixture
def good(tmp_path) -> Path:
    path = tmp_path / "good.jsonl"
    path.write_text(jsonl([RECORD] * 3))
    return path


@pytest.fixture
def word_tokenizer(tmp_path) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = tokenizers.Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


# --- request logs ---------------------------------------------------------------------------------------------

def test_truncated_gzip_is_one_line(tmp_path):
    data = gzip.compress(jsonl({"prompt": list(range(i, i + 40)), "output": list(range(i, i + 200))}
                               for i in range(300)).encode())
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(data[: len(data) // 2])
    proc = run("simulate", path, *SIM)
    assert proc.returncode == 2 and proc.stdout == ""
    one_line(proc.stderr, str(path), "truncated")


def test_gzip_is_told_by_its_content_not_its_name(tmp_path, capsys):
    plain_named_gz = tmp_path / "plain.jsonl.gz"
    plain_named_gz.write_text(jsonl([RECORD]))
    gzip_named_jsonl = tmp_path / "packed.jsonl"
    gzip_named_jsonl.write_bytes(gzip.compress(jsonl([RECORD]).encode()))
    assert cli.main(["simulate", str(plain_named_gz), str(gzip_named_jsonl), *SIM]) == 0
    out = capsys.readouterr().out
    assert "| plain |" in out and "| packed |" in out
    zstd = tmp_path / "log.jsonl.zst"
    zstd.write_bytes(b"\x28\xb5\x2f\xfd" + bytes(20))
    refused(capsys, "simulate", zstd, *SIM, needles=(str(zstd), "zstd", "only gzip"))


def test_latin1_is_refused_with_the_line_and_a_utf8_bom_is_accepted(tmp_path, capsys):
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(jsonl([RECORD]).encode() + '{"prompt": "café", "output": "x"}\n'.encode("latin-1"))
    refused(capsys, "simulate", latin, *SIM, needles=(f"{latin}:2:", "not UTF-8", "0xe9"))
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(codecs.BOM_UTF8 + jsonl([RECORD]).encode())
    assert cli.main(["simulate", str(bom), *SIM]) == 0


def test_bad_records_are_named_by_their_line_counted_from_1(tmp_path, capsys):
    nested = tmp_path / "nested.jsonl"
    nested.write_text(jsonl([RECORD]) + "\n" + jsonl([{"prompt": [[1, 2], [3]], "output": [1]}]))
    refused(capsys, "simulate", nested, *SIM, needles=(f"{nested}:3: prompt", "flat list", "item 1 is [1, 2]"))
    fieldless = tmp_path / "fieldless.jsonl"
    fieldless.write_text(jsonl([RECORD, {"prompt": [1]}]))
    refused(capsys, "simulate", fieldless, *SIM, needles=(f"{fieldless}:2:", "'output'"))


def test_unknown_format_lists_the_accepted_ones(tmp_path, capsys):
    csv = tmp_path / "log.csv"
    csv.write_text("prompt,output\n1,2\n")
    refused(capsys, "simulate", csv, *SIM, needles=(f"{csv}:1: not valid JSON", "JSON Lines", "plain text (.txt)",
                                                   "--tokenizer"))
    refused(capsys, "simulate", tmp_path, *SIM, needles=(str(tmp_path), "is a folder"))


def test_plain_text_logs_with_a_tokenizer(tmp_path, capsys, word_tokenizer):
    lines = tmp_path / "lines.txt"
    lines.write_text("the cat sat on the mat\nhello world\nthe\n")  # the last: one token, nothing to decode
    refused(capsys, "simulate", lines, *SIM, needles=(str(lines), "needs a tokenizer", "--tokenizer"))
    blocks = tmp_path / "blocks.txt"
    blocks.write_text("the cat sat\non the mat\n\nhello world\na dog sat\n\n\nthe cat\n")
    rows = tmp_path / "rows.json"
    assert cli.main(["simulate", str(lines), str(blocks), "--tokenizer", str(word_tokenizer), *SIM,
                     "--json", str(rows)]) == 0
    requests = {r["trace"]: (r["requests"], r["tokens"]) for r in json.loads(rows.read_text())}
    assert requests == {"lines": (2, 5 + 1), "blocks": (3, 5 + 4 + 1)}  # each first token is the prompt


# --- simulate's output options ---------------------------------------------------------------------------------

def test_unwritable_json_is_refused_before_the_run(tmp_path, good):
    target = good / "rows.json"  # under a file: can never be written
    proc = run("simulate", good, *SIM, "--json", target)
    assert proc.returncode == 2 and proc.stdout == ""  # refused before any replay: nothing computed, nothing lost
    one_line(proc.stderr, f"--json {target}", "cannot write", "is a file")


def test_plot_to_a_folder_or_without_an_image_type(tmp_path, capsys, good):
    pytest.importorskip("matplotlib")
    folder = tmp_path / "plots"
    folder.mkdir()
    refused(capsys, "simulate", good, *SIM, "--plot", folder, needles=(f"--plot {folder}", "is a folder",
                                                                       str(folder / "results.png")))
    assert not Path(f"{folder}.png").exists()
    refused(capsys, "simulate", good, *SIM, "--plot", tmp_path / "plot.txt", needles=("--plot", ".png", ".svg"))
    assert not (tmp_path / "plot.txt").exists()


def test_wide_names_the_profile_of_its_accept_len_column(capsys, good):
    assert cli.main(["simulate", str(good), "--method", "none", "--method", "prompt-lookup:k=4", "--profile",
                     "h200-llama8b", "--profile", "seed-pcie8", "--no-progress", "--wide"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert "accept_len h200-llama8b b1" in head and "speedup seed-pcie8 b1" in head


def test_one_trace_twice_and_max_width_zero(tmp_path, capsys, good):
    refused(capsys, "simulate", good, tmp_path / ".." / tmp_path.name / good.name, *SIM,
            needles=("given twice", good.name))
    other = tmp_path / "sub" / "good.jsonl.gz"
    other.parent.mkdir()
    other.write_bytes(gzip.compress(good.read_bytes()))
    refused(capsys, "simulate", good, other, *SIM, needles=("both named 'good'", str(other)))
    refused(capsys, "simulate", good, "--method", "ngramspec-adaptive:max_width=0", "--no-progress",
            needles=("'ngramspec-adaptive:max_width=0'", "max_width must be an int >= 1, got 0"))


# --- demo and calibrate: refused before any model loads --------------------------------------------------------

def test_demo_bad_policy_is_one_line_in_a_subprocess(tmp_path):
    proc = run("demo", "--policy", "bogus", "--gguf", tmp_path / "absent.gguf")
    assert proc.returncode == 2, proc.stderr
    one_line(proc.stderr, "ngramspec demo: error: --policy", "'bogus'", "adaptive")


@pytest.fixture
def no_model_load(monkeypatch):
    pytest.importorskip("torch")
    from ngramspec.engine import model

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")
    monkeypatch.setattr(model, "_load", refuse)


@pytest.mark.parametrize("args, needles", [
    (["demo", "--policy", "adaptive:max_width=0"], ["--policy", "max_width must be an int >= 1, got 0"]),
    (["demo", "--device", "tpu"], ["--device", "'tpu'", "cpu or cuda"]),
    (["demo", "--gguf", "absent.gguf"], ["--gguf absent.gguf: no such file"]),
    (["demo", "--repeats", "0"], ["--repeats must be >= 1"]),
    (["demo", "--policy", "plain", "--recycle"], ["--recycle needs a drafting policy"]),
    (["calibrate", "--device", "tpu"], ["ngramspec calibrate: error: --device", "'tpu'"]),
    (["calibrate", "--gguf", "absent.gguf"], ["--gguf absent.gguf: no such file"]),
    (["calibrate", "--widths", "0,2"], ["--widths", ">= 1"]),
])
def test_engine_commands_refuse_bad_options(args, needles, capsys, monkeypatch, tmp_path, no_model_load):
    monkeypatch.chdir(tmp_path)
    refused(capsys, *args, needles=needles)


def test_engine_output_paths_are_checked_first(capsys, tmp_path, no_model_load):
    refused(capsys, "demo", "--json-out", tmp_path, needles=(f"--json-out {tmp_path}", "is a folder"))
    (tmp_path / "file").write_text("")
    refused(capsys, "calibrate", "-o", tmp_path / "file" / "y.json", "--gguf", tmp_path / "absent.gguf",
            needles=("--output", "cannot write"))


def test_demo_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    out = capsys.readouterr().out
    options = out[out.index("options:"):].split("\n  -")[1:]
    assert len(options) == 12
    for option in options:  # each entry: the option (and its metavar), then its help text
        assert len(option.split()) > 2, option


# --- test skips ------------------------------------------------------------------------------------------------

def test_a_skip_reason_is_one_line_with_the_fix(tmp_path):
    (tmp_path / "broken_pkg.py").write_text("raise ImportError('\\n\\nIMPORTANT: PLEASE READ THIS\\n' + "
                                            "'\\n'.join(f'line {i}' for i in range(18)))\n")
    (tmp_path / "test_skips.py").write_text(
        "import pytest\n"
        "def test_missing():\n    pytest.importorskip('tiktoken_absent')\n"
        "def test_broken():\n    pytest.importorskip('broken_pkg', exc_type=ImportError)\n"
        "def test_long():\n    pytest.skip('why\\n' + 'more\\n' * 20)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(tmp_path), str(TESTS.parent)])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "skip_reasons",
                           "test_skips.py"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == 3 and "line 3" not in proc.stdout and "more" not in proc.stdout, proc.stdout
    assert "needs the package 'tiktoken_absent', not installed (pip install" in skipped[0]
    assert "'broken_pkg' does not import (IMPORTANT: PLEASE READ THIS); reinstall it" in skipped[1]
    assert skipped[2].endswith("why ...")
