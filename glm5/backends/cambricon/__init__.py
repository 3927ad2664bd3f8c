"""The cambricon backend: Cambricon MLUs through torch_mlu (device ``mlu``, collectives
``cncl``), kernels from the Triton library compiled by Cambricon's Triton (triton-linalg), with
MLU launch rules from tuning.json. torch_mlu and the Neuware SDK (CNToolkit, CNNL, CNCL) come
from Cambricon's SDK or docker images, not PyPI."""

from __future__ import annotations

from pathlib import Path

from glm5.backends import vendor
from glm5.backends.api import API_VERSION

GLM5_API_VERSION = API_VERSION

SPEC = vendor.VendorSpec(
    name="cambricon", vendor="Cambricon", device_type="mlu", collective="cncl",
    quant_scheme="w8a16", priority=16,
    description="Triton kernels on Cambricon MLUs (torch_mlu, Cambricon Triton)",
    tuning=Path(__file__).with_name("tuning.json"), aliases=("mlu",), extension="torch_mlu",
    tools=("cnmon",), triton_package="Cambricon's Triton (triton-linalg)",
    install="install Cambricon Neuware (CNToolkit, CNNL, CNCL; NEUWARE_HOME) and its torch_mlu "
            "wheel (Cambricon SDK / docker image; not on PyPI)",
)
BACKEND = vendor.make_backend(SPEC)


def detect() -> tuple[bool, str]:
    return vendor.detect_extension_device(SPEC)


glm5_register_backends = vendor.triton_plugin(BACKEND, detect)
