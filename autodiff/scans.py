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
#     cumprod of x with its zeros replaced by 1, n_j the number of zeros among x_0..x_j, f the
#     position of the first zero and S_j = sum_{k <= j, x_k != 0} t_k / x_k:
#       n_j = 0:  d out_j = C_j S_j
#       n_j = 1:  d out_j = C_j (t_f + x_f S_j)     (x_f S_j is 0, but its derivative is not)
#       n_j > 1:  d out_j = 0
#     A linear map of t built from cumsums and masks (no branch on the data), O(n) like the op;
#     the vjp is its transpose, with reverse cumsums. Keeping x_f (rather than its value 0)
#     makes second derivatives right at a single zero; at two or more zeros in one scan the
#     second derivative misses the x_f1 x_f2 terms (torch's cumprod_backward has the same
#     limit).
def _cumprod_parts(x, dim):
    z = x == 0
    xs = torch.where(z, torch.ones_like(x), x)
    C = xs.cumprod(dim)
    nz = z.to(torch.int32).cumsum(dim)
    m0, m1 = nz == 0, nz == 1
    first = z & m1
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    xf = torch.where(first, x, zero).cumsum(dim)  # x_f from f on (a differentiable 0)
    return z, xs, C, m0, m1, first, xf


@register_jvp_rule(aten.cumprod.default)
def cumprod_jvp_rule(primals, tangents, kwargs):
    """Note [cumprod with zeros]"""
    out = aten.cumprod.default(*primals, **kwargs)
    t = tangents[0]
    if t is None:
        return out, None
    x, dim = _scan_args(primals, kwargs)
    t = t.to(out.dtype)
    if x.dim() == 0:
        return out, t
    z, xs, C, m0, m1, first, xf = _cumprod_parts(x, dim)
    zero = torch.zeros((), dtype=out.dtype, device=out.device)
    S = torch.where(z, zero, t / xs).cumsum(dim)
    tf_ = torch.where(first, t, zero).cumsum(dim)
    d = torch.where(m0, C * S, zero) + torch.where(m1, C * (tf_ + xf * S), zero)
    return out, d


@register_vjp_rule(aten.cumprod.default)
def cumprod_vjp_rule(ct, primals, kwargs, out, needs):
    x, dim = _scan_args(primals, kwargs)
    rest = (None,) * (len(primals) - 1)
    if x.dim() == 0:
        return (ct.to(primals[0].dtype),) + rest
    z, xs, C, m0, m1, first, xf = _cumprod_parts(x, dim)
    zero = torch.zeros((), dtype=ct.dtype, device=ct.device)
    cC = ct * conj_if_complex(C)
    # transpose of t -> m0 C S + m1 C (t_f + x_f S), term by term
    via_s = torch.where(m0, cC, zero) + torch.where(m1, cC * conj_if_complex(xf), zero)
    g = torch.where(z, zero, _rev_cumsum(via_s, dim) / conj_if_complex(xs))
    g = g + torch.where(first, _rev_cumsum(torch.where(m1, cC, zero), dim), zero)
    return (g.to(primals[0].dtype),) + rest


def _logcumsumexp_weights(x, dim):
    """e = exp(x - max), S = cumsum(e): d out_j = sum_{k <= j} e_k t_k / S_j (torch's jvp; as
    torch, complex inputs are not shifted: max is not defined for them, and shifting by the
    largest real part underflows where torch's unshifted sum does not)."""
    e = x.exp() if x.is_complex() else (x - x.amax(dim, keepdim=True)).exp()
    return e, e.cumsum(dim)


@register_jvp_rule(aten.logcumsumexp.default)
def logcumsumexp_jvp_rule(primals, tangents, kwargs):
    x, dim = primals
    out = aten.logcumsumexp.default(x, dim)
    t = tangents[0]
    if t is None:
        return out, None
    if x.dim() == 0:
        return out, t
    e, S = _logcumsumexp_weights(x, dim)
    return out, (e * t).cumsum(dim) / S


@register_vjp_rule(aten.logcumsumexp.default)
def logcumsumexp_vjp_rule(ct, primals, kwargs, out, needs):
    x, dim = primals
    if x.dim() == 0:
        return ct, None
    if x.is_complex():
        # in log space, as torch: sum_{j >= k} conj(ct_j) exp(x_k - out_j) without overflow
        log_ct = torch.log(conj_if_complex(ct))
        rev = aten.logcumsumexp.default((log_ct - out).flip(dim), dim).flip(dim)
        return conj_if_complex((rev + x).exp()), None
    e, S = _logcumsumexp_weights(x, dim)
    return e * _rev_cumsum(ct / S, dim), None


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
