"""Every configuration of the server benchmark (`scripts/sglang_engine_bench.py`) is one the plugin accepts: its
`--speculative-adaptive-config` file resolves and builds its controller (a misspelt knob fails here, on the CPU, not
minutes into a GPU call)."""
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ngramspec_sglang.config import resolve_config
from ngramspec_sglang.drafting import make_controller

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "sglang_engine_bench.py"


@pytest.fixture(scope="module")
def configs():
    spec = importlib.util.spec_from_file_location("sglang_engine_bench_configs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.CONFIGS


def test_every_adaptive_config_resolves_and_builds_its_controller(configs, tmp_path):
    checked = 0
    for name, cfg in configs.items():
        if cfg.get("speculative_algorithm") != "NGRAM_ADAPTIVE":
            continue
        path = None
        if "adaptive_file" in cfg:
            path = tmp_path / f"{name}.json"
            path.write_text(json.dumps(cfg["adaptive_file"]))
        args = SimpleNamespace(speculative_num_draft_tokens=cfg.get("speculative_num_draft_tokens"),
                               speculative_adaptive_config=str(path) if path else None,
                               speculative_ngram_max_bfs_breadth=cfg.get("speculative_ngram_max_bfs_breadth", 10))
        config = resolve_config(args)
        make_controller(config)
        for key, value in cfg.get("adaptive_file", {}).get("controller", {}).items():
            assert config.controller[key] == value, name
        checked += 1
    assert checked >= 10


def test_a_misspelt_controller_knob_is_refused(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"controller": {"min_gian": 0.3}}))
    config = resolve_config(SimpleNamespace(speculative_num_draft_tokens=None, speculative_adaptive_config=str(path),
                                            speculative_ngram_max_bfs_breadth=10))
    with pytest.raises(ValueError, match="min_gian"):
        make_controller(config)


def test_the_http_bench_configs_resolve_and_write_their_file(tmp_path):
    """`scripts/sglang_http_bench.py`: a configuration's dict becomes its `--speculative-adaptive-config` file, which
    the plugin accepts and whose controller options reach the controller."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from sglang_http_bench import CONFIGS, build_parser, server_cmd
    finally:
        sys.path.remove(str(SCRIPT.parent))
    checked = 0
    for name, items in CONFIGS.items():
        cmd = server_cmd(build_parser().parse_args(["--model", "M", "--out", str(tmp_path)]), name)
        if "--speculative-adaptive-config" not in cmd:
            continue
        path = cmd[cmd.index("--speculative-adaptive-config") + 1]
        assert path.startswith(str(tmp_path)) and json.loads(Path(path).read_text()) == items[-1]
        config = resolve_config(SimpleNamespace(speculative_num_draft_tokens=None, speculative_adaptive_config=path,
                                                speculative_ngram_max_bfs_breadth=10))
        ctl = make_controller(config)
        if "max_step_tokens" in items[-1].get("controller", {}):
            assert ctl.max_step_tokens == items[-1]["controller"]["max_step_tokens"]
        checked += 1
    assert checked >= 1


def test_the_kernel_window_is_read_back_after_an_untimed_pass(configs, tmp_path):
    """`--kernel-profile`: the bench opens a window (the start file), runs an untimed pass, and reads what the
    worker wrote; a server that never writes one (plain decoding) gives an error entry, and no start file is left."""
    bench = sys.modules["sglang_engine_bench_configs"]
    path = str(tmp_path / "kernels.json")

    class Worker:  # what the scheduler's worker does with the files, at the `after`-th generate after the start file
        def __init__(self, writes, after=1):
            self.writes, self.calls, self.after = writes, 0, after

        def generate(self, prompts, sampling):
            self.calls += 1
            if self.writes and self.calls >= self.after and Path(path + ".start").exists():
                Path(path).write_text(json.dumps({"steps": 32, "gpu_ms_per_step": 7.5}))
                Path(path + ".start").unlink()

    engine = Worker(True)
    assert bench.kernel_window(engine, path, ["a", "b"], {}, 1) == {"steps": 32, "gpu_ms_per_step": 7.5}
    assert engine.calls == 1  # the window closed in the first request
    engine = Worker(False)
    out = bench.kernel_window(engine, path, ["a", "b", "c", "d", "e"], {}, 1, wait_s=0.2)
    assert "error" in out and engine.calls == 4 and not Path(path + ".start").exists() and not Path(path).exists()
    engine = Worker(True)
    assert bench.kernel_window(engine, path, ["a"] * 16, {}, 16)["steps"] == 32 and engine.calls == 1
    # a batch whose drafts are accepted whole ends before the window: the batch again, until the window is written
    engine = Worker(True, after=3)
    assert bench.kernel_window(engine, path, ["a"] * 16, {}, 16)["steps"] == 32 and engine.calls == 3


class WordTokenizer:
    """A stand-in tokenizer: one token per whitespace-separated word."""

    def __call__(self, text):
        return {"input_ids": text.split()}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(ids)


def test_the_preamble_has_the_asked_length_and_is_the_same_every_time(configs):
    bench = sys.modules["sglang_engine_bench_configs"]
    tok = WordTokenizer()
    for n in (50, 4000, 30000):  # the last one longer than the files: they repeat
        text = bench.preamble_text(tok, n)
        assert len(tok(text)["input_ids"]) == n and text == bench.preamble_text(tok, n)
    assert "file: ngramspec/cache.py" in bench.preamble_text(tok, 200)


HANGING_CHILD = '''
import faulthandler, signal, subprocess, sys, time
faulthandler.register(signal.SIGUSR1, all_threads=True)
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(grandchild.pid, file=sys.stderr, flush=True)

def waiting_here():
    time.sleep(600)

waiting_here()
'''


def test_a_configuration_past_its_timeout_leaves_its_stacks_and_no_process(configs, tmp_path):
    """A configuration that outlived its limit on the GPU left only capture progress bars: whether it hung or ran
    slowly was unknown. Now the stacks of the processes that registered SIGUSR1 come back, the log is written, and
    the whole process group (the engine's processes too) is killed."""
    import time

    bench = sys.modules["sglang_engine_bench_configs"]
    script = tmp_path / "hang.py"
    script.write_text(HANGING_CHILD)
    logs = tmp_path / "logs"
    t = time.time()
    res = bench.run_child(str(script), "hang", timeout=3, logs=str(logs), grace=2)
    assert res["error"] == "timeout 3s" and time.time() - t < 30
    assert "waiting_here" in res["stderr_tail"]  # where it was
    log = (logs / "hang.log").read_text()
    assert "waiting_here" in log
    grandchild = int(log.splitlines()[0])
    def alive(pid):  # a zombie is dead: whether init reaps it soon depends on the container
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    for _ in range(50):  # the group's SIGKILL reaches the grandchild too
        if not alive(grandchild):
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the grandchild outlived the timeout")


def test_a_finished_configuration_is_read_from_its_result_line(configs, tmp_path):
    bench = sys.modules["sglang_engine_bench_configs"]
    script = tmp_path / "ok.py"
    script.write_text('import sys\nprint("noise")\nprint("RESULT {\\"tok_s\\": 1.5}")\nprint("x", file=sys.stderr)\n')
    res = bench.run_child(str(script), "ok", timeout=30, logs=str(tmp_path / "logs"))
    assert res["tok_s"] == 1.5 and "wall_s" in res
    assert (tmp_path / "logs" / "ok.log").read_text() == "x\n"
