"""Split-KV verify attention (`split_kv_verify`) on the CPU, through Triton's interpreter: the same output as a
reference attention and as SGLang's own prefill kernel (the one it replaces), for chains and trees, GQA, ragged
prefixes and paged KV slots; and it declines what it is not built for.

Triton reads TRITON_INTERPRET when it is imported, so the kernel tests run in a subprocess that sets it
(`test_the_kernel_tests_pass_in_triton_s_interpreter`); in this process they are skipped unless it is set."""
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from ngramspec_sglang.verify_attention import SplitKvVerify, install, n_splits_for, rows_padded  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
kernel_test = pytest.mark.skipif(not INTERPRETED, reason="runs in the interpreter's subprocess")


def test_the_kernel_tests_pass_in_triton_s_interpreter():
    if INTERPRETED:
        pytest.skip("this is the subprocess")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", __file__],
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout


def tree_masks(bs, width, gen, chain=False):
    """[bs, width, width] draft masks: row 0 the root; each other token under an earlier one (its path visible)."""
    masks = torch.zeros(bs, width, width, dtype=torch.bool)
    for b in range(bs):
        parent = [-1] + [i - 1 if chain else int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, width)]
        for i in range(width):
            j = i
            while j >= 0:
                masks[b, i, j] = True
                j = parent[j]
    return masks


def problem(bs, width, h_q, h_kv, d, prefix_lens, gen, dtype=torch.float32, chain=False):
    pool = sum(prefix_lens) + 40
    k_buffer = torch.randn(pool, h_kv, d, generator=gen).to(dtype)
    v_buffer = torch.randn(pool, h_kv, d, generator=gen).to(dtype)
    slots = torch.randperm(pool, generator=gen)[: sum(prefix_lens)]  # paged: prefix tokens anywhere in the pool
    kv_indptr = torch.zeros(bs + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(torch.tensor(prefix_lens), 0)
    qo_indptr = torch.arange(0, (bs + 1) * width, width, dtype=torch.int32)
    q = torch.randn(bs * width, h_q, d, generator=gen).to(dtype)
    k = torch.randn(bs * width, h_kv, d, generator=gen).to(dtype)
    v = torch.randn(bs * width, h_kv, d, generator=gen).to(dtype)
    masks = tree_masks(bs, width, gen, chain)
    # SGLang's verify mask: per request, width rows of (prefix + width) cells; the prefix cells all visible
    rows = []
    for b in range(bs):
        full = torch.ones(width, prefix_lens[b] + width, dtype=torch.bool)
        full[:, prefix_lens[b]:] = masks[b]
        rows.append(full.reshape(-1))
    custom_mask = torch.cat(rows)
    mask_indptr = torch.zeros(bs + 1, dtype=torch.int64)
    mask_indptr[1:] = torch.cumsum(torch.tensor([width * (n + width) for n in prefix_lens]), 0)
    return dict(q=q, k=k, v=v, k_buffer=k_buffer, v_buffer=v_buffer, qo_indptr=qo_indptr, kv_indptr=kv_indptr,
                kv_indices=slots.to(torch.int64), custom_mask=custom_mask, mask_indptr=mask_indptr, masks=masks)


def reference(p, bs, width, h_q, h_kv, d):
    out = torch.empty(bs * width, h_q, d)
    group = h_q // h_kv
    for b in range(bs):
        idx = p["kv_indices"][p["kv_indptr"][b]:p["kv_indptr"][b + 1]]
        rows = slice(b * width, (b + 1) * width)
        for h in range(h_q):
            g = h // group
            keys = torch.cat([p["k_buffer"][idx, g].float(), p["k"][rows, g].float()])
            vals = torch.cat([p["v_buffer"][idx, g].float(), p["v"][rows, g].float()])
            s = p["q"][rows, h].float() @ keys.T / d ** 0.5
            seen = torch.cat([torch.ones(width, len(idx), dtype=torch.bool), p["masks"][b]], 1)
            out[rows, h] = torch.softmax(s.masked_fill(~seen, float("-inf")), 1) @ vals
    return out


def run(kernel, p, width, use_mask=True):
    o = torch.empty_like(p["q"])
    ok = kernel(p["q"], p["k"], p["v"], o, p["k_buffer"], p["v_buffer"], p["qo_indptr"], p["kv_indptr"],
                p["kv_indices"], p["custom_mask"] if use_mask else None, True, p["mask_indptr"], width, 1.0, 1.0,
                1.0 / p["q"].shape[2] ** 0.5)
    return ok, o


@kernel_test
@pytest.mark.parametrize("bs, width, h_q, h_kv, d, prefix_lens, chain", [
    (1, 4, 4, 1, 16, [37], False),
    (2, 8, 8, 2, 32, [5, 130], False),
    (3, 3, 4, 4, 16, [64, 1, 200], True),
    (1, 16, 8, 2, 64, [300], False),
    (2, 1, 4, 2, 16, [9, 70], False),  # width 1: the root alone
    (2, 5, 6, 2, 16, [70, 33], False),  # groups of 3 query heads (padded to 4 in the grouped kernel)
])
@pytest.mark.parametrize("grouped", [False, True])
def test_it_equals_a_reference_attention_for_trees_and_chains(bs, width, h_q, h_kv, d, prefix_lens, chain, grouped):
    gen = torch.Generator().manual_seed(bs * 100 + width)
    p = problem(bs, width, h_q, h_kv, d, prefix_lens, gen, chain=chain)
    kernel = SplitKvVerify(max_bs=4, h_q=h_q, v_head_dim=d, max_width=16, device="cpu", grouped=grouped)
    ok, o = run(kernel, p, width)
    assert ok and kernel.launches == 1
    torch.testing.assert_close(o, reference(p, bs, width, h_q, h_kv, d), atol=2e-4, rtol=2e-4)
    if chain:  # a chain needs no mask: the causal path gives the same
        ok, o2 = run(kernel, p, width, use_mask=False)
        assert ok
        torch.testing.assert_close(o2, o, atol=1e-5, rtol=1e-5)


@kernel_test
def test_a_wrong_mask_changes_the_output():
    """The tree's cells are read: the same problem with another tree gives another output (the test can fail)."""
    gen = torch.Generator().manual_seed(7)
    p = problem(2, 8, 4, 2, 16, [20, 50], gen)
    kernel = SplitKvVerify(max_bs=2, h_q=4, v_head_dim=16, max_width=8, device="cpu")
    _, o = run(kernel, p, 8)
    p2 = dict(p, custom_mask=p["custom_mask"].clone())
    p2["custom_mask"][p["mask_indptr"][1] - 1] = ~p2["custom_mask"][p["mask_indptr"][1] - 1]  # request 0's last cell
    _, o2 = run(kernel, p2, 8)
    assert not torch.allclose(o[:8], o2[:8]) and torch.equal(o[8:], o2[8:])


@kernel_test
@pytest.mark.parametrize("grouped", [False, True])
def test_it_equals_sglangs_prefill_kernel_on_the_same_verify(grouped):
    ext = pytest.importorskip("sglang.kernels.ops.attention.extend_attention")
    gen = torch.Generator().manual_seed(3)
    bs, width, h_q, h_kv, d = 2, 8, 8, 2, 32
    p = problem(bs, width, h_q, h_kv, d, [45, 110], gen, dtype=torch.float16)
    kernel = SplitKvVerify(max_bs=bs, h_q=h_q, v_head_dim=d, max_width=16, device="cpu", grouped=grouped)
    ok, ours = run(kernel, p, width)
    theirs = torch.empty_like(p["q"])
    ext.extend_attention_fwd(p["q"], p["k"], p["v"], theirs, p["k_buffer"], p["v_buffer"], p["qo_indptr"],
                             p["kv_indptr"], p["kv_indices"], p["custom_mask"], True, p["mask_indptr"], width, 1.0,
                             1.0, 1.0 / d ** 0.5)
    assert ok
    torch.testing.assert_close(ours.float(), theirs.float(), atol=2e-3, rtol=2e-3)


@kernel_test
def test_it_declines_what_it_is_not_built_for():
    gen = torch.Generator().manual_seed(1)
    p = problem(2, 4, 4, 2, 16, [10, 12], gen)
    small = SplitKvVerify(max_bs=1, h_q=4, v_head_dim=16, max_width=16, device="cpu")
    assert run(small, p, 4)[0] is False  # a batch above its buffers
    other_heads = SplitKvVerify(max_bs=4, h_q=8, v_head_dim=16, max_width=16, device="cpu")
    assert run(other_heads, p, 4)[0] is False
    k = SplitKvVerify(max_bs=4, h_q=4, v_head_dim=16, max_width=16, device="cpu")
    o = torch.empty_like(p["q"])
    args = (p["q"], p["k"], p["v"], o, p["k_buffer"], p["v_buffer"], p["qo_indptr"], p["kv_indptr"],
            p["kv_indices"], p["custom_mask"], True, p["mask_indptr"], 4, 1.0, 1.0, 0.25)
    assert k(*args, sliding_window_size=8) is False
    assert k(*args, logit_cap=30.0) is False
    assert k(*args, sinks=torch.zeros(4)) is False
    assert k(*args[:10], False, *args[11:]) is False  # not causal
    assert k(*args[:12], 3, *args[13:]) is False  # ragged: rows are not bs * width
    assert k.launches == 0


def test_splits_and_buffers():
    assert [n_splits_for(bs, 32) for bs in (1, 2, 3, 8, 9, 48)] == [16, 16, 8, 8, 4, 4]
    assert [rows_padded(w) for w in (1, 3, 16, 17)] == [16, 16, 16, 32]
    k = SplitKvVerify(max_bs=48, h_q=32, v_head_dim=64, max_width=16, device="cpu")
    assert k.nbytes <= 26 * 2 ** 20  # 192 lanes x 32 heads x 16 rows x 64 (+ the log-sum-exps), float32


@kernel_test
def test_install_routes_a_triton_backends_verify_through_it_and_leaves_others():
    from types import SimpleNamespace

    kernel = SplitKvVerify(max_bs=2, h_q=4, v_head_dim=16, max_width=8, device="cpu")
    triton_like = SimpleNamespace(use_verify_splitkv=False, use_verify_shared_kv=True, verify_splitkv_fwd=None)
    assert install(triton_like, kernel)
    assert triton_like.use_verify_splitkv and not triton_like.use_verify_shared_kv
    gen = torch.Generator().manual_seed(5)
    p = problem(2, 4, 4, 2, 16, [11, 30], gen)
    ok, o = run(triton_like.verify_splitkv_fwd, p, 4)  # called as SGLang's backend calls it
    assert ok and kernel.launches == 1
    torch.testing.assert_close(o, reference(p, 2, 4, 4, 2, 16), atol=2e-4, rtol=2e-4)
    other = SimpleNamespace(forward_extend=None)
    assert not install(other, kernel) and vars(other) == {"forward_extend": None}


def test_the_knob_is_grouped_by_default_and_takes_true_false_or_grouped():
    from ngramspec_sglang.config import AdaptiveConfig

    assert AdaptiveConfig(widths=(1, 2, 4)).split_kv_verify == "grouped"
    assert AdaptiveConfig(widths=(1, 2, 4), split_kv_verify=False).split_kv_verify is False
    assert AdaptiveConfig(widths=(1, 2, 4), split_kv_verify=True).split_kv_verify is True
    assert AdaptiveConfig(widths=(1, 2, 4), split_kv_verify="grouped").split_kv_verify == "grouped"
    with pytest.raises(ValueError, match="split_kv_verify"):
        AdaptiveConfig(widths=(1, 2, 4), split_kv_verify="yes")


@kernel_test
def test_the_start_up_check_agrees_with_sglangs_kernel_and_catches_a_broken_one():
    pytest.importorskip("sglang.kernels.ops.attention.extend_attention")
    from ngramspec_sglang.verify_attention import SELF_CHECK_TOLERANCE, self_check

    kernel = SplitKvVerify(max_bs=4, h_q=8, v_head_dim=32, max_width=16, device="cpu")
    assert self_check(kernel, 2, 32, torch.float16, "cpu") <= SELF_CHECK_TOLERANCE
    assert kernel.launches == 0  # the check is not counted as a served verify
    grouped = SplitKvVerify(max_bs=4, h_q=8, v_head_dim=32, max_width=16, device="cpu", grouped=True)
    assert self_check(grouped, 2, 32, torch.float16, "cpu") <= SELF_CHECK_TOLERANCE

    def zeros(q, k, v, o, *args):  # a "reference" that is wrong
        o.zero_()

    assert self_check(kernel, 2, 32, torch.float16, "cpu", reference=zeros) > SELF_CHECK_TOLERANCE


@kernel_test
@pytest.mark.parametrize("setting", [True, "grouped"])
def test_the_worker_builds_the_kernel_the_setting_names(setting):
    """`split_kv_verify` true builds the per-head kernel, "grouped" the grouped one, sized by the model's attention
    layer as the backend sees it, after its start-up check against SGLang's kernel; a kernel that fails the check is
    not used."""
    from types import SimpleNamespace

    pytest.importorskip("sglang.kernels.ops.attention.extend_attention")
    from ngramspec_sglang.verify_attention import checked_kernel

    layer = SimpleNamespace(tp_q_head_num=8, tp_k_head_num=2, v_head_dim=32, qk_head_dim=32)
    kernel = checked_kernel(setting, layer, 4, 8, torch.float16, "cpu")
    assert kernel is not None and kernel.grouped == (setting == "grouped")
    assert (kernel.max_bs, kernel.h_q, kernel.v_head_dim, kernel.max_rows) == (4, 8, 32, 16)

    def zeros(q, k, v, o, *args):  # a "reference" that disagrees
        o.zero_()

    assert checked_kernel(setting, layer, 4, 8, torch.float16, "cpu", reference=zeros) is None
