"""The draw interface and seeded tensor maker behind the kit's input generators
(:mod:`glm5.testing.cases`), with the size tiers, the profiles and GLM-5's shapes they draw.

A generator is written once against `Draw`, so the same definition drives hypothesis
(`HypothesisDraw`, with shrinking) and the `glm5 parity` CLI (`RandomDraw`, no hypothesis needed
at runtime); `Maker` draws the seed of a torch.Generator and makes the example's tensors from it.
"""

from __future__ import annotations

import abc
import random
from typing import Any, Sequence

import torch

TIERS = ("edge", "model", "tile", "large", "huge")
PROFILES: dict[str, tuple[str, ...]] = {
    "smoke": ("edge", "tile"),
    "quick": ("edge", "tile", "model"),
    "default": ("edge", "model", "tile", "large", "huge"),
    "full": ("edge", "model", "tile", "large", "huge"),
}
DEFAULT_PROFILE = "default"
# Examples per (op, dtype) of a profile when the caller does not say.
PROFILE_EXAMPLES = {"smoke": 4, "quick": 6, "default": 10, "full": 100}

# GLM-5's shapes (glm5.core.config preset "glm-5"; the kit does not import the model layer).
GLM5 = dict(hidden=6144, q_lora=2048, kv_lora=512, rope=64, nope=192, heads=64,
            index_heads=32, index_dim=128, index_topk=2048, experts=256, top_k=8,
            moe_inter=2048, vocab=154880)

class Draw(abc.ABC):
    """Primitive choices; implemented over random.Random or hypothesis."""

    tiers: tuple[str, ...] = PROFILES[DEFAULT_PROFILE]

    @abc.abstractmethod
    def int(self, lo: int, hi: int) -> int:
        """An integer in [lo, hi] (inclusive)."""

    def choice(self, seq: Sequence[Any]) -> Any:
        return seq[self.int(0, len(seq) - 1)]

    def flag(self) -> bool:
        return self.int(0, 1) == 1

    def tier(self) -> str:
        """The size tier of this example (one of ``self.tiers``)."""
        return self.choice(self.tiers)

    def cover(self, options: Sequence[Any]) -> Any:
        """A choice that consecutive examples of a parity run rotate through (a flag that
        decides which code path runs: every option is reached within len(options) examples,
        whatever the seed); hypothesis draws it."""
        return self.choice(options)

    def variant(self, options: Sequence[Any]) -> Any:
        """A variant of the example's tier that successive passes over the tiers rotate through
        (the first pass takes the first option)."""
        return self.choice(options)


class RandomDraw(Draw):
    """Choices from random.Random(seed); ``tier`` fixes the example's tier and ``index`` (the
    example's number) drives ``cover`` (the parity runner cycles through both)."""

    def __init__(self, seed: int, tier: str | None = None,
                 tiers: tuple[str, ...] | None = None, index: int | None = None) -> None:
        self.r = random.Random(seed)
        self._tier = tier
        self._index = index
        self._covers = 0
        if tiers is not None:
            self.tiers = tiers

    def int(self, lo: int, hi: int) -> int:
        return self.r.randint(lo, hi)

    def tier(self) -> str:
        return self._tier if self._tier is not None else super().tier()

    def cover(self, options: Sequence[Any]) -> Any:
        if self._index is None:
            return self.choice(options)
        # Each cover call of a generator rotates with its own offset, so two flags of one
        # example do not move in lockstep.
        self._covers += 1
        return options[(self._index + self._covers * (self._index // len(options) + 1))
                       % len(options)]

    def variant(self, options: Sequence[Any]) -> Any:
        if self._index is None:
            return self.choice(options)
        return options[(self._index // len(self.tiers)) % len(options)]


class HypothesisDraw(Draw):
    def __init__(self, data: Any, tiers: tuple[str, ...] | None = None) -> None:
        from hypothesis import strategies as st

        self.data, self.st = data, st
        if tiers is not None:
            self.tiers = tiers

    def int(self, lo: int, hi: int) -> int:
        return self.data.draw(self.st.integers(lo, hi))


class Maker:
    """Seeded tensors in the case's dtype, optionally non-contiguous."""

    def __init__(self, d: Draw, dtype: torch.dtype) -> None:
        self.d = d
        self.dtype = dtype
        self.g = torch.Generator().manual_seed(d.int(0, 2**31 - 1))

    def randn(self, *shape: int, scale: float = 1.0, dtype: torch.dtype | None = None,
              noncontig: bool | None = None) -> torch.Tensor:
        dt = dtype or self.dtype
        nc = self.d.flag() if noncontig is None else noncontig
        if nc and len(shape) >= 1 and shape[-1] > 0:
            base = torch.randn(*shape[:-1], 2 * shape[-1], generator=self.g) * scale
            return base.to(dt)[..., ::2]
        return (torch.randn(*shape, generator=self.g) * scale).to(dt)

    def uniform(self, *shape: int, lo: float, hi: float, dtype: torch.dtype | None = None):
        t = torch.rand(*shape, generator=self.g) * (hi - lo) + lo
        return t.to(dtype or self.dtype)

    def randint(self, lo: int, hi: int, *shape: int) -> torch.Tensor:  # [lo, hi)
        return torch.randint(lo, hi, shape, generator=self.g)

    def perm(self, n: int) -> torch.Tensor:
        return torch.randperm(n, generator=self.g)

    def magnitude(self) -> float:
        # Tiny inputs (mean(x^2) near a norm's eps: 1e-3), small, unit and large ones; fp16's
        # range caps the large end where products accumulate.
        big = 30.0 if self.dtype != torch.float16 else 8.0
        return self.d.cover((1e-3, 1.0, big, 1e-2))

    def angles(self, T: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = self.randint(0, 4096, T).double()
        inv = 10000.0 ** (-torch.arange(half, dtype=torch.float64) / max(half, 1))
        th = pos[:, None] * inv[None, :]
        return th.cos().to(self.dtype), th.sin().to(self.dtype)


def i32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32)
