"""Derivative rules of reductions: the vjp broadcasts the cotangent back over the reduced dims."""

from __future__ import annotations

import math

import torch

from ._registry import register_jvp_rule, register_vjp_rule
from ._util import logsumexp_jvp

aten = torch.ops.aten


def _dims(x, dim):
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(x.dim()))
    if isinstance(dim, int):
        dim = [dim]
    return sorted(d % max(x.dim(), 1) for d in dim)


def _keep(ct, x, dim, keepdim):
    """Reinsert the reduced dims of ``ct`` as size 1, so it broadcasts against ``x``."""
    if keepdim or x.dim() == 0:
        return ct
    for d in _dims(x, dim):
        ct = ct.unsqueeze(d)
    return ct


def _count(x, dim):
    n = 1
    for d in _dims(x, dim):
        n *= x.shape[d] if x.dim() else 1
    return n


def _args(primals, kwargs, pos=1):
    """(x, dim, keepdim) of ``op(x, [ord,] dim=None, keepdim=False, ...)``; keepdim may be a
    keyword (var.correction, std.correction)."""
    x = primals[0]
    dim = primals[pos] if len(primals) > pos else kwargs.get("dim")
    keepdim = primals[pos + 1] if len(primals) > pos + 1 else kwargs.get("keepdim", False)
    return x, dim, keepdim


# sum / mean: linear ---------------------------------------------------------------------------
def def_sum(op, mean):
    def sum_jvp_rule(primals, tangents, kwargs):
        out = op(*primals, **kwargs)
        t = tangents[0]
        return out, None if t is None else op(t, *primals[1:], **kwargs)

    def sum_vjp_rule(ct, primals, kwargs, out, needs):
        x, dim, keepdim = _args(primals, kwargs)
        g = _keep(ct, x, dim, keepdim).expand(x.shape)
        if mean:  # after the expand, as torch: a gradient the caller may write into in place
            g = g / _count(x, dim)
        return (g,) + (None,) * (len(primals) - 1)

    register_jvp_rule(op)(sum_jvp_rule)
    register_vjp_rule(op)(sum_vjp_rule)


def_sum(aten.sum.dim_IntList, mean=False)
def_sum(aten.sum.default, mean=False)
def_sum(aten.mean.dim, mean=True)
def_sum(aten.mean.default, mean=True)


# the rest: d out = sum over dims of w(x, out) * dx, with w defined once ---------------------
def def_weighted(op, weight, pos=1, jvp=None):
    """``out = op(x, dim, keepdim)`` whose derivative is ``sum(weight(x, out_keep, dim) * t)``
    (``jvp(x, t, dims, keepdim)``: torch's own forward formula, where it is not that sum)."""

    def weighted_jvp_rule(primals, tangents, kwargs):
        out = op(*primals, **kwargs)
        t = tangents[0]
        if t is None:
            return out, None
        x, dim, keepdim = _args(primals, kwargs, pos)
        if jvp is not None and not x.is_complex():  # amax is real-only: weights for complex
            return out, jvp(x, t, _dims(x, dim), keepdim)
        o = out[0] if isinstance(out, tuple) else out
        w = weight(x, _keep(o, x, dim, keepdim), dim, primals, kwargs)
        dt = (w * t).sum(_dims(x, dim), keepdim=keepdim) if x.dim() else w * t
        if isinstance(out, tuple):
            return out, (dt,) + (None,) * (len(out) - 1)
        return out, dt

    def weighted_vjp_rule(ct, primals, kwargs, out, needs):
        x, dim, keepdim = _args(primals, kwargs, pos)
        if isinstance(out, tuple):
            ct, out = ct[0], out[0]
            if ct is None:
                return (None,) * len(primals)
        w = weight(x, _keep(out, x, dim, keepdim), dim, primals, kwargs)
        return (_keep(ct, x, dim, keepdim) * w.conj(),) + (None,) * (len(primals) - 1)

    register_jvp_rule(op)(weighted_jvp_rule)
    register_vjp_rule(op)(weighted_vjp_rule)


def _argext_weight(x, o, dim, primals, kwargs):
    """max/min: the derivative is shared evenly by the tied extreme elements."""
    mask = (x == o).to(x.dtype)
    return mask / mask.sum(_dims(x, dim), keepdim=True)


def _logsumexp_weight(x, o, dim, primals, kwargs):
    return torch.exp(x - o)


def _prod_weight(x, o, dim, primals, kwargs):
    # d prod / dx_i = prod_{j != i} x_j; written without dividing by x_i so zeros are fine
    d = _dims(x, dim)[0] if x.dim() else 0
    if x.dim() == 0 or x.shape[d] == 0:  # (an empty product: no element to weigh)
        return torch.ones_like(x)
    ones = torch.ones_like(x.narrow(d, 0, 1))
    left = torch.cat([ones, x.narrow(d, 0, x.shape[d] - 1)], d).cumprod(d)
    right = torch.cat([x.narrow(d, 1, x.shape[d] - 1), ones], d).flip(d).cumprod(d).flip(d)
    return left * right


def _var_weight(x, o, dim, primals, kwargs, std=False):
    c = kwargs.get("correction")
    c = 1 if c is None else c
    n = _count(x, dim)
    centered = x - x.mean(_dims(x, dim), keepdim=True)
    if centered.is_complex():  # d|z - m|^2 = 2 Re(conj(z - m) dz)
        centered = torch.conj_physical(centered)
    dof = n - c
    if dof <= 0 and (dim is None or x.dim() == 0):
        # torch's var_backward without a dim: 2 / 0 times (x - mean) as constants, inf * 0 = nan
        # (a constant: its own derivative is 0, where differentiating 2 (x - mean) / 0 gives nan)
        real = centered.real if centered.is_complex() else centered
        w = torch.where(real == 0, torch.full_like(real, math.nan), torch.full_like(real, math.inf))
    else:
        w = 2 * centered / dof  # with a dim and dof < 0, torch's 2 / dof too (negative)
    if not std:
        return w
    w = w / (2 * o)
    # torch masks d std where std = 0 (constant input): the zero subgradient, not 0/0
    return torch.where(o == 0, torch.zeros_like(w), w)


def _norm_weight(x, o, dim, primals, kwargs):
    """d ||x||_p / dx = sgn(x) |x|^(p-1) / ||x||^(p-1); p = 2 gives x / ||x||."""
    p = primals[1] if len(primals) > 1 else 2
    if p == 0:  # piecewise constant
        return torch.zeros_like(x)
    # at a zero norm torch picks the zero subgradient: divide by 1 there (x is 0 too)
    safe = torch.where(o == 0, torch.ones_like(o), o)
    if p == 2:
        # masked, not only divided by 1: x / 1 would make the second derivative at 0 the
        # identity, where torch's (x / norm).masked_fill(norm == 0, 0) gives 0
        # Note [No lazy conjugate inside wrappers]
        w = torch.conj_physical(x / safe) if x.is_complex() else x / safe
        return torch.where(o == 0, torch.zeros_like(w), w)
    s = torch.conj_physical(x.sgn()) if x.is_complex() else x.sgn()  # d|z| = Re(conj(sgn z) dz)
    if p == float("inf") or p == -float("inf"):
        return _argext_weight(x.abs(), o, dim, primals, kwargs) * s
    w = s * x.abs().pow(p - 1) / safe.pow(p - 1)
    return torch.where((o == 0) | (x == 0), torch.zeros_like(w), w)  # |0|^(p-1) is inf for p < 1


def_weighted(aten.amax.default, _argext_weight)
def_weighted(aten.amin.default, _argext_weight)
def_weighted(aten.logsumexp.default, _logsumexp_weight, jvp=logsumexp_jvp)
def_weighted(aten.var.correction, _var_weight)
def_weighted(aten.std.correction, lambda *a: _var_weight(*a, std=True))


def _full_max_weight(x, o, dim, primals, kwargs):
    mask = (x == o).to(x.dtype)
    return mask / mask.sum()


def def_full(op, weight):
    def full_jvp_rule(primals, tangents, kwargs):
        out = op(*primals, **kwargs)
        t = tangents[0]
        return out, None if t is None else (
            weight(primals[0], out, None, primals, kwargs) * t
        ).sum()

    def full_vjp_rule(ct, primals, kwargs, out, needs):
        return (ct * weight(primals[0], out, None, primals, kwargs).conj(),)

    register_jvp_rule(op)(full_jvp_rule)
    register_vjp_rule(op)(full_vjp_rule)


def_full(aten.max.default, _full_max_weight)
def_full(aten.min.default, _full_max_weight)
def_full(
    aten.prod.default,
    lambda x, o, *a: _prod_weight(x.reshape(-1), None, 0, (), {}).reshape(x.shape),
)


def _prod_dim_weight(x, o, dim, primals, kwargs):
    return _prod_weight(x, o, dim, primals, kwargs)


def_weighted(aten.prod.dim_int, _prod_dim_weight)


def def_selecting(op):
    """``(values, indices) = op(x, dim, keepdim)``: the derivative flows through the returned
    index only (ties are not split), as in torch."""

    def selecting_jvp_rule(primals, tangents, kwargs):
        out = op(*primals, **kwargs)
        t = tangents[0]
        if t is None:
            return out, None
        x, dim, keepdim = _args(primals, kwargs)
        if x.dim() == 0:
            return out, (t, None)
        idx = _keep(out[1], x, dim, keepdim)
        dt = t.gather(dim, idx)
        return out, (dt if keepdim else dt.squeeze(dim), None)

    def selecting_vjp_rule(cts, primals, kwargs, out, needs):
        x, dim, keepdim = _args(primals, kwargs)
        ct = cts[0]
        if ct is None:
            return (None,) * len(primals)
        if x.dim() == 0:
            return (ct,) + (None,) * (len(primals) - 1)
        idx = _keep(out[1], x, dim, keepdim)
        g = torch.zeros(x.shape, dtype=ct.dtype, device=ct.device).scatter(
            dim, idx, _keep(ct, x, dim, keepdim)
        )
        return (g,) + (None,) * (len(primals) - 1)

    register_jvp_rule(op)(selecting_jvp_rule)
    register_vjp_rule(op)(selecting_vjp_rule)


def_selecting(aten.max.dim)
def_selecting(aten.min.dim)
def_weighted(aten.linalg_vector_norm.default, _norm_weight, pos=2)


def def_moments(op, std):
    """``(var or std, mean) = op(x, dim, correction=, keepdim=)``: the two reductions at once."""

    def moments_jvp_rule(primals, tangents, kwargs):
        out = op(*primals, **kwargs)
        t = tangents[0]
        if t is None:
            return out, None
        x, dim, keepdim = _args(primals, kwargs)
        w = _var_weight(x, _keep(out[0], x, dim, keepdim), dim, primals, kwargs, std=std)
        dims = _dims(x, dim)
        return out, ((w * t).sum(dims, keepdim=keepdim), t.mean(dims, keepdim=keepdim))

    def moments_vjp_rule(cts, primals, kwargs, out, needs):
        x, dim, keepdim = _args(primals, kwargs)
        g = None
        if cts[0] is not None:
            w = _var_weight(x, _keep(out[0], x, dim, keepdim), dim, primals, kwargs, std=std)
            g = _keep(cts[0], x, dim, keepdim) * w.conj()
        if cts[1] is not None:
            gm = (_keep(cts[1], x, dim, keepdim) / _count(x, dim)).expand(x.shape)
            g = gm if g is None else g + gm
        return (g,) + (None,) * (len(primals) - 1)

    register_jvp_rule(op)(moments_jvp_rule)
    register_vjp_rule(op)(moments_vjp_rule)


def_moments(aten.var_mean.correction, std=False)
def_moments(aten.std_mean.correction, std=True)
