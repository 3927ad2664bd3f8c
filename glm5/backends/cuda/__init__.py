"""The cuda backend: NVIDIA GPUs (CUDA, not ROCm) served by the Triton kernel library, with
launch parameters from this backend's tuning table (tuning.json beside this file, falling back
op by op to the kernels' defaults). `glm5 parity --backend cuda --emulate` runs the same
kernels on CPU tensors through the Triton interpreter. Shared device-backend machinery (the
GLM5_DEVICE override, CUDA-vs-HIP detection, tuning tables, emulation) is glm5.backends.vendor.
"""

from __future__ import annotations

from pathlib import Path

from glm5.backends import vendor
from glm5.backends.api import API_VERSION

GLM5_API_VERSION = API_VERSION
TUNING = Path(__file__).with_name("tuning.json")

SPEC = vendor.VendorSpec(
    name="cuda", vendor="NVIDIA", device_type="cuda", collective="nccl", quant_scheme="w4a8",
    priority=20, description="Triton kernels on NVIDIA CUDA GPUs", tuning=TUNING,
    aliases=("nvidia",), install="pip install 'glm5[cuda]'",
)
BACKEND = vendor.make_backend(SPEC)


def detect() -> tuple[bool, str]:
    """NVIDIA CUDA, told apart from ROCm/DTK (Hygon, AMD) which also shows up as `cuda`."""
    ov = vendor.override(SPEC)
    if ov is not None and not ov[0]:
        return ov
    if not vendor.module_present("triton"):
        return False, "triton is not installed (pip install 'glm5[cuda]')"
    import torch

    if getattr(torch.version, "hip", None):
        kind, why = vendor.rocm_vendor(torch)
        see = "the hygon backend" if kind == "hygon" else "AMD GPUs have no glm5 backend yet"
        return False, f"torch is a ROCm build (hip {torch.version.hip}; {why}): see {see}"
    if torch.version.cuda is None:
        return False, "torch is a CPU-only build (no CUDA runtime)"
    if not torch.cuda.is_available():
        return False, "no CUDA device visible"
    return True, f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"


glm5_register_backends = vendor.triton_plugin(BACKEND, detect)
