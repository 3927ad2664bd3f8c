"""The Hadamard rotation of the fp8 indexer (``dsa_indexer_hadamard``): DeepSeek-V3.2's official
inference code and SGLang rotate the indexer's q and k by the orthonormal Hadamard matrix
(``rotate_activation``: fast_hadamard_transform with scale ``d^-0.5``, computed in fp32, the
result in the activations' dtype) before quantizing them to e4m3. An orthonormal rotation keeps
every q . k, so it only changes the quantization error: it spreads a few large channels over
all of them, so one per-row fp8 scale fits the row better. vLLM and TRT-LLM skip it.
"""

from __future__ import annotations

import functools

import torch


def _check_width(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n & (n - 1):
        raise ValueError(f"glm5.hadamard: argument 'n' expected a power of two >= 1, got {n!r}")


@functools.lru_cache(maxsize=16)
def _matrix(n: int, device: str) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:  # Sylvester: H_2m = [[H, H], [H, -H]]
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h * n ** -0.5).to(torch.float32).to(device)


def hadamard_matrix(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal, symmetric n x n Hadamard matrix (Sylvester's order: entry (i, j) is
    ``(-1)^popcount(i & j) / sqrt(n)``, as the fast Walsh-Hadamard transform computes), fp32.
    ``n`` must be a power of two."""
    _check_width(n)
    return _matrix(n, str(torch.device(device)))


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x @ H`` over the last axis ([..., n], n a power of two), computed in fp32 and returned
    in ``x``'s dtype, as ``rotate_activation`` does."""
    h = hadamard_matrix(x.shape[-1], x.device)
    return torch.matmul(x.to(torch.float32), h).to(x.dtype)
