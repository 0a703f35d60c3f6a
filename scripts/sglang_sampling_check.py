#!/usr/bin/env python3
"""Sampling stays exact: NGRAM_ADAPTIVE's (and SGLang's NGRAM's) output distribution equals plain decoding's.

One GPU call (H200, SGLang 0.5.23 kit copied to .gpukit and carried, SmolLM2-135M-Instruct float16 at $MODEL_DIR;
this check and both soaks of scripts/sglang_soak.py side by side on one GPU, ~8 minutes; the KV pools are capped,
--max-total-tokens, so that servers starting at the same time do not starve each other):
    source .gpukit/device/env.sh && W=/tmp/harness && mkdir -p $W && S=scripts/sglang_soak.py && \
    { timeout -k 15 540 python3 $S --model $MODEL_DIR --algorithm NGRAM_ADAPTIVE --minutes 4 --port 30100 \
        --max-total-tokens 400000 --out $W/soak_adaptive > $W/soak_adaptive.txt 2>&1 & \
      timeout -k 15 540 python3 $S --model $MODEL_DIR --algorithm plain --minutes 4 --port 30200 \
        --max-total-tokens 400000 --out $W/soak_plain > $W/soak_plain.txt 2>&1 & \
      timeout -k 15 500 python3 scripts/sglang_sampling_check.py --model $MODEL_DIR --out $W/sampling.json \
        --max-total-tokens 400000 --budget 480 --logs $W/sampling_logs > $W/sampling.txt 2>&1 ; wait ; } ; \
    python3 $S --compare $W/soak_adaptive/soak.json $W/soak_plain/soak.json > $W/compare.txt 2>&1 ; \
    cp $W/sampling.json $OUT/ ; cp $W/soak_adaptive/soak.json $OUT/soak_adaptive.json ; \
    cp $W/soak_plain/soak.json $OUT/soak_plain.json ; cat $W/*.txt > $OUT/console.txt ; \
    tar -czf $OUT/logs.tar.gz -C $W --exclude='*.json' --exclude='*.jsonl' --exclude='*.npz' . ; \
    tail -n 30 $W/sampling.txt $W/soak_adaptive.txt $W/soak_plain.txt $W/compare.txt
(5 files come back under $OUT: sampling.json, soak_adaptive.json, soak_plain.json, console.txt, logs.tar.gz.)
Beside the two soaks, whose servers slow its own start-ups, the check ran out of --budget after plain decoding and
NGRAM_ADAPTIVE (one H100): for the controls, run `--configs plain,ngram` (then `plain,adaptive_w8`) in a call alone.

Why offline (`sglang.Engine`, one child process per configuration, as scripts/sglang_engine_bench.py): the check
needs thousands of short requests per prompt; a list of prompts with a list of sampling parameters goes to the
scheduler in one call, so 2,000 samples of 8 tokens take seconds (HTTP would add a request per sample and nothing
the test needs; the HTTP server is exercised by scripts/sglang_soak.py).

Per configuration (plain; adaptive = NGRAM_ADAPTIVE; ngram = SGLang's NGRAM; adaptive_w8 = NGRAM_ADAPTIVE verifying
8 tokens at every step, so the sampling verifier works whatever the controller would choose; adaptive_pp =
NGRAM_ADAPTIVE with `preplan`) and per temperature
setting (t07: temperature 0.7, top_p 0.95; t10: temperature 1.0), --samples (2,000) samples of the first --tokens
(8) generated tokens of each of a few copy-heavy prompts, each sample with its own `sampling_seed` (seed ranges
never overlap between sets). SGLang uses a request's `sampling_seed` only with --enable-deterministic-inference
(`--deterministic` here; otherwise every sample draws from the scheduler's RNG: still independent samples, which is
all the test needs). Plain decoding draws three sets: A (the reference), B (a second, independent set: plain vs
plain must pass) and a perturbed set at temperature + 0.05 (how large a change the test sees at this sample size).

The statistics (`chi2_homogeneity`, `holm`, `compare_sets`; pure Python, no scipy): per prompt and position (and
the whole 8-token sequence), a chi-square two-sample test of homogeneity between a set and plain's set A, tokens
too rare for an expected count of 5 in both samples pooled into one bin; Holm's correction over all the tests of one
comparison (prompts x positions); a comparison fails when a Holm-adjusted p-value is below --alpha (0.01).
Expected: plain B, adaptive, ngram and adaptive_w8 pass; `broken_verifier` must fail: plain's set B passed through
`greedy_verifier_mimic`, which does what a verifier that accepts drafts greedily under sampling does on copy text
(at every position after the first, with probability --broken-q the sampled token is replaced by the most likely
next token after the same prefix, estimated from the samples), so the product code carries no sabotage switch.

Accept length under sampling next to greedy: SGLang's tokens per verify step (completion tokens /
`meta_info.spec_verify_ct`, as sglang_engine_bench.py) over the sampled requests, and over the 16 copy-heavy prompts
of sglang_engine_bench.py generated to --accept-tokens (128) greedily and at each temperature.

    python scripts/sglang_sampling_check.py --model MODEL_DIR --out sampling.json [--samples 2000] [--tokens 8]
        [--configs plain,adaptive,ngram,adaptive_w8] [--temps t07,t10] [--max-total-tokens N] [--deterministic]
    python scripts/sglang_sampling_check.py --analyze sampling.json     # the statistics again, from saved samples
                                                                        # (a .json.gz file too)
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import random
import sys
import tempfile
import time
from collections import Counter, defaultdict

SCRIPTS = os.path.dirname(os.path.abspath(__file__))

CONFIGS = {
    "plain": {},
    # draft_max_batch null: every batch may draft (the running-request cap is then 48, as NGRAM's). With the
    # default, the samples' batches (hundreds of requests) would all decode plainly and verify nothing
    "adaptive": {"speculative_algorithm": "NGRAM_ADAPTIVE", "adaptive_file": {"draft_max_batch": None}},
    "ngram": {"speculative_algorithm": "NGRAM"},
    # every step verifies 8 tokens (root + 7 drafted): the sampling verifier at work even where the controller
    # would decode plainly at these temperatures
    "adaptive_w8": {"speculative_algorithm": "NGRAM_ADAPTIVE",
                    "adaptive_file": {"fixed_width": 8, "draft_max_batch": None}},
    # the verify prepared before the wait (`preplan`, the default now; one server with it once failed this
    # check before the worker's step buffers were zeroed)
    "adaptive_pp": {"speculative_algorithm": "NGRAM_ADAPTIVE",
                    "adaptive_file": {"draft_max_batch": None, "preplan": True}},
}
TEMPS = {
    "t07": {"temperature": 0.7, "top_p": 0.95},
    "t10": {"temperature": 1.0, "top_p": 1.0},
}
PERTURB = 0.05  # plain's perturbed set: temperature + PERTURB
COMMON = dict(attention_backend="triton", sampling_backend="pytorch", log_level="warning", random_seed=0,
              disable_prefill_cuda_graph=True)

_CODE = ("class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
         "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n"
         "    def peek(self):\n        return self.items[-1]\n")
_FETCH = ("function fetchUser(id) {\n  return fetch('/api/users/' + id)\n    .then(res => res.json())\n"
          "    .then(data => {\n      console.log(data.name);\n      return data;\n    });\n}\n")
_TEXT = ("The quick brown fox jumps over the lazy dog. The dog did not move. The fox jumped again, higher this time, "
         "and landed softly in the tall grass on the other side of the fence.")
_LIST = "apples, pears, plums, cherries, grapes, melons, lemons, limes, figs, dates\n"
# name -> (chat template or not, text). Copy-heavy: the answer repeats the prompt, so n-gram drafts are accepted
# often; the chat prompts also leave the model a choice of how to start (entropy for the test to see).
PROMPTS = {
    "code_copy": (False, "# stack.py\n" + _CODE + "\n# stack_copy.py: an exact copy of stack.py\n" + _CODE[:13]),
    "list_copy": (False, "Fruit list, written out four times:\n" + _LIST * 3 + "apples, pears,"),
    "chat_repeat": (True, "Repeat the following text word for word:\n\n" + _TEXT),
    "chat_rewrite": (True, "Rewrite this code with a docstring and comments, keeping all the code:\n\n" + _FETCH),
}
END = -1  # a position after the request stopped (EOS within the first tokens)


# ----------------------------------------------------------------------------------------------------- statistics


def chi2_sf(x: float, df: float) -> float:
    """P(X > x) for X ~ chi-square with df degrees of freedom: the regularized upper incomplete gamma Q(df/2, x/2)
    (series below a + 1, Lentz's continued fraction above; Numerical Recipes 6.2)."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    if x <= 0:
        return 1.0
    a, z = 0.5 * df, 0.5 * x
    log_front = a * math.log(z) - z - math.lgamma(a)
    if z < a + 1.0:  # P(a, z) by its series; Q = 1 - P
        term = total = 1.0 / a
        ap = a
        for _ in range(10_000):
            ap += 1.0
            term *= z / ap
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300
    b = z + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    return min(1.0, math.exp(log_front) * h)


def chi2_homogeneity(a, b, min_expected: float = 5.0) -> dict:
    """Chi-square two-sample test that samples `a` and `b` (hashable outcomes) come from one distribution.

    Outcomes whose pooled count gives an expected count below `min_expected` in either sample are binned together
    ("other"); an "other" bin still below it joins the smallest kept outcome. Fewer than two bins: nothing to test
    (df 0, p 1). Returns stat, df, p, the number of bins and the two sample sizes."""
    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    if not na or not nb:
        return {"stat": 0.0, "df": 0, "p": 1.0, "bins": 0, "n": [na, nb]}
    n = na + nb
    need = min_expected * n / min(na, nb)  # pooled count at which both expected counts reach min_expected
    bins, other = [], [0, 0]
    for key in sorted(set(ca) | set(cb), key=lambda k: (-(ca[k] + cb[k]), str(k))):
        pair = [ca[key], cb[key]]
        if sum(pair) >= need:
            bins.append(pair)
        else:
            other[0] += pair[0]
            other[1] += pair[1]
    if sum(other):
        if sum(other) >= need or not bins:
            bins.append(other)
        else:
            bins[-1] = [bins[-1][0] + other[0], bins[-1][1] + other[1]]
    if len(bins) < 2:
        return {"stat": 0.0, "df": 0, "p": 1.0, "bins": len(bins), "n": [na, nb]}
    stat = 0.0
    for x, y in bins:
        t = x + y
        ea, eb = t * na / n, t * nb / n
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    df = len(bins) - 1
    return {"stat": stat, "df": df, "p": chi2_sf(stat, df), "bins": len(bins), "n": [na, nb]}


def holm(pvalues: list[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values (same order as given): reject where adjusted p < alpha."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted, running = [1.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def greedy_verifier_mimic(samples: list[list[int]], q: float, seed: int = 0, start: int = 1) -> list[list[int]]:
    """Plain decoding's samples as a broken speculative sampler would return them: at every position from `start`
    on, with probability q the token becomes the most frequent next token after the same prefix (among `samples`),
    as when a verifier accepts a draft that is the likely continuation instead of sampling. Prefixes seen in no
    sample keep their token. A control that must fail the homogeneity test; the product code has no such switch."""
    rng = random.Random(seed)
    width = max((len(s) for s in samples), default=0)
    nxt = [defaultdict(Counter) for _ in range(width)]
    for s in samples:
        for k in range(start, len(s)):
            nxt[k][tuple(s[:k])][s[k]] += 1
    mode = [{p: c.most_common(1)[0][0] for p, c in table.items()} for table in nxt]
    out = []
    for s in samples:
        new = list(s)
        for k in range(start, len(new)):
            if rng.random() < q:
                new[k] = mode[k].get(tuple(new[:k]), new[k])
        out.append(new)
    return out


def position_outcomes(samples: list[list[int]], k: int | None):
    """Outcome per sample at position k (END past the sample's end), or the whole sequence when k is None."""
    if k is None:
        return [tuple(s) for s in samples]
    return [s[k] if k < len(s) else END for s in samples]


def compare_sets(ref: dict, other: dict, tokens: int, alpha: float, min_expected: float = 5.0) -> dict:
    """One comparison: per prompt (keys of both dicts: prompt -> list of samples) and position, the homogeneity
    test; Holm's correction over every test with df > 0; passes when no adjusted p-value is below alpha."""
    tests = []
    for prompt in sorted(set(ref) & set(other)):
        for k in list(range(tokens)) + [None]:
            r = chi2_homogeneity(position_outcomes(ref[prompt], k), position_outcomes(other[prompt], k),
                                 min_expected)
            tests.append({"prompt": prompt, "position": "seq" if k is None else k + 1, **r})
    live = [t for t in tests if t["df"] > 0]
    for t, adj in zip(live, holm([t["p"] for t in live])):
        t["p_holm"] = adj
    min_p = min((t["p"] for t in live), default=1.0)
    min_adj = min((t["p_holm"] for t in live), default=1.0)
    worst = min(live, key=lambda t: t["p"], default=None)
    return {"passes": min_adj >= alpha, "tests": len(live), "untestable": len(tests) - len(live),
            "min_p": min_p, "min_p_holm": min_adj,
            "worst": {k: worst[k] for k in ("prompt", "position", "stat", "df", "p")} if worst else None,
            "detail": tests}


def expectation(name: str) -> str:
    if name == "broken_verifier":
        return "fail"
    if name.startswith("plain_t+"):
        return "info"
    return "pass"


def analyze(results: dict, tokens: int, alpha: float, broken_q: float, min_expected: float = 5.0) -> dict:
    """Every comparison against plain decoding's set A, per temperature setting, with its verdict."""
    report = {}
    plain = results.get("plain", {}).get("samples", {})
    for temp, by_prompt in plain.items():
        ref = {p: sets["A"] for p, sets in by_prompt.items() if "A" in sets}
        candidates = {}
        if all("B" in sets for sets in by_prompt.values()):
            candidates["plain_B"] = {p: sets["B"] for p, sets in by_prompt.items()}
            candidates["broken_verifier"] = {p: greedy_verifier_mimic(sets["B"], broken_q, seed=i)
                                             for i, (p, sets) in enumerate(sorted(by_prompt.items()))}
        if all("P" in sets for sets in by_prompt.values()):
            candidates[f"plain_t+{PERTURB}"] = {p: sets["P"] for p, sets in by_prompt.items()}
        for name, res in results.items():
            if name != "plain" and temp in res.get("samples", {}):
                candidates[name] = {p: sets["A"] for p, sets in res["samples"][temp].items()}
        report[temp] = {}
        for name, other in candidates.items():
            c = compare_sets(ref, other, tokens, alpha, min_expected)
            c["expected"] = expectation(name)
            c["ok"] = c["expected"] == "info" or c["passes"] == (c["expected"] == "pass")
            c["scipy_max_rel_diff"] = scipy_check(c["detail"])
            report[temp][name] = c
    return report


def scipy_check(tests: list[dict]) -> float | None:
    """Where scipy is installed (the GPU image has it): the largest relative difference between our p-values and
    scipy.stats.chi2.sf over the tests of a comparison (None without scipy)."""
    try:
        from scipy.stats import chi2
    except ImportError:
        return None
    diffs = [abs(t["p"] - chi2.sf(t["stat"], t["df"])) / max(t["p"], 1e-300) for t in tests if t["df"] > 0]
    return max(diffs, default=0.0)


# ------------------------------------------------------------------------------------------------------ GPU side


def prompt_texts(model: str) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    out = {}
    for name, (chat, text) in PROMPTS.items():
        if chat and getattr(tok, "chat_template", None):
            text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True)
        out[name] = text
    return out


def draw(engine, text: str, params: dict, seeds: range, tokens: int, batch: int) -> tuple[list, dict]:
    """len(seeds) samples of the first `tokens` tokens of `text`, `batch` requests per engine call."""
    samples, spec = [], {"tokens": 0, "verify_steps": 0}
    seeds = list(seeds)
    for i in range(0, len(seeds), batch):
        chunk = seeds[i: i + batch]
        sp = [{**params, "max_new_tokens": tokens, "sampling_seed": s} for s in chunk]
        for r in engine.generate([text] * len(chunk), sp):
            samples.append(list(r.get("output_ids") or [])[:tokens])
            meta = r.get("meta_info", {})
            spec["tokens"] += meta.get("completion_tokens") or 0
            spec["verify_steps"] += meta.get("spec_verify_ct") or 0
    return samples, spec


def copy_accept_length(engine, prompts: list[str], params: dict, tokens: int, repeats: int) -> dict:
    t = time.perf_counter()
    res = engine.generate(prompts * repeats, [{**params, "max_new_tokens": tokens}] * (len(prompts) * repeats))
    secs = time.perf_counter() - t
    done = sum(r["meta_info"].get("completion_tokens") or 0 for r in res)
    steps = sum(r["meta_info"].get("spec_verify_ct") or 0 for r in res)
    return {"tokens": done, "verify_steps": steps, "accept_len": round(done / steps, 3) if steps else None,
            "seconds": round(secs, 2)}


def run_one(name: str, a) -> dict:
    import sglang

    sys.path.insert(0, SCRIPTS)
    from sglang_engine_bench import COPY_PROMPTS, chat_prompts

    # where flashinfer is missing (the GPU kit), every speculative server samples through ngramspec's fallback,
    # SGLang's NGRAM (the control) included; the result records whether it was in place
    os.environ["NGRAMSPEC_SAMPLING_FALLBACK"] = "1"
    cfg = dict(CONFIGS[name])
    adaptive_file = cfg.pop("adaptive_file", None)
    if adaptive_file is not None:
        path = os.path.join(tempfile.mkdtemp(), f"{name}.json")
        with open(path, "w") as f:
            json.dump(adaptive_file, f)
        cfg["speculative_adaptive_config"] = path
    extra = json.loads(a.extra) if a.extra else {}
    if a.deterministic:
        extra["enable_deterministic_inference"] = True
    if a.mem_fraction is not None:
        extra.setdefault("mem_fraction_static", a.mem_fraction)
    if a.max_total_tokens is not None:
        extra.setdefault("max_total_tokens", a.max_total_tokens)
    t0 = time.time()
    engine = sglang.Engine(model_path=a.model, dtype=a.dtype, **{**COMMON, **extra, **cfg})
    startup = time.time() - t0
    out = {"config": name, "startup_s": round(startup, 1), "samples": {}, "spec": {}, "accept": {}}
    texts = prompt_texts(a.model)
    n = a.samples
    try:
        for text in texts.values():  # first-time costs (kernels, graphs) outside the sampled sets
            engine.generate([text] * 4, {"temperature": 0.7, "max_new_tokens": a.tokens})
        t = time.time()
        for ti, temp in enumerate(a.temps.split(",")):
            params = TEMPS[temp]
            for pi, (prompt, text) in enumerate(texts.items()):
                base = ((ti * 16 + pi) * 8 + list(CONFIGS).index(name)) * 4 * n  # disjoint seed ranges everywhere
                sets = {"A": (params, range(base, base + n))}
                if name == "plain":
                    sets["B"] = (params, range(base + n, base + 2 * n))
                    sets["P"] = ({**params, "temperature": params["temperature"] + PERTURB},
                                 range(base + 2 * n, base + 3 * n))
                for set_name, (p, seeds) in sets.items():
                    samples, spec = draw(engine, text, p, seeds, a.tokens, a.batch)
                    out["samples"].setdefault(temp, {}).setdefault(prompt, {})[set_name] = samples
                    out["spec"].setdefault(temp, {}).setdefault(prompt, {})[set_name] = spec
        out["sampling_s"] = round(time.time() - t, 1)
        import importlib.util

        out["flashinfer"] = importlib.util.find_spec("flashinfer") is not None  # False: ngramspec's fallback sampled
        copy = chat_prompts(a.model, COPY_PROMPTS)
        for label, params in [("greedy", {"temperature": 0.0})] + [(t, TEMPS[t]) for t in a.temps.split(",")]:
            out["accept"][label] = copy_accept_length(engine, copy, params, a.accept_tokens, a.accept_repeats)
    finally:
        engine.shutdown()
    return out


def spec_accept(res: dict, temp: str) -> float | None:
    """Tokens per verify step over every sampled request of one temperature (set A)."""
    rows = [sets["A"] for sets in res.get("spec", {}).get(temp, {}).values() if "A" in sets]
    steps = sum(r["verify_steps"] for r in rows)
    return round(sum(r["tokens"] for r in rows) / steps, 3) if steps else None


def drafts_accepted(res: dict, temp: str, tokens: int) -> bool | None:
    """Whether a speculative configuration accepted any draft over its samples of one temperature (None: no verify
    steps recorded, plain decoding). With none, every sample was decoded one token per step and the comparison
    says nothing about the verifier: `tokens` per sample take `tokens - 1` steps after the prefill."""
    accept = spec_accept(res, temp)
    if accept is None:
        return None
    return accept > tokens / (tokens - 1) * 1.01


def print_report(results: dict, report: dict, alpha: float, temps: list[str], tokens: int = 8) -> bool:
    ok = True
    print(f"\nTwo-sample chi-square per prompt and position vs plain decoding's set A (Holm over each row's tests, "
          f"alpha {alpha})")
    print(f"{'temp':5s} {'comparison':16s} {'expected':8s} {'tests':>5s} {'min p':>10s} {'min p Holm':>10s} "
          f"{'verdict':8s} {'ok':3s} worst (prompt, position, stat, df)")
    for temp, rows in report.items():
        for name, c in rows.items():
            ok &= c["ok"]
            w = c["worst"] or {}
            print(f"{temp:5s} {name:16s} {c['expected']:8s} {c['tests']:5d} {c['min_p']:10.3g} "
                  f"{c['min_p_holm']:10.3g} {'pass' if c['passes'] else 'FAIL':8s} {'yes' if c['ok'] else 'NO':3s} "
                  + (f"{w.get('prompt')} {w.get('position')} {w.get('stat', 0):.1f} {w.get('df')}" if w else ""))
    diffs = [c.get("scipy_max_rel_diff") for rows in report.values() for c in rows.values()]
    diffs = [d for d in diffs if d is not None]
    if diffs:
        print(f"p-values vs scipy.stats.chi2.sf: largest relative difference {max(diffs):.2g}")
    print("\nAccept length (tokens per verify step): 8-token samples at each temperature; 16 copy-heavy prompts "
          "generated to --accept-tokens, greedy and sampled")
    labels = ["greedy"] + temps
    print(f"{'config':10s} " + " ".join(f"{'samples ' + t:>12s}" for t in temps)
          + " " + " ".join(f"{'copy ' + t:>12s}" for t in labels))
    for name, res in results.items():
        if "error" in res or "skipped" in res:
            print(f"{name:10s} {'error: ' + res['error'] if 'error' in res else 'skipped: ' + res['skipped']}")
            ok &= "error" not in res
            continue
        cells = [spec_accept(res, t) for t in temps] + [res.get("accept", {}).get(t, {}).get("accept_len")
                                                        for t in labels]
        print(f"{name:10s} " + " ".join(f"{c if c is not None else '-':>12}" for c in cells))
        idle = [t for t in temps if drafts_accepted(res, t, tokens) is False]
        if idle:
            ok = False
            print(f"{'':10s} NO draft accepted over the samples at {', '.join(idle)}: each sample decoded one token "
                  "per step, so its test says nothing about the verifier")
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model")
    p.add_argument("--out")
    p.add_argument("--analyze", help="a result file of this script: print its statistics again (no GPU)")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--configs", default="plain,adaptive,ngram,adaptive_w8",
                   help=f"comma-separated, in order (with --budget, the last ones may be left out), of {list(CONFIGS)}")
    p.add_argument("--temps", default="t07,t10", help=f"comma-separated, of {sorted(TEMPS)}")
    p.add_argument("--samples", type=int, default=2000, help="samples per prompt, set and temperature")
    p.add_argument("--tokens", type=int, default=8, help="generated tokens per sample")
    p.add_argument("--batch", type=int, default=1000, help="requests per engine call")
    p.add_argument("--alpha", type=float, default=0.01, help="family-wise error rate of one comparison (Holm)")
    p.add_argument("--broken-q", type=float, default=0.3, help="replacement rate of the broken-verifier control")
    p.add_argument("--min-expected", type=float, default=5.0, help="rare outcomes are binned below this")
    p.add_argument("--accept-tokens", type=int, default=128)
    p.add_argument("--accept-repeats", type=int, default=2)
    p.add_argument("--mem-fraction", type=float, help="mem_fraction_static of each engine (default: SGLang's)")
    p.add_argument("--max-total-tokens", type=int,
                   help="max_total_tokens of each engine: a KV pool of at most this many tokens (needed where other "
                        "servers start on the same GPU meanwhile, see scripts/sglang_soak.py)")
    p.add_argument("--deterministic", action="store_true",
                   help="--enable-deterministic-inference in every config: each sample's sampling_seed is used")
    p.add_argument("--extra", default="", help="JSON object of extra sglang.Engine arguments for every config")
    p.add_argument("--timeout", type=int, default=300, help="seconds per configuration")
    p.add_argument("--budget", type=float, default=0.0,
                   help="seconds for the whole run (0: no limit); a configuration gets what is left of it, and the "
                        "result file is written after each configuration")
    p.add_argument("--logs", help="folder for each configuration's stderr")
    p.add_argument("--one", help=argparse.SUPPRESS)
    a = p.parse_args()
    temps = a.temps.split(",")
    if any(t not in TEMPS for t in temps):
        p.error(f"--temps: unknown setting in {a.temps!r}; known: {sorted(TEMPS)}")
    if a.analyze:
        try:
            with (gzip.open if a.analyze.endswith(".gz") else open)(a.analyze, "rt") as f:
                saved = json.load(f)
        except (OSError, ValueError) as e:
            print(f"--analyze {a.analyze}: {e}", file=sys.stderr)
            return 2
        results = saved.get("results", saved)
        report = analyze(results, a.tokens, a.alpha, a.broken_q, a.min_expected)
        return 0 if print_report(results, report, a.alpha, list(report) or temps, a.tokens) else 1
    if not a.model or not a.out:
        p.error("--model and --out are needed (or --analyze FILE)")
    if a.one:
        print("RESULT " + json.dumps(run_one(a.one, a)), flush=True)
        return 0
    results = {}
    t_all = time.time()
    names = a.configs.split(",")
    for name in names:
        if name not in CONFIGS:
            p.error(f"--configs: unknown config {name!r}; known: {sorted(CONFIGS)}")
    args = {k: v for k, v in vars(a).items() if k != "one"}

    def save() -> dict:
        report = analyze(results, a.tokens, a.alpha, a.broken_q, a.min_expected)
        with open(a.out, "w") as f:
            json.dump({"args": args, "report": report, "results": results, "wall_s": round(time.time() - t_all, 1)},
                      f)
        return report

    for name in names:
        limit = a.timeout if not a.budget else min(a.timeout, a.budget - (time.time() - t_all))
        if limit < 30:
            results[name] = {"config": name, "skipped": "out of time (--budget)"}
            print(f"{name}: skipped, out of time (--budget)", flush=True)
            continue
        sys.path.insert(0, SCRIPTS)
        from sglang_engine_bench import run_child

        res = run_child(__file__, name, limit, a.logs)
        results[name] = res
        if "error" in res:
            print(f"{name}: {res['error']}\n{res.get('stderr_tail', '')}", flush=True)
        else:
            print(f"{name}: start-up {res['startup_s']} s, sampling {res.get('sampling_s')} s, "
                  f"{res['wall_s']} s in all", flush=True)
        save()
    report = save()
    ok = print_report(results, report, a.alpha, temps, a.tokens)
    print(f"\n{'all expectations met' if ok else 'EXPECTATIONS NOT MET'}; samples and p-values in {a.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
