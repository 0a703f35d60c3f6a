"""The kernel profile's window and split (`NGRAMSPEC_KERNEL_PROFILE`), with a stand-in profiler."""
import json

import pytest

pytest.importorskip("torch")

from ngramspec_sglang.kernel_profile import KernelProfile, _device_kernels, category, summarize  # noqa: E402


@pytest.mark.parametrize("name, cat", [
    ("sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize64x64x64", "gemm"),
    ("nvjet_hsh_64x8_64x16_4x1_v_bz_splitK_TNT", "gemm"),
    ("void gemv2T_kernel_val<int, int, __half>", "gemm"),
    ("_fwd_kernel", "attention"),
    ("_fwd_grouped_kernel_stage1", "attention"),
    ("create_flashinfer_kv_indices_triton", "attention"),
    ("rmsnorm_kernel", "norm"),
    ("void flashinfer::norm::FusedAddRMSNormKernel<8u, __half>(__half*, __half*)", "norm"),
    ("rotary_embedding_kernel", "rope"),
    ("act_and_mul_kernel", "activation"),
    ("verify_tree_greedy", "sampling"),
    ("void at::native::vectorized_elementwise_kernel<4, ...>", "copy_elementwise"),
    ("Memcpy HtoD (Pinned -> Device)", "copy_elementwise"),
    ("some_custom_kernel", "other"),
])
def test_kernels_fall_in_their_categories(name, cat):
    assert category(name) == cat


def test_the_summary_is_per_step_and_adds_up():
    s = summarize([("gemm_a", 1000.0), ("gemm_a", 1000.0), ("_fwd_kernel", 500.0), ("x", 100.0)], steps=2)
    assert s["gpu_ms_per_step"] == pytest.approx(1.3)
    assert s["by_category_ms_per_step"] == {"gemm": 1.0, "attention": 0.25, "other": 0.05}
    assert s["kernels"][0] == {"name": "gemm_a", "category": "gemm", "ms_per_step": 1.0, "launches_per_step": 1.0}


class _Range:
    def __init__(self, us):
        self.us = us

    def elapsed_us(self):
        return self.us


class _Event:
    def __init__(self, name, device, us, annotation=None):
        from torch.autograd import DeviceType

        self.name, self.time_range = name, _Range(us)
        self.device_type = DeviceType.CUDA if device else DeviceType.CPU
        if annotation is not None:
            self.is_user_annotation = annotation


class _Events:
    def __init__(self, events):
        self._events = events

    def events(self):
        return self._events


def test_only_kernels_count_not_the_host_ops_nor_the_device_spans_of_annotated_ranges():
    """A GPU run counted SGLang's `record_function` spans ("scheduler.run_batch", "step[VERIFY bs=1]") as kernels:
    the step's time again on top of its kernels."""
    prof = _Events([
        _Event("nvjet_sm90_hsh_512x16_64x3_2x1_v_bz_TNT", True, 110.0),
        _Event("_fwd_kernel", True, 20.0),
        _Event("aten::mm", False, 30.0),  # host op
        _Event("scheduler.run_batch", True, 900.0, annotation=True),  # flagged by torch
        _Event("step[VERIFY bs=1]", True, 500.0),  # a torch without the flag: known by its name
        _Event("scheduler.process_batch_result", True, 40.0, annotation=False),
    ])
    assert _device_kernels(prof) == [("nvjet_sm90_hsh_512x16_64x3_2x1_v_bz_TNT", 110.0), ("_fwd_kernel", 20.0)]


class FakeProfiler:
    opened = 0

    def __enter__(self):
        FakeProfiler.opened += 1
        return self

    def __exit__(self, *exc):
        return False


def test_a_window_opens_on_the_start_file_and_closes_after_its_steps(tmp_path):
    path = str(tmp_path / "k.json")
    synced = []
    kp = KernelProfile(path, steps=3, profiler_factory=FakeProfiler, synchronize=lambda: synced.append(1),
                       kernels_of=lambda prof: [("gemm", 2000.0), ("_fwd_kernel", 600.0)])
    kp.before_step()
    kp.launched(16, 1)
    assert not kp.active and kp.windows == 0  # no start file: nothing recorded
    open(path + ".start", "w").close()
    kp.before_step()
    kp.launched(16, 2)
    kp.prefill()
    kp.before_step()
    kp.launched(1, 2, forwards=4)
    assert kp.active and not (tmp_path / "k.json").exists()
    kp.before_step()
    kp.launched(16, 3)
    assert not kp.active and kp.windows == 1 and synced == [1]
    assert not (tmp_path / "k.json.start").exists()
    out = json.loads((tmp_path / "k.json").read_text())
    assert out["steps"] == 3 and out["forwards"] == 6 and out["prefills_in_window"] == 1
    assert out["widths"] == {"1": 1, "16": 2} and out["batch_sizes"] == {"2": 2, "3": 1}
    assert out["by_category_ms_per_step"] == {"gemm": pytest.approx(2 / 3, abs=1e-4),
                                              "attention": pytest.approx(0.2, abs=1e-4)}
    kp.before_step()
    kp.launched(16, 1)
    assert not kp.active and kp.windows == 1  # the start file is gone: no second window


def test_the_window_needs_a_step(tmp_path):
    with pytest.raises(ValueError):
        KernelProfile(str(tmp_path / "k.json"), steps=0)


def test_the_real_torch_profiler_opens_and_closes(tmp_path):
    """The default profiler (torch.profiler; CPU only here, so no device kernels) runs the window end to end."""
    import torch

    path = str(tmp_path / "k.json")
    open(path + ".start", "w").close()
    kp = KernelProfile(path, steps=2)
    for _ in range(2):
        kp.before_step()
        torch.ones(8, 8) @ torch.ones(8, 8)
        kp.launched(1, 1)
    out = json.loads((tmp_path / "k.json").read_text())
    assert out["steps"] == 2 and out["gpu_ms_per_step"] >= 0 and isinstance(out["kernels"], list)


class BrokenProfiler:
    def __enter__(self):
        raise RuntimeError("CUPTI unavailable")

    def __exit__(self, *exc):
        return False


def test_a_failing_profiler_is_reported_and_turned_off_not_raised(tmp_path):
    path = str(tmp_path / "k.json")
    open(path + ".start", "w").close()
    kp = KernelProfile(path, steps=2, profiler_factory=BrokenProfiler)
    kp.before_step()
    kp.launched(16, 1)
    assert not kp.active and "CUPTI unavailable" in kp.failed
    assert "CUPTI unavailable" in json.loads((tmp_path / "k.json").read_text())["error"]
    assert not (tmp_path / "k.json.start").exists()
    open(path + ".start", "w").close()
    kp.before_step()  # no second try
    assert not kp.active


def test_a_profiler_that_fails_at_the_end_is_reported_too(tmp_path):
    path = str(tmp_path / "k.json")
    open(path + ".start", "w").close()

    def bad_kernels(prof):
        raise RuntimeError("no events")

    kp = KernelProfile(path, steps=1, profiler_factory=FakeProfiler, kernels_of=bad_kernels)
    kp.before_step()
    kp.launched(16, 1)
    assert kp.failed and "no events" in json.loads((tmp_path / "k.json").read_text())["error"]
