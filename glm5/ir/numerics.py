"""What a correct kernel may differ from the float64 oracle by: the error model of an op.

Every op's ``OpDef.error`` says, output by output, how far a correct implementation may sit
from the oracle ``r`` (the op's reference run in float64 on the same, upcast inputs). The bound
on ``|y - r|``, elementwise, is

    MARGIN * (u(out) * |r| + u(work) * mid)  +  LAMBDA * u(acc) * acc  +  step  +  floor

* ``u(d)`` is the unit roundoff of dtype ``d`` (half an ulp at 1): 2^-8 bf16, 2^-11 fp16,
  2^-24 fp32, 2^-53 fp64.
* ``out`` is the output's own dtype: its final rounding. An fp32 output computed from bf16
  inputs gets fp32 slack (the inputs are exact; only the arithmetic rounds).
* ``work`` is the dtype the kernel was called with (the op's dispatch dtype). ``mid`` is the
  magnitude of the values a correct kernel may round to it between stages, propagated to the
  output, as the op's model says (P before P·V in attention, the normalised value before the
  weight in a norm, the activation between an expert's two GEMMs). A stage the contract keeps
  in fp32 has no ``mid`` term.
* ``acc`` is float32 (float64 for a float64 call): the arithmetic inside. A sum of ``n`` terms
  contributes ``sqrt(n) * sum|terms|``: the probabilistic bound of Higham & Mary (SIAM J. Sci.
  Comput. 41(5), 2019), ``lambda * sqrt(n) * u * sum|x_i y_i|``, which holds with probability
  at least ``1 - 2n exp(-lambda^2/2)`` for independent roundings and is what blocked GPU/CPU
  sums achieve; the worst case ``n * u`` is far too loose to catch a dropped key.
* ``step`` is absolute: quantization codes that may move by one step, i.e. codes whose
  quotient lies within the kernel's rounding error of a half (the oracle finds them).
* ``floor`` is a few subnormal spacings of the output and working dtypes (underflow) plus the
  smallest normal fp32 number (fp32 subnormals may be flushed to zero).

The ``out`` and ``mid`` terms count single roundings, each at most u relative to the value
rounded: worst cases, exact to first order. MARGIN = 1.25 covers the second-order part (a
rounding is relative to the computed value, not the exact one; products of (1 + delta)
factors) and no more: a bf16 norm may round twice (0.78%), and a kernel 1% off must fail.
LAMBDA = 6 is the probabilistic constant of the fp32 terms (library exp / log / rsqrt of one to
two ulps included): per element the failure probability of the sum bound is below 2n e^-18
(3e-8 n).

For integer outputs (indices, codes) ``step`` is the allowed difference in code units and the
other terms do not apply.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

MARGIN = 1.25
LAMBDA = 6.0
FLOOR_SPACINGS = 4.0


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half an ulp at 1 (eps / 2) of a floating dtype."""
    return torch.finfo(dtype).eps / 2.0


def acc_dtype(work: torch.dtype) -> torch.dtype:
    """The arithmetic a kernel called with ``work`` is held to: fp32, or fp64 for fp64."""
    return torch.float64 if work == torch.float64 else torch.float32


def subnormal_spacing(dtype: torch.dtype) -> float:
    fi = torch.finfo(dtype)
    return fi.smallest_normal * fi.eps


def floor(out: torch.dtype, work: torch.dtype) -> float:
    """The absolute slack every element gets: a few subnormal spacings of the output and
    working dtypes, and the fp32 arithmetic's smallest normal (GPUs and NPUs flush fp32
    subnormals to zero: silu(-100) = -3.7e-42 may come out as -0)."""
    acc = acc_dtype(work)
    return (FLOOR_SPACINGS * max(subnormal_spacing(out), subnormal_spacing(work))
            + torch.finfo(acc).smallest_normal)


Mag = torch.Tensor | float


@dataclass
class ErrorTerms:
    """The error sources of one output, as float64 magnitudes broadcastable to the output
    (see the module docstring for how they become a bound)."""

    mid: Mag = 0.0
    acc: Mag = 0.0
    step: Mag = 0.0
    # Roundings to the working dtype that may land below its normal range, each off by up to
    # half a subnormal spacing, weighted by what multiplies them afterwards (|up| for silu(gate)
    # before the product): MARGIN * spacing(work) / 2 * tiny.
    tiny: Mag = 0.0

    def __add__(self, other: "ErrorTerms") -> "ErrorTerms":
        return ErrorTerms(self.mid + other.mid, self.acc + other.acc, self.step + other.step,
                          self.tiny + other.tiny)

    def scale(self, f: Mag) -> "ErrorTerms":
        return ErrorTerms(self.mid * f, self.acc * f, self.step * f, self.tiny * f)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "ErrorTerms":
        """Apply a linear map with non-negative coefficients (|W| @, a sum, a gather) to each
        term (a zero term stays zero; others arrive as tensors, to be broadcast by ``fn``)."""
        return ErrorTerms(*(0.0 if _zero(x) else fn(_t(x))
                            for x in (self.mid, self.acc, self.step, self.tiny)))

    def absolute(self, work: torch.dtype) -> torch.Tensor | float:
        """The terms as an absolute bound (without the output's own rounding and the floor):
        what a later stage sees as the error of its input."""
        return (MARGIN * (unit_roundoff(work) * self.mid
                          + subnormal_spacing(work) / 2.0 * self.tiny)
                + LAMBDA * unit_roundoff(acc_dtype(work)) * self.acc + self.step)


def _zero(x: Mag) -> bool:
    return not isinstance(x, torch.Tensor) and float(x) == 0.0


def _t(x: Mag) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.tensor(float(x), dtype=torch.float64)


def bound(ref: torch.Tensor, terms: ErrorTerms, out: torch.dtype,
          work: torch.dtype) -> torch.Tensor:
    """The elementwise bound on |y - ref| for an output of dtype ``out`` of a kernel called
    with ``work`` (float64 tensor shaped like ``ref``)."""
    r = ref.to(torch.float64).abs()
    b = (MARGIN * unit_roundoff(out) * r + terms.absolute(work) + floor(out, work))
    return torch.broadcast_to(_t(b), ref.shape).to(torch.float64)


def describe(terms_doc: str, out: torch.dtype, work: torch.dtype) -> str:
    """One line: the numbers of the bound formula for (out, work) and the op's terms."""
    return (f"{MARGIN:g}*({unit_roundoff(out):.3g}*|r| + {unit_roundoff(work):.3g}*mid) + "
            f"{LAMBDA:g}*{unit_roundoff(acc_dtype(work)):.3g}*acc + step; {terms_doc}")


# --------------------------------------------------------------------------- building blocks
def sqrt_n(n: int) -> float:
    return math.sqrt(max(int(n), 1))


def abs_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|x| @ |w|^T: the magnitude of x @ w^T's terms."""
    return x.abs() @ w.abs().transpose(-1, -2)


def linear_error(x: torch.Tensor, ex: ErrorTerms, w: torch.Tensor, y: torch.Tensor,
                 rounded: bool = True) -> ErrorTerms:
    """Error of ``y = x @ w^T`` (float64 values) given the error ``ex`` of ``x``: the input's
    error through |w|, fp32 accumulation over K, and (``rounded``) a rounding of y to the
    working dtype, as an unfused implementation stores it."""
    K = x.shape[-1]
    wa = w.abs().transpose(-1, -2)
    own = ErrorTerms(mid=y.abs() if rounded else 0.0, acc=sqrt_n(K) * (x.abs() @ wa),
                     tiny=1.0 if rounded else 0.0)
    w2 = w.pow(2).transpose(-1, -2)
    return carry(ex, x.shape, lambda e: e @ wa, lambda e2: e2 @ w2) + own


def carry(ex: ErrorTerms, shape: torch.Size, through_abs: Callable[[torch.Tensor], torch.Tensor],
          through_sq: Callable[[torch.Tensor], torch.Tensor]) -> ErrorTerms:
    """The error ``ex`` of an input (shaped ``shape``) carried through a linear map that sums
    over it: ``through_abs(e)`` applies |W| (the worst case, every error aligned with W's
    signs), ``through_sq(e2)`` applies W^2. The errors of different elements come from
    independent roundings: by Hoeffding's inequality their weighted sum exceeds LAMBDA *
    sqrt(sum W^2 b^2) with probability below 2 exp(-LAMBDA^2 / 2) (the Higham & Mary model
    again), which for a K-term sum is up to sqrt(K) / LAMBDA times tighter. The smaller of the
    two is kept. ``acc`` terms are already the scale of a random error (the bound applies
    LAMBDA once): they carry in plain quadrature."""

    def f(e: torch.Tensor, lam: float) -> torch.Tensor:
        e = torch.broadcast_to(e, shape)
        return torch.minimum(through_abs(e), lam * torch.sqrt(through_sq(e * e)))

    def g(x: Mag, lam: float) -> Mag:
        return 0.0 if _zero(x) else f(_t(x), lam)

    return ErrorTerms(mid=g(ex.mid, LAMBDA), acc=g(ex.acc, 1.0), step=g(ex.step, LAMBDA),
                      tiny=g(ex.tiny, LAMBDA))


def no_error() -> ErrorTerms:
    """The error of an exact input."""
    return ErrorTerms()


def rms_norm_error(x: torch.Tensor, ex: ErrorTerms, g: torch.Tensor, eps: float,
                   y: torch.Tensor) -> ErrorTerms:
    """Error of ``y = x * rsqrt(mean(x^2) + eps) * g`` over the last dim given the error of x:
    d n_i = r dx_i - n_i r (sum_j n_j dx_j) / D; plus the fp32 mean over D, the rsqrt and two
    products, and one rounding of x * r to the working dtype before the weight."""
    D = x.shape[-1]
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    n = x * r
    ga = g.abs()

    def through(e: torch.Tensor) -> torch.Tensor:
        e = torch.broadcast_to(e, x.shape)
        return ga * (r * e + n.abs() * r * (n.abs() * e).mean(-1, keepdim=True))

    own = ErrorTerms(mid=y.abs(), acc=(sqrt_n(D) + 4.0) * y.abs(),
                     tiny=torch.broadcast_to(ga, y.shape))
    return ex.map(through) + own


def rope_magnitude(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
                   rope: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, Callable]:
    """(|x1 c| + |x2 s| per output element, the map of an input error through the rotation)."""
    zc, zs = torch.zeros_like(cos), torch.zeros_like(sin)

    def through(e: torch.Tensor) -> torch.Tensor:
        e = torch.broadcast_to(e, x.shape)
        return rope(e, cos.abs(), zs, interleaved) + rope(e, zc, sin.abs(), interleaved).abs()

    return through(x.abs()), through


def rope_error(x: torch.Tensor, ex: ErrorTerms, cos: torch.Tensor, sin: torch.Tensor,
               interleaved: bool, rope: Callable[..., torch.Tensor]) -> ErrorTerms:
    """Error of a rotation: the input error through |cos|, |sin|; two products (each may be
    rounded to the working dtype) and a sum in fp32."""
    m, through = rope_magnitude(x, cos, sin, interleaved, rope)
    return ex.map(through) + ErrorTerms(mid=m, acc=2.0 * m, tiny=2.0)


def silu_mul_error(a: torch.Tensor, b: torch.Tensor, ea: ErrorTerms, eb: ErrorTerms,
                   rounded: bool = True) -> ErrorTerms:
    """Error of ``silu(a) * b``: |silu'(a)| ea |b| + |silu(a)| eb; exp, add, divide and multiply
    in fp32; silu(a) may be rounded to the working dtype before the product (``rounded``)."""
    sig = torch.sigmoid(a)
    silu = a * sig
    dsilu = (sig * (1.0 + a * (1.0 - sig))).abs()
    y = (silu * b).abs()
    return (ea.map(lambda e: dsilu * b.abs() * e) + eb.map(lambda e: silu.abs() * e)
            + ErrorTerms(mid=y if rounded else 0.0, acc=4.0 * y,
                         tiny=b.abs() if rounded else 0.0))


def fragile_codes(q: torch.Tensor, window: torch.Tensor | float,
                  determined: torch.Tensor | bool = False) -> torch.Tensor:
    """Codes ``round(q)`` that a perturbation of the quotient by ``window`` (code units) may
    move: the distance of |q| to the nearest half is within the window. ``determined`` marks
    quotients every implementation computes exactly (an exact input over a power-of-two scale:
    division and multiplication by the reciprocal are both exact): an exact half there must
    round to even, so it is not fragile."""
    frac = q.abs() - q.abs().floor()
    dist = (frac - 0.5).abs()
    return (dist <= window) & ~((dist == 0) & torch.as_tensor(determined))


def power_of_two(s: torch.Tensor) -> torch.Tensor:
    """Positive finite values that are exact powers of two."""
    m, _ = torch.frexp(s)
    return (s > 0) & torch.isfinite(s) & (m == 0.5)


QUOTIENT_ULPS = 8.0  # x / s with an approximate division (GPU div.full: 2 ulp) and an s that
#                      is itself off by 2 ulp: the quotient moves by up to ~8 u relative.


@dataclass(frozen=True)
class SelectionRows:
    """What a selection op's rule hands the kit to judge a kernel's indices.

    ``scores`` [T, S] float64: the oracle's score of every candidate (-inf: not selectable);
    ``terms``: the ErrorTerms of those scores (their uncertainty in a correct kernel);
    ``k``: entries per row; ``exact`` [T] bool: rows where no two candidates are closer than
    their uncertainty unless their inputs are identical, so the result must equal the
    reference's exactly (ties to the smaller index); ``problems``: extra failures the rule
    found (row, message); ``expected``: dense outputs recomputed for the kernel's own indices
    (e.g. routing weights), judged against their own error terms.
    """

    scores: torch.Tensor
    terms: ErrorTerms
    k: int
    exact: torch.Tensor
    problems: tuple[tuple[int, str], ...] = ()
    expected: dict[str, Any] = field(default_factory=dict)
    score_dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class Selection:
    """How the kit judges a selection op (on its OpDef): ``index_output`` names the output that
    holds the indices; ``rows(o, got, work)`` builds the SelectionRows from the float64 inputs
    ``o`` and the kernel's outputs ``got`` (a dict by output name)."""

    index_output: str
    rows: Callable[[dict[str, Any], dict[str, torch.Tensor], torch.dtype], SelectionRows]
    doc: str = ""


def near_ties(scores: torch.Tensor, bnd: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[T] bool: rows holding two selectable candidates whose scores lie within twice the row's
    largest bound of each other while their input keys differ (``keys`` [T, S, ...] compared
    exactly): there a correct kernel's rounding may order them either way. Neighbours in score
    order suffice: any such pair has a neighbouring pair at most as far apart with differing
    keys."""
    T, S = scores.shape
    kk = keys.reshape(T, S, -1)
    ok = torch.isfinite(scores)
    s = scores.masked_fill(~ok, float("-inf"))
    order = torch.argsort(s, dim=-1)
    ss = torch.gather(s, 1, order)
    ko = torch.gather(kk, 1, order[..., None].expand_as(kk))
    oko = torch.gather(ok, 1, order)
    tie = 2.0 * bnd.masked_fill(~ok, 0.0).amax(-1, keepdim=True)
    close = (ss[:, 1:] - ss[:, :-1]) <= tie
    differ = (ko[:, 1:] != ko[:, :-1]).any(-1)
    both = oko[:, 1:] & oko[:, :-1]
    return (close & differ & both).any(-1)
