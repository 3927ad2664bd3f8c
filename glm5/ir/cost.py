"""Helpers shared by the ops' cost models (`OpDef.cost`: flops and bytes moved per call)."""

from __future__ import annotations

import torch


def tensor_bytes(*ts: torch.Tensor | None) -> float:
    """Bytes held by the tensors among ``ts`` (anything else, such as an absent bias, counts 0)."""
    return float(sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor)))
