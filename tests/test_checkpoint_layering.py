"""The checkpoint format is defined once (glm5/core/checkpoint_files.py, below the model) and its
names stay importable from glm5.core.checkpoint (which reads models) and glm5.deploy.quantize
(which writes quantized directories). That core never imports deploy is the layer contract's
(tests/test_layers.py)."""

from __future__ import annotations

from pathlib import Path

import glm5.core.checkpoint as checkpoint
import glm5.core.checkpoint_files as files

GLM5 = Path(checkpoint.__file__).resolve().parents[1]


def test_format_names_are_defined_once_and_importable_from_quantize():
    from glm5.deploy import quantize

    for name in ("INDEX", "SINGLE", "DESCRIPTION", "METHOD", "FORMAT_VERSION", "FLOAT",
                 "MSMODELSLIM_DESCRIPTION", "CheckpointError", "read_description",
                 "repack_model", "load_model"):
        assert getattr(quantize, name) is getattr(checkpoint, name), name
    for name in ("INDEX", "SINGLE", "DESCRIPTION", "METHOD", "FORMAT_VERSION", "FLOAT",
                 "MSMODELSLIM_DESCRIPTION", "CheckpointError", "read_description",
                 "save_pretrained"):
        assert getattr(checkpoint, name) is getattr(files, name), name
    for src in ((GLM5 / "deploy" / "quantize.py").read_text(),
                (GLM5 / "core" / "checkpoint.py").read_text()):
        for name in ("DESCRIPTION", "METHOD", "FORMAT_VERSION", "FLOAT",
                     "MSMODELSLIM_DESCRIPTION"):
            assert f"\n{name} = " not in src, name
        assert "def read_description" not in src and "def save_pretrained" not in src
    assert "def repack_model" not in (GLM5 / "deploy" / "quantize.py").read_text()
