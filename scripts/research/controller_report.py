"""Summarize `ngramspec simulate --json` rows into the controller table: adaptive vs best static vs oracle."""
import json
import sys
from collections import defaultdict

rows = [r for path in sys.argv[1:] for r in json.load(open(path))]
groups = defaultdict(dict)
for r in rows:
    groups[(r["trace"], r["profile"], r["batch"])][r["method"]] = r
print("| trace | profile | batch | adaptive | best static (hindsight) | oracle-ctl | captured share "
      "| adaptive accept_len | never slower | >= best static |")
print("|---|---|---:|---:|---|---:|---:|---:|:-:|:-:|")
for (trace, profile, batch), m in sorted(groups.items()):
    ad = m.get("ngramspec-adaptive")
    if ad is None:
        continue
    static = {k: v for k, v in m.items() if k.startswith(("ngramspec-chain", "ngramspec-tree"))}
    best_name, best = max(static.items(), key=lambda kv: kv[1]["speedup"])
    orc = next((v for k, v in m.items() if k.startswith("oracle-ctl")), None)
    share = (ad["speedup"] - 1) / (orc["speedup"] - 1) if orc and orc["speedup"] > 1 else float("nan")
    print(f"| {trace} | {profile} | {batch} | {ad['speedup']:.3f} | {best['speedup']:.3f} ({best_name}) | "
          f"{orc['speedup'] if orc else float('nan'):.3f} | {share:.2f} | {ad['accept_len']:.3f} | "
          f"{'yes' if ad['speedup'] >= 0.99 else 'NO'} | {'yes' if ad['speedup'] >= best['speedup'] else 'NO'} |")
