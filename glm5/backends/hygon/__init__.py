"""The hygon backend: Hygon DCUs (K100, BW1000, Z100) under DTK, Hygon's ROCm-style stack. The
DTK build of torch shows DCUs as ``cuda`` devices through HIP (no torch extension), so detection
tells a Hygon DCU apart from an AMD GPU and from NVIDIA (glm5.backends.vendor.rocm_vendor).
Kernels: the Triton library through Triton's HIP backend, with ROCm launch rules (wavefront 64)
from tuning.json. Collectives: ``nccl``, which is RCCL in a ROCm build of torch."""

from __future__ import annotations

from pathlib import Path

from glm5.backends import vendor
from glm5.backends.api import API_VERSION

GLM5_API_VERSION = API_VERSION

SPEC = vendor.VendorSpec(
    name="hygon", vendor="Hygon", device_type="cuda", collective="nccl", quant_scheme="w8a8",
    priority=18, description="Triton kernels on Hygon DCUs (DTK / HIP, wavefront 64)",
    tuning=Path(__file__).with_name("tuning.json"), aliases=("dcu", "dtk"), tools=("hy-smi",),
    install="install Hygon DTK and its torch build (DCU driver, `source /opt/dtk/env.sh`)",
)
BACKEND = vendor.make_backend(SPEC)


def detect() -> tuple[bool, str]:
    """A HIP build of torch whose device is a Hygon DCU (or GLM5_DEVICE=hygon on a HIP build)."""
    ov = vendor.override(SPEC)
    if ov is not None and not ov[0]:
        return ov
    import torch

    if not getattr(torch.version, "hip", None):
        build = "a CUDA build (NVIDIA)" if torch.version.cuda else "a CPU-only build"
        tool = vendor.which("hy-smi")
        hint = f"; {tool} is on PATH, so a DCU appears to be installed" if tool else ""
        return False, f"torch is {build}, not DTK's HIP build: {SPEC.install}{hint}"
    if ov is None:
        kind, why = vendor.rocm_vendor(torch)
        if kind != "hygon":
            return False, f"not a Hygon DCU ({why}); set GLM5_DEVICE=hygon to claim it anyway"
    if not torch.cuda.is_available():
        return False, f"DTK torch (hip {torch.version.hip}) sees no DCU{vendor._tool_hint(SPEC)}"
    if not vendor.module_present("triton"):
        return False, "triton is not installed (DTK's or FlagTree's Triton for HIP)"
    forced = f"; {ov[1]}" if ov else ""
    return True, f"{torch.cuda.get_device_name(0)} (hip {torch.version.hip}){forced}"


glm5_register_backends = vendor.triton_plugin(BACKEND, detect)
