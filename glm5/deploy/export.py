"""ONNX export of the whole model: glm5 ops become ONNX functions (domain `glm5`) with
standard-op bodies (glm5/ir/onnx_export.py), so onnxruntime's CPU provider runs the model.

The graph is the prefill forward of a fixed [batch, seq_len] without a KV cache
(logits [B, T, V]); the dense-vs-sparse attention choice and query chunking are decided at
export time from seq_len, so export at the length you will run.
"""

from __future__ import annotations

from pathlib import Path

import torch

# progress.progress_bar is looked up at call time: tests and callers may replace it
from glm5 import progress
from glm5.core.model import GLM5ForCausalLM
from glm5.core.output import atomic_file


class _Prefill(torch.nn.Module):
    def __init__(self, model: GLM5ForCausalLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)


def export_onnx(model: GLM5ForCausalLM, out: str | Path, seq_len: int = 16, batch: int = 1,
                keep_functions: bool = True, overwrite: bool = False) -> Path:
    """Write ``out`` (.onnx) for input_ids [batch, seq_len] int64 -> logits.

    The file is written atomically (glm5/core/output.py): into a temporary directory beside
    ``out``, then renamed into place, so a failed export leaves nothing behind; an existing
    ``out`` is replaced only with ``overwrite`` (`OutputExistsError` otherwise)."""
    from glm5.ir.onnx_export import (  # lazy: onnx + onnxscript (optional) load only when exporting
        EXPORT_STEPS,
        export,
    )

    if seq_len < 1 or batch < 1:
        raise ValueError(f"glm5 export: seq_len and batch expected >= 1, got {seq_len}, {batch}")
    ids = torch.zeros(batch, seq_len, dtype=torch.long)
    steps = (*EXPORT_STEPS, "write")
    with atomic_file(out, overwrite=overwrite, who="glm5 export") as tmp, \
            progress.progress_bar(len(steps), "export", "step") as bar:
        done = 0

        def on_step(name: str) -> None:
            nonlocal done
            bar.update(steps.index(name) - done)
            done = steps.index(name)
            bar.set_description_str(f"export: {name}")

        with torch.no_grad():
            prog = export(_Prefill(model.eval()), (ids,), keep_functions=keep_functions,
                          on_step=on_step)
        on_step("write")
        prog.save(str(tmp))
        bar.update(len(steps) - done)
    return Path(out)
