"""Derivative rules of scans along a dim: cumsum (linear: its transpose is the reversed cumsum),
cumprod, logcumsumexp, cummax and cummin. Each jvp is written as a linear map of the tangent in
cumsums and masks, and each vjp is that map's transpose (reverse cumsums), so both are made of
ordinary differentiable, batchable ops, with no branch on the data (the rules run under vmap)."""

from __future__ import annotations

import torch

from ._registry import register_jvp_rule, register_vjp_rule
from ._util import conj_if_complex
from .views import def_linear

aten = torch.ops.aten


def _rev_cumsum(v, dim):
    return v.flip(dim).cumsum(dim).flip(dim)


def _scan_args(primals, kwargs):
    x, dim = primals[0], primals[1]
    dtype = primals[2] if len(primals) > 2 else kwargs.get("dtype")
    if dtype is not None:
        x = x.to(dtype)
    return x, dim


# Note [cumprod with zeros]
#     out_j = prod_{k <= j} x_k, so d out_j = sum_{k <= j} t_k prod_{i <= j, i != k} x_i. With C the
#     cumprod of x with its zeros replaced by 1, n_j the number of zeros among x_0..x_j, f1 and f2
#     the positions of the first two zeros and S_j = sum_{k <= j, x_k != 0} t_k / x_k:
#       n_j = 0:  d out_j = C_j S_j
#       n_j = 1:  d out_j = C_j (t_f1 + x_f1 S_j)                          (x_f1 S_j is 0)
#       n_j = 2:  d out_j = C_j (t_f1 x_f2 + x_f1 t_f2 + x_f1 x_f2 S_j)    (all 0)
#       n_j > 2:  d out_j = 0
#     A linear map of t built from cumsums and masks (no branch on the data), O(n) like the op;
#     the vjp is its transpose, with reverse cumsums. The terms that are 0 keep the zeros x_f as
#     differentiable values, so that their derivatives are right: second derivatives are exact
#     at any number of zeros (d2 out_j / dx_f1 dx_f2 = C_j, as torch's). A third derivative
#     with three zeros in one scan would need an n_j = 3 term: not kept (it costs every call).
_HALF = (torch.float16, torch.bfloat16)


def _cumprod_parts(x, dim):
    z = x == 0
    xs = torch.where(z, torch.ones_like(x), x)
    C = xs.cumprod(dim)
    nz = z.to(torch.int32).cumsum(dim)
    m = (nz == 0, nz == 1, nz == 2)
    firsts = (z & m[1], z & m[2])  # the first and second zero
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    # x_f1, x_f2 from their position on (differentiable zeros)
    xf = tuple(torch.where(f, x, zero).cumsum(dim) for f in firsts)
    return z, xs, C, m, firsts, xf


@register_jvp_rule(aten.cumprod.default)
def cumprod_jvp_rule(primals, tangents, kwargs):
    """Note [cumprod with zeros]"""
    out = aten.cumprod.default(*primals, **kwargs)
    t = tangents[0]
    if t is None:
        return out, None
    x, dim = _scan_args(primals, kwargs)
    t = t.to(out.dtype)
    if x.dim() == 0 or x.shape[dim] == 1:  # out is x (t / x * x underflows at tiny x)
        return out, t
    half = out.dtype in _HALF  # in float32, as torch's kernels: t / x and C * S underflow
    x, t = (x.float(), t.float()) if half else (x, t)
    z, xs, C, (m0, m1, m2), firsts, (xf1, xf2) = _cumprod_parts(x, dim)
    zero = torch.zeros((), dtype=x.dtype, device=out.device)
    S = torch.where(z, zero, t / xs).cumsum(dim)
    tf1, tf2 = (torch.where(f, t, zero).cumsum(dim) for f in firsts)
    d = (
        torch.where(m0, C * S, zero)
        + torch.where(m1, C * (tf1 + xf1 * S), zero)
        + torch.where(m2, C * (tf1 * xf2 + xf1 * tf2 + xf1 * xf2 * S), zero)
    )
    return out, d.to(out.dtype) if half else d


@register_vjp_rule(aten.cumprod.default)
def cumprod_vjp_rule(ct, primals, kwargs, out, needs):
    x, dim = _scan_args(primals, kwargs)
    rest = (None,) * (len(primals) - 1)
    if x.dim() == 0 or x.shape[dim] == 1:  # out is x (ct * x / x underflows at tiny x)
        return (ct.to(primals[0].dtype),) + rest
    if x.dtype in _HALF:  # in float32, as torch's kernels: ct * C underflows in float16
        x, ct = x.float(), ct.float()
    z, xs, C, (m0, m1, m2), (first, second), (xf1, xf2) = _cumprod_parts(x, dim)
    zero = torch.zeros((), dtype=ct.dtype, device=ct.device)
    cC = ct * conj_if_complex(C)
    c1, c2 = conj_if_complex(xf1), conj_if_complex(xf2)
    # transpose of the jvp's map, term by term: through S, then t_f1, then t_f2
    via_s = torch.where(m0, cC, zero) + torch.where(m1, cC * c1, zero)
    via_s = via_s + torch.where(m2, cC * c1 * c2, zero)
    g = torch.where(z, zero, _rev_cumsum(via_s, dim) / conj_if_complex(xs))
    via_f1 = torch.where(m1, cC, zero) + torch.where(m2, cC * c2, zero)
    g = g + torch.where(first, _rev_cumsum(via_f1, dim), zero)
    g = g + torch.where(second, _rev_cumsum(torch.where(m2, cC * c1, zero), dim), zero)
    return (g.to(primals[0].dtype),) + rest


# Note [logcumsumexp derivatives]
#     d out_j = sum_{k <= j} exp(x_k - out_j) t_k. Weights from one global shift,
#     exp(x - max) / cumsum(exp(x - max)), underflow to 0 / 0 once x spans more than ~709
#     (float64; ~88 in float32: a -100 mask is enough), and torch's log-space formula is not
#     linear in t (its derivative in the cotangent is lost where the cotangent is 0). Instead
#     the tangent is the linear recurrence D_j = a_j D_{j-1} + exp(x_j - out_j) t_j with
#     a_j = exp(out_{j-1} - out_j) in [0, 1] (out never decreases), solved by a parallel prefix
#     scan: every factor is at most 1, so nothing overflows, and the result is exactly linear in
#     t. The vjp is its transpose, the same scan run backwards. log2(n) rounds of elementwise
#     ops, no branch on the data (batches under vmap, differentiates again).
def _exp_diff(u, v):
    """exp(u - v), 0 where v = -inf (a prefix of -inf: no derivative flows, and no NaN from
    -inf - -inf in this rule or in its own derivatives)."""
    dead = torch.isneginf(v.real if v.is_complex() else v)
    return torch.where(dead, 0, torch.where(dead, 0, u - v).exp())


def _shift(v, n, dim, fill):
    """v moved n places forward along dim, the first n entries filled with ``fill``."""
    pad = torch.full_like(v.narrow(dim, 0, n), fill)
    return torch.cat([pad, v.narrow(dim, 0, v.shape[dim] - n)], dim)


def _linear_scan(a, b, dim):
    """y_j = a_j y_{j-1} + b_j (y_{-1} = 0) along dim, by Hillis-Steele doubling."""
    n, step = b.shape[dim], 1
    while step < n:
        b = b + a * _shift(b, step, dim, 0)
        a = a * _shift(a, step, dim, 1)
        step *= 2
    return b


def _logcumsumexp_coefficients(x, out, dim):
    """(a, w): a_j = exp(out_{j-1} - out_j) (a_0 = 0) and w_j = exp(x_j - out_j)."""
    prev = _shift(out, 1, dim, float("-inf"))
    return _exp_diff(prev, out), _exp_diff(x, out)


@register_jvp_rule(aten.logcumsumexp.default)
def logcumsumexp_jvp_rule(primals, tangents, kwargs):
    """Note [logcumsumexp derivatives]"""
    x, dim = primals
    out = aten.logcumsumexp.default(x, dim)
    t = tangents[0]
    if t is None:
        return out, None
    if x.dim() == 0 or x.shape[dim] == 0:
        return out, t
    a, w = _logcumsumexp_coefficients(x, out, dim)
    return out, _linear_scan(a, w * t, dim)


@register_vjp_rule(aten.logcumsumexp.default)
def logcumsumexp_vjp_rule(ct, primals, kwargs, out, needs):
    """The transpose of the jvp's scan: g_k = conj(w_k) E_k, E_k = ct_k + conj(a_{k+1}) E_{k+1}."""
    x, dim = primals
    if x.dim() == 0 or x.shape[dim] == 0:
        return ct, None
    a, w = _logcumsumexp_coefficients(x, out, dim)
    a_next = torch.cat(
        [a.narrow(dim, 1, a.shape[dim] - 1), torch.zeros_like(a.narrow(dim, 0, 1))], dim
    )
    E = _linear_scan(conj_if_complex(a_next).flip(dim), ct.flip(dim), dim).flip(dim)
    return conj_if_complex(w) * E, None


def def_cumext(op):
    """``(values, indices) = op(x, dim)`` with values = x gathered at indices."""

    def cumext_jvp_rule(primals, tangents, kwargs):
        x, dim = primals
        out = op(x, dim)
        t = tangents[0]
        if t is None:
            return out, None
        return out, (t if x.dim() == 0 else t.gather(dim, out[1]), None)

    def cumext_vjp_rule(cts, primals, kwargs, out, needs):
        x, dim = primals
        ct = cts[0]
        if ct is None or x.dim() == 0:
            return ct, None
        g = torch.zeros(x.shape, dtype=ct.dtype, device=ct.device)
        return g.scatter_add(dim, out[1], ct), None

    register_jvp_rule(op)(cumext_jvp_rule)
    register_vjp_rule(op)(cumext_vjp_rule)


def_cumext(aten.cummax.default)
def_cumext(aten.cummin.default)


def _cumsum_transpose(ct, dim):
    if ct.dim() == 0:  # a 0-d cumsum is the identity (and flip of a 0-d batched value is not)
        return ct
    return ct.flip(dim).cumsum(dim).flip(dim)


def_linear(aten.cumsum.default, lambda ct, x, dim, **k: _cumsum_transpose(ct, dim))
