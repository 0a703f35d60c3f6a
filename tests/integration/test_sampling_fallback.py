"""`ngramspec_sglang.sampling_fallback`: sampled tree verification without flashinfer, on CPU (torch only).

- the vectorised torch kernel equals a line-by-line transliteration of SGLang's CUDA kernel
  (`sgl_kernel/speculative/sampling.cuh`) for the same coins, thresholds included;
- it is lossless: the emitted sequence is distributed as autoregressive sampling from the target (chi-square over
  20000 draws, per-sequence and per-node conditionals), and the test catches a lossy variant (threshold_single=0.1);
- the torch renorms keep flashinfer's pivot semantics;
- `install_if_needed` rebinds exactly when flashinfer is missing, idempotently.
"""
import importlib.util
import logging
import math
import types

import pytest
import torch

from ngramspec_sglang import sampling_fallback as sf
from ngramspec_sglang.sampling_fallback import (
    top_k_renorm_prob_torch,
    top_p_renorm_prob_torch,
)
from ngramspec_sglang.sampling_fallback import (
    tree_speculative_sampling_target_only_torch as tree_sample,
)

# ---------------------------------------------------------------------------------------------- trees
# A tree: parent of each node (node 0 the root, -1); children in sibling order = increasing node index.
CHAIN = [-1, 0, 1, 2]  # 0 -> 1 -> 2 -> 3
TREE = [-1, 0, 0, 0, 1, 1, 2, 4]  # root children 1,2,3; 1 -> 4,5; 2 -> 6; 4 -> 7


def tree_arrays(parents):
    """(retrive_next_token, retrive_next_sibling, depth) local-index arrays for one request."""
    n = len(parents)
    nxt, sib = [-1] * n, [-1] * n
    for node in range(n - 1, 0, -1):  # build sibling lists so that children are in index order
        p = parents[node]
        sib[node] = nxt[p]
        nxt[p] = node
    depth = [0] * n
    for node in range(1, n):
        depth[node] = depth[parents[node]] + 1
    return nxt, sib, depth


def make_batch(parents, tokens, probs, bs, num_spec=None, gen=None, coins=None):
    """Kernel inputs for `bs` copies of one request (tokens: per node; probs: (nodes, vocab) target rows)."""
    nxt, sib, depth = tree_arrays(parents)
    n, vocab = probs.shape
    num_spec = num_spec or max(depth) + 1
    rows = lambda values: torch.tensor(values, dtype=torch.int64).repeat(bs, 1)  # noqa: E731
    if coins is None:
        coins = torch.rand(bs, n, generator=gen), torch.rand(bs, generator=gen)
    return dict(
        predicts=torch.zeros(bs * n, dtype=torch.int32),
        accept_index=torch.full((bs, num_spec), -1, dtype=torch.int32),
        accept_token_num=torch.empty(bs, dtype=torch.int32),
        candidates=rows(tokens),
        retrive_index=torch.arange(bs * n, dtype=torch.int64).reshape(bs, n),
        retrive_next_token=rows(nxt),
        retrive_next_sibling=rows(sib),
        uniform_samples=coins[0],
        uniform_samples_for_final_sampling=coins[1],
        target_probs=probs.float().expand(bs, n, vocab).contiguous(),
        draft_probs=torch.zeros(bs, n, vocab),
    )


def emitted(kw):
    """Per row, the emitted tokens as SGLang reads them: predicts[accept_index[:accept_token_num + 1]]."""
    out = []
    for b in range(kw["accept_index"].shape[0]):
        k = int(kw["accept_token_num"][b])
        out.append(tuple(int(kw["predicts"][int(i)]) for i in kw["accept_index"][b, : k + 1]))
    return out


# ---------------------------------------------------------------------- reference: the CUDA kernel, one row at a time


def kernel_reference(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                     retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
                     draft_probs, threshold_single=1.0, threshold_acc=1.0):
    """TreeSpeculativeSamplingTargetOnly transliterated (float32 arithmetic as the kernel), one block per row."""
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    bs, num_draft = candidates.shape
    num_spec, vocab = accept_index.shape[1], target_probs.shape[-1]
    thr_single, thr_acc = f32(threshold_single), f32(max(threshold_acc, 1e-9))
    for bx in range(bs):
        prob_acc = f32(0.0)
        cur_row = 0
        coin = uniform_samples[bx, 0]
        last = int(retrive_index[bx, 0])
        accept_index[bx, 0] = last
        num_acc = 0
        cur = 0
        for _ in range(1, num_spec):
            cur = int(retrive_next_token[bx, cur])
            while cur != -1:
                draft_index = int(retrive_index[bx, cur])
                tok = int(candidates[bx, cur])
                q = target_probs[bx, cur_row, tok]
                prob_acc = prob_acc + q
                if q > 0 and (coin < prob_acc / thr_acc or q >= thr_single):
                    prob_acc = f32(0.0)
                    cur_row = cur
                    coin = uniform_samples[bx, cur]
                    predicts[last] = tok
                    num_acc += 1
                    accept_index[bx, num_acc] = draft_index
                    last = draft_index
                    break
                draft_probs[bx, cur_row, tok] = target_probs[bx, cur_row, tok]
                cur = int(retrive_next_sibling[bx, cur])
            if cur == -1:
                break
        accept_token_num[bx] = num_acc
        coin = uniform_samples_for_final_sampling[bx]
        q = target_probs[bx, cur_row]
        p = draft_probs[bx, cur_row] if num_acc != num_spec - 1 else torch.zeros_like(q)
        relu = (q - p).clamp_min(0)
        u = coin * relu.sum()
        sampled, cdf, last_valid = vocab, f32(0.0), -1
        for i in range(vocab):
            if relu[i] > 0:
                cdf = cdf + relu[i]
                last_valid = i
                if cdf > u and sampled == vocab:
                    sampled = i
        if sampled == vocab:
            sampled = vocab - 1 if last_valid == -1 else last_valid
        predicts[last] = sampled


def random_batch(gen, bs=64, vocab=7, num_spec=4):
    """Rows of assorted trees, tokens (distinct among siblings, sometimes with zero target mass), probs, coins."""
    shapes = [CHAIN, TREE, [-1], [-1, 0], [-1, 0, 0, 1, 1, 3, 3, 3]]
    n = max(map(len, shapes))
    kw = make_batch([-1] + [0] * (n - 1), [0] * n, torch.full((n, vocab), 1.0 / vocab), bs, num_spec, gen)
    for b in range(bs):
        parents = shapes[b % len(shapes)] + [-2] * (n - len(shapes[b % len(shapes)]))
        real = [p for p in parents if p != -2]
        nxt, sib, _ = tree_arrays(real)
        pad = n - len(real)
        kw["retrive_next_token"][b] = torch.tensor(nxt + [-1] * pad)
        kw["retrive_next_sibling"][b] = torch.tensor(sib + [-1] * pad)
        kw["candidates"][b] = torch.randint(0, vocab, (n,), generator=gen)
        for p in range(len(real)):  # distinct sibling tokens
            kids = [c for c in range(1, len(real)) if real[c] == p]
            kw["candidates"][b, kids] = torch.randperm(vocab, generator=gen)[: len(kids)]
        logits = torch.randn(n, vocab, generator=gen) * 2
        if b % 2:  # drafts the target likes: deeper acceptances
            for c in range(1, len(real)):
                logits[real[c], kw["candidates"][b, c]] += 3.0
        logits[torch.rand(n, vocab, generator=gen) < 0.2] = -math.inf  # zero-mass tokens
        logits[:, 0] = logits[:, 0].nan_to_num(neginf=0.0)
        kw["target_probs"][b] = torch.softmax(logits, -1)
    kw["uniform_samples_for_final_sampling"][::7] = 1.0  # u = the whole residual mass: the last-valid fallback
    kw["uniform_samples_for_final_sampling"][1::7] = 0.0
    return kw


@pytest.mark.parametrize("thresholds", [(1.0, 1.0), (0.3, 1.0), (1.0, 0.5), (0.2, 0.7), (0.0, 1.0), (1.0, 0.0)])
def test_matches_the_kernel_transliteration_coin_for_coin(thresholds):
    gen = torch.Generator().manual_seed(7)
    for num_spec in (4, 3, 4, 2):  # 3, 2: depth limits below the trees' depth
        kw = random_batch(gen, num_spec=num_spec)
        ref = {k: v.clone() for k, v in kw.items()}
        tree_sample(**kw, threshold_single=thresholds[0], threshold_acc=thresholds[1], deterministic=True)
        kernel_reference(**ref, threshold_single=thresholds[0], threshold_acc=thresholds[1])
        for name in ("predicts", "accept_index", "accept_token_num", "draft_probs"):
            assert torch.equal(kw[name], ref[name]), name
        assert kw["predicts"].dtype == torch.int32 and kw["accept_index"].dtype == torch.int32


def test_depth_limit_and_empty_batch():
    # a chain longer than num_spec allows: accepts at most num_spec - 1 drafts, bonus from the full target row
    probs = torch.zeros(4, 5)
    probs[:, 2] = 1.0
    kw = make_batch(CHAIN, [9, 2, 2, 2], probs, bs=3, num_spec=3, gen=torch.Generator().manual_seed(0))
    tree_sample(**kw)
    assert kw["accept_token_num"].tolist() == [2, 2, 2]
    assert emitted(kw) == [(2, 2, 2)] * 3
    kw = make_batch(CHAIN, [9, 2, 2, 2], probs, bs=0, gen=torch.Generator().manual_seed(0))
    tree_sample(**kw)


# ---------------------------------------------------------------------------------------------- losslessness


def chi2_sf(stat: float, df: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def chi2_pvalue(observed: dict, expected_p: dict, n: int) -> float:
    """Pearson chi-square p-value; cells with expected count < 5 pooled; an observation outside support -> 0."""
    if any(key not in expected_p or expected_p[key] == 0 for key in observed):
        return 0.0
    cells, pool_obs, pool_exp = [], 0, 0.0
    for key, p in expected_p.items():
        if p * n < 5:
            pool_obs, pool_exp = pool_obs + observed.get(key, 0), pool_exp + p * n
        else:
            cells.append((observed.get(key, 0), p * n))
    if pool_exp > 0:
        cells.append((pool_obs, pool_exp))
    if len(cells) < 2:
        return 1.0
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return chi2_sf(stat, len(cells) - 1)


def autoregressive_distribution(parents, tokens, probs, num_spec):
    """P(emitted sequence) when sampling the target token by token: the draft tree only says where the target
    rows come from (the row of the node the prefix reaches); the sequence ends one token after leaving the tree or
    at num_spec tokens."""
    nxt, sib, _ = tree_arrays(parents)
    dist = {}

    def walk(node, prefix, p_prefix, depth):
        children = {}
        c = nxt[node]
        while c != -1:
            children[tokens[c]] = c
            c = sib[c]
        for tok, p in enumerate(probs[node].tolist()):
            if p == 0:
                continue
            if tok in children and depth + 1 < num_spec:
                walk(children[tok], prefix + (tok,), p_prefix * p, depth + 1)
            else:
                dist[prefix + (tok,)] = dist.get(prefix + (tok,), 0.0) + p_prefix * p

    walk(0, (), 1.0, 0)
    return dist


def rule_distribution(parents, tokens, probs, num_spec):
    """P(emitted sequence) by enumerating the acceptance rule (thresholds 1): child i of a node is accepted when
    the node's coin falls in [sum_{j<i} q(t_j), sum_{j<=i} q(t_j)); if none is, the bonus is drawn from q with the
    children's tokens removed, renormalised; at the depth limit from q."""
    nxt, sib, _ = tree_arrays(parents)
    dist = {}

    def walk(node, prefix, p_prefix, n_acc):
        q = probs[node].double()
        residual = q.clone()
        lo = 0.0
        c = nxt[node] if n_acc < num_spec - 1 else -1
        while c != -1:
            qc = float(q[tokens[c]])
            if qc > 0:
                walk(c, prefix + (tokens[c],), p_prefix * qc, n_acc + 1)  # coin in [lo, lo + qc)
            lo += qc
            residual[tokens[c]] = 0.0
            c = sib[c]
        p_reject = max(0.0, 1.0 - lo)
        if p_reject > 0 and residual.sum() > 0:
            for tok, r in enumerate((residual / residual.sum()).tolist()):
                if r > 0:
                    dist[prefix + (tok,)] = dist.get(prefix + (tok,), 0.0) + p_prefix * p_reject * r

    walk(0, (), 1.0, 0)
    return dist


def monte_carlo(parents, tokens, probs, n, seed, **thresholds):
    gen = torch.Generator().manual_seed(seed)
    kw = make_batch(parents, tokens, probs, n, gen=gen)
    tree_sample(**kw, **thresholds)
    counts = {}
    for seq in emitted(kw):
        counts[seq] = counts.get(seq, 0) + 1
    return counts


def conditional_pvalues(counts, parents, tokens, probs):
    """For each tree node, reached by its token path: the next emitted token among the draws that emitted that path
    and went on, against the node's target row (chi-square p-values)."""
    nxt, sib, depth = tree_arrays(parents)
    num_spec = max(depth) + 1
    out = {}
    for node in range(len(parents)):
        path, x = [], node
        while x != 0:
            path.append(tokens[x])
            x = parents[x]
        path = tuple(reversed(path))
        if depth[node] >= num_spec:
            continue
        nexts = {}
        for seq, c in counts.items():
            if len(seq) > len(path) and seq[: len(path)] == path:
                nexts[seq[len(path)]] = nexts.get(seq[len(path)], 0) + c
        total = sum(nexts.values())
        if total >= 50:
            out[node] = chi2_pvalue(nexts, {t: float(p) for t, p in enumerate(probs[node].tolist())}, total)
    return out


def case(parents, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    tokens = [0] * len(parents)
    for p in range(len(parents)):
        kids = [c for c in range(1, len(parents)) if parents[c] == p]
        tokens_p = torch.randperm(vocab, generator=gen)[: len(kids)].tolist()
        for c, t in zip(kids, tokens_p):
            tokens[c] = t
    probs = torch.distributions.Dirichlet(torch.full((vocab,), 1.5)).sample((len(parents),))
    probs = probs.float() / probs.float().sum(-1, keepdim=True)
    return tokens, probs


N = 20000


@pytest.mark.parametrize("parents,seed", [(CHAIN, 1), (TREE, 2), (TREE, 3)], ids=["chain", "tree-a", "tree-b"])
def test_lossless_by_enumeration_and_monte_carlo(parents, seed):
    torch.manual_seed(seed)
    tokens, probs = case(parents, 6, seed)
    num_spec = max(tree_arrays(parents)[2]) + 1
    target = autoregressive_distribution(parents, tokens, probs, num_spec)
    rule = rule_distribution(parents, tokens, probs, num_spec)
    # the rejection rule, enumerated, is exactly autoregressive sampling from the target
    assert set(rule) == set(target)
    assert all(abs(rule[k] - target[k]) < 1e-6 for k in target)
    assert abs(sum(target.values()) - 1) < 1e-5
    counts = monte_carlo(parents, tokens, probs, N, seed)
    assert chi2_pvalue(counts, target, N) > 1e-3
    # the first token is distributed as the root's target row, each next one as the matching node's row
    first = {}
    for seq, c in counts.items():
        first[seq[0]] = first.get(seq[0], 0) + c
    assert chi2_pvalue(first, {t: float(p) for t, p in enumerate(probs[0].tolist())}, N) > 1e-3
    pvalues = conditional_pvalues(counts, parents, tokens, probs)
    assert len(pvalues) >= 3
    assert min(pvalues.values()) > 1e-3, pvalues


@pytest.mark.parametrize("parents,seed", [(CHAIN, 1), (TREE, 2)], ids=["chain", "tree"])
def test_the_same_test_fails_for_a_lossy_variant(parents, seed):
    # threshold_single=0.1: accept every draft with target probability >= 0.1 (what the kernel's relaxation does)
    tokens, probs = case(parents, 6, seed)
    num_spec = max(tree_arrays(parents)[2]) + 1
    target = autoregressive_distribution(parents, tokens, probs, num_spec)
    counts = monte_carlo(parents, tokens, probs, N, seed, threshold_single=0.1)
    first = {}
    for seq, c in counts.items():
        first[seq[0]] = first.get(seq[0], 0) + c
    assert chi2_pvalue(counts, target, N) < 1e-3
    assert min([chi2_pvalue(first, {t: float(p) for t, p in enumerate(probs[0].tolist())}, N)]
               + list(conditional_pvalues(counts, parents, tokens, probs).values())) < 1e-3


# ---------------------------------------------------------------------------------------------- renorms


def test_torch_renorms_keep_flashinfers_pivot_semantics():
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.2, 0.1], [0.5, 0.25, 0.125, 0.0625, 0.0625]])
    out = top_k_renorm_prob_torch(probs, torch.tensor([2, 3]))
    assert torch.allclose(out[0], torch.tensor([0, 0.4, 0.2, 0.2, 0]) / 0.8)  # tie at the pivot: 3 kept
    assert torch.allclose(out[1], torch.tensor([0.5, 0.25, 0.125, 0, 0]) / 0.875)
    assert torch.allclose(top_k_renorm_prob_torch(probs, 1 << 30), probs / probs.sum(-1, keepdim=True))
    out = top_p_renorm_prob_torch(probs, torch.tensor([0.6, 0.7]))
    assert torch.allclose(out[0], torch.tensor([0, 0.4, 0.2, 0.2, 0]) / 0.8)  # ties at the pivot kept
    assert torch.allclose(out[1], torch.tensor([0.5, 0.25, 0, 0, 0]) / 0.75)
    assert torch.allclose(top_p_renorm_prob_torch(probs, 1.0), probs)
    # CPU tensors take the torch path of the dispatching wrappers
    assert torch.equal(sf.top_k_renorm_prob(probs, torch.tensor([2, 3])),
                       top_k_renorm_prob_torch(probs, torch.tensor([2, 3])))
    assert torch.equal(sf.top_p_renorm_prob(probs, 0.7), top_p_renorm_prob_torch(probs, 0.7))


# ---------------------------------------------------------------------------------------------- SGLang's own


def test_against_sglangs_kernel_where_it_runs():
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed here")
    if not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None:
        pytest.skip("SGLang has no CPU/torch reference of tree_speculative_sampling_target_only (a CUDA JIT kernel "
                    "on flashinfer headers); compared with its transliteration above instead")
    from sglang.kernels.ops.speculative.sampling import tree_speculative_sampling_target_only

    gen = torch.Generator().manual_seed(11)
    kw = {k: v.cuda() for k, v in random_batch(gen, bs=256).items()}
    ref = {k: v.clone() for k, v in kw.items()}
    tree_sample(**kw)
    tree_speculative_sampling_target_only(**ref, threshold_single=1.0, threshold_acc=1.0, deterministic=True)
    assert torch.equal(kw["accept_token_num"], ref["accept_token_num"])
    assert torch.equal(kw["accept_index"], ref["accept_index"])
    assert torch.equal(kw["predicts"], ref["predicts"])


# ---------------------------------------------------------------------------------------------- installation


@pytest.fixture
def no_flashinfer(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flashinfer" else real(name, *a))


def fake_eagle_utils():
    originals = {name: object() for name in sf.PATCHED_NAMES}
    return types.SimpleNamespace(__name__="fake.eagle_utils", unrelated=1, **originals), originals


def test_install_rebinds_once_when_flashinfer_is_missing(no_flashinfer, caplog):
    module, originals = fake_eagle_utils()
    log = logging.getLogger("test.sampling_fallback")
    with caplog.at_level(logging.INFO, logger="test.sampling_fallback"):
        assert sf.install_if_needed(log, module=module) is True
        assert sf.install_if_needed(log, module=module) is True
    assert module.tree_speculative_sampling_target_only is tree_sample
    assert module.top_k_renorm_prob is sf.top_k_renorm_prob
    assert module.top_p_renorm_prob is sf.top_p_renorm_prob
    assert module.unrelated == 1
    assert getattr(module, sf.FALLBACK_MARK) == originals
    assert len([r for r in caplog.records if "flashinfer is not installed" in r.getMessage()]) == 1


def test_install_does_nothing_when_flashinfer_is_found(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "flashinfer" else real(name, *a))
    module, originals = fake_eagle_utils()
    assert sf.install_if_needed(logging.getLogger("x"), module=module) is False
    assert {name: getattr(module, name) for name in sf.PATCHED_NAMES} == originals
    assert not hasattr(module, sf.FALLBACK_MARK)


def test_install_patches_the_globals_eagle_sample_reads(no_flashinfer):
    try:
        from sglang.srt.speculative import eagle_utils
    except Exception as exc:  # noqa: BLE001 - any import failure of sglang here means: nothing to check
        pytest.skip(f"sglang's eagle_utils does not import here ({type(exc).__name__}: {exc})"[:200])
    names = set(eagle_utils.eagle_sample.__code__.co_names)
    assert set(sf.PATCHED_NAMES) <= names  # read as module globals at call time
    saved = {name: getattr(eagle_utils, name) for name in sf.PATCHED_NAMES}
    try:
        assert sf.install_if_needed(logging.getLogger("x")) is True
        assert eagle_utils.tree_speculative_sampling_target_only is tree_sample
        assert sf.install_if_needed(logging.getLogger("x")) is True
    finally:
        for name, value in saved.items():
            setattr(eagle_utils, name, value)
        if hasattr(eagle_utils, sf.FALLBACK_MARK):
            delattr(eagle_utils, sf.FALLBACK_MARK)


@pytest.mark.parametrize("env, installs", [("1", 1), (None, 0)])
def test_the_run_batch_hook_installs_it_for_every_algorithm_only_when_asked(monkeypatch, env, installs):
    """NGRAMSPEC_SAMPLING_FALLBACK=1: the scheduler's first batch installs the fallback whatever the algorithm (the
    NGRAM control of the sampling check); unset, the hook leaves sampling alone; either way it checks once."""
    from ngramspec_sglang import hooks

    calls = []
    monkeypatch.setattr(sf, "install_if_needed", lambda *a, **k: calls.append(1) or True)
    monkeypatch.setattr(hooks, "_fallback_checked", False)
    if env is None:
        monkeypatch.delenv("NGRAMSPEC_SAMPLING_FALLBACK", raising=False)
    else:
        monkeypatch.setenv("NGRAMSPEC_SAMPLING_FALLBACK", env)
    scheduler = types.SimpleNamespace(draft_worker=None, waiting_queue=[])
    for _ in range(3):
        assert hooks.record_waiting(lambda s, *a, **k: "ran", scheduler) == "ran"
    assert len(calls) == installs
