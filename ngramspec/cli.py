"""`ngramspec` command line: `simulate`, `profiles`, `demo`, `calibrate`.

Each subcommand lives in its own module and is imported lazily, so `ngramspec simulate` never imports torch.
A missing optional package ends the command with one line naming the package, not a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

SUBCOMMANDS = {
    "simulate": ("ngramspec.sim.simulate", "Will n-gram speculation help on my traffic? Replay request logs "
                                       "(token ids or text) under cost profiles and compare draft methods."),
    "profiles": ("ngramspec.sim.profiles", "List the built-in cost profiles (or describe your own FILE.json)."),
    "demo": ("ngramspec.engine.demo", "Plain greedy vs NGRAM_ADAPTIVE on a real model (SmolLM2-135M)."),
    "calibrate": ("ngramspec.engine.calibrate", "Measure the verify cost c(B, n) of a model on this device."),
}

# optional packages a subcommand may import, and what to install for them
_EXTRAS = {"torch": "ngramspec[engine]", "transformers": "ngramspec[engine]", "gguf": "ngramspec[engine]",
           "accelerate": "ngramspec[engine]", "matplotlib": "ngramspec[sim]",
           "tqdm": "ngramspec[sim]", "sglang": "sglang==0.5.23", "arctic_inference": "arctic-inference==0.3.0",
           "tiktoken": "tiktoken", "tokenizers": "tokenizers"}


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("ngramspec")
    except PackageNotFoundError:  # run from a checkout that was never installed
        from ngramspec import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ngramspec", description="Adaptive n-gram speculative decoding.")
    parser.add_argument("--version", action="version", version=f"ngramspec {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)  # each subcommand parses its own arguments
    return parser


def missing_package_line(command: str, exc: ImportError) -> str:
    """One line for a missing optional package."""
    text = str(exc).splitlines()[0] if str(exc) else repr(exc)
    name = (getattr(exc, "name", None) or "").split(".")[0]
    if isinstance(exc, ModuleNotFoundError) and name:
        hint = _EXTRAS.get(name, name)
        return f"ngramspec {command}: error: needs the optional package {name!r} (pip install '{hint}')"
    return f"ngramspec {command}: error: {text}"


def check_output(path: str | None, option: str, example: str = "results.json") -> None:
    """Make sure the output file `path` (given as `option`) can be written before a long run, so a bad path does
    not cost the results: ValueError naming the option otherwise (for a folder, `example` is the file name it
    suggests inside it). A file this creates is removed again; `-` (stdout) passes."""
    if not path or path == "-":
        return
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{option} {path}: is a folder; give a file name inside it, e.g. {target / example}")
    folder = next((p for p in (target.parent, *target.parent.parents) if p.exists()), None)
    if folder is not None and not folder.is_dir():
        raise ValueError(f"{option} {path}: cannot write there ({folder} is a file, not a folder)")
    existed = target.exists()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "a"):
            pass
    except OSError as exc:
        raise ValueError(f"{option} {path}: cannot write there ({exc.strerror or exc})") from None
    if not existed:
        target.unlink()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in SUBCOMMANDS:
        parser.parse_args(argv)  # --help, --version, or an error naming the commands (exit 2)
        return 2
    command = argv[0]
    try:
        module = importlib.import_module(SUBCOMMANDS[command][0])
        return int(module.main(argv[1:]) or 0)
    except ImportError as exc:
        print(missing_package_line(command, exc), file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `ngramspec profiles | head`: the reader left, nothing more to say
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
