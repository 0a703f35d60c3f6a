"""Draft methods for the replay simulator, and the registry that names them.

A method is built from a spec `name:key=value,...` (e.g. `ngramspec-tree:k=8`, `sglang-ngram:match=PROB`).
Other modules add methods with `register_method(name, factory)`; the built-in ones (`baselines`, ...,
`adaptive`) register themselves that way when `_load_builtins` imports them.

The protocol (per request `rid`; drafts are `(tokens int32, parents int32)`, parent -1 = child of the root,
the root being the last committed token, and `parents[j] < j`):

    start(rid, prompt)                 a request joins, with its prompt
    propose(rids) -> [(tokens, parents)]   one draft per request, possibly empty
    verify_width(rids, drafts) -> int  batch verify width including the root (1 = plain decode)
    update(rid, committed, n_accepted) the tokens committed this step (accepted draft tokens + bonus)
    observe_step(batch, width, ms)     the simulated step time under the profile, for adaptive methods
    finish(rid)                        the request is done
    close()                            the replay is over (e.g. write what was learned)

Optional hooks the simulator honours: `warmup()` runs before the replay's clock starts (JIT compilation stays
out of the proposer's time); `needs_future = True` makes it call `see_future(rid, output)` before
`start` (upper bounds only); `profile_dependent = True` makes it replay once per profile and call
`bind_profile(profile)` first; `uses_scores = True` (the trace must carry `topk`) makes it call
`see_scores(rid, rows)` before each `update`, with the model's top-k at the positions whose distributions produced
the committed tokens (one row per committed token: what a server's verify computed in that step). Before every
`propose` the simulator sets `method.waiting` to the number of requests not yet admitted (what a server's
scheduler knows: its queue length).
"""
from __future__ import annotations

import importlib
import inspect
from typing import Callable

import numpy as np

from ngramspec.controller.protocol import check_positive as positive_int  # noqa: F401 (for the methods)

EMPTY = np.zeros(0, dtype=np.int32)
CHAIN_PARENTS = np.arange(-1, 4095, dtype=np.int32)
EMPTY_DRAFT = (EMPTY, EMPTY)


def chain(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A chain draft: each token the child of the previous one."""
    tokens = np.asarray(tokens, dtype=np.int32)
    return tokens, CHAIN_PARENTS[: len(tokens)]


class Method:
    """Base class with the protocol's defaults."""

    name: str = "method"
    needs_future = False
    profile_dependent = False
    uses_scores = False
    waiting: int | None = None  # requests queued behind the batch; the simulator sets it before each propose

    def warmup(self) -> None:
        """Compile or load whatever the method needs, before the replay's clock starts."""

    def start(self, rid, prompt: np.ndarray) -> None:
        pass

    def propose(self, rids: list) -> list[tuple[np.ndarray, np.ndarray]]:
        raise NotImplementedError

    def verify_width(self, rids: list, drafts: list) -> int:
        return 1 + max((len(tokens) for tokens, _ in drafts), default=0)

    def update(self, rid, committed: np.ndarray, n_accepted: int) -> None:
        pass

    def observe_step(self, batch_size: int, width: int, duration_ms: float) -> None:
        pass

    def finish(self, rid) -> None:
        pass

    def close(self) -> None:
        """The replay is over."""


METHODS: dict[str, Callable[..., Method]] = {}
DESCRIPTIONS: dict[str, str] = {}
_BUILTIN_MODULES = ("baselines", "sglang_ngram", "arctic_suffix", "ngramspec_static", "ahead", "recycling",
                    "oracle_ctl", "adaptive")
_loaded = False


def register_method(name: str, factory: Callable[..., Method], description: str | None = None) -> None:
    """Make `name` available to `make_method`; `factory(**params)` builds a fresh Method. `description` (one
    line, for `ngramspec simulate --help`) defaults to the first line of the factory's docstring."""
    if not name or ":" in name or "," in name or "=" in name:
        raise ValueError(f"bad method name {name!r}")
    METHODS[name] = factory
    doc = description or (factory.__doc__ or "").strip()
    DESCRIPTIONS[name] = doc.splitlines()[0].strip() if doc else ""


def _load_builtins() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module in _BUILTIN_MODULES:
        importlib.import_module(f"ngramspec.sim.methods.{module}")


def available_methods() -> list[str]:
    _load_builtins()
    return sorted(METHODS)


def method_parameters(name: str) -> list[tuple[str, object]]:
    """(parameter, default) of a registered method, in signature order."""
    _load_builtins()
    params = inspect.signature(METHODS[name]).parameters.values()
    return [(p.name, p.default) for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]


def describe_methods() -> str:
    """Every method with its parameters and defaults, one entry per method (for `simulate --help`)."""
    lines = []
    for name in available_methods():
        params = ",".join(f"{k}={'(default)' if v is None else '(required)' if v is inspect.Parameter.empty else v}"
                          for k, v in method_parameters(name))
        lines.append(f"  {name}" + (f":{params}" if params else ""))
        if DESCRIPTIONS.get(name):
            lines.append(f"      {DESCRIPTIONS[name]}")
    return "\n".join(lines)


def _parse_value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_spec(spec: str) -> tuple[str, dict]:
    """`name:key=value,...` -> (name, {key: value}); ints and floats are converted."""
    name, _, rest = spec.strip().partition(":")
    params = {}
    if rest:
        for item in rest.split(","):
            key, eq, value = item.partition("=")
            if not eq or not key.strip() or not value.strip():
                raise ValueError(f"method spec {spec!r}: parameters are key=value, got {item!r}")
            params[key.strip()] = _parse_value(value.strip())
    return name, params


def make_method(spec: str) -> Method:
    """Build a method from its spec; unknown names or parameters raise ValueError."""
    _load_builtins()
    name, params = parse_spec(spec)
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(available_methods())}")
    factory = METHODS[name]
    accepted = inspect.signature(factory).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in accepted.values()):
        unknown = sorted(set(params) - set(accepted))
        if unknown:
            raise ValueError(f"method {name!r} takes parameters {sorted(accepted) or 'none'}, not {unknown}")
    try:
        method = factory(**params)
    except ValueError as exc:  # a bad parameter value: say which spec it came from
        raise ValueError(f"method {spec.strip()!r}: {exc}") from None
    method.name = spec.strip()
    return method


def flag(value, what: str) -> bool:
    if value in (0, 1, True, False):
        return bool(value)
    raise ValueError(f"{what} must be 0 or 1, got {value!r}")
