"""Write the engine's greedy generations as a trace in the shared format (gzip JSONL, one record per request),
so that `ngramspec simulate` can replay exactly what the engine did."""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Sequence

GENERATOR = "SmolLM2-135M-Instruct (GGUF Q4_1), ngramspec engine, greedy"


def write_trace(path: str | Path, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], *,
                workload: str, ids: Sequence[str] | None = None, source: str = "ngramspec.engine",
                topk: Sequence | None = None) -> Path:
    """One record `{id, workload, generator, source, prompt, output}` per request, in replay order; with `topk`
    (per request, [len(output), k]: `GenerationResult.topk`) each record also holds it."""
    if len(prompts) != len(outputs):
        raise ValueError(f"{len(prompts)} prompts but {len(outputs)} outputs")
    ids = [f"{workload}-{i}" for i in range(len(prompts))] if ids is None else list(ids)
    if len(ids) != len(prompts):
        raise ValueError(f"{len(ids)} ids for {len(prompts)} requests")
    if topk is not None and (len(topk) != len(outputs) or any(len(t) != len(o) for t, o in zip(topk, outputs))):
        raise ValueError("topk needs one row per output token of every request")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(path, "wb", mtime=0) as raw:
        for j, (rid, prompt, output) in enumerate(zip(ids, prompts, outputs)):
            if not len(prompt) or not len(output):
                raise ValueError(f"request {rid}: empty prompt or output")
            record = {"id": rid, "workload": workload, "generator": GENERATOR, "source": source,
                      "prompt": [int(t) for t in prompt], "output": [int(t) for t in output]}
            if topk is not None:
                record["topk"] = [[int(t) for t in row] for row in topk[j]]
            raw.write((json.dumps(record) + "\n").encode())
    return path


def read_trace(path: str | Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]
