"""Print the installed sglang's own requirements, less the packages that only run on a GPU.

Used by `scripts/setup_env.sh sglang` for the CPU test environment ("cpu" flavour, ~3.5 GB instead of ~11 GB):
sglang itself is installed with --no-deps, then these requirements with torch held at the CPU build.
Left out: the CUDA torch build and what is pinned to it (torchvision/torchaudio/torchcodec/timm), and the GPU
kernel packages (sglang-kernel, flashinfer, deep-ep/gemm, flash-mla, cutlass-dsl, tilelang, ...). Nothing our
CPU tests run needs them; tests that need what they bring skip with the import error as the reason.
"""
import re
from importlib.metadata import requires

from packaging.requirements import Requirement

GPU_ONLY = {  # distribution -> its top-level module (tests/integration/conftest.py skips on these only)
    "torch": "torch", "torchaudio": "torchaudio", "torchvision": "torchvision", "torchcodec": "torchcodec",
    "timm": "timm", "torch-memory-saver": "torch_memory_saver", "cuda-python": "cuda", "flash-attn-4": "flash_attn",
    "flashinfer-python": "flashinfer", "humming-kernels": "humming", "nvidia-cutlass-dsl": "cutlass",
    "nvidia-mathdx": "nvidia", "nvshmem4py-cu13": "nvshmem", "quack-kernels": "quack", "sgl-deep-ep": "deep_ep",
    "sgl-deep-gemm": "deep_gemm", "sgl-flash-mla": "flash_mla", "sglang-kernel": "sgl_kernel", "tilelang": "tilelang",
}


def cpu_requirements() -> list[str]:
    out = []
    for line in requires("sglang") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # another platform's or an extra's requirement
        if re.sub(r"[-_.]+", "-", req.name).lower() in GPU_ONLY:
            continue
        req.marker = None
        out.append(str(req))
    return out


if __name__ == "__main__":
    print("\n".join(cpu_requirements()))
