"""glm5-example: a minimal, complete third-party glm5 backend.

It registers one backend, ``example`` (vendor "Example Corp", device type ``cpu``, priority 10),
with plain-torch kernels for ``rms_norm``, ``silu_mul`` and ``topk_indices``. Each kernel takes
the op's arguments positionally, exactly as docs/ops.md lists them, and returns what docs/ops.md says
(same shapes, output dtypes, -1 conventions). See docs/plugins.md in the glm5 repository.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import glm5

# The plugin API this plugin was built against. glm5 refuses a plugin whose major version
# differs from its own glm5.API_VERSION (with the reason shown by `glm5 backends --diagnose`).
GLM5_API_VERSION = "1.0"

# Floating dtypes these kernels accept for their (first) floating input. A float64 call is
# declined and goes to the next candidate (in the end the reference, the float64 oracle).
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

backend = glm5.Backend(
    "example",
    vendor="Example Corp",
    device_type="cpu",
    priority=10,
    description="worked example: plain-torch CPU kernels (rms_norm, silu_mul, topk_indices)",
    settings={"quant_scheme": "none", "collective": "gloo"},
)


@backend.availability
def _available() -> tuple[bool, str]:
    # A real vendor backend checks here for its runtime package and a device, and says which
    # one is missing; it must never raise (an exception is reported as "unavailable").
    return True, "cpu always present"


@backend.kernel("rms_norm", dtypes=DTYPES)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2, -1) + eps) * weight with fp32 math, output in x's dtype."""
    y = F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps)
    return y.to(x.dtype)


@backend.kernel("silu_mul", dtypes=DTYPES)
def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :I]) * x[..., I:] with fp32 math, output in x's dtype."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def _k_fits(scores: torch.Tensor, k: int) -> bool:
    # torch.topk needs k <= S; for k > S this kernel declines and selection passes the call
    # to the next candidate (another backend, or the reference, which pads with -1).
    return k <= scores.shape[-1]


@backend.kernel("topk_indices", dtypes=DTYPES, supports=_k_fits)
def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest finite scores per row, descending, ties to the smaller index; -1 past the
    finite ones; int32.

    The tie rule is part of the contract (deterministic selection keeps RL rollouts the same on
    every backend) and the kit checks it exactly: ``torch.topk`` does not promise it, a stable
    descending sort does (equal scores keep their index order).
    """
    finite = torch.isfinite(scores)
    keyed = scores.masked_fill(~finite, float("-inf"))  # NaN and +inf never get selected
    vals, idx = torch.sort(keyed, dim=-1, descending=True, stable=True)
    vals, idx = vals[..., :k], idx[..., :k].to(torch.int32)
    # Non-finite entries sort last (as -inf), so valid entries come first and the tail is -1.
    return idx.masked_fill(vals == float("-inf"), -1)


@glm5.hookimpl
def glm5_register_backends(registry) -> None:
    registry.register(backend)
