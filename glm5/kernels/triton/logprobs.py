"""Triton token_logprobs: log_softmax(h · w_vocabᵀ / temperature)[t, targets[t]] and the row
entropy, with an online logsumexp over vocabulary chunks — never a [T, V] logits tensor.

Grid (cdiv(T, BLOCK_T), SPLIT): when there are few token blocks (decode, short RL batches) the
vocabulary is also split across SPLIT programs (about TARGET_PROGRAMS programs in all on a GPU);
each writes fp32 partials [SPLIT, T] x 4 that a second small kernel merges. Outputs are fp32.
The @triton.jit kernels live in ``_logprobs_kernels`` and are imported on first call.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from glm5.kernels.triton.launch import (FLOATS, cdiv, check_device, interpreted, launch,
                                        launch_opts, next_pow2, split_for_target)

DEFAULTS: dict[str, dict[str, Any]] = {
    "token_logprobs": {
        "BLOCK_T": 64, "BLOCK_V": 128, "BLOCK_D": 64, "num_warps": 8, "num_stages": 3,
        # Split V across programs until about this many programs run (GPU); 0 = never split.
        "TARGET_PROGRAMS": 264,
        # The interpreter runs programs one after another: splitting only adds work there.
        "TARGET_PROGRAMS_INTERPRETED": 0,
        # Tokens per program of the kernel merging the split partials.
        "COMBINE_BLOCK_T": 256,
    },
}


def _kernels():
    # lazy: optional dependency: _logprobs_kernels imports triton (on the first launch)
    from glm5.kernels.triton import _logprobs_kernels

    return _logprobs_kernels


def make_token_logprobs(p: dict[str, Any]) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    def token_logprobs(h: torch.Tensor, w_vocab: torch.Tensor, targets: torch.Tensor,
                       temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        check_device("token_logprobs", h=h, w_vocab=w_vocab, targets=targets)
        T, D = h.shape
        V = w_vocab.shape[0]
        dev = h.device
        logp = torch.empty(T, dtype=torch.float32, device=dev)
        ent = torch.empty(T, dtype=torch.float32, device=dev)
        if T == 0:
            return logp, ent
        interp = interpreted()
        # Tiles never follow T (a tl.constexpr that did would compile per length bucket):
        # fewer tokens than BLOCK_T are masked.
        bt = max(16, next_pow2(int(p.get("BLOCK_T", 64))))
        bv = max(16, next_pow2(int(p.get("BLOCK_V", 128))))
        bd = max(16, next_pow2(int(p.get("BLOCK_D", 64))))
        bd = min(bd, max(16, next_pow2(D)))
        n_tb = cdiv(T, bt)
        n_chunks = cdiv(V, bv)
        target = int(p.get("TARGET_PROGRAMS_INTERPRETED" if interp else "TARGET_PROGRAMS", 0))
        split, per = split_for_target(n_tb, n_chunks, target, p.get("SPLIT_V"))
        # four allocations, not views of one: a view at offset i*split*T floats is 16-byte
        # aligned only for some T, and alignment is part of Triton's specialization key
        parts = [torch.empty(split, T, dtype=torch.float32, device=dev) for _ in range(4)]
        dot_f32 = interp or h.dtype == torch.float32 or w_vocab.dtype == torch.float32
        k = _kernels()
        launch(
            k.token_logprobs_partial_kernel, (n_tb, split), p, "token_logprobs",
            h, w_vocab, targets, parts[0], parts[1], parts[2], parts[3],
            T, V, D, 1.0 / float(temperature), per * bv,
            h.stride(0), h.stride(1), w_vocab.stride(0), w_vocab.stride(1), targets.stride(0),
            BLOCK_T=bt, BLOCK_V=bv, BLOCK_D=bd, DOT_F32=dot_f32, **launch_opts(p))
        cb = max(16, next_pow2(int(p.get("COMBINE_BLOCK_T", 256))))
        launch(
            k.token_logprobs_combine_kernel, (cdiv(T, cb),), p, "token_logprobs",
            parts[0], parts[1], parts[2], parts[3], logp, ent, T, split, BLOCK_T=cb)
        return logp, ent

    return token_logprobs


def kernels(tuning: Callable[[str], dict[str, Any]]) -> list[tuple]:
    return [("token_logprobs", make_token_logprobs(tuning("token_logprobs")), FLOATS, None)]
