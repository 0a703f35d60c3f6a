"""GPU time by kernel over a window of decode steps (NGRAMSPEC_KERNEL_PROFILE=FILE), for diagnosis; off by default.

Where does a verify's forward spend its time against a decode's: the weight GEMMs, the attention kernels, or the
small kernels around them? The CUDA events of `HostProfile` time a step as a whole; this splits it by kernel.

Rank 0 only. A window starts at the first decode step after the file ``FILE.start`` appears (a client creates it
just before the steps it wants split: `scripts/sglang_engine_bench.py --kernel-profile` does so before each timed
set) and lasts ``NGRAMSPEC_KERNEL_PROFILE_STEPS`` decode steps (default 64). Inside it `torch.profiler` records the
kernels (CUDA graph replays included: CUPTI reports the kernels a graph launches); at its end the device is
synchronised, ``FILE`` is written (JSON: steps, the widths and batch sizes launched, prefills in the window, GPU
milliseconds per step by kernel category and the heaviest kernels) and ``FILE.start`` removed. The profiler costs
host time inside the window, so the window's own step times are not a configuration's speed."""
from __future__ import annotations

import json
import logging
import os
import re
from collections import Counter
from typing import Callable, Iterable, Optional

logger = logging.getLogger(__name__)

# first match wins; names lowercased (cuBLAS/CUTLASS/nvjet GEMMs, SGLang's Triton attention kernels, ...); norms
# first: FlashInfer's norm kernels carry "flashinfer" in their names
CATEGORIES = (
    ("norm", re.compile(r"norm")),
    ("attention", re.compile(r"attn|attention|flash|_fwd_kernel|_fwd_grouped_kernel|decode_kernel|extend_kernel"
                             r"|kv_indices")),
    ("gemm", re.compile(r"gemm|gemv|cutlass|cublas|xmma|nvjet|splitk|matmul|\bmm\b")),
    ("rope", re.compile(r"rotary|rope")),
    ("activation", re.compile(r"act_and_mul|silu|gelu|swiglu")),
    ("sampling", re.compile(r"argmax|softmax|sort|topk|top_k|sampl|multinomial|verify|tree")),
    ("copy_elementwise", re.compile(r"memcpy|memset|copy|fill|cat_|index|gather|scatter|elementwise|reduce")),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, pattern in CATEGORIES:
        if pattern.search(low):
            return cat
    return "other"


def summarize(kernels: Iterable[tuple[str, float]], steps: int, top: int = 25) -> dict:
    """``kernels``: (name, device microseconds) per kernel launch. GPU ms per step by category and the heaviest
    kernels (total ms, launches per step)."""
    total_us: Counter = Counter()
    launches: Counter = Counter()
    for name, us in kernels:
        total_us[name] += float(us)
        launches[name] += 1
    per = max(steps, 1)
    by_cat: Counter = Counter()
    for name, us in total_us.items():
        by_cat[category(name)] += us
    return {
        "gpu_ms_per_step": round(sum(total_us.values()) / 1e3 / per, 4),
        "by_category_ms_per_step": {c: round(us / 1e3 / per, 4) for c, us in by_cat.most_common()},
        "kernels": [{"name": name[:160], "category": category(name), "ms_per_step": round(us / 1e3 / per, 4),
                     "launches_per_step": round(launches[name] / per, 2)}
                    for name, us in total_us.most_common(top)],
    }


def _torch_profiler():
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


# SGLang's own `record_function` ranges ("scheduler.run_batch", "step[VERIFY bs=1]"): the profiler mirrors each on
# the device as a span over the kernels inside it, which is not a kernel (torch flags them `is_user_annotation`; the
# names are the fallback for a torch without the flag)
ANNOTATION = re.compile(r"^(scheduler\.|step\[|ProfilerStep#)")


def is_annotation(evt) -> bool:
    return bool(getattr(evt, "is_user_annotation", False)) or bool(ANNOTATION.match(evt.name))


def _device_kernels(prof) -> list[tuple[str, float]]:
    """(name, device µs) of every kernel the profiler saw: events on the device, not the host's ops nor the device
    spans of annotated ranges (counted, they would add each step's time again)."""
    from torch.autograd import DeviceType

    out = []
    for evt in prof.events():
        if evt.device_type != DeviceType.CPU and not is_annotation(evt):
            out.append((evt.name, evt.time_range.elapsed_us()))
    return out


class KernelProfile:
    def __init__(self, path: str, steps: int = 64, profiler_factory: Callable = _torch_profiler,
                 kernels_of: Callable = _device_kernels, synchronize: Optional[Callable] = None):
        if steps < 1:
            raise ValueError(f"NGRAMSPEC_KERNEL_PROFILE_STEPS must be >= 1, got {steps}")
        self.path = path
        self.window = steps
        self._factory = profiler_factory
        self._kernels_of = kernels_of
        self._sync = synchronize
        self._prof = None
        self._steps = 0
        self._widths: Counter = Counter()
        self._batches: Counter = Counter()
        self._forwards = 0
        self._prefills = 0
        self.windows = 0  # windows written
        self.failed: Optional[str] = None  # why the profiler failed, once it has

    @classmethod
    def from_env(cls, rank: int, synchronize: Optional[Callable] = None):
        path = os.environ.get("NGRAMSPEC_KERNEL_PROFILE")
        if not path or rank != 0:
            return None
        return cls(path, int(os.environ.get("NGRAMSPEC_KERNEL_PROFILE_STEPS", "64")), synchronize=synchronize)

    @property
    def active(self) -> bool:
        return self._prof is not None

    def before_step(self) -> None:
        """Call at the start of every decode step: opens a window when ``FILE.start`` exists."""
        if self._prof is None and not self.failed and os.path.exists(self.path + ".start"):
            self._steps, self._forwards, self._prefills = 0, 0, 0
            self._widths.clear()
            self._batches.clear()
            try:
                prof = self._factory()
                prof.__enter__()
            except Exception as e:  # a diagnostic never takes the server down
                self._fail(e)
                return
            self._prof = prof

    def _fail(self, error: Exception) -> None:
        """The profiler failed: say so in FILE, stop trying (the server runs on)."""
        self.failed = repr(error)
        self._prof = None
        logger.warning("NGRAMSPEC_KERNEL_PROFILE: the profiler failed (%s); off", self.failed)
        with open(self.path, "w") as f:
            json.dump({"error": f"the profiler failed: {self.failed}"}, f)
        try:
            os.remove(self.path + ".start")
        except FileNotFoundError:
            pass

    def launched(self, width: int, batch_size: int, forwards: int = 1) -> None:
        """Call once a decode step's work is launched; closes the window after its last step."""
        if self._prof is None:
            return
        self._steps += 1
        self._forwards += int(forwards)
        self._widths[int(width)] += 1
        self._batches[int(batch_size)] += 1
        if self._steps >= self.window:
            self._close()

    def prefill(self) -> None:
        if self._prof is not None:
            self._prefills += 1

    def _close(self) -> None:
        prof, self._prof = self._prof, None
        try:
            if self._sync is not None:
                self._sync()
            prof.__exit__(None, None, None)
            kernels = self._kernels_of(prof)
        except Exception as e:  # a diagnostic never takes the server down
            self._fail(e)
            return
        result = {"steps": self._steps, "forwards": self._forwards, "prefills_in_window": self._prefills,
                  "widths": {str(k): v for k, v in sorted(self._widths.items())},
                  "batch_sizes": {str(k): v for k, v in sorted(self._batches.items())}}
        result.update(summarize(kernels, self._steps))
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, self.path)
        try:
            os.remove(self.path + ".start")
        except FileNotFoundError:
            pass
        self.windows += 1
