"""MLA preprocessing (MLAPO): the composite `mla_prolog`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glm5.ir.numerics import (
    ErrorTerms,
    carry,
    linear_error,
    rms_norm_error,
    rope_error,
    sqrt_n,
    no_error,
)
from glm5.ir.opdef import OpDef, check_index_range, require, value_checks
from glm5.ir.cost import tensor_bytes
from glm5.ir.ops_norm import acc_of, rms_norm_ref, rope_ref
from glm5.ir.signature import INDEX_DTYPES, OpInputError, OutArg, TensorArg, scalar


def _split_q(q: torch.Tensor, H: int, Dn: int) -> tuple[torch.Tensor, torch.Tensor]:
    q = q.reshape(q.shape[0], H, -1)
    return q[..., :Dn], q[..., Dn:]


def _write_cache(kv_cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    keep = slots >= 0
    kv_cache[slots[keep].long()] = rows[keep].to(kv_cache.dtype)


def mla_prolog_ref(x, w_qa, g_qa, w_qb, w_kva, g_kva, w_uk, cos, sin, eps, kv_cache, slots,
                   absorb):
    acc = acc_of(x)
    H, Dn, Rkv = w_uk.shape
    xf = x.to(acc)
    c_q = rms_norm_ref(F.linear(xf, w_qa.to(acc)), g_qa, eps)
    q_nope, q_pe = _split_q(F.linear(c_q, w_qb.to(acc)), H, Dn)
    q_pe = rope_ref(q_pe, cos, sin, True)
    q_main = torch.einsum("thd,hdc->thc", q_nope, w_uk.to(acc)) if absorb else q_nope
    kv = F.linear(xf, w_kva.to(acc))
    ckv = rms_norm_ref(kv[:, :Rkv], g_kva, eps)
    k_pe = rope_ref(kv[:, Rkv:], cos, sin, True)
    _write_cache(kv_cache, slots, torch.cat((ckv, k_pe), dim=-1))
    dt = x.dtype
    return q_main.to(dt).contiguous(), q_pe.to(dt).contiguous(), c_q.to(dt)


def mla_prolog_decompose(ops, x, w_qa, g_qa, w_qb, w_kva, g_kva, w_uk, cos, sin, eps, kv_cache,
                         slots, absorb):
    H, Dn, Rkv = w_uk.shape
    c_q = ops.rms_norm(F.linear(x, w_qa), g_qa, eps)
    q_nope, q_pe = _split_q(F.linear(c_q, w_qb), H, Dn)
    q_pe = ops.rope(q_pe, cos, sin, True)
    q_main = torch.einsum("thd,hdc->thc", q_nope, w_uk) if absorb else q_nope.contiguous()
    kv = F.linear(x, w_kva)
    ckv = ops.rms_norm(kv[:, :Rkv], g_kva, eps)
    k_pe = ops.rope(kv[:, Rkv:], cos, sin, True)
    with torch.no_grad():
        _write_cache(kv_cache, slots, torch.cat((ckv, k_pe), dim=-1).detach())
    # Contiguous outputs, as the contract, the reference and the fake (`OpDef.meta`) have it:
    # the absorbed einsum's q_main comes out [T, H, R] with strides (R, T * R, 1), which
    # inductor rejects against the fake's strides. (.contiguous() is a no-op when already so.)
    return q_main.contiguous(), q_pe.contiguous(), c_q.contiguous()


def mla_prolog_error(o, r, work):
    """The chain of the decomposition, each stage's error carried into the next: the three
    down/up projections are fp32 sums over their inputs (acc sqrt(n) |x||W|) whose results may
    be rounded to the working dtype (mid); the two RMS norms and the interleaved rope as in
    rms_norm / rope; the absorb product an fp32 sum over Dn. kv_cache: the written rows carry
    the latent norm's and k_pe's error, every other row must be untouched (no slack)."""
    x, eps = o["x"], o["eps"]
    H, Dn, Rkv = o["w_uk"].shape
    T = x.shape[0]
    cos, sin = o["cos"], o["sin"]
    a = F.linear(x, o["w_qa"])
    ea = linear_error(x, no_error(), o["w_qa"], a)
    c_q = rms_norm_ref(a, o["g_qa"], eps)
    ecq = rms_norm_error(a, ea, o["g_qa"], eps, c_q)
    qf = F.linear(c_q, o["w_qb"])
    eq = linear_error(c_q, ecq, o["w_qb"], qf)
    q_nope, q_pe = _split_q(qf, H, Dn)
    split = [eq.map(lambda e, j=j: _split_q(torch.broadcast_to(e, qf.shape), H, Dn)[j])
             for j in (0, 1)]
    eqpe = rope_error(q_pe, split[1], cos, sin, True, rope_ref)
    if o["absorb"]:
        wuk = o["w_uk"].abs()
        q_main = torch.einsum("thd,hdc->thc", q_nope, o["w_uk"])
        wuk2 = o["w_uk"].pow(2)
        eqm = carry(split[0], q_nope.shape, lambda e: torch.einsum("thd,hdc->thc", e, wuk),
                    lambda e2: torch.einsum("thd,hdc->thc", e2, wuk2)) + ErrorTerms(
            mid=q_main.abs(), acc=sqrt_n(Dn) * torch.einsum("thd,hdc->thc", q_nope.abs(), wuk))
    else:
        eqm = split[0]
    kv = F.linear(x, o["w_kva"])
    ekv = linear_error(x, no_error(), o["w_kva"], kv)
    ckv = rms_norm_ref(kv[:, :Rkv], o["g_kva"], eps)
    eckv = rms_norm_error(kv[:, :Rkv], ekv.map(lambda e: torch.broadcast_to(e, kv.shape)[:, :Rkv]),
                          o["g_kva"], eps, ckv)
    ekpe = rope_error(kv[:, Rkv:], ekv.map(lambda e: torch.broadcast_to(e, kv.shape)[:, Rkv:]),
                      cos, sin, True, rope_ref)
    cache = o["kv_cache"]
    slots = o["slots"].long()
    keep = slots >= 0

    def rows(e_latent: torch.Tensor, e_pe: torch.Tensor) -> torch.Tensor:
        full = torch.zeros(cache.shape, dtype=torch.float64)
        row = torch.cat((torch.broadcast_to(e_latent, (T, Rkv)),
                         torch.broadcast_to(e_pe, (T, cache.shape[1] - Rkv))), dim=-1)
        full[slots[keep]] = row[keep]
        return full

    ecache = ErrorTerms(*(rows(_f(getattr(eckv, f)), _f(getattr(ekpe, f)))
                          for f in ("mid", "acc", "step", "tiny")))
    return {"q_main": eqm, "q_pe": eqpe, "c_q": ecq, "kv_cache": ecache}


def _f(x):
    return x if isinstance(x, torch.Tensor) else torch.tensor(float(x), dtype=torch.float64)


def _prolog_check(a, s) -> None:
    op = "mla_prolog"
    require(s["Rkv"] == s["Rkv2"], op, "kv_cache",
            f"rows of Rkv+Dr={s['Rkv'] + s['Dr']} matching w_kva", list(a["kv_cache"].shape))
    require(s["Dr"] % 2 == 0, op, "cos", "an even rope dim Dr", s["Dr"])
    for name in ("w_qa", "w_qb", "w_kva", "w_uk"):
        require(a[name].dtype == a["x"].dtype, op, name, f"the dtype of x ({a['x'].dtype})",
                a[name].dtype)
    check_index_range(op, "slots", a["slots"], 0, s["N"], "(cache rows; -1 = skip)")
    sl = a["slots"]
    if sl.numel() and value_checks(sl):
        v = sl[sl >= 0]
        if v.numel() != torch.unique(v).numel():
            raise OpInputError(f"glm5.{op}: argument 'slots' expected distinct cache rows, "
                               f"got a repeated slot")


def _prolog_shape(s, a):
    return (s["T"], s["H"], s["Rkv"] if a["absorb"] else s["Dn"])


def _prolog_cost(a, s):
    T, D, Rq, H, Dn, Dr, Rkv = s["T"], s["D"], s["Rq"], s["H"], s["Dn"], s["Dr"], s["Rkv"]
    flops = 2.0 * T * (D * Rq + Rq * H * (Dn + Dr) + D * (Rkv + Dr))
    if a["absorb"]:
        flops += 2.0 * T * H * Dn * Rkv
    wb = (tensor_bytes(a["w_qa"], a["w_qb"], a["w_kva"])
          + (tensor_bytes(a["w_uk"]) if a["absorb"] else 0))
    esz = a["x"].element_size()
    out = T * H * ((Rkv if a["absorb"] else Dn) + Dr) * esz + T * Rq * esz
    return flops, wb + tensor_bytes(a["x"]) + out + T * (Rkv + Dr) * a["kv_cache"].element_size()


MLA_PROLOG = OpDef(
    name="mla_prolog",
    summary="MLA preprocessing: q/kv down-projections, norms, RoPE, absorb, cache write",
    params=(
        TensorArg("x", ("T", "D")),
        TensorArg("w_qa", ("Rq", "D")),
        TensorArg("g_qa", ("Rq",)),
        TensorArg("w_qb", ("H*(Dn+Dr)", "Rq")),
        TensorArg("w_kva", ("Rkv+Dr", "D")),
        TensorArg("g_kva", ("Rkv",)),
        TensorArg("w_uk", ("H", "Dn", "Rkv")),
        TensorArg("cos", ("T", "Dr/2")),
        TensorArg("sin", ("T", "Dr/2")),
        scalar("eps", float, minimum=0.0),
        TensorArg("kv_cache", ("N", "Rkv2+Dr")),
        TensorArg("slots", ("T",), INDEX_DTYPES),
        scalar("absorb", bool),
    ),
    outputs=(
        OutArg("q_main", _prolog_shape, "like:x"),
        OutArg("q_pe", ("T", "H", "Dr"), "like:x"),
        OutArg("c_q", ("T", "Rq"), "like:x"),
    ),
    reference=mla_prolog_ref,
    cost=_prolog_cost,
    error=mla_prolog_error,
    check=_prolog_check,
    decompose=mla_prolog_decompose,
    mutates=("kv_cache",),
    category="mla",
)

OPS = (MLA_PROLOG,)
