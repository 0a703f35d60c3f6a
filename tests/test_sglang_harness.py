"""The GPU harness of the sampling and soak checks (scripts/sglang_sampling_check.py, scripts/sglang_soak.py), on CPU:
the chi-square statistics (p-values against scipy's, identical distributions pass, shifted ones and the broken-
verifier control fail), the soak's request mix, schedule, parsers and checks, and a whole soak run against a stub
HTTP server on 127.0.0.1 (this file, run as `--stub-server PORT`; `--stub-bench ...` stands in for bench_serving).
"""
from __future__ import annotations

import gzip
import json
import math
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from script_module import load_script

ROOT = Path(__file__).resolve().parents[1]




# ------------------------------------------------------------------------------------------------- the stubs

STUB_VOCAB, STUB_CONTEXT = 1000, 512


def run_stub_server(port: int, out: str) -> None:
    """A stand-in for `sglang.launch_server` with the endpoints the soak uses, a child process named like SGLang's
    scheduler (for the RSS lookup), and NGRAM_ADAPTIVE's state file (loaded at start if there, written after 0.5 s).
    Answers are deterministic functions of the prompt."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    state_file = os.path.join(out, "controller_state.npz")
    if os.path.exists(state_file):
        print(f"NGRAM_ADAPTIVE: controller state loaded from {state_file}", flush=True)
    else:
        print(f"NGRAM_ADAPTIVE: no controller state at {state_file} yet, starting cold", flush=True)
    threading.Timer(0.5, lambda: Path(state_file).write_bytes(b"state")).start()
    if os.environ.get("NGRAMSPEC_MEM_TRACE"):  # --mem-trace: as the plugin's MemTrace writes it
        Path(os.environ["NGRAMSPEC_MEM_TRACE"]).write_text(json.dumps({"every_s": 30.0, "snapshots": [
            {"t_s": 30.0, "rss_mb": 100.0, "traced_mb": 1.0, "grew": []}]}))

    watch = "import os, time\np = os.getppid()\nwhile os.getppid() == p:\n    time.sleep(0.2)\n"
    subprocess.Popen([sys.executable, "-c", watch, "sglang::scheduler_TP0"])
    lock = threading.Lock()
    state = {"inflight": 0, "done": 0, "aborted": set(), "responses": {}}

    def tokens_for(body: dict) -> list[int]:
        sp = body.get("sampling_params") or {}
        seed = sum(map(ord, body.get("text") or "")) + sum(body.get("input_ids") or [])
        return [(seed * 31 + k * 7) % STUB_VOCAB for k in range(min(int(sp.get("max_new_tokens", 16)), 12))]

    def answer(body: dict, ids: list[int], finish: dict) -> dict:
        sp = body.get("sampling_params") or {}
        text = " ".join(f"w{t}" for t in ids)
        if sp.get("json_schema"):
            text, finish = '{"name": "Al", "age": 3}', {"type": "stop"}
        elif sp.get("regex"):
            text, finish = "yes, 12 apples", {"type": "stop"}
        elif sp.get("stop"):
            finish = {"type": "stop"}
        meta = {"finish_reason": finish, "completion_tokens": len(ids), "prompt_tokens": 5}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[-0.1, t, None] for t in ids]
            meta["output_top_logprobs"] = [[[-0.1, t, None], [-2.0, t + 1, None]] for t in ids]
        return {"text": text, "output_ids": ids, "meta_info": meta}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, status: int, payload, ctype: str = "application/json") -> None:
            data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            with lock:
                key = (self.path.split("?")[0], status)
                state["responses"][key] = state["responses"].get(key, 0) + 1

        def do_GET(self):
            path = self.path.split("?")[0]
            if path == "/health":
                self.reply(200, "ok", "text/plain")
            elif path == "/server_info":
                self.reply(200, {"context_length": None, "internal_states": [{"max_total_num_tokens": 100000}]})
            elif path == "/metrics":
                with lock:
                    n, done = state["inflight"], state["done"]
                    responses = dict(state["responses"])
                lab = '{model_name="stub",engine_type="unified"}'
                lines = ["# HELP sglang:num_running_reqs The number of running requests.",
                         "# TYPE sglang:num_running_reqs gauge",
                         f"sglang:num_running_reqs{lab} {float(n)}", f"sglang:num_queue_reqs{lab} 0.0",
                         f"sglang:token_usage{lab} {n / 100:.2f}", f"sglang:kv_used_tokens{lab} {100.0 * n}",
                         f"sglang:kv_available_tokens{lab} {100000.0 - 100 * n}",
                         f"sglang:kv_evictable_tokens{lab} 0.0",
                         f"ngramspec:verify_width{lab} {1 + done % 5}", f"ngramspec:drafted_tokens{lab} {done % 7}",
                         f"ngramspec:predicted_accept_length{lab} {1 + done % 3 / 3:.3f}",
                         f"ngramspec:realized_accept_length{lab} {1 + done % 4 / 4:.3f}",
                         f'sglang:queue_time_seconds_bucket{{le="+Inf",model_name="stub"}} {float(done)}']
                lines += [f'sglang:http_responses_total{{endpoint="{p}",status_code="{s}",method="POST"}} {float(c)}'
                          for (p, s), c in responses.items()]
                self.reply(200, "\n".join(lines) + "\n", "text/plain")
            else:
                self.reply(404, {"error": "no such endpoint"})

        def do_POST(self):
            path = self.path.split("?")[0]
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if path == "/abort_request":
                with lock:
                    state["aborted"].add(body.get("rid"))
                self.reply(200, "")
            elif path == "/flush_cache":  # as SGLang's: with ?timeout=S, waits up to S seconds for idle
                query = dict(q.split("=", 1) for q in self.path.partition("?")[2].split("&") if "=" in q)
                deadline = time.monotonic() + float(query.get("timeout", 0))
                while True:
                    with lock:
                        busy = state["inflight"] > 0
                    if not busy or time.monotonic() >= deadline:
                        break
                    time.sleep(0.01)
                self.reply(400 if busy else 200, "busy" if busy else "Cache flushed.", "text/plain")
            elif path == "/generate":
                self.generate(body)
            else:
                self.reply(404, {"error": "no such endpoint"})

        def generate(self, body: dict) -> None:
            ids = body.get("input_ids")
            if body.get("text") == "" or (ids is not None and (not ids or len(ids) >= STUB_CONTEXT
                                                               or any(not 0 <= t < STUB_VOCAB for t in ids))):
                self.reply(400, {"error": {"message": "invalid request"}})
                return
            with lock:
                state["inflight"] += 1
            try:
                out = tokens_for(body)
                rid, finish = body.get("rid"), {"type": "length"}
                if body.get("stream"):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    for k in range(1, len(out) + 1):
                        time.sleep(0.02)
                        with lock:
                            if rid in state["aborted"]:
                                finish = {"type": "abort"}
                        done = finish["type"] == "abort" or k == len(out)
                        chunk = answer(body, out[:k], finish if done else None)
                        self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                        self.wfile.flush()
                        if done:
                            break
                    self.wfile.write(b"data: [DONE]\n\n")
                    return
                for _ in range(5 if rid else 1):
                    time.sleep(0.05)
                    with lock:
                        if rid in state["aborted"]:
                            finish = {"type": "abort"}
                n = (body.get("sampling_params") or {}).get("n", 1)
                a = answer(body, out, finish)
                self.reply(200, [a] * n if n > 1 else a)
            except (BrokenPipeError, ConnectionResetError):
                pass
            finally:
                with lock:
                    state["inflight"] -= 1
                    state["done"] += 1
                    sched = os.environ.get("NGRAMSPEC_SCHED_PROFILE")
                    if sched:  # SGLang's scheduler profile, as the plugin's hook writes it: 10 steps of 5 ms each
                        steps = 10 * state["done"]
                        Path(sched).write_text(json.dumps({"decode_steps": steps, "decode_periods": steps,
                                                           "decode_period_s": 0.005 * steps, "phases": {}}))

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    server.serve_forever()


def run_stub_bench(port: int, num: int, out_file: str) -> None:
    """A stand-in for bench_serving: a few requests, then its JSONL result line."""
    import http.client

    errors, t0 = [], time.time()
    for i in range(min(num, 4)):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            conn.request("POST", "/generate", json.dumps({"text": f"bench {i}", "sampling_params": {
                "max_new_tokens": 8}}), {"Content-Type": "application/json"})
            status = conn.getresponse().status
            errors.append("" if status == 200 else f"HTTP {status}")
        except OSError as e:
            errors.append(repr(e))
        finally:
            conn.close()
    with open(out_file, "a") as f:
        f.write(json.dumps({"completed": errors.count(""), "errors": errors, "duration": time.time() - t0,
                            "output_throughput": 1.0, "accept_length": None}) + "\n")


# ---------------------------------------------------------------------------------------------------- statistics

@pytest.fixture(scope="module")
def sc():
    return load_script("sglang_sampling_check")


@pytest.fixture(scope="module")
def soak():
    return load_script("sglang_soak")


# chi2.sf(x, df) from scipy 1.17.1
SCIPY_SF = [(3.841458820694124, 1, 0.04999999999999989), (5.991464547107979, 2, 0.05000000000000007),
            (11.070497693516351, 5, 0.05000000000000007), (18.307038053275146, 10, 0.05000000000000005),
            (23.209251158954356, 10, 0.010000000000000005), (43.77297182574219, 30, 0.04999999999999989),
            (0.5, 1, 0.47950012218695337), (1.0, 3, 0.8012519569012009), (7.0, 3, 0.07189777249646509),
            (20.0, 10, 0.029252688076961124), (100.0, 10, 5.4497019829205215e-17), (50.0, 60, 0.8178960840225449),
            (300.0, 200, 5.924540335483916e-06), (0.001, 4, 0.9999998750416589), (2.5, 0.5, 0.04724670114390913),
            (40.0, 1, 2.5396285894708634e-10), (700.0, 400, 1.07656270646138e-18),
            (1500.0, 1000, 1.0454640385980825e-22)]


def test_chi2_sf_matches_scipy_and_closed_forms(sc):
    for x, df, ref in SCIPY_SF:
        assert math.isclose(sc.chi2_sf(x, df), ref, rel_tol=1e-12), (x, df)
    for x in (0.01, 0.7, 3.0, 12.0, 60.0):
        assert math.isclose(sc.chi2_sf(x, 2), math.exp(-x / 2), rel_tol=1e-12)
        assert math.isclose(sc.chi2_sf(x, 1), math.erfc(math.sqrt(x / 2)), rel_tol=1e-10)
    assert sc.chi2_sf(0.0, 3) == 1.0 and sc.chi2_sf(-1.0, 3) == 1.0


def test_chi2_homogeneity_matches_scipy_contingency_tables(sc):
    # scipy.stats.chi2_contingency(table, correction=False): statistic, p
    for table, stat, p in [([[30, 50, 20], [40, 40, 20]], 2.5396825396825395, 0.28087620176428163),
                           ([[120, 60, 20], [90, 70, 40]], 11.721611721611723, 0.0028489469027145743),
                           ([[500, 300, 150, 50], [450, 330, 160, 60]], 5.291821930192049, 0.1516339347552897)]:
        a = [k for k, c in enumerate(table[0]) for _ in range(c)]
        b = [k for k, c in enumerate(table[1]) for _ in range(c)]
        r = sc.chi2_homogeneity(a, b)
        assert r["df"] == len(table[0]) - 1
        assert math.isclose(r["stat"], stat, rel_tol=1e-12) and math.isclose(r["p"], p, rel_tol=1e-10)


def test_rare_outcomes_are_binned_and_degenerate_cases_untested(sc):
    a = [0] * 90 + [1] * 6 + [2, 3, 4, 5]
    b = [0] * 88 + [1] * 8 + [6, 7, 8, 9]
    r = sc.chi2_homogeneity(a, b)  # 0 kept; 1 (pooled 14) kept; 2..9 pooled into "other" (8 < 10) joins 1
    assert r["bins"] == 2 and r["df"] == 1
    assert sc.chi2_homogeneity([7] * 50, [7] * 60)["df"] == 0  # one outcome: nothing to test
    assert sc.chi2_homogeneity([1, 2], [3, 4])["p"] == 1.0
    assert sc.chi2_homogeneity([], [1])["df"] == 0


def test_holm(sc):
    adj = sc.holm([0.01, 0.04, 0.03, 0.005])
    assert [round(x, 10) for x in adj] == [0.03, 0.06, 0.06, 0.02]
    assert sc.holm([]) == [] and sc.holm([0.9, 0.9]) == [1.0, 1.0]


def markov_sampler(seed: int, n: int, tokens: int = 8, temp: float = 1.0, prompt: int = 0) -> list[list[int]]:
    """Samples from a fixed random Markov chain over 12 tokens (a stand-in for a model: a few likely tokens per
    context), optionally at another temperature."""
    chain = random.Random(100 + prompt)
    logits = {(p, t): [chain.gauss(0, 1.5) for _ in range(12)] for p in range(tokens) for t in range(12)}
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        s, prev = [], prompt
        for k in range(tokens):
            w = [math.exp(x / temp) for x in logits[(k, prev)]]
            prev = rng.choices(range(12), weights=w)[0]
            s.append(prev)
        out.append(s)
    return out


def test_same_distribution_passes_and_broken_ones_fail(sc):
    prompts = ("p0", "p1")
    a = {p: markov_sampler(1 + i, 2000, prompt=i) for i, p in enumerate(prompts)}
    b = {p: markov_sampler(11 + i, 2000, prompt=i) for i, p in enumerate(prompts)}
    hot = {p: markov_sampler(21 + i, 2000, temp=1.5, prompt=i) for i, p in enumerate(prompts)}
    broken = {p: sc.greedy_verifier_mimic(b[p], 0.3, seed=i) for i, p in enumerate(prompts)}
    same = sc.compare_sets(a, b, 8, alpha=0.01)
    assert same["passes"] and same["tests"] + same["untestable"] == 2 * 9 and same["min_p_holm"] >= 0.01
    shifted = sc.compare_sets(a, hot, 8, alpha=0.01)
    assert not shifted["passes"] and shifted["min_p"] < 1e-6
    bad = sc.compare_sets(a, broken, 8, alpha=0.01)
    assert not bad["passes"] and bad["worst"]["position"] != 1  # the first token is never replaced
    assert all(t["p"] > 0.001 for t in bad["detail"] if t["position"] == 1)


def test_greedy_verifier_mimic(sc):
    samples = [[0, 1, 2], [0, 1, 3], [0, 1, 2], [5, 6]]
    assert sc.greedy_verifier_mimic(samples, 0.0) == samples
    full = sc.greedy_verifier_mimic(samples, 1.0)
    assert full[1] == [0, 1, 2] and full[3] == [5, 6] and [s[0] for s in full] == [0, 0, 0, 5]


def test_analyze_report_and_cli(sc, tmp_path, capsys):
    def sets(seed, **extra):
        return {"A": markov_sampler(seed, 1500), **{k: markov_sampler(seed + v, 1500, temp=t)
                                                    for k, (v, t) in extra.items()}}
    results = {"plain": {"samples": {"t07": {"p": sets(1, B=(1, 1.0), P=(2, 1.05))}}, "spec": {}, "accept": {}},
               "adaptive": {"samples": {"t07": {"p": sets(40)}}, "spec": {"t07": {"p": {
                   "A": {"tokens": 12000, "verify_steps": 4000}}}}, "accept": {"greedy": {"accept_len": 3.5}}},
               "ngram": {"samples": {"t07": {"p": {"A": markov_sampler(50, 1500, temp=2.0)}}}}}
    report = sc.analyze(results, tokens=8, alpha=0.01, broken_q=0.3)
    rows = report["t07"]
    assert rows["plain_B"]["passes"] and rows["plain_B"]["ok"]
    assert rows["adaptive"]["passes"] and rows["adaptive"]["ok"]
    assert not rows["broken_verifier"]["passes"] and rows["broken_verifier"]["ok"]
    assert not rows["ngram"]["passes"] and not rows["ngram"]["ok"]  # a changed distribution is caught
    assert rows["plain_t+0.05"]["ok"]  # informative only
    assert sc.spec_accept(results["adaptive"], "t07") == 3.0
    assert sc.drafts_accepted(results["adaptive"], "t07", 8) and sc.drafts_accepted(results["plain"], "t07", 8) is None
    assert sc.print_report(results, report, 0.01, ["t07"]) is False
    assert "NO draft accepted" not in capsys.readouterr().out
    # a configuration whose samples were all decoded one token per step (8 tokens in 7 steps): its pass says nothing
    idle = {k: v for k, v in results.items() if k != "ngram"}
    idle["adaptive"] = {**results["adaptive"], "spec": {"t07": {"p": {"A": {"tokens": 8000, "verify_steps": 7000}}}}}
    assert sc.drafts_accepted(idle["adaptive"], "t07", 8) is False
    idle_report = sc.analyze(idle, tokens=8, alpha=0.01, broken_q=0.3)
    assert idle_report["t07"]["adaptive"]["ok"]  # the distributions agree ...
    assert sc.print_report(idle, idle_report, 0.01, ["t07"]) is False  # ... and the report still fails
    assert "NO draft accepted over the samples at t07" in capsys.readouterr().out
    sc.print_report(results, report, 0.01, ["t07"])
    out = capsys.readouterr().out
    assert "broken_verifier" in out and "FAIL" in out and "3.5" in out
    path = tmp_path / "sampling.json"
    path.write_text(json.dumps({"results": {k: v for k, v in results.items() if k != "ngram"}}))
    gz = tmp_path / "sampling.json.gz"  # a saved run kept compressed
    gz.write_bytes(gzip.compress(path.read_bytes()))
    for saved in (path, gz):
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "sglang_sampling_check.py"), "--analyze",
                               str(saved)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "plain_B" in proc.stdout


class FakeEngine:
    """sglang.Engine as the sampling check uses it: each request's tokens drawn from a fixed Markov chain (per prompt)
    with the request's own seed, at its temperature; spec configs report verify steps; `broken` configs return the
    argmax token instead of a sample at every position after the first, half the time."""
    seeds: list = []

    def __init__(self, **kw):
        self.kw = kw
        self.spec = kw.get("speculative_algorithm")

    def generate(self, prompts, params):
        import zlib

        params = [params] * len(prompts) if isinstance(params, dict) else params
        out = []
        for text, p in zip(prompts, params):
            seed = p.get("sampling_seed")
            FakeEngine.seeds.append(seed)
            chain = random.Random(zlib.crc32(text.encode()))
            rng = random.Random((zlib.crc32(text.encode()) << 32) ^ (seed if seed is not None else 7))
            ids, prev = [], 0
            for k in range(p["max_new_tokens"]):
                logits = [chain.gauss(0, 1.5) + 0.3 * ((prev + j) % 3) for j in range(12)]
                best = max(range(12), key=logits.__getitem__)
                temp = p.get("temperature", 1.0)
                if temp == 0 or (self.kw.get("broken") and k > 0 and rng.random() < 0.5):
                    prev = best
                else:
                    prev = rng.choices(range(12), weights=[math.exp(x / temp) for x in logits])[0]
                ids.append(prev)
            meta = {"completion_tokens": len(ids)}
            if self.spec:
                meta["spec_verify_ct"] = max(1, len(ids) // 2)
            out.append({"output_ids": ids, "meta_info": meta})
        return out

    def shutdown(self):
        pass


def test_sampling_check_child_with_a_fake_engine(sc, monkeypatch):
    """run_one (the GPU child) end to end with a stand-in sglang.Engine and tokenizer: the sets, disjoint seeds,
    accept lengths, and the analysis of what it returns (a verifier that returns argmax tokens is caught)."""
    import types
    from argparse import Namespace

    fake_sglang = types.ModuleType("sglang")
    fake_sglang.Engine = FakeEngine
    fake_tf = types.ModuleType("transformers")

    class Tok:
        chat_template = "fake"

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
            return "<user>" + messages[0]["content"] + "<assistant>"

    fake_tf.AutoTokenizer = types.SimpleNamespace(from_pretrained=lambda model: Tok())
    monkeypatch.setitem(sys.modules, "sglang", fake_sglang)
    monkeypatch.setitem(sys.modules, "transformers", fake_tf)
    monkeypatch.setattr(FakeEngine, "seeds", [])
    a = Namespace(model="/m", extra="", deterministic=False, mem_fraction=None, max_total_tokens=400000,
                  dtype="float16", samples=400, tokens=8, temps="t07,t10", batch=250, accept_tokens=16,
                  accept_repeats=1)
    results = {name: sc.run_one(name, a) for name in ("plain", "adaptive")}
    a.extra = json.dumps({"broken": True})
    results["ngram"] = sc.run_one("ngram", a)
    seeds = [x for x in FakeEngine.seeds if x is not None]
    assert len(seeds) == len(set(seeds)) == 400 * 4 * 2 * (3 + 1 + 1)  # every sample its own seed
    engines = []
    monkeypatch.setattr(fake_sglang, "Engine", lambda **kw: engines.append(kw) or FakeEngine(**kw))
    a.samples, a.extra, a.temps = 5, "", "t07"
    sc.run_one("adaptive_w8", a)
    cfg = engines[0]["speculative_adaptive_config"]
    assert json.loads(Path(cfg).read_text()) == {"fixed_width": 8, "draft_max_batch": None}  # every batch drafts
    assert engines[0]["max_total_tokens"] == 400000 and engines[0]["attention_backend"] == "triton"
    plain = results["plain"]
    assert set(plain["samples"]["t07"]["code_copy"]) == {"A", "B", "P"}
    assert set(results["adaptive"]["samples"]["t10"]["chat_repeat"]) == {"A"}
    assert all(len(x) == 8 for x in plain["samples"]["t07"]["list_copy"]["A"])
    assert results["adaptive"]["accept"]["greedy"]["accept_len"] == 2.0 and plain["accept"]["t07"]["accept_len"] is None
    assert sc.spec_accept(results["adaptive"], "t07") == 2.0
    report = sc.analyze(results, tokens=8, alpha=0.01, broken_q=0.3)
    for temp in ("t07", "t10"):
        rows = report[temp]
        assert rows["plain_B"]["passes"] and rows["adaptive"]["passes"], temp
        assert not rows["broken_verifier"]["passes"] and not rows["ngram"]["passes"], temp


# ---------------------------------------------------------------------------------------------------- the soak


def test_request_mix_kinds_keeps_only_those_kinds(soak):
    """--kinds: the clients send only the named kinds, in their relative weights; an unknown kind is an error."""
    mix = soak.RequestMix(seed=5, kinds=["n", "logprob"])
    specs = [mix.next() for _ in range(2000)]
    assert {s["kind"] for s in specs} == {"n", "logprob"}
    share_n = sum(s["kind"] == "n" for s in specs) / len(specs)
    w = soak.RequestMix.WEIGHTS
    assert abs(share_n - w["n"] / (w["n"] + w["logprob"])) < 0.04
    for bad in (["n", "nope"], []):
        with pytest.raises(ValueError, match="request kinds"):
            soak.RequestMix(kinds=bad)
    assert soak.build_parser().parse_args(["--model", "m", "--kinds", "n,logprob"]).kinds == "n,logprob"


def test_request_mix_fractions_and_bounds(soak):
    mix = soak.RequestMix(seed=3)
    specs = [mix.next() for _ in range(4000)]
    kinds = {k: sum(s["kind"] == k for s in specs) / len(specs) for k in soak.RequestMix.WEIGHTS}
    for k, w in soak.RequestMix.WEIGHTS.items():
        assert abs(kinds[k] - w) < 0.03, (k, kinds[k], w)
    streams = [s for s in specs if s["stream"]]
    assert sum(s["disconnect_after"] is not None for s in streams) / len(streams) >= 0.10
    rids = [s["body"]["rid"] for s in specs if s["kind"] == "abort"]
    assert len(rids) == len(set(rids)) and all(s["abort_after"] <= 1.5 for s in specs if s["kind"] == "abort")
    for s in specs:
        sp = s["body"]["sampling_params"]
        assert 1 <= sp["max_new_tokens"] <= soak.RequestMix.MAX_NEW
        json.dumps(s["body"])
    assert {s["check"] for s in specs} == {None, "logprobs", "json", "regex", "stop", "n"}
    again = soak.RequestMix(seed=3)
    assert [again.next()["body"] for _ in range(50)] == [s["body"] for s in specs[:50]]
    try:  # the bodies obey SGLang's /generate contract where that package is installed
        from sglang.api.v1.api_types import GenerateRequest
    except ImportError:
        return
    for s in specs[:500]:
        GenerateRequest.from_json_value(s["body"])
    for _, body in soak.bad_request_cases(STUB_CONTEXT, STUB_VOCAB):
        GenerateRequest.from_json_value(body)


def test_check_answer_and_outcomes(soak):
    def spec(kind, check, **sp):
        return {"kind": kind, "check": check, "abort_after": None,
                "body": {"text": "x", "sampling_params": {"max_new_tokens": 8, **sp}}}
    stop = {"finish_reason": {"type": "stop"}}
    assert soak.check_answer(spec("json_schema", "json"), {"text": '{"name": "a", "age": 1}', "meta_info": stop}) \
        is None
    assert soak.check_answer(spec("json_schema", "json"), {"text": '{"name": "a"', "meta_info": stop})
    assert soak.check_answer(spec("json_schema", "json"), {"text": '{"name": "a"', "meta_info": {
        "finish_reason": {"type": "length"}}}) is None  # cut by max_new_tokens: not judged
    assert soak.check_answer(spec("regex", "regex"), {"text": "no, 7 pears", "meta_info": stop}) is None
    assert soak.check_answer(spec("regex", "regex"), {"text": "maybe", "meta_info": stop})
    assert soak.check_answer(spec("stop", "stop", stop=["."]), {"text": "a. b", "meta_info": stop})
    assert soak.check_answer(spec("n", "n", n=2), [{}, {}]) is None
    assert soak.check_answer(spec("n", "n", n=3), [{}, {}])
    lp = {"completion_tokens": 2, "output_token_logprobs": [[0, 1, None]]}
    assert soak.check_answer(spec("logprob", "logprobs"), {"text": "ab", "meta_info": lp})
    ab = {**spec("abort", None), "abort_after": 0.1}
    assert soak.outcome_of(ab, 200, {"meta_info": {"finish_reason": {"type": "abort"}}}, None) == "aborted"
    assert soak.outcome_of(spec("greedy", None), 200, {"text": "a", "meta_info": {"finish_reason": {
        "type": "abort"}}}, None) == "unexpected_abort"
    assert soak.outcome_of(spec("greedy", None), 503, "x", None) == "http_503"
    assert soak.outcome_of(spec("greedy", None), None, None, "timeout") == "timeout"
    assert soak.classify_exception(socket.timeout()) == "timeout"
    assert soak.classify_exception(ConnectionRefusedError()) == "connection"


def test_schedule(soak):
    """Each server instance's part ramps 2..32 req/s over its first half and holds 32 over its second half, the
    window the RSS check fits."""
    segs = soak.schedule(600.0)
    bench = [s for s in segs if s["kind"] == "bench"]
    assert [s["rate"] for s in bench] == [2, 4, 8, 16, 32, 32] * 2
    assert [s.get("hold", False) for s in bench] == [False] * 5 + [True] + [False] * 5 + [True]
    assert [s["kind"] for s in segs].index("restart") == 6 and segs[6]["start"] == 300.0
    assert [(s["start"], s["end"]) for s in bench if s.get("hold")] == [(150.0, 300.0), (450.0, 600.0)]
    assert math.isclose(sum(s["end"] - s["start"] for s in bench), 600.0)
    assert all(math.isclose(x["end"], y["start"]) for x, y in zip(segs, segs[1:]))
    # the RSS check's window, each instance's second half, is its hold
    assert soak.second_half([(t, 0.0) for t in range(0, 301, 5)], 0, 300)[0][0] == 150
    assert [s["kind"] for s in soak.schedule(100.0, rates=(1, 2), restart_at=0.5, hold=0.0)] == [
        "bench", "bench", "restart", "bench", "bench"]
    alone = soak.schedule(60.0, restart_at=None)
    assert all(s["kind"] == "bench" for s in alone) and [s["rate"] for s in alone] == [2, 4, 8, 16, 32, 32]
    assert alone[-1]["hold"] and math.isclose(alone[-1]["start"], 30.0) and alone[-1]["end"] == 60.0
    for bad in ("1", "-0.1"):
        with pytest.raises(SystemExit):
            soak.main(["--model", "m", "--out", "o", "--hold", bad])


def test_rss_slope(soak):
    line = [(t, 500.0 + 2.0 * t / 60) for t in range(0, 300, 5)]
    assert math.isclose(soak.slope_per_min(line), 2.0, rel_tol=1e-9)
    assert soak.slope_per_min(line[:2]) is None and soak.slope_per_min([(1, 2), (1, 3), (1, 4)]) is None
    rng = random.Random(0)
    flat = [(t, 800 + rng.uniform(-1, 1)) for t in range(0, 600, 5)]
    assert abs(soak.slope_per_min(flat)) < 0.5
    half = soak.second_half(line, 0, 300)
    assert half[0][0] == 150 and half[-1][0] == 295


def test_an_instance_rss_window_ends_where_the_restart_stopped_it(soak):
    """Instance 0 serves until the half-time restart starts instance 1 (at 300 s), which is ready only at 400 s:
    instance 0's window is its own 0-300 s (second half: 30 samples of it), not up to instance 1's readiness (its
    second half would hold 10 samples of instance 0, the last 50 s before it stopped)."""
    samples = [{"t": t, "instance": 0, "rss": {"scheduler": 3000 + 0.1 * t}} for t in range(0, 300, 5)]
    samples += [{"t": t, "instance": 1, "rss": {"scheduler": 3500.0}} for t in range(400, 600, 5)]
    res = {"load_window": [0, 600], "samples": samples,
           "instances": [{"instance": 0, "started": -60.0, "startup_s": 60.0, "ready_at": 0.0},
                         {"instance": 1, "started": 300.0, "startup_s": 100.0, "ready_at": 400.0}]}
    w0, w1 = soak.rss_windows(res)
    assert w0["window"] == [0, 300] and w0["points"] == 30 and math.isclose(w0["slope_mb_per_min"], 6.0)
    assert w1["window"] == [400, 600] and w1["points"] == 20 and w1["slope_mb_per_min"] == 0.0


def test_rss_windows_split_the_growth_by_kind(soak):
    """The RSS slope of each instance's window, and beside it which kind of page grows (here shared memory, as
    CUDA's pinned host memory would): 6 MB/min in all, of it shmem 6, anon and file flat."""
    samples = [{"t": t, "instance": 0, "rss": {"scheduler": 3000 + 0.1 * t},
                "scheduler_kinds": {"anon": 2500.0, "file": 200.0, "shmem": 300 + 0.1 * t}} for t in range(0, 600, 10)]
    samples += [{"t": 5.0, "instance": 0, "error": "lost"}]  # a sample without memory counts is left out
    res = {"load_window": [0, 600], "samples": samples,
           "instances": [{"instance": 0, "started": 0.0, "startup_s": 0.0, "ready_at": 0.0}]}
    (w,) = soak.rss_windows(res)
    assert math.isclose(w["slope_mb_per_min"], 6.0) and w["points"] == 30
    assert w["slope_by_kind"] == {"anon": 0.0, "file": 0.0, "shmem": 6.0}
    for s in samples:
        s["m"] = {"ngramspec:pinned_host_mb": 100 + 0.1 * s["t"], "ngramspec:pinned_host_active_mb": 4.0}
    # NGRAM_ADAPTIVE's pinned-memory gauges beside the page kinds: the growth is torch's pinned cache, not in use
    assert soak.rss_windows(res)[0]["slope_by_kind"] == {"anon": 0.0, "file": 0.0, "shmem": 6.0, "pinned": 6.0,
                                                           "pinned_in_use": 0.0}
    for s in samples:
        s.pop("scheduler_kinds", None)  # an older result file: no split
        s.pop("m", None)
    assert soak.rss_windows(res)[0]["slope_by_kind"] == {}


METRICS_TEXT = """# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",engine_type="unified",tp_rank="0"} 3.0
sglang:num_running_reqs{model_name="m",engine_type="unified",tp_rank="1"} 2.0
sglang:num_queue_reqs{model_name="m"} 0.0
sglang:kv_used_tokens{model_name="m"} 1234.0
sglang:token_usage{model_name="m"} 0.05
ngramspec:verify_width{model_name="m",note="a \\"quoted\\" label"} 3.5
ngramspec:drafted_tokens 2.25 1700000000000
sglang:queue_time_seconds_bucket{le="0.5",model_name="m"} 7.0
sglang:http_responses_total{endpoint="/generate",status_code="200",method="POST"} 40.0
sglang:http_responses_total{endpoint="/generate",status_code="400",method="POST"} 2.0
sglang:http_responses_total{endpoint="/health",status_code="200",method="GET"} 9.0
garbage line without value
"""


def test_parse_metrics(soak):
    m = soak.parse_metrics(METRICS_TEXT)
    assert soak.metric(m, "sglang:num_running_reqs") == 5.0
    assert soak.metric(m, "sglang:num_running_reqs", tp_rank=1) == 2.0
    assert soak.metric(m, "sglang:absent") is None
    assert m["ngramspec:verify_width"][0][0]["note"] == 'a "quoted" label'
    v = soak.tracked_values(m)
    assert v["ngramspec:verify_width"] == 3.5 and v["ngramspec:drafted_tokens"] == 2.25
    assert v["sglang:kv_used_tokens"] == 1234.0 and "sglang:kv_available_tokens" not in v
    assert soak.responses_by_status(m) == {"/generate 200": 40.0, "/generate 400": 2.0, "/health 200": 9.0}


def fake_result(**over) -> dict:
    """A soak result as Soak.finish builds it, healthy unless `over` says otherwise."""
    samples = []
    for i in range(60):
        t, inst = 20 + 5 * i, 0 if i < 30 else 1
        m = {"sglang:num_running_reqs": 4.0, "ngramspec:verify_width": 1 + i % 3,
             **{g: 1.0 + (i % 2) for g in soak_gauges[1:]}}
        samples.append({"t": t, "instance": inst, "rss": {"scheduler": 900.0 + (i % 2) * 0.5, "server": 300.0},
                        "m": m})
    res = {"algorithm": "NGRAM_ADAPTIVE", "load_window": [20.0, 320.0],
           "instances": [{"instance": 0, "started": 0.0, "startup_s": 15.0, "log": "server_0.log",
                          "idle_baseline": {"sglang:kv_used_tokens": 0.0}},
                         {"instance": 1, "started": 170.0, "startup_s": 15.0, "log": "server_1.log",
                          "idle_baseline": {"sglang:kv_used_tokens": 0.0}}],
           "samples": samples, "events": [], "server_up_at_end": True,
           "records": [{"kind": "stream", "outcome": "ok"}, {"kind": "stream", "outcome": "disconnected"},
                       {"kind": "abort", "outcome": "aborted"}, {"kind": "n", "outcome": "restart"}],
           "calls": [{"call": "abort", "status": 200, "error": None, "restart": False},
                     {"call": "flush", "status": 400, "error": None, "restart": False},
                     {"call": "flush", "status": None, "error": "connection", "restart": True}],
           "benches": [{"rate": 2, "num_prompts": 10, "completed": 10, "failed": 0}],
           "streams": {"sent": 20, "disconnected": 5},
           "idle_after_drain": {"sglang:num_running_reqs": 0.0, "sglang:num_queue_reqs": 0.0,
                                "sglang:kv_used_tokens": 0.0},
           "logs": {"server_0.log": {}, "server_1.log": {"NGRAM_ADAPTIVE: controller state loaded": 1}},
           "probe_before": [[1, 2, 3], [4, 5]], "probe_after": [[1, 2, 3], [4, 5]], "drain_instance": 1,
           "bad_requests": [{"case": "empty_text", "status": 400, "server_up_after": True}]}
    res.update(over)
    return res


soak_gauges = ("ngramspec:verify_width", "ngramspec:drafted_tokens", "ngramspec:predicted_accept_length",
               "ngramspec:realized_accept_length")


def test_flush_cycles_catch_a_flush_that_keeps_the_old_cache(soak):
    """flush_keeps_memory: the scheduler's RSS over the flush cycles after the drain. A flush that kept the old
    n-gram cache (444 MB at the default capacity) grew it by a cache per flush; noise of a few MB passes; too few
    answered flushes say nothing."""
    def cycles(*rss, status=200):
        return [{"t": 700.0 + i, "status": status, "scheduler_rss_mb": r} for i, r in enumerate(rss)]

    assert "flush_keeps_memory" not in soak.evaluate(fake_result())  # an older result without the cycles
    ok = soak.evaluate(fake_result(flush_cycles=cycles(3700.0, 3702.5, 3701.0, 3704.0)))["flush_keeps_memory"]
    assert ok["ok"] is True and ok["grew_mb"] == 4.0
    leak = soak.evaluate(fake_result(flush_cycles=cycles(3697.0, 4141.0, 4585.0, 5029.0)))["flush_keeps_memory"]
    assert leak["ok"] is False and leak["grew_mb"] == 1332.0
    assert soak.evaluate(fake_result(flush_cycles=cycles(3700.0, 5000.0, status=400)))["flush_keeps_memory"]["ok"] \
        is None  # refused (requests running): nothing was flushed
    assert soak.evaluate(fake_result(flush_cycles=[]))["flush_keeps_memory"]["ok"] is None


def test_evaluate_healthy_and_each_failure(soak):
    checks = soak.evaluate(fake_result())
    assert all(c["ok"] is not False for c in checks.values()), {k: c for k, c in checks.items() if not c["ok"]}
    assert checks["disconnect_share"]["share"] == round(5 / 30, 4) and checks["no_failures"]["outcomes"]["restart"] == 1
    assert [w["instance"] for w in checks["rss_flat"]["windows"]] == [0, 1]
    assert checks["warm_start"]["state_loaded_lines"]["server_1.log"] == 1 and checks["warm_start"]["ok"] is None
    warm = fake_result(events=[{"what": "state file before restart"}])
    warm["instances"][1]["why"] = "half-time restart"
    assert soak.evaluate(warm)["warm_start"]["ok"] is True
    warm["logs"]["server_1.log"] = {}
    assert soak.evaluate(warm)["warm_start"]["ok"] is False
    bad = {
        "server_up": fake_result(events=[{"what": "server exited unexpectedly"}]),
        "no_failures": fake_result(records=[{"kind": "json_schema", "outcome": "constraint"}]),
        "disconnect_share": fake_result(streams={"sent": 100, "disconnected": 2}),
        "aborts_sent": fake_result(calls=[]),
        "idle_after_drain": fake_result(logs={"server_1.log": {"memory leak detected": 1}}),
        "probes_identical": fake_result(probe_after=[[1, 2, 4], [4, 5]]),
        "bad_requests": fake_result(bad_requests=[{"case": "oov_large", "status": None, "error": "connection",
                                                   "server_up_after": False}]),
    }
    for name, res in bad.items():
        assert soak.evaluate(res)[name]["ok"] is False, name
    assert soak.evaluate(fake_result(server_up_at_end=False))["server_up"]["ok"] is False
    # the load window against the minutes asked: a server start that took it all fails the run
    assert soak.evaluate(fake_result(args={"minutes": 5}))["load_ran"]["ok"] is True
    assert "lengths_agree" not in soak.evaluate(fake_result())  # only with NGRAMSPEC_CHECK_LENS or a report
    differ = soak.evaluate(fake_result(logs={"server_0.log": {soak.LENGTHS_DIFFER: 3}}))["lengths_agree"]
    assert differ == {"ok": False, "batches_differing": 3}
    starved = soak.evaluate(fake_result(args={"minutes": 2}, load_window=[171.3, 170.0]))["load_ran"]
    assert starved["ok"] is False and starved["seconds"] == -1.3
    relaunched = fake_result()
    relaunched["instances"].append({"instance": 2, "started": 300.0, "startup_s": 15.0, "log": "server_2.log",
                                    "why": "server down during the load"})
    assert soak.evaluate(relaunched)["server_up"]["ok"] is False
    assert soak.evaluate(fake_result(probe_before=["timeout", [4, 5]], probe_after=["timeout", [4, 5]]))[
        "probes_identical"]["ok"] is False  # no answer is no evidence
    for margin, ok in ((0.01, True), (0.3, False), (None, False)):  # a measured near-tie passes, nothing else
        tie = soak.evaluate(fake_result(probe_after=[[1, 2, 4], [4, 5]], probe_margins=[
            {"probe": 0, "after": "probe_after", "position": 2, "top2_margin": margin}]))["probes_identical"]
        assert tie["ok"] is ok and tie["identical"] is False, margin
    assert soak.evaluate(fake_result())["probes_identical"]["identical"] is True
    assert soak.evaluate(fake_result(idle_after_drain={"sglang:num_running_reqs": 0.0, "sglang:num_queue_reqs": 0.0,
                                                       "sglang:kv_used_tokens": 64.0}))["idle_after_drain"]["ok"] \
        is False
    growing = fake_result()
    for s in growing["samples"]:
        s["rss"]["scheduler"] = 900.0 + s["t"] * 0.5  # 30 MB/min
    rss = soak.evaluate(growing, rss_limit=10.0)["rss_flat"]
    assert rss["ok"] is False and math.isclose(rss["windows"][1]["slope_mb_per_min"], 30.0, rel_tol=1e-6)
    flat_gauges = fake_result()
    for s in flat_gauges["samples"]:
        s["m"]["ngramspec:drafted_tokens"] = 2.0
    assert soak.evaluate(flat_gauges)["ngramspec_gauges_moving"]["ok"] is False
    assert "ngramspec_gauges_moving" not in soak.evaluate(fake_result(algorithm="plain"))
    fails = soak.failures_by_kind(fake_result(calls=[{"call": "flush", "status": 500, "error": None,
                                                      "restart": False}],
                                              benches=[{"rate": 32, "num_prompts": 5, "failed": 2}]))
    assert fails == {"flush_call": {"500": 1}, "bench_serving": {"rate 32": 2}}


def test_default_commands(soak, tmp_path):
    """The launch_server and bench_serving command lines (their flags checked against sglang 0.5.23's parsers when
    this harness was written: ServerArgs.add_cli_args and sglang.benchmark.serving.cli_main)."""
    a = soak.build_parser().parse_args(["--model", "/m", "--out", str(tmp_path), "--algorithm", "NGRAM_ADAPTIVE",
                                        "--minutes", "4", "--port", "30100", "--mem-fraction", "0.2",
                                        "--max-total-tokens", "400000"])
    s = soak.Soak(a)
    cmd = s.server_cmd()
    assert cmd[1:3] == ["-m", "sglang.launch_server"] and "--enable-metrics" in cmd
    flags = dict(zip(cmd, cmd[1:]))
    assert flags["--host"] == "127.0.0.1" and flags["--port"] == "30100" and flags["--mem-fraction-static"] == "0.2"
    assert flags["--max-total-tokens"] == "400000" and flags["--max-running-requests"] == "48"
    assert flags["--attention-backend"] == "triton" and flags["--sampling-backend"] == "pytorch"
    assert flags["--speculative-algorithm"] == "NGRAM_ADAPTIVE"
    cfg = json.loads(Path(flags["--speculative-adaptive-config"]).read_text())
    assert cfg["state_file"] == str(tmp_path / "controller_state.npz") and 0 < cfg["state_save_minutes"] <= 1
    a.adaptive_config = '{"plain_forwards_max_batch": 48}'  # settings of the run beside the soak's own
    flags2 = dict(zip(c2 := s.server_cmd(), c2[1:]))
    cfg = json.loads(Path(flags2["--speculative-adaptive-config"]).read_text())
    assert cfg["plain_forwards_max_batch"] == 48 and cfg["state_file"] == str(tmp_path / "controller_state.npz")
    s.dataset_path = str(tmp_path / "d.json")
    bench = s.bench_cmd(8, 100, "o.jsonl", 3)
    flags = dict(zip(bench, bench[1:]))
    assert bench[1:3] == ["-m", "sglang.bench_serving"] and flags["--backend"] == "sglang"
    assert flags["--dataset-name"] == "random" and flags["--dataset-path"] == s.dataset_path
    assert (flags["--random-input-len"], flags["--random-output-len"]) == ("2048", "2048")
    assert int(2048 * float(flags["--random-range-ratio"])) == 16  # lengths drawn from 16..2048
    assert (flags["--request-rate"], flags["--num-prompts"], flags["--host"]) == ("8", "100", "127.0.0.1")
    a.mem_fraction = a.max_total_tokens = None
    for algo, spec in (("plain", None), ("NGRAM", "NGRAM")):
        a.algorithm = algo
        c = soak.Soak(a).server_cmd()
        assert ("--speculative-algorithm" in c) == bool(spec) and "--speculative-adaptive-config" not in c
        assert "--mem-fraction-static" not in c and "--max-total-tokens" not in c


def test_a_failed_abort_or_flush_is_recorded_without_deadlock(soak, tmp_path):
    """An /abort_request or /flush_cache that fails (the server is down) is recorded, with whether a restart window
    covers it, and leaves the lock free; a failed call once held the soak's lock forever (every thread stuck)."""
    with socket.socket() as sock:  # a port that nothing answers
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    a = soak.build_parser().parse_args(["--model", "/m", "--out", str(tmp_path), "--port", str(port),
                                        "--flush-every", "0.01"])
    s = soak.Soak(a)
    s.restart_windows.append([time.time() - 5, time.time() + 60])
    s.gate.set()
    done = threading.Event()

    def calls():
        s.abort("soak-1")
        s.stop_clients.clear()
        t = threading.Thread(target=s.flusher_loop, args=(time.time() + 0.5,), daemon=True)
        t.start()
        time.sleep(0.3)
        s.stop_clients.set()
        t.join(5)
        done.set()

    threading.Thread(target=calls, daemon=True).start()
    assert done.wait(20), "a failed call deadlocked the soak"
    assert s.lock.acquire(timeout=1)
    s.lock.release()
    kinds = {c["call"] for c in s.calls}
    assert kinds == {"abort", "flush"} and all(c["error"] and c["restart"] for c in s.calls), s.calls


def test_idle_waits_for_open_generate_calls(soak, tmp_path, monkeypatch):
    """The drain's idle reading waits while /generate calls are still open (what the idle check requires), up to
    its time limit."""
    a = soak.build_parser().parse_args(["--model", "/m", "--out", str(tmp_path)])
    s = soak.Soak(a)
    idle = {"sglang:num_running_reqs": 0.0, "sglang:num_queue_reqs": 0.0, "sglang:kv_used_tokens": 0.0}
    readings = iter([{**idle, "generate_requests_active": 5.0}, {**idle, "generate_requests_active": 0.0}])
    monkeypatch.setattr(soak.time, "sleep", lambda _: None)
    monkeypatch.setattr(s, "idle_values", lambda: next(readings))
    assert s.idle_metrics(wait=60, used_max=0)["generate_requests_active"] == 0.0
    monkeypatch.setattr(s, "idle_values", lambda: {**idle, "generate_requests_active": 2.0})
    assert s.idle_metrics(wait=0.05)["generate_requests_active"] == 2.0  # gives up at the limit


def test_compare(soak, tmp_path, capsys):
    a, b = fake_result(), fake_result(algorithm="plain")
    for r in (a, b):
        r["checks"] = soak.evaluate(r)
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pb.write_text(json.dumps(b))
    pa.write_text(json.dumps(a))
    assert soak.compare(str(pa), str(pb)) == 0
    gz = tmp_path / "a.json.gz"  # as results are kept in docs/sglang/
    gz.write_bytes(gzip.compress(pa.read_bytes()))
    assert soak.compare(str(gz), str(pb)) == 0
    crashed = {"case": "empty_text", "status": None, "error": "connection", "server_up_after": False}
    b["bad_requests"] = [crashed]  # plain SGLang 0.5.23 goes down on it; A's 400 with the server up is no failure
    pb.write_text(json.dumps(b))
    assert soak.compare(str(pa), str(pb)) == 0
    assert "refused where the control went down" in capsys.readouterr().out
    pa.write_text(json.dumps(dict(a, bad_requests=[crashed])))
    pb.write_text(json.dumps(dict(b, bad_requests=[{"case": "empty_text", "status": 400, "server_up_after": True}])))
    assert soak.compare(str(pa), str(pb)) == 1  # the other way round is one
    pb.write_text(json.dumps(dict(b, bad_requests=[{"case": "empty_text", "status": 200, "server_up_after": True}])))
    assert soak.compare(str(pa), str(pb)) == 1
    b["bad_requests"] = fake_result()["bad_requests"]
    pb.write_text(json.dumps(b))
    a["records"].append({"kind": "logprob", "outcome": "http_500"})
    a["bad_requests"] = [{"case": "empty_text", "status": 200, "server_up_after": True}]
    a["checks"] = soak.evaluate(a)
    pa.write_text(json.dumps(a))
    assert soak.compare(str(pa), str(pb)) == 1
    out = capsys.readouterr().out
    assert "http_500" in out and "empty_text" in out
    # a result judged by an older version of a check is judged again by this one, and the change is said
    stored = dict(a, checks={**a["checks"], "server_up": {"ok": not a["checks"]["server_up"]["ok"]}})
    pa.write_text(json.dumps(stored))
    soak.compare(str(pa), str(pb))
    out = capsys.readouterr().out
    assert "verdicts changed since the run: server_up" in out
    assert out.count("verdicts changed") == 1  # the control's stored verdicts stand


def test_process_tree_rss_and_helpers(soak, tmp_path):
    watch = "import os, time\np = os.getppid()\nwhile os.getppid() == p:\n    time.sleep(0.1)\n"
    child = subprocess.Popen([sys.executable, "-c", watch, "sglang::scheduler_TP0"])
    try:
        time.sleep(0.3)
        assert child.pid in soak.process_tree(os.getpid())
        assert soak.process_role(child.pid, os.getpid()) == "scheduler"
        roles = soak.rss_by_role(os.getpid())
        assert roles["scheduler"] > 1 and roles["server"] > 1
        kinds = soak.scheduler_kinds(os.getpid())
        assert set(kinds) == {"anon", "file", "shmem"} and 0 < kinds["anon"] < roles["scheduler"]
    finally:
        child.kill()
        child.wait()
    assert soak.rss_mb(-5) is None and soak.rss_kinds(-5) is None
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048, "vocab_size": 777}))
    assert soak.model_limits(str(tmp_path)) == (2048, 777)
    assert soak.model_limits(str(tmp_path / "none")) == (8192, 49152)
    assert soak.find_key({"a": [{"b": 1}, {"max_req_input_len": 5}]}, "max_req_input_len") == 5
    assert soak.first_difference([1, 2, 3], [1, 2, 4]) == 2 and soak.first_difference([1], [1, 2]) == 1
    pattern = soak.token_pattern(200)
    assert len(pattern) == 200 and pattern[:61] == pattern[61:122] and max(pattern) < 1500
    cases = dict(soak.bad_request_cases(512, 1000))
    assert len(cases["context_limit"]["input_ids"]) == 511 and 1000 in cases["oov_vocab_size"]["input_ids"]
    convs = soak.synthetic_sharegpt(50, seed=1)
    assert len(convs) == 50 and all(len(c["conversations"]) == 2 for c in convs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_soak_end_to_end_against_a_stub_server(tmp_path):
    """The whole soak (clients, disconnects, aborts, flushes, restart, sampler, bench segments, drain, probes, bad
    requests, checks) for 6 s against the stub server, all on 127.0.0.1."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": STUB_CONTEXT,
                                                   "vocab_size": STUB_VOCAB}))
    me = str(Path(__file__).resolve())
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "scripts" / "sglang_soak.py"), "--model", str(model), "--out", str(out),
           "--algorithm", "NGRAM_ADAPTIVE", "--minutes", "0.1", "--port", str(free_port()), "--clients", "3",
           "--sample-every", "0.5", "--flush-every", "1", "--segment-grace", "1", "--bench-startup", "0",
           "--idle-wait", "2", "--request-timeout", "10", "--disconnect-share", "0.5", "--mem-trace",
           "--server-cmd", json.dumps([sys.executable, me, "--stub-server", "{port}", "{out}"]),
           "--bench-cmd", json.dumps([sys.executable, me, "--stub-bench", "{port}", "{num_prompts}",
                                      "{output_file}"])]
    t = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    wall = time.time() - t
    res = json.loads((out / "soak.json").read_text())
    checks = res["checks"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert wall < 6 + 30
    assert len(res["instances"]) == 2 and all(i["ready"] for i in res["instances"])  # the half-time restart
    assert res["probe_after_restart"] == res["probe_before"] == res["probe_after"] == res["probe_after_flush"]
    for name in ("server_up", "no_failures", "disconnect_share", "aborts_sent", "flush_under_load",
                 "idle_after_drain", "probes_identical", "ngramspec_gauges_moving", "bad_requests", "warm_start"):
        assert checks[name]["ok"] is True, (name, checks[name])
    kinds = {r["kind"] for r in res["records"]}
    assert {"stream", "disconnect", "abort"} <= kinds
    assert any(r["outcome"] == "disconnected" for r in res["records"])
    assert any(s.get("rss", {}).get("scheduler") for s in res["samples"])
    assert res["benches"] and all(b["completed"] is not None for b in res["benches"])
    assert {r["case"]: r["status"] for r in res["bad_requests"]}["oov_large"] == 400
    assert json.loads((out / "adaptive_config.json").read_text())["state_file"].endswith("controller_state.npz")
    assert "all checks passed" in proc.stdout
    assert sorted(res["mem_trace"]) == ["0", "1"] and "memory trace, instance 1" in proc.stdout  # per instance
    assert [c["status"] for c in res["flush_cycles"]] == [200] * 4 and checks["flush_keeps_memory"]["ok"] is True
    assert "flush cycles (status, scheduler RSS MB): 200 " in proc.stdout


def test_http_bench_prompts_never_repeat_at_the_default_size():
    """200 prompts at each of two rates: no prompt twice, so no rate is measured on outputs already cached."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from sglang_http_bench import build_parser, server_cmd, sharegpt_prompts
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    texts = [p["conversations"][0]["value"] for off in (0, 200) for p in sharegpt_prompts(200, offset=off)]
    assert len(texts) == 400 and len(set(texts)) == 400
    codes = [t.split("\n\n", 1)[1] for t in texts[0::2]]
    assert len(set(codes)) == 200 and all(len(c.splitlines()) >= 6 for c in codes)
    # every server runs with the engine bench's settings (the memory the 8B-cost model's start-up needs)
    cmd = server_cmd(build_parser().parse_args(["--model", "M", "--out", "o"]), "adaptive")
    assert cmd[cmd.index("--mem-fraction-static") + 1] == "0.5" and "--disable-prefill-cuda-graph" in cmd
    assert cmd[-2:] == ["--speculative-algorithm", "NGRAM_ADAPTIVE"]


def test_http_bench_places_each_gap_between_chunks_in_time():
    """bench_serving's per-request details (TTFT and the gaps, seconds) become the gaps' times since the requests
    were sent: which tenth of the span holds the tail, and the largest gaps with their request and place."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from sglang_http_bench import itl_timeline
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    # request 0: TTFT 0.1 s, nine gaps of 10 ms (chunks at 0.11 .. 0.19 s); request 1: TTFT 0.5 s, then 10 ms gaps
    # and one of 300 ms as its 4th gap, ending at 1.0 s
    tl = itl_timeline([0.1, 0.5, None], [[0.01] * 9, [0.01, 0.01, 0.01, 0.3, 0.01, 0.01, 0.01, 0.01, 0.01, 0.12],
                                         [0.5]])
    assert tl["span_s"] == pytest.approx(1.0)
    assert [x["gaps"] for x in tl["slices"]] == [0, 9, 0, 0, 0, 3, 0, 0, 6, 1]
    big = tl["largest"][0]
    assert big == {"at_s": 0.83, "gap_ms": 300.0, "request": 1, "chunk": 4, "chunks": 11}
    assert tl["slices"][8]["max_ms"] == 300.0 and tl["slices"][1]["p99_ms"] == pytest.approx(10.0)
    assert tl["largest"][1]["gap_ms"] == pytest.approx(120.0) and tl["largest"][1]["at_s"] == pytest.approx(1.0)
    assert itl_timeline([], []) == {} and itl_timeline([None], [[0.1]]) == {}


def test_http_bench_against_a_stub_server(tmp_path):
    """`scripts/sglang_http_bench.py`: a server per config, bench_serving at each rate, the table and the JSON, all
    against the stub server on 127.0.0.1; a config whose server never starts is an error, not a hang."""
    me = str(Path(__file__).resolve())
    out = tmp_path / "out"
    script = str(ROOT / "scripts" / "sglang_http_bench.py")
    stub_server = json.dumps([sys.executable, me, "--stub-server", "{port}", str(tmp_path)])
    stub_bench = json.dumps([sys.executable, me, "--stub-bench", "{port}", "{num_prompts}", "{output_file}"])
    cmd = [sys.executable, script, "--model", str(tmp_path), "--out", str(out), "--num-prompts", "6",
           "--port", str(free_port()), "--server-cmd", stub_server, "--bench-cmd", stub_bench]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "http_bench.json").read_text())["results"]
    assert list(res) == ["plain", "ngram", "adaptive"]
    for r in res.values():
        assert set(r["rates"]) == {"inf", "8"} and all(x["completed"] == 4 for x in r["rates"].values())
        # each rate's own scheduler profile: the stub's bench sends 4 requests (10 decode steps each, 5 ms)
        assert all(x["scheduler"]["decode_steps"] == 40 and x["scheduler"]["period_ms"] == 5.0
                   for x in r["rates"].values())
    assert "1.000" in proc.stdout  # every config against plain decoding of the same run
    by_rate = [json.loads((out / f"prompts_sharegpt_{rate}.json").read_text()) for rate in ("inf", "8")]
    for prompts in by_rate:
        assert [p["id"].split("-")[0] for p in prompts] == ["copy", "free"] * 3
    texts = [p["conversations"][0]["value"] for prompts in by_rate for p in prompts]
    assert len(set(texts)) == 12  # no prompt twice, within a rate or across the two
    # a server left running on the port is an error, not a measurement of that server
    with socket.create_server(("127.0.0.1", 0)) as busy:
        taken = busy.getsockname()[1]
        proc = subprocess.run(cmd[:-5] + [str(taken), "--server-cmd", stub_server, "--bench-cmd", stub_bench,
                                          "--configs", "plain"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and f"already answers on port {taken}" in proc.stdout
    dead = json.dumps([sys.executable, "-c", "import sys; sys.exit(3)"])
    proc = subprocess.run(cmd[:-4] + ["--server-cmd", dead, "--bench-cmd", stub_bench, "--configs", "plain",
                                      "--startup-timeout", "5"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "did not start" in proc.stdout
    proc = subprocess.run([sys.executable, script, "--model", "m", "--out", str(out), "--configs", "eagle"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown config 'eagle'" in proc.stderr and "Traceback" not in proc.stderr



def test_load_from_ready_gives_the_whole_load_after_a_slow_start_up(soak, tmp_path):
    """A 10-minute soak beside other servers started in 149 s and got 500 s of load: by default the run's hard end
    is fixed from its start (so it fits a call); --load-from-ready moves the hard end instead of cutting the load."""
    for flag, expected in (([], 8.0 * 60 + 160.0 - 110.0 - 149.0), (["--load-from-ready"], 8.0 * 60)):
        a = soak.build_parser().parse_args(["--model", "/m", "--out", str(tmp_path), "--minutes", "8", *flag])
        run = soak.Soak(a)
        load_start = run.t0 + 149.0
        assert run.load_end(load_start) - load_start == pytest.approx(expected)
        assert run.hard_end - run.load_end(load_start) >= 110.0  # the drain, checks and bad requests still fit


def test_the_memory_trace_is_summed_up_per_instance(soak):
    trace = {"snapshots": [{"t_s": 30.0, "rss_mb": 3900.0, "traced_mb": 210.5, "grew": [],
                            "native": {"anon": 3000.0, "malloc_used": 900.0}},
                           {"t_s": 330.0, "rss_mb": 4055.0, "traced_mb": 212.0, "native": {"anon": 3150.0},
                            "grew": [{"site": "sglang/x.py:12", "mb": 1.25, "count": 300},
                                     {"site": "ngramspec_sglang/y.py:3", "mb": 0.2, "count": -4}]}]}
    lines = soak.mem_trace_lines({"0": trace, "1": {"snapshots": []}}, top=1)
    assert lines == ["memory trace, instance 0: 2 snapshots over 300 s, RSS 3900.0 -> 4055.0 MB, traced Python heap "
                     "210.5 -> 212.0 MB", "  of it: anon 3000.0 -> 3150.0",
                     "  grew +1.25 MB (+300 blocks) at sglang/x.py:12"]


if __name__ == "__main__":
    if sys.argv[1] == "--stub-server":
        run_stub_server(int(sys.argv[2]), sys.argv[3])
    elif sys.argv[1] == "--stub-bench":
        run_stub_bench(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
