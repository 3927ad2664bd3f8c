"""TVM (llvm, host CPU) exact top-k selection over rows of distinct int64 keys.

Used by the fused `indexer_topk` (its keys put the order-preserving score bits in the high 32
bits and ``2**32 − 1 − s`` in the low 32, so keys are distinct and the integer order is the op's
order: score descending, ties to the smaller index; invalid entries are INT64_MIN).

``select_topk(src[R, W], dst[R, KP], kb, sort)``, one row per parallel work item:

1. radix select on the key viewed as unsigned (``key ^ INT64_MIN``): passes of 11, 11, 11, 11,
   10, 10 bits build a histogram of the next digit among the keys that share the prefix found
   so far, and walk it from the top to the digit holding the kb-th largest key. It stops as soon
   as the keys at or above the prefix are exactly kb (with random scores: after 2–3 passes).
   Each pass reads the row once; no comparison sort of W keys ever runs;
2. one pass writes the kb selected keys (those whose top bits are ≥ the prefix) to ``dst[r,
   :kb]`` in input order, and INT64_MIN to ``dst[r, kb:KP]`` (equal keys — repeated INT64_MIN
   for invalid entries — take a second pass: keys above the threshold first, then equal ones);
3. when ``sort`` is set, an LSD radix sort (eight stable counting passes over 8-bit digits,
   between ``dst[r]`` and the row's scratch) sorts ``dst[r, :kb]`` descending; the INT64_MIN
   padding ``dst[r, kb:KP]`` is already last. ~4x less work per row than a bitonic network
   over KP (GLM-5's kb = 2048: 8 x (2 x 2048 + 512) steps against 66 x 1024
   compare-exchanges).

``torch.topk`` does a partial sort per row; the passes here are a few integer operations per
element (the timings: docs/performance.md). W, R and kb are symbolic (no recompiles).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

REV = 3  # bump when the kernel source changes (part of the build-cache key)
_PASSES = (11, 11, 11, 11, 10, 10)  # digit widths, most significant first (sum 64)
HIST = 1 << max(_PASSES)


def _digit(T: Any, key: Any, ps: Any, top: Any) -> Any:
    """Sort digit ``ps`` (8 bits, least significant first) of an int64 key, reversed (255 -
    digit of the unsigned key ``key ^ INT64_MIN``) so that an ascending counting sort orders
    the keys descending."""
    u = T.bitwise_xor(T.reinterpret("uint64", key), top)
    return 255 - T.Cast("int32", T.bitwise_and(T.shift_right(u, T.Cast("uint64", 8 * ps)),
                                               T.uint64(255)))


def pow2_at_least(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


MAX_KP = 1 << 20  # the widest selection (KP) the callers size scratch for


@functools.lru_cache(maxsize=None)
def build_select() -> Any:
    """The PrimFunc ``select_topk(src[R, W] int64, tmp[R, W] int64, dst[R, KP] int64, kb,
    sort)`` (KP a power of two, 1 <= kb <= min(W, KP); ``tmp`` is scratch; ``src`` may be a
    view with any row stride)."""
    from tvm.script import tirx as T

    assert _PASSES == (11, 11, 11, 11, 10, 10)  # the shift/width formulas below assume it
    TOP = T.reinterpret("uint64", T.min_value("int64"))

    @T.prim_func
    def select_topk(src_h: T.handle, tmp_h: T.handle, dst_h: T.handle, kb: T.int32,
                    sort: T.int32):
        T.func_attr({"global_symbol": "select_topk", "tirx.noalias": True})
        R = T.int32()
        W = T.int32()
        KP = T.int32()
        SR = T.int32()
        src = T.match_buffer(src_h, (R, W), "int64", strides=(SR, 1))  # row views are fine
        tmp = T.match_buffer(tmp_h, (R, W), "int64")
        dst = T.match_buffer(dst_h, (R, KP), "int64")
        for r in T.parallel(R):
            hist = T.alloc_buffer((HIST,), "int32", scope="global")
            # st[0] prefix found so far (right-aligned), st[1] its bit count, st[2] keys still
            # needed from the current digit, st[3] state (0 refine, 1 done, 2 digit found),
            # st[4] running count, st[5] the digit, st[6] keys left in tmp (the candidates
            # sharing the prefix, gathered after the first pass)
            st = T.alloc_buffer((7,), "uint64", scope="global")
            st[0] = T.uint64(0)
            st[1] = T.uint64(0)
            st[2] = T.Cast("uint64", kb)
            st[3] = T.uint64(0)
            st[6] = T.uint64(0)
            for ps in range(6):
                if st[3] == T.uint64(0):
                    nb = T.bind(T.if_then_else(ps < 4, 11, 10))
                    sh = T.bind(T.if_then_else(ps < 4, 53 - 11 * ps, 50 - 10 * ps))
                    mask = T.bind(T.Cast("uint64", T.shift_left(1, nb) - 1))
                    for i in range(HIST):
                        hist[i] = 0
                    if ps == 0:
                        for j in range(W):
                            u = T.bind(T.bitwise_xor(T.reinterpret("uint64", src[r, j]), TOP))
                            dig = T.bind(T.Cast("int32", T.shift_right(u, T.uint64(53))))
                            hist[dig] = hist[dig] + 1
                    else:
                        for j in range(T.Cast("int32", st[6])):
                            u = T.bind(T.bitwise_xor(T.reinterpret("uint64", tmp[r, j]), TOP))
                            dig = T.bind(T.Cast("int32", T.bitwise_and(
                                T.shift_right(u, T.Cast("uint64", sh)), mask)))
                            hist[dig] = hist[dig] + 1
                    # walk the digits from the top to the one holding the kb-th largest key
                    st[4] = T.uint64(0)
                    st[5] = T.uint64(0)
                    for i in range(T.shift_left(1, nb)):
                        if st[3] == T.uint64(0):
                            dd = T.bind(T.shift_left(1, nb) - 1 - i)
                            if st[4] + T.Cast("uint64", hist[dd]) >= st[2]:
                                st[5] = T.Cast("uint64", dd)
                                st[2] = st[2] - st[4]
                                if T.Cast("uint64", hist[dd]) == st[2]:
                                    st[3] = T.uint64(1)
                                else:
                                    st[3] = T.uint64(2)
                            else:
                                st[4] = st[4] + T.Cast("uint64", hist[dd])
                    st[0] = T.shift_left(st[0], T.Cast("uint64", nb)) + st[5]
                    st[1] = st[1] + T.Cast("uint64", nb)
                    if st[3] == T.uint64(2):
                        st[3] = T.uint64(0)
                        # keep only the keys of the chosen digit for the next pass
                        st[4] = T.uint64(0)
                        if ps == 0:
                            for j in range(W):
                                u = T.bind(T.bitwise_xor(T.reinterpret("uint64", src[r, j]),
                                                         TOP))
                                if T.shift_right(u, T.uint64(53)) == st[0]:
                                    tmp[r, T.Cast("int32", st[4])] = src[r, j]
                                    st[4] = st[4] + T.uint64(1)
                        else:
                            for j in range(T.Cast("int32", st[6])):
                                u = T.bind(T.bitwise_xor(T.reinterpret("uint64", tmp[r, j]),
                                                         TOP))
                                if T.bitwise_and(T.shift_right(u, T.Cast("uint64", sh)),
                                                 mask) == st[5]:
                                    tmp[r, T.Cast("int32", st[4])] = tmp[r, j]
                                    st[4] = st[4] + T.uint64(1)
                        st[6] = st[4]
            # the selected keys in input order: those whose top bits are >= the prefix when
            # they are exactly kb (st[3] == 1); else (equal keys, e.g. repeated INT64_MIN) the
            # keys above the prefix first, then keys equal to it until kb are written
            st[4] = T.uint64(0)
            for j in range(W):
                u = T.bind(T.bitwise_xor(T.reinterpret("uint64", src[r, j]), TOP))
                top = T.bind(T.shift_right(u, T.uint64(64) - st[1]))
                if top > st[0] or (top == st[0] and st[3] == T.uint64(1)):
                    dst[r, T.Cast("int32", st[4])] = src[r, j]
                    st[4] = st[4] + T.uint64(1)
            if st[3] != T.uint64(1):
                for j in range(W):
                    u = T.bind(T.bitwise_xor(T.reinterpret("uint64", src[r, j]), TOP))
                    if T.shift_right(u, T.uint64(64) - st[1]) == st[0]:
                        if st[4] < T.Cast("uint64", kb):
                            dst[r, T.Cast("int32", st[4])] = src[r, j]
                            st[4] = st[4] + T.uint64(1)
            for j in range(KP - kb):
                dst[r, kb + j] = T.min_value("int64")
            if sort != 0:
                # LSD radix sort of dst[r, :kb], descending: a stable counting sort per 8-bit
                # digit of the unsigned key, least significant first, between dst and tmp
                # (eight passes, an even count: the keys end in dst)
                for ps in range(8):
                    for i in range(256):
                        hist[i] = 0
                    for j in range(kb):
                        hist[_digit(T, T.if_then_else(ps % 2 == 0, dst[r, j], tmp[r, j]), ps,
                                    TOP)] += 1
                    st[4] = T.uint64(0)  # exclusive prefix sums: each digit's first slot
                    for i in range(256):
                        c = T.bind(hist[i])
                        hist[i] = T.Cast("int32", st[4])
                        st[4] = st[4] + T.Cast("uint64", c)
                    if ps % 2 == 0:
                        for j in range(kb):
                            dg = T.bind(_digit(T, dst[r, j], ps, TOP))
                            tmp[r, hist[dg]] = dst[r, j]
                            hist[dg] = hist[dg] + 1
                    else:
                        for j in range(kb):
                            dg = T.bind(_digit(T, tmp[r, j], ps, TOP))
                            dst[r, hist[dg]] = tmp[r, j]
                            hist[dg] = hist[dg] + 1

    return select_topk


def select_kernel(context: Callable[[], Any]) -> Callable[..., Any]:
    """The compiled ``select_topk`` from the backend's build cache."""
    return context().kernel("select_topk", {"rev": REV, "passes": list(_PASSES)}, build_select,
                            "select_topk")
