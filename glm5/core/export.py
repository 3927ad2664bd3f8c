"""ONNX export of the whole model: glm5 ops become ONNX functions (domain `glm5`) with
standard-op bodies (glm5/ir/onnx_export.py), so onnxruntime's CPU provider runs the model.

The graph is the prefill forward of a fixed [batch, seq_len] without a KV cache
(logits [B, T, V]); the dense-vs-sparse attention choice and query chunking are decided at
export time from seq_len, so export at the length you will run.
"""

from __future__ import annotations

from pathlib import Path

import torch

from glm5.core.model import GLM5ForCausalLM


class _Prefill(torch.nn.Module):
    def __init__(self, model: GLM5ForCausalLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)


def export_onnx(model: GLM5ForCausalLM, out: str | Path, seq_len: int = 16, batch: int = 1,
                keep_functions: bool = True) -> Path:
    """Write ``out`` (.onnx) for input_ids [batch, seq_len] int64 -> logits."""
    from glm5.ir.onnx_export import export

    if seq_len < 1 or batch < 1:
        raise ValueError(f"glm5 export: seq_len and batch expected >= 1, got {seq_len}, {batch}")
    ids = torch.zeros(batch, seq_len, dtype=torch.long)
    with torch.no_grad():
        prog = export(_Prefill(model.eval()), (ids,), keep_functions=keep_functions)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    prog.save(str(out))
    return out
