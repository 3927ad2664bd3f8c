"""The cuda backend: NVIDIA GPUs (CUDA, not ROCm) served by the Triton kernel library, with
launch parameters from this backend's tuning table (tuning.json beside this file, falling back
op by op to the kernels' defaults). `glm5 parity --backend cuda --emulate` runs the same
kernels on CPU tensors through the Triton interpreter."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from glm5.backends.api import API_VERSION, Backend, hookimpl

GLM5_API_VERSION = API_VERSION
TUNING = Path(__file__).with_name("tuning.json")

BACKEND = Backend(
    "cuda",
    vendor="NVIDIA",
    device_type="cuda",
    priority=20,
    description="Triton kernels on NVIDIA CUDA GPUs",
    settings={"quant_scheme": "w4a8", "collective": "nccl", "tuning_table": str(TUNING)},
)


def detect() -> tuple[bool, str]:
    """NVIDIA CUDA, told apart from ROCm/DTK (Hygon, AMD) which also shows up as `cuda`."""
    forced = os.environ.get("GLM5_DEVICE", "").strip().lower()
    if forced and forced not in ("cuda", "nvidia"):
        return False, f"GLM5_DEVICE={forced} selects another device"
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed (pip install 'glm5[cuda]')"
    import torch

    if getattr(torch.version, "hip", None):
        return False, f"torch is a ROCm build (hip {torch.version.hip}): see the hygon backend"
    if torch.version.cuda is None:
        return False, "torch is a CPU-only build (no CUDA runtime)"
    if not torch.cuda.is_available():
        return False, "no CUDA device visible"
    return True, f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"


@BACKEND.availability
def _available() -> tuple[bool, str]:
    return detect()


@BACKEND.emulation
def _emulation() -> tuple[bool, str]:
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False, "TRITON_INTERPRET=1 must be set before the kernels are imported"
    return True, "Triton interpreter on CPU tensors"


@hookimpl
def glm5_register_backends(registry) -> None:
    if not BACKEND.kernels:
        from glm5.kernels.triton import registry as kreg

        tuning = kreg.load_table(BACKEND.settings.get("tuning_table") or TUNING)
        for op, fn, dtypes, supports in kreg.kernels(tuning):
            BACKEND.kernel(op, dtypes=dtypes, supports=supports)(fn)
    registry.register(BACKEND)
