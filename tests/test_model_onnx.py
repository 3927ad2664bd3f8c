"""`glm5 export --format onnx`: glm5 ops become ONNX functions (domain glm5) and onnxruntime's
CPU provider reproduces glm5's logits."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import glm5  # noqa: E402
from glm5 import cli  # noqa: E402
from tolerances_model import assert_logits_close  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("glm5").setLevel(logging.ERROR)


@pytest.mark.parametrize("indexer", [{}, {"dsa_indexer_dtype": "fp8",
                                          "dsa_indexer_hadamard": True}],
                         ids=["bf16-indexer", "fp8-indexer-hadamard"])
def test_export_checkpoint_runs_in_onnxruntime(tmp_path, capsys, indexer):
    import onnx
    import onnxruntime as ort

    from glm5.core.config import preset
    from glm5.core.model import GLM5ForCausalLM

    cfg = preset("tiny").replace(index_n_heads=8, **indexer)
    selector = "indexer_topk_fp8" if indexer else "indexer_topk"
    torch.manual_seed(0)
    m = GLM5ForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1) if p.dim() > 1 else p.fill_(1.0)
    m.save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "tiny.onnx"
    assert cli.main(["export", "--format", "onnx", "--model", str(tmp_path / "ckpt"),
                     "--seq-len", "12", str(out)]) == 0  # 12 > index_topk: the sparse path
    assert "wrote" in capsys.readouterr().out
    proto = onnx.load(str(out))
    assert {f.domain for f in proto.functions} == {"glm5"}
    assert {"mla_prolog", selector, "sparse_attention", "moe_experts"} <= {
        f.name for f in proto.functions}
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    got = sess.run(None, {sess.get_inputs()[0].name: ids.numpy()})[0]
    model = glm5.load_model(tmp_path / "ckpt").eval()
    with torch.no_grad():
        want = model(ids).numpy()
    assert_logits_close(torch.from_numpy(got), torch.from_numpy(want),
                        what="onnxruntime vs glm5 logits")


def test_export_errors(tmp_path, capsys):
    assert cli.main(["export", "--preset", "glm-5", str(tmp_path / "x.onnx")]) == 2
    assert "--model" in capsys.readouterr().err
    assert cli.main(["export", "--format", "tflite", "--preset", "tiny",
                     str(tmp_path / "x.onnx")]) == 2
