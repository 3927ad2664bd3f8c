"""No compilation per sequence length: every Triton kernel of glm5.kernels.triton, launched by its
op's launcher for 50 different lengths (1, odd values, multiples of 16, up to 1000), must need
exactly one compiled variant per declared variant -- measured as Triton's own specialization
key for a CUDA target (glm5.kernels.triton.compile_check), so no GPU is needed and nothing is
compiled or run. The planted-bug tests show the check fails for a length passed as a
``tl.constexpr`` or as a specialized int."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Callable

import pytest
import torch

triton = pytest.importorskip("triton")

from glm5.ir.quant_formats import quantize_weight  # noqa: E402
from glm5.kernels.triton import compile_check, registry  # noqa: E402
from glm5.kernels.triton.launch import interpreted  # noqa: E402

# 50 lengths: 1, small odd and even values, multiples of 16 and their neighbours.
LENGTHS = sorted({1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 13, 15, 16, 17, 19, 23, 31, 32, 33, 37, 47, 48,
                  49, 63, 64, 65, 80, 97, 111, 112, 127, 128, 129, 160, 191, 192, 200, 255, 256,
                  257, 301, 320, 383, 384, 449, 511, 512, 513, 640, 1000})
assert len(LENGTHS) == 50

DEV = "cuda" if torch.cuda.is_available() and not interpreted() else "cpu"
BF = torch.bfloat16


def _r(*shape: int, dtype: torch.dtype = BF) -> torch.Tensor:
    return torch.randn(*shape, device=DEV).to(dtype)


def _i(*shape: int, hi: int) -> torch.Tensor:
    return torch.randint(0, max(hi, 1), shape, device=DEV, dtype=torch.int32)


def _ranges(T: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal key ranges of the last T of S positions: [0, S - T + t + 1)."""
    ke = torch.arange(S - T + 1, S + 1, device=DEV, dtype=torch.int32).clamp(min=0)
    return torch.zeros_like(ke), ke


# Each scenario: (op, call(fn, L) -> None, variant(L) -> label). A label groups the lengths that
# must share one compilation; all labels but quant_linear's are the same for every length.
def _lightning(fn, L):
    for T, S in ((L, L), (1 + L % 3, L)):  # prefill, decode (a few queries over L keys)
        ks, ke = _ranges(T, S)
        fn(_r(T, 2, 16), _r(S, 16), _r(T, 2, dtype=torch.float32), ks, ke)


def _topk(decode: bool) -> Callable[..., Any]:
    def call(fn, L):
        T = 1 + L % 3 if decode else L
        ks, ke = _ranges(T, L)
        fn(_r(T, 2, 16), _r(L, 16), _r(T, 2, dtype=torch.float32), ks, ke, 4)

    return call


def _paged(decode: bool, fp8: bool = False) -> Callable[..., Any]:
    """fp8: the pool as e4m3 codes with a scale per row (paged_indexer_topk_fp8)."""
    ps = 4

    def call(fn, L):  # a prefill chunk / a decode batch over sequences of L keys
        B = 1 + L % 3 if decode else L
        pool = _r(64 * ps, 16)
        pool = (pool.to(torch.float8_e4m3fn), _r(64 * ps, dtype=torch.float32).abs()) \
            if fp8 else (pool,)
        table = _i(B, math.ceil(L / ps), hi=64)
        fn(_r(B, 2, 16), *pool, _r(B, 2, dtype=torch.float32), table,
           torch.arange(B, device=DEV, dtype=torch.int32) % B,
           torch.full((B,), L, device=DEV, dtype=torch.int32), ps, 4)

    return call


def _topk_variant(op: str, decode: bool, ps: int = 1) -> Callable[[int], Any]:
    """Split top-k or not at length L (the split kernel stores order keys: its own variant,
    and the merge kernel runs only then)."""
    from glm5.kernels.triton import indexer

    def variant(L: int) -> bool:
        p = {**registry.default_table()[op], **GPU_LIKE[op]}
        T = 1 + L % 3 if decode else L
        keys = math.ceil(L / ps) * ps
        return indexer._merge_plan(p, 4, 2, 16, T, keys, True)[4] > 1

    return variant


def _sparse(fn, L):
    k = _r(L, 1, 32)
    fn(_r(L, 4, 32), k, k[..., :16], _i(L, 8, hi=L), 0.1)


def _sparse_decode(fn, L):
    """A decode batch of 1-3 queries over L selected keys: split-KV (the partials and their
    merge) from 2 key blocks on, one pass below."""
    T = 1 + L % 3
    k = _r(L, 1, 32)
    fn(_r(T, 4, 32), k, k[..., :16], _i(T, L, hi=L), 0.1)


def _sparse_variant(L: int) -> str:
    # fp32 partials (split) and the op's own out (one split) are two declared variants
    from glm5.kernels.triton.splitkv import split_keys

    p = {**registry.default_table()["sparse_attention"], **GPU_LIKE["sparse_attention"]}
    return "split" if split_keys(p, 1 + L % 3, L, p["BLOCK_K"])[0] > 1 else "one"


def _attention(fn, L):
    """Grouped heads (G = 2), T = L queries: the DECODE regime up to DECODE_MAX_T, then MHA."""
    ks, ke = _ranges(L, L)
    fn(_r(L, 4, 16), _r(L, 2, 16), _r(L, 2, 16), ks, ke, 0.1)


def _attention_decode(fn, L):
    ks, ke = _ranges(1 + L % 3, L)
    fn(_r(1 + L % 3, 4, 16), _r(L, 2, 16), _r(L, 2, 16), ks, ke, 0.1)


def _attention_mqa(decode: bool) -> Callable[..., Any]:
    """Absorbed-MLA layout (Hk = 1, G = 16, v a view of k): the MQA regime at every T."""
    def call(fn, L):
        T = 1 + L % 3 if decode else L
        ks, ke = _ranges(T, L)
        k = _r(L, 1, 48)
        fn(_r(T, 16, 48), k, k[..., :32], ks, ke, 0.1)

    return call


def _attention_variant(T: Callable[[int], int], H: int, Hk: int, Dqk: int, Dv: int
                       ) -> Callable[[int], Any]:
    """(regime, split-KV or not) at length L: T(L) queries over L keys. The split variant
    writes fp32 partials (another out dtype): a declared variant of its own."""
    from glm5.kernels.triton import attention as A
    from glm5.kernels.triton.splitkv import split_keys

    def variant(L: int) -> Any:
        p = {**registry.default_table()["attention"], **GPU_LIKE["attention"]}
        t, G = T(L), H // Hk
        c = A.tiles(p, t, G, Dqk, Dv)
        blocks = math.ceil(t / c["BLOCK_T"]) * Hk * math.ceil(G / c["BLOCK_G"]) * \
            math.ceil(Dv / c["BLOCK_DV"])
        return A.regime(p, t, G), split_keys(p, blocks, L, c["BLOCK_N"])[0] > 1

    return variant


def _mla(absorb: bool) -> Callable[..., Any]:
    def call(fn, L):
        D, Rq, H, Dn, Rkv, Dr = 32, 16, 2, 16, 32, 8
        fn(_r(L, D), _r(Rq, D), _r(Rq), _r(H * (Dn + Dr), Rq), _r(Rkv + Dr, D), _r(Rkv),
           _r(H, Dn, Rkv), _r(L, Dr // 2), _r(L, Dr // 2), 1e-6, _r(2048, Rkv + Dr),
           _i(L, hi=2048), absorb)

    return call


MOE_E, MOE_K = 4, 2


def _moe(fn, L):
    D, I = 32, 16
    fn(_r(L, D), _i(L, MOE_K, hi=MOE_E), _r(L, MOE_K), _r(MOE_E, 2 * I, D), _r(MOE_E, D, I))


def _moe_variant(L: int) -> str:
    # two tile regimes, decode and prefill, picked from T * k against the expert count
    from glm5.kernels.triton import moe

    t = moe.tiles(registry.default_table()["moe_experts"], L, MOE_K, MOE_E, 2)
    return "decode" if t["decode"] else "prefill"


# K = 640: the decode GEMV splits K (3 steps of 256), so its reduction kernel runs too
QUANT = {s: quantize_weight(torch.randn(48, 640), s) for s in ("w8a16", "w8a8", "w4a8", "w6a12")}


def _quant(scheme: str) -> Callable[..., Any]:
    def call(fn, L):
        wp, ws = QUANT[scheme]
        fn(_r(L, 640), wp.to(DEV), ws.to(DEV), scheme, None)

    return call


def _quant_variant(L: int) -> str:
    return "decode" if L <= 16 else "prefill"  # GEMV_M of the default tuning


def _logprobs(fn, L):
    fn(_r(L, 32), _r(1000, 32), _i(L, hi=1000).long(), 0.7)  # 8 vocabulary chunks: split


SCENARIOS: list[tuple[str, Callable[..., Any], Callable[[int], Any]]] = [
    ("rms_norm", lambda fn, L: fn(_r(L, 32), _r(32), 1e-6), lambda L: None),
    ("rope", lambda fn, L: fn(_r(L, 4, 16), _r(L, 8), _r(L, 8), True), lambda L: None),
    ("silu_mul", lambda fn, L: fn(_r(L, 64)), lambda L: None),
    ("lightning_indexer", _lightning, lambda L: None),
    *[("indexer_topk", _topk(d), _topk_variant("indexer_topk", d)) for d in (False, True)],
    *[("indexer_topk_fp8", _topk(d), _topk_variant("indexer_topk_fp8", d)) for d in (False, True)],
    *[("paged_indexer_topk", _paged(d), _topk_variant("paged_indexer_topk", d, 4))
      for d in (False, True)],
    *[("paged_indexer_topk_fp8", _paged(d, True),
       _topk_variant("paged_indexer_topk_fp8", d, 4)) for d in (False, True)],
    ("sparse_attention", _sparse, lambda L: None),
    ("sparse_attention", _sparse_decode, _sparse_variant),
    # decode (T <= DECODE_MAX_T) and prefill tiles are two declared variants for G < 16
    ("attention", _attention, _attention_variant(lambda L: L, 4, 2, 16, 16)),
    ("attention", _attention_decode, _attention_variant(lambda L: 1 + L % 3, 4, 2, 16, 16)),
    ("attention", _attention_mqa(False), _attention_variant(lambda L: L, 16, 1, 48, 32)),
    ("attention", _attention_mqa(True), _attention_variant(lambda L: 1 + L % 3, 16, 1, 48,
                                                           32)),
    *[("mla_prolog", _mla(absorb), lambda L: None) for absorb in (True, False)],
    ("moe_experts", _moe, _moe_variant),  # decode and prefill tiles: two variants
    # decode (M <= GEMV_M: the GEMV) and prefill (the GEMM) are two declared variants
    *[("quant_linear", _quant(s), _quant_variant) for s in QUANT],
    ("token_logprobs", _logprobs, lambda L: None),
]

# Tunings as the backends use them: one program per tile (cuda), and a persistent grid
# (ascend); the vocabulary and key splits as on a GPU (the interpreter alone would never split).
POLICIES = {
    "tiles": {},
    "persistent": {"grid": "persistent", "programs": 8},
}
GPU_LIKE = {"token_logprobs": {"TARGET_PROGRAMS_INTERPRETED": 264},
            "sparse_attention": {"TARGET_PROGRAMS_INTERPRETED": 264, "SPLIT_MIN_KEYS": 32},
            "attention": {"TARGET_PROGRAMS_INTERPRETED": 264, "SPLIT_MIN_KEYS": 32},
            "indexer_topk": {"TARGET_PROGRAMS_INTERPRETED": 264, "SPLIT_MIN_KEYS": 64},
            "indexer_topk_fp8": {"TARGET_PROGRAMS_INTERPRETED": 264, "SPLIT_MIN_KEYS": 64},
            "paged_indexer_topk": {"TARGET_PROGRAMS_INTERPRETED": 264, "SPLIT_MIN_KEYS": 64},
            "paged_indexer_topk_fp8": {"TARGET_PROGRAMS_INTERPRETED": 264,
                                       "SPLIT_MIN_KEYS": 64}}


def _ops(policy: str) -> dict[str, Callable[..., Any]]:
    default = registry.default_table()

    def tuning(op: str) -> dict[str, Any]:
        return {**default.get(op, {}), **GPU_LIKE.get(op, {}), **POLICIES[policy]}

    return {row[0]: row[1] for row in registry.kernels(tuning)}


def _sweep(op: str, call: Callable[..., Any], variant: Callable[[int], Any],
           policy: str) -> dict[tuple[str, Any], set[str]]:
    """{(kernel, variant label): the set of keys} over LENGTHS."""
    fn = _ops(policy)[op]
    keys: dict[tuple[str, Any], set[str]] = defaultdict(set)
    torch.manual_seed(0)
    for L in LENGTHS:
        with compile_check.record_launches() as log:
            call(fn, L)
        assert log, f"{op}: no kernel launched at length {L}"
        for name, key in log:
            keys[(name, variant(L))].add(key)
    return keys


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_one_compilation_per_variant_over_50_lengths(policy):
    launched: set[str] = set()
    bad = []
    for op, call, variant in SCENARIOS:
        for (name, label), keys in _sweep(op, call, variant, policy).items():
            launched.add(name)
            if len(keys) != 1:
                bad.append(f"{op}/{name} variant {label}: {len(keys)} compilations")
    assert not bad, f"{policy}: compilation per length: " + "; ".join(bad)
    # every entry kernel of the library took part (a new kernel needs a scenario here)
    assert launched == set(compile_check.entry_kernels()), \
        set(compile_check.entry_kernels()) - launched


def test_variants_that_should_differ_do():
    """The key is not blind: the declared quant_linear and moe_experts variants (decode and
    prefill) and the schemes compile apart. quant_linear decode runs the GEMV (and quantizes to
    fp32 codes), prefill the GEMM (int8 codes)."""
    keys = _sweep("quant_linear", _quant("w4a8"), _quant_variant, "tiles")
    assert {k for k in keys if k[0].startswith("quant_gemv")} == {
        ("quant_gemv_kernel", "decode"), ("quant_gemv_reduce_kernel", "decode")}
    assert {k for k in keys if k[0] == "quant_linear_int_kernel"} == {
        ("quant_linear_int_kernel", "prefill")}
    dec = keys[("quantize_rows_kernel", "decode")]
    pre = keys[("quantize_rows_kernel", "prefill")]
    assert len(dec) == len(pre) == 1 and dec != pre
    w6 = _sweep("quant_linear", _quant("w6a12"), _quant_variant, "tiles")
    assert w6[("quant_gemv_kernel", "decode")] != keys[("quant_gemv_kernel", "decode")]
    keys = _sweep("moe_experts", _moe, _moe_variant, "tiles")
    for kern in ("moe_gemm13_kernel", "moe_gemm2_kernel"):
        dec, pre = keys[(kern, "decode")], keys[(kern, "prefill")]
        assert len(dec) == len(pre) == 1 and dec != pre
    # attention: the DECODE and MHA tiles, each with its own out (one split) and with fp32
    # partials (split-KV): four variants that all compile apart
    flash: dict[Any, set[str]] = defaultdict(set)
    for call, T in ((_attention, lambda L: L), (_attention_decode, lambda L: 1 + L % 3)):
        keys = _sweep("attention", call, _attention_variant(T, 4, 2, 16, 16), "tiles")
        for (name, label), k in keys.items():
            if name == "flash_attention_kernel":
                flash[label] |= k
    assert set(flash) == {("DECODE", False), ("DECODE", True), ("MHA", False), ("MHA", True)}
    assert all(len(k) == 1 for k in flash.values())
    assert len({next(iter(k)) for k in flash.values()}) == 4


# ---------------------------------------------------------------- planted bugs: the check fails
@triton.jit
def _len_constexpr_kernel(x_ptr, N: triton.language.constexpr, BLOCK: triton.language.constexpr):
    i = triton.language.arange(0, BLOCK)
    triton.language.store(x_ptr + i, i, mask=i < N)


@triton.jit
def _len_int_kernel(x_ptr, N, BLOCK: triton.language.constexpr):
    i = triton.language.arange(0, BLOCK)
    triton.language.store(x_ptr + i, i, mask=i < N)


@triton.jit(do_not_specialize=["N"])
def _len_runtime_kernel(x_ptr, N, BLOCK: triton.language.constexpr):
    i = triton.language.arange(0, BLOCK)
    triton.language.store(x_ptr + i, i, mask=i < N)


def _count(kernel) -> int:
    x = torch.empty(16, dtype=torch.int32)
    return len({compile_check.specialization_key(kernel, (x, L), {"BLOCK": 16})
                if kernel is not _len_constexpr_kernel else
                compile_check.specialization_key(kernel, (x,), {"N": L, "BLOCK": 16})
                for L in LENGTHS})


def test_planted_constexpr_length_is_caught():
    assert _count(_len_constexpr_kernel) == 50


def test_planted_specialized_int_length_is_caught():
    # Triton specializes an int on == 1 and on divisibility by 16: three variants over LENGTHS
    assert _count(_len_int_kernel) == 3


def test_runtime_length_is_one_variant():
    assert _count(_len_runtime_kernel) == 1


def test_misaligned_pointer_is_a_variant():
    """A tensor's 16-byte alignment is part of the key (a slice at an odd offset compiles anew),
    so launchers must hand kernels fresh or aligned buffers."""
    x = torch.empty(64, dtype=torch.int32)
    k = {compile_check.specialization_key(_len_runtime_kernel, (x[o:], 5), {"BLOCK": 16})
         for o in (0, 1, 4)}
    assert len(k) == 2


def test_entry_kernel_names_its_arguments():
    from glm5.kernels.triton._common import entry_kernel

    def k(x_ptr, T, N_TILES, BLOCK: triton.language.constexpr):
        pass

    with pytest.raises(TypeError, match="k has no argument S"):
        entry_kernel("T", "S")(k)
    # grid-policy args the kernel lacks (NUM_PROGRAMS, GRID_i) are left out, not passed on
    kern = entry_kernel("T")(k)
    x = torch.empty(4)
    assert len({compile_check.specialization_key(kern, (x, n, n), {"BLOCK": 16})
                for n in (1, 16, 17)}) == 1
