"""Rows that stress an e4m3 row quantizer (shared by the ONNX and TVM ports of `glm5.ir.fp8`)."""

from __future__ import annotations

import torch


def e4m3_stress_rows(n: int = 128) -> torch.Tensor:
    """fp32 rows of ``n`` values: every e4m3 grid value and every midpoint between neighbours
    (ties to even), +-1 fp32 ulp around the midpoints, both signs, in rows led by 448 (scale
    1: the codes are the values); rows of magnitudes 1e-9 .. 1e6; rows whose amax / 448 is
    2^-21 .. 2^60 exactly; zero rows and rows below the 1e-4 amax floor."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()  # 0 .. 448
    mids = (grid[1:] + grid[:-1]) / 2
    vals = torch.cat([grid, mids, mids.nextafter(torch.tensor(0.0)),
                      mids.nextafter(torch.tensor(1e9))])
    vals = torch.cat([vals, -vals])
    vals = torch.cat([vals, vals[: (-len(vals)) % (n - 1)]])
    lead = torch.full((len(vals) // (n - 1), 1), 448.0)
    rows = [torch.cat([lead, vals.reshape(-1, n - 1)], 1)]
    g = torch.Generator().manual_seed(0)
    rows.append(torch.randn(40, n, generator=g) * torch.logspace(-9, 6, 40)[:, None])
    pow2 = torch.randn(82, n, generator=g)
    pow2[:, 0] = 448 * 2.0 ** torch.arange(-21, 61).float()
    pow2[:, 1:] = pow2[:, 1:].clamp(-1, 1) * pow2[:, :1] / 2
    rows += [pow2, torch.zeros(2, n), torch.full((2, n), 3e-5)]
    return torch.cat(rows)
