"""Write the engine's greedy generations as a trace in the shared format (gzip JSONL, one record per request),
so that `ngramspec simulate` can replay exactly what the engine did."""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Sequence

GENERATOR = "SmolLM2-135M-Instruct (GGUF Q4_1), ngramspec engine, greedy"


def write_trace(path: str | Path, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], *,
                workload: str, ids: Sequence[str] | None = None, source: str = "ngramspec.engine") -> Path:
    """One record `{id, workload, generator, source, prompt, output}` per request, in replay order."""
    if len(prompts) != len(outputs):
        raise ValueError(f"{len(prompts)} prompts but {len(outputs)} outputs")
    ids = [f"{workload}-{i}" for i in range(len(prompts))] if ids is None else list(ids)
    if len(ids) != len(prompts):
        raise ValueError(f"{len(ids)} ids for {len(prompts)} requests")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(path, "wb", mtime=0) as raw:
        for rid, prompt, output in zip(ids, prompts, outputs):
            if not prompt or not output:
                raise ValueError(f"request {rid}: empty prompt or output")
            record = {"id": rid, "workload": workload, "generator": GENERATOR, "source": source,
                      "prompt": [int(t) for t in prompt], "output": [int(t) for t in output]}
            raw.write((json.dumps(record) + "\n").encode())
    return path


def read_trace(path: str | Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]
