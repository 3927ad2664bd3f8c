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
3. when ``sort`` is set, a bitonic network (KP a power of two, branch-free min/max) sorts
   ``dst[r]`` descending.

``torch.topk`` spends ~15 ns per element on these rows (a partial sort per row); the passes
here are a few integer operations per element. W, R and kb are symbolic (no recompiles).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

REV = 1  # bump when the kernel source changes (part of the build-cache key)
_PASSES = (11, 11, 11, 11, 10, 10)  # digit widths, most significant first (sum 64)
HIST = 1 << max(_PASSES)


def pow2_at_least(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


MAX_KP = 1 << 20  # the bitonic network's stage loop covers rows up to this width


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
        T.func_attr({"global_symbol": "select_topk", "tir.noalias": True})
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
                # bitonic network, descending overall: stage a sorts blocks of 2^(a+1) keys
                # (alternating direction), step b compares keys 2^(a-b) apart
                for a in range(20):
                    if T.shift_left(2, a) <= KP:
                        for b in range(a + 1):
                            for i in range(KP // 2):
                                lo = T.bind(T.bitwise_or(
                                    T.shift_left(T.shift_right(i, a - b), a - b + 1),
                                    T.bitwise_and(i, T.shift_left(1, a - b) - 1)))
                                hi = T.bind(T.bitwise_or(lo, T.shift_left(1, a - b)))
                                x = T.bind(dst[r, lo])
                                y = T.bind(dst[r, hi])
                                desc = T.bind(T.bitwise_and(lo, T.shift_left(2, a)) == 0)
                                dst[r, lo] = T.if_then_else(desc, T.max(x, y), T.min(x, y))
                                dst[r, hi] = T.if_then_else(desc, T.min(x, y), T.max(x, y))

    return select_topk


def select_kernel(context: Callable[[], Any]) -> Callable[..., Any]:
    """The compiled ``select_topk`` from the backend's build cache."""
    return context().kernel("select_topk", {"rev": REV, "passes": list(_PASSES)}, build_select,
                            "select_topk")
