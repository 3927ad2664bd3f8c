"""Canonical quantization formats (docs/ops.md): schemes, weight quantization, int4/int6 packing.

All quantization arithmetic is fp32 (scales are fp32 by definition, the quotient ``x / s`` is
taken in fp32 and rounded half-to-even), so the float64 oracle and an fp32 kernel produce the
same codes bit for bit. This module is the one place that knows the packed layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 128  # K-group length of the grouped schemes


@dataclass(frozen=True)
class Scheme:
    name: str
    weight_bits: int  # 8, 4 or 6
    act_bits: int | None  # None = activations stay in floating point
    grouped: bool  # per-group-of-128 weight scales (else per output channel)

    @property
    def weight_qmax(self) -> int:
        return {8: 127, 4: 7, 6: 31}[self.weight_bits]

    @property
    def act_qmax(self) -> int | None:
        return None if self.act_bits is None else ACT_QMAX[self.act_bits]

    def packed_k(self, K: int) -> int:
        """Packed columns for K input features (zero-padded to a whole packing unit)."""
        if self.weight_bits == 8:
            return K
        if self.weight_bits == 4:
            return (K + 1) // 2
        return (K + 3) // 4 * 3

    def scale_shape(self, N: int, K: int) -> tuple[int, ...]:
        return (N, n_groups(K)) if self.grouped else (N,)

    def weight_dtype(self) -> torch.dtype:
        return torch.int8 if self.weight_bits == 8 else torch.uint8

    def unpacked_k(self, packed: int) -> int:
        """Upper bound of K for a packed width (exact K comes from the activation)."""
        if self.weight_bits == 8:
            return packed
        if self.weight_bits == 4:
            return packed * 2
        return packed // 3 * 4


SCHEMES: dict[str, Scheme] = {
    "w8a16": Scheme("w8a16", 8, None, False),
    "w8a8": Scheme("w8a8", 8, 8, False),
    "w4a8": Scheme("w4a8", 4, 8, True),
    "w6a12": Scheme("w6a12", 6, 12, True),
}
ACT_QMAX = {8: 127, 12: 2047}
ACT_DTYPE = {8: torch.int8, 12: torch.int16}


def n_groups(K: int) -> int:
    return (K + GROUP - 1) // GROUP


def get_scheme(name: str, where: str = "quant") -> Scheme:
    try:
        return SCHEMES[name]
    except KeyError:
        raise ValueError(
            f"glm5.{where}: argument 'scheme' expected one of {sorted(SCHEMES)}, got {name!r}"
        ) from None


def symmetric_codes(
    x: torch.Tensor, amax: torch.Tensor, qmax: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = amax / qmax`` (1 where amax is 0) and ``clamp(round(x / s), ±qmax)``, fp32 math.

    ``amax`` broadcasts against ``x``. Returns (codes as int32, scale fp32).
    """
    amax = amax.to(torch.float32)
    s = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    q = torch.round(x.to(torch.float32) / s).clamp_(-qmax, qmax).to(torch.int32)
    return q, s


def quantize_per_token_ref(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric per-row quantization: (codes int8/int16 [M, K], scale fp32 [M])."""
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=-1, keepdim=True) if xf.shape[-1] else xf.new_zeros(xf.shape[0], 1)
    q, s = symmetric_codes(xf, amax, ACT_QMAX[bits])
    return q.to(ACT_DTYPE[bits]), s.squeeze(-1)


def group_view(w: torch.Tensor) -> tuple[torch.Tensor, int]:
    """[N, K] -> [N, G, 128] zero-padded along K, and K."""
    N, K = w.shape
    G = n_groups(K)
    pad = G * GROUP - K
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))
    return w.reshape(N, G, GROUP), K


def quantize_weight(w: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a dense weight ``w[N, K]`` into the canonical (packed codes, scales) of ``scheme``."""
    sc = get_scheme(scheme, "quantize_weight")
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(
            f"glm5.quantize_weight: argument 'w' expected a floating [N, K] tensor, "
            f"got {w.dtype} {list(w.shape)}"
        )
    wf = w.to(torch.float32)
    if sc.grouped:
        g, K = group_view(wf)
        q, s = symmetric_codes(g, g.abs().amax(-1, keepdim=True), sc.weight_qmax)
        q = q.reshape(w.shape[0], -1)[:, :K]
        s = s.squeeze(-1)
    else:
        q, s = symmetric_codes(wf, wf.abs().amax(-1, keepdim=True), sc.weight_qmax)
        s = s.squeeze(-1)
    return pack(q, sc), s


def pack(q: torch.Tensor, sc: Scheme) -> torch.Tensor:
    """Pack int codes ``q[..., K]`` (int32 values in range) into the scheme's byte layout."""
    if sc.weight_bits == 8:
        return q.to(torch.int8)
    K = q.shape[-1]
    unit = 2 if sc.weight_bits == 4 else 4
    pad = (-K) % unit
    if pad:
        q = torch.nn.functional.pad(q, (0, pad))
    u = q.to(torch.int32) & ((1 << sc.weight_bits) - 1)  # two's complement in `bits` bits
    if sc.weight_bits == 4:
        u = u.reshape(*q.shape[:-1], -1, 2)
        return (u[..., 0] | (u[..., 1] << 4)).to(torch.uint8)
    u = u.reshape(*q.shape[:-1], -1, 4)
    word = u[..., 0] | (u[..., 1] << 6) | (u[..., 2] << 12) | (u[..., 3] << 18)
    b = torch.stack((word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF), dim=-1)
    return b.reshape(*q.shape[:-1], -1).to(torch.uint8)


def unpack(packed: torch.Tensor, sc: Scheme, K: int) -> torch.Tensor:
    """Inverse of :func:`pack`: int32 codes ``[..., K]``."""
    if sc.weight_bits == 8:
        return packed[..., :K].to(torch.int32)
    p = packed.to(torch.int32)
    if sc.weight_bits == 4:
        lo, hi = p & 0xF, (p >> 4) & 0xF
        u = torch.stack((lo, hi), dim=-1).reshape(*p.shape[:-1], -1)
        return (u - ((u & 0x8) << 1))[..., :K]
    b = p.reshape(*p.shape[:-1], -1, 3)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    u = torch.stack([(word >> (6 * j)) & 0x3F for j in range(4)], dim=-1)
    u = u.reshape(*p.shape[:-1], -1)
    return (u - ((u & 0x20) << 1))[..., :K]


def dequantize_weight(
    packed: torch.Tensor, scale: torch.Tensor, scheme: str, K: int
) -> torch.Tensor:
    """Dense fp32 ``[N, K]`` from canonical codes and scales (for checks and fallbacks)."""
    sc = get_scheme(scheme, "dequantize_weight")
    q = unpack(packed, sc, K).to(torch.float32)
    if sc.grouped:
        s = scale.to(torch.float32).repeat_interleave(GROUP, dim=-1)[..., :K]
    else:
        s = scale.to(torch.float32).unsqueeze(-1)
    return q * s
