"""The mthreads backend: Moore Threads GPUs through torch_musa (device ``musa``, collectives
``mccl``), kernels from the Triton library compiled by the MUSA Triton backend (FlagTree
third_party/mthreads), with MUSA launch rules (128-lane warps on the S4000) from tuning.json.
torch_musa and the MUSA SDK (muDNN, MCCL) come from Moore Threads' releases or docker images,
not PyPI."""

from __future__ import annotations

from pathlib import Path

from glm5.backends import vendor
from glm5.backends.api import API_VERSION

GLM5_API_VERSION = API_VERSION

SPEC = vendor.VendorSpec(
    name="mthreads", vendor="Moore Threads", device_type="musa", collective="mccl",
    quant_scheme="w6a12", priority=14,
    description="Triton kernels on Moore Threads GPUs (torch_musa, MUSA Triton)",
    tuning=Path(__file__).with_name("tuning.json"), aliases=("musa", "moorethreads"),
    extension="torch_musa", tools=("mthreads-gmi",),
    triton_package="the MUSA Triton backend (FlagTree)",
    install="install the MUSA SDK (driver, muDNN, MCCL; MUSA_HOME) and its torch_musa wheel "
            "(Moore Threads releases / docker image; not on PyPI)",
)
BACKEND = vendor.make_backend(SPEC)


def detect() -> tuple[bool, str]:
    return vendor.detect_extension_device(SPEC)


glm5_register_backends = vendor.triton_plugin(BACKEND, detect)
