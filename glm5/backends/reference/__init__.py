"""The reference backend: serves every op from its OpDef reference (plain torch, any device,
float64-capable). It is the oracle of the conformance kit and the explicit last resort of
selection. Registered through glm5's own `glm5.backends` entry point, like any plugin."""

from __future__ import annotations

from glm5.backends.api import API_VERSION, REFERENCE, Backend, hookimpl
from glm5.ir.catalog import OPS

GLM5_API_VERSION = API_VERSION


def make_backend() -> Backend:
    b = Backend(
        REFERENCE,
        vendor="glm5",
        device_type="any",
        priority=-1000,
        description="OpDef references in plain torch eager (the float64 oracle)",
        settings={"quant_scheme": "none", "collective": "gloo"},
    )
    for op in OPS.values():
        b.kernel(op.name, dtypes=None)(op.reference)
    return b


@hookimpl
def glm5_register_backends(registry) -> None:
    registry.register(make_backend())
