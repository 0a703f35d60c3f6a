"""The step's kernels run without numba's reference counting where numba offers it (`ngramspec._nrt`, private numba
options and internals). Without them (a numba that dropped one) the same kernels compile with reference counting and
must take the same drafts and decisions: a replay in a fresh process with the options switched off (and its own
numba cache, so that no kernel compiled the other way is reused) against the same replay here."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ngramspec import _nrt

ROOT = Path(__file__).resolve().parents[1]

_REPLAY = textwrap.dedent('''
    import hashlib, sys
    import numpy as np
    from ngramspec import NgramCache
    from ngramspec.controller import AdaptiveController
    from ngramspec.layout import accepted_path


    def digest(batch, steps=120):
        rng = np.random.default_rng(batch)
        docs = [rng.integers(0, 300, 250).tolist() for _ in range(3)]
        cache, ctl = NgramCache(max_depth=16), AdaptiveController()
        h = hashlib.sha256()
        pos, outs, active, nxt, committed = {}, {}, [], 0, {}
        for step in range(steps):
            while len(active) < batch:
                doc = docs[nxt % 3]
                a = int(rng.integers(0, 100))
                outs[nxt] = doc[a:a + 40] + rng.integers(0, 300, 20).tolist() + doc[a + 40:a + 100]
                cache.start_request(nxt, doc[:150] + [nxt])
                ctl.start(nxt)
                pos[nxt] = 0
                active.append(nxt)
                nxt += 1
            commits = [np.asarray(committed.pop(r, []), np.int32) for r in active]
            b, p = ctl.step(cache, list(active), commits, waiting=1)
            h.update(repr((p.width, p.lengths.tolist(), p.expected.hex(), p.cost.hex(), p.reason, b.tokens.tolist(),
                           b.parents.tolist(), b.probs.tolist(), b.offsets.tolist())).encode())
            for i, rid in enumerate(list(active)):
                out, k, o, at = outs[rid], int(p.lengths[i]), int(b.offsets[i]), pos[rid]
                path = accepted_path(b.tokens[o:o + k], b.parents[o:o + k], out[at:at + k + 1])
                n = min(len(path) + 1, len(out) - at)
                committed[rid] = out[pos[rid]:pos[rid] + n]
                pos[rid] += n
                if pos[rid] == len(out):
                    active.remove(rid)
                    committed.pop(rid, None)
                    cache.finish_request(rid)
                    ctl.finish(rid)
            ctl.observe_step(len(active) or 1, p.width, 20.0 + 2.5 * p.width)
        return h.hexdigest()
''')

# `ngramspec._nrt` loaded and switched off before the package imports it (its kernels read the options when defined)
_OFF = textwrap.dedent('''
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("ngramspec._nrt", sys.argv[1])
    n = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(n)
    n.NO_REFCOUNT = n.NO_REFCOUNT_LIST = n.REFCOUNT = {}
    sys.modules["ngramspec._nrt"] = n
''')
_KINDS = ("from ngramspec._draft import _propose, append_own\n"
          "from ngramspec.controller.choose import _ctl_step\n"
          "from ngramspec.controller.step import _host_core\n"
          "print(*[f.targetoptions.get('_nrt', True) for f in (_propose, append_own, _ctl_step, _host_core)])\n")


def _digests_here() -> list[str]:
    scope: dict = {}
    exec(_REPLAY, scope)
    return [scope["digest"](b) for b in (1, 4)]


@pytest.mark.slow  # compiles every kernel of the step a second time (its own numba cache)
def test_without_the_no_refcount_options_the_step_takes_the_same_decisions(tmp_path):
    here = _digests_here()
    code = _OFF + _REPLAY + "print(digest(1), digest(4))\n" + _KINDS
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "ngramspec" / "_nrt.py")], env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split("\n")
    assert lines[1].split() == ["True"] * 4  # every step kernel counted references there
    assert lines[0].split() == here
    assert len(set(here)) == 2  # two different replays, each the same either way


def test_this_numba_runs_the_step_without_reference_counting():
    """The options are there in every numba this project supports (the test environment's included): otherwise
    the step would silently run the slower, reference-counted way."""
    assert _nrt.NO_REFCOUNT == {"_nrt": False}
    assert _nrt.NO_REFCOUNT_LIST == {"_nrt": False, "no_cpython_wrapper": True}
    from ngramspec._draft import _propose, append_own
    from ngramspec.controller.choose import _ctl_step
    from ngramspec.controller.step import _host_core
    assert [f.targetoptions.get("_nrt", True) for f in (_propose, append_own, _ctl_step, _host_core)] == [False] * 4
