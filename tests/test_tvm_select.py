"""The TVM radix-select kernel (glm5/kernels/tvm/select.py) against torch.topk on int64 keys:
distinct keys sharing high bits (as the indexer's score|index keys do), repeated INT64_MIN
(invalid entries), kb = 1 and kb = W, strided row views, sorted and unsorted output."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("tvm")

from glm5.kernels.tvm import select  # noqa: E402
from glm5.kernels.tvm.build import TVMContext  # noqa: E402

INT64_MIN = torch.iinfo(torch.int64).min


@pytest.fixture(scope="module")
def pick(tmp_path_factory):
    ctx = TVMContext(cache_dir=tmp_path_factory.mktemp("tvm_select_cache"))
    return select.select_kernel(lambda: ctx)


def _keys(g: torch.Generator, R: int, W: int, spread: int, invalid: float) -> torch.Tensor:
    hi = torch.randint(-spread, spread + 1, (R, W), generator=g)
    x = (hi << 32) + (2**32 - 1 - torch.arange(W))  # distinct: index in the low bits
    x[torch.rand(R, W, generator=g) < invalid] = INT64_MIN
    return x


def _run(pick, src: torch.Tensor, kb: int, sort: bool) -> torch.Tensor:
    R, W = src.shape
    dst = torch.empty(R, select.pow2_at_least(kb), dtype=torch.int64)
    pick(src, torch.empty(R, W, dtype=torch.int64), dst, kb, int(sort))
    assert (dst[:, kb:] == INT64_MIN).all()
    return dst[:, :kb]


@pytest.mark.parametrize("spread,invalid", [(2, 0.0), (3, 0.4), (2**30, 0.1), (0, 0.5)])
def test_matches_torch_topk(pick, spread, invalid):
    g = torch.Generator().manual_seed(spread + int(invalid * 10))
    for _ in range(40):
        R = int(torch.randint(1, 5, (1,), generator=g))
        W = int(torch.randint(1, 70, (1,), generator=g))
        kb = int(torch.randint(1, W + 1, (1,), generator=g))
        x = _keys(g, R, W, spread, invalid)
        ref = torch.topk(x, kb, dim=1).values
        assert torch.equal(_run(pick, x, kb, True), ref), (x, kb)
        got = _run(pick, x, kb, False).sort(dim=1, descending=True).values
        assert torch.equal(got, ref), (x, kb)


def test_wide_rows_and_row_views(pick):
    g = torch.Generator().manual_seed(7)
    full = _keys(g, 8, 3000 + 100, 2**31 - 1, 0.2)
    view = full[:, 100:]  # row stride 3100, width 3000: read in place
    for kb in (1, 256, 300, 3000):
        assert torch.equal(_run(pick, view, kb, True), torch.topk(view, kb, dim=1).values)


def test_full_64_bit_keys(pick):
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-2**62, 2**62, (6, 500), generator=g)
    x[0] = torch.iinfo(torch.int64).max - torch.arange(500)  # extremes of the range
    x[1, :250] = INT64_MIN + 1 + torch.arange(250)
    assert torch.equal(_run(pick, x, 128, True), torch.topk(x, 128, dim=1).values)
