"""Cost profiles: the time of one batched step of `batch` sequences, each verifying `width` tokens.

`width` counts the root, so width 1 is a plain decode step. Built in (package data,
`ngramspec/data/profiles/*.json`; `ngramspec profiles` lists them):

- `seed-pcie8`: decode 12.2 ms; a verify of width n > 1 costs 22.5 + 2.5 n ms (any batch size).
- `h200-llama8b`: CUDA-graph (`graph_ms`) chain rows measured for a Llama-3.1-8B-shaped model on one H200,
  interpolated piecewise-linearly over batch and width.

Any JSON file of the shape `ngramspec calibrate` writes (`{"rows": [{"B": .., "k": .., "graph_ms": ..,
"eager_ms": .., "kind": "chain"}, ...]}`) is a profile too: `--profile FILE.json` (reads `graph_ms`, or
`eager_ms` where the file has no CUDA-graph timings), or `FILE.json:COLUMN` to read another column.
"""
from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from pathlib import Path

from ngramspec.controller.cost import CostTable, check_shape, read_json


class CostProfile:
    name: str

    def cost_ms(self, batch: int, width: int) -> float:
        raise NotImplementedError

    def total_ms(self, step_counts: dict[tuple[int, int], int]) -> float:
        """Total time of a replay given how many steps ran at each (batch, width)."""
        return float(sum(n * self.cost_ms(b, w) for (b, w), n in step_counts.items()))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class LinearProfile(CostProfile):
    """Decode costs `decode_ms`; a verify of width n > 1 costs `verify_base_ms + verify_per_token_ms * n`."""

    def __init__(self, name: str, decode_ms: float, verify_base_ms: float, verify_per_token_ms: float):
        if decode_ms <= 0 or verify_base_ms < 0 or verify_per_token_ms < 0 or verify_base_ms + verify_per_token_ms <= 0:
            raise ValueError(f"{name}: step costs must be positive")
        self.name = name
        self.decode_ms = decode_ms
        self.verify_base_ms = verify_base_ms
        self.verify_per_token_ms = verify_per_token_ms

    def cost_ms(self, batch: int, width: int) -> float:
        check_shape(batch, width)
        if width == 1:
            return self.decode_ms
        return self.verify_base_ms + self.verify_per_token_ms * width


class TableProfile(CostTable, CostProfile):
    """Measured step times on a (batch x width) grid, interpolated piecewise-linearly in both (the controller's
    ``CostTable``, as a profile)."""


def _profile_from_data(data: dict, name: str, source: str, column: str | None = None) -> CostProfile:
    if isinstance(data, dict) and isinstance(data.get("linear"), dict):
        try:
            return LinearProfile(name, **{k: float(v) for k, v in data["linear"].items()})
        except TypeError:
            raise ValueError(f"{source}: 'linear' takes decode_ms, verify_base_ms and verify_per_token_ms") from None
    return TableProfile.from_data(data, column or (data.get("column") if isinstance(data, dict) else None),
                                  name=name, source=source)


def builtin_profile_files() -> dict[str, object]:
    """Built-in profiles shipped as package data (`ngramspec/data/profiles/NAME.json`), by name."""
    folder = resources.files("ngramspec") / "data" / "profiles"
    return {entry.name[:-5]: entry for entry in sorted(folder.iterdir(), key=lambda e: e.name)
            if entry.name.endswith(".json")}


def builtin_profile_info() -> list[dict]:
    """Name, description and source of every built-in profile."""
    out = []
    for name, entry in builtin_profile_files().items():
        data = json.loads(entry.read_text())
        out.append({"name": name, "description": data.get("description", ""), "source": data.get("source", "")})
    return out


@lru_cache(maxsize=None)
def _builtin(name: str) -> CostProfile:
    data = json.loads(builtin_profile_files()[name].read_text())
    return _profile_from_data(data, name, f"built-in profile {name}")


def load_profile_file(path: str | Path, column: str | None = None) -> CostProfile:
    """A profile from a JSON file: a calibration table (`rows`) or a linear model (`linear`)."""
    path = Path(path)
    return _profile_from_data(read_json(path), path.stem, str(path), column)


def get_profile(spec: str) -> CostProfile:
    """A profile by built-in name (`ngramspec profiles` lists them) or by JSON file (`FILE.json`, or
    `FILE.json:COLUMN` to read another column of a calibration file, e.g. `eager_ms`)."""
    builtins = builtin_profile_files()
    if spec in builtins:
        return _builtin(spec)
    path, _, column = spec.partition(".json:")
    if column:
        return load_profile_file(path + ".json", column)
    if spec.endswith(".json"):
        return load_profile_file(spec)
    raise ValueError(f"unknown profile {spec!r}: use one of {', '.join(builtins)} or a FILE.json cost table "
                     "(e.g. from `ngramspec calibrate`)")


BUILTIN_PROFILES = tuple(builtin_profile_files())
SEED_PCIE8 = get_profile("seed-pcie8")


def describe(profile: CostProfile, batches=(1, 8, 32), widths=(1, 4, 8, 16)) -> list[str]:
    """A few step times of a profile, one line per batch size."""
    return [f"    batch {b:>3d}: " + "  ".join(f"w{w} {profile.cost_ms(b, w):6.2f} ms" for w in widths)
            for b in batches]


def main(argv: list[str] | None = None) -> int:
    """`ngramspec profiles [FILE.json ...]`: the built-in cost profiles, or the given files, with a few step times."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog="ngramspec profiles",
        description="List the built-in cost profiles (step time of `batch` sequences verifying `width` tokens; "
                    "width 1 = plain decode). Give FILE.json (from `ngramspec calibrate`) to check your own.")
    parser.add_argument("files", nargs="*", metavar="FILE.json[:COLUMN]", help="your own cost files")
    args = parser.parse_args(argv)
    try:
        if args.files:
            for spec in args.files:
                profile = get_profile(spec)
                print(f"{spec}: usable as --profile {spec}")
                print("\n".join(describe(profile)))
            return 0
        for info in builtin_profile_info():
            print(f"{info['name']}: {info['description']}")
            print(f"    source: {info['source']}")
            print("\n".join(describe(get_profile(info["name"]))))
    except (ValueError, FileNotFoundError) as exc:
        print(f"ngramspec profiles: error: {exc}", file=sys.stderr)
        return 2
    print("\nYour own: `ngramspec calibrate -o my.json` on your device, "
          "then `ngramspec simulate ... --profile my.json`.")
    return 0
