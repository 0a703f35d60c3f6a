"""`ngramspec` command line: `simulate`, `demo`, `calibrate`.

Each subcommand lives in its own module and is imported lazily, so `ngramspec simulate` never imports torch.
"""
from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "simulate": ("ngramspec.simulate", "Replay traces under cost profiles and compare draft methods."),
    "demo": ("ngramspec.engine.demo", "Plain greedy vs NGRAM_ADAPTIVE on a real model (SmolLM2-135M)."),
    "calibrate": ("ngramspec.engine.calibrate", "Measure verify cost c(B, n) of a model on this device."),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        print("usage: ngramspec {%s} ..." % ",".join(SUBCOMMANDS))
        for name, (_, text) in SUBCOMMANDS.items():
            print(f"  {name:10s} {text}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
