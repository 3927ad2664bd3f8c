"""Contract emulators of the torch_npu fused ops the ascend backend binds to.

This module stands in for the ``torch_npu`` namespace when there is no NPU (torch_npu/CANN must
never be installed on a CPU machine: its autoload entry point breaks ``import torch``). Each
function has the vendor op's name, argument names, argument order and keyword-only split, and
implements the op on CPU tensors from the vendor's *documented* semantics:

- it validates its inputs as the documentation states the real op does (layout strings, head
  counts, head dims, block sizes, dtypes, index conventions) and raises ``ValueError`` naming the
  op and the argument, so a binding that breaks the contract fails here too;
- a documented mode this emulator does not implement (quantized MLA prolog modes, int4 matmuls,
  activation fusion in grouped matmul, ...) raises ``NotImplementedError`` naming the mode, so
  nothing is silently approximated;
- numerics follow the vendor's published golden references where they exist.

The emulators live by op family: :mod:`~glm5.backends.ascend.contract_attention` (lightning
indexer, sparse flash attention, MLA prolog), :mod:`~glm5.backends.ascend.contract_moe_quant`
(dynamic quant, quantized and grouped matmuls, swiglu, MoE gating) and
:mod:`~glm5.backends.ascend.contract_checks` (the shared argument checks and layout helpers);
this module re-exports them under the names torch_npu uses.

Sources (cited per function): the torch_npu API pages (Ascend/op-plugin ``docs``; copies read in
public repositories), the CANN ``ops-transformer`` / ``ops-nn`` aclnn pages and their golden test
files, and vllm-ascend's call sites (``vllm_ascend/device/device_op.py``,
``vllm_ascend/attention/sfa_v1.py``). See docs/vendors.md, "Ascend vendor ops".

Emulation is a contract check, not proof of hardware behaviour: what the documents leave open
(tie order inside the device top-k, rows whose every sparse index is invalid, the rounding rule of
``round``) is stated where it arises.
"""

from __future__ import annotations

from glm5.backends.ascend.contract_attention import (  # noqa: F401  (re-exported)
    LI_SPARSE_COUNTS, MLA_CACHE_MODES, MLA_D, MLA_DR, MLA_HCKV, MLA_HCQ, MLA_HE, SFA_D, SFA_DR,
    npu_lightning_indexer, npu_mla_prolog_v2, npu_mla_prolog_v3, npu_sparse_flash_attention)
from glm5.backends.ascend.contract_checks import HALF_DTYPES, I64_MAX, POW2_HEADS  # noqa: F401
# The rightDownCausal mask, under the name tests read it by.
from glm5.backends.ascend.contract_checks import causal_limit as _causal_limit  # noqa: F401
from glm5.backends.ascend.contract_moe_quant import (  # noqa: F401  (re-exported)
    GMM_INNER_LIMIT, npu_dynamic_quant, npu_grouped_matmul, npu_moe_gating_top_k,
    npu_quant_matmul, npu_swiglu, npu_weight_quant_batchmatmul)

__all__ = [
    "npu_lightning_indexer",
    "npu_sparse_flash_attention",
    "npu_mla_prolog_v2",
    "npu_mla_prolog_v3",
    "npu_dynamic_quant",
    "npu_quant_matmul",
    "npu_weight_quant_batchmatmul",
    "npu_grouped_matmul",
    "npu_swiglu",
    "npu_moe_gating_top_k",
]

