"""The Hadamard rotation of the fp8 indexer (``dsa_indexer_hadamard``): DeepSeek-V3.2's official
inference code and SGLang rotate the indexer's q and k by the orthonormal Hadamard matrix
(``rotate_activation``: fast_hadamard_transform with scale ``d^-0.5``, computed in fp32, the
result in the activations' dtype) before quantizing them to e4m3. An orthonormal rotation keeps
every q . k, so it only changes the quantization error: it spreads a few large channels over
all of them, so one per-row fp8 scale fits the row better. vLLM and TRT-LLM skip it.
"""

from __future__ import annotations

import torch


def _check_width(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n & (n - 1):
        raise ValueError(f"glm5.hadamard: argument 'n' expected a power of two >= 1, got {n!r}")


def sign_matrix(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The n x n Hadamard matrix of +-1 in Sylvester's order (entry (i, j) is
    ``(-1)^popcount(i & j)``, as the fast Walsh-Hadamard transform computes), fp32, symmetric.
    ``n`` must be a power of two. Built on every call (log2 n concatenations): a cached tensor
    made while torch.export traces would be a fake tensor outliving the trace."""
    _check_width(n)
    h = torch.ones(1, 1, dtype=torch.float32, device=device)
    while h.shape[0] < n:  # H_2m = [[H, H], [H, -H]]
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def hadamard_matrix(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal Hadamard matrix, ``sign_matrix(n) / sqrt(n)``, fp32."""
    return sign_matrix(n, device) * n ** -0.5


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x @ H`` over the last axis ([..., n], n a power of two) for the orthonormal H: the +-1
    sums in fp32, then the scale ``n^-0.5``, returned in ``x``'s dtype, as
    ``rotate_activation`` (fast_hadamard_transform with ``scale = n^-0.5``) does."""
    n = x.shape[-1]
    return (torch.matmul(x.to(torch.float32), sign_matrix(n, x.device)) * n ** -0.5).to(x.dtype)
