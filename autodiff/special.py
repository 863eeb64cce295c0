"""Derivative rules of the special functions and the remaining pointwise ops (copysign,
fmax/fmin, nextafter, frexp, div with rounding modes, polygamma, Bessel functions, erfcx,
log_ndtr, ndtri), as table rows of the elementwise helpers. Each formula is torch's
(derivatives.yaml), in torch's order, so float32 results round as torch's do (Note [Rounding as
torch], autodiff/elementwise.py)."""

from __future__ import annotations

import math

import torch

from ._registry import register_jvp_rule, register_vjp_rule
from .elementwise import def_binary, def_unary, pullback

aten = torch.ops.aten

_SQRT_2PI = math.sqrt(2 * math.pi)
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)


def _safe_bessel_x(x):
    """x, with |x| <= eps replaced by eps: the i1 / i1e formulas divide by x; their limit at 0
    is 1/2 (torch's i1_backward does the same)."""
    eps = torch.finfo(x.dtype).eps
    tiny = x.abs() <= eps
    return torch.where(tiny, torch.full_like(x, eps), x), tiny


def _i1_pullback(g, x, o):
    """d/dx I1(x) = I0(x) - I1(x) / x"""
    safe, tiny = _safe_bessel_x(x)
    d = torch.special.i0(safe) - o * safe.reciprocal()
    return g * torch.where(tiny, torch.full_like(x, 0.5), d)


def _i1e_pullback(g, x, o):
    """d/dx I1e(x) = I0e(x) - I1e(x) (sgn x + 1 / x)"""
    safe, tiny = _safe_bessel_x(x)
    d = torch.special.i0e(safe) - o * (safe.sgn() + safe.reciprocal())
    return g * torch.where(tiny, torch.full_like(x, 0.5), d)


def _copysign_pullback(g, x, o, *scalar):
    """d/dx copysign(x, y) = copysign(1, x y) (0 at x = 0, as torch)"""
    ratio = o / x
    return g * ratio.masked_fill(x == 0, 0)


for _op, _pb in (
    (aten.i0.default, lambda g, x, o: g * torch.special.i1(x)),
    (aten.special_i0e.default, lambda g, x, o: g * (torch.special.i1e(x) - x.sgn() * o)),
    (aten.special_i1.default, _i1_pullback),
    (aten.special_i1e.default, _i1e_pullback),
    (aten.special_erfcx.default, lambda g, x, o: (2.0 * x * o - _TWO_OVER_SQRT_PI) * g),
    (
        aten.special_log_ndtr.default,
        lambda g, x, o: g / _SQRT_2PI * (o + x.pow(2) / 2).neg().exp(),
    ),
    (aten.special_ndtri.default, lambda g, x, o: g * _SQRT_2PI * (o.square() / 2).exp()),
    (aten.copysign.Scalar, _copysign_pullback),
):
    def_unary(_op, pullback(_pb))


def _fmax_mask(x, y):
    return (x >= y).logical_or_(y.isnan())


def _fmin_mask(x, y):
    return (x <= y).logical_or_(y.isnan())


def _zero_partial(g, x, y, o):
    return torch.zeros_like(g)


for _op, _px, _py in (
    (aten.copysign.Tensor, lambda g, x, y, o: _copysign_pullback(g, x, o), _zero_partial),
    # fmax/fmin ignore a NaN operand: the derivative goes to the other one; ties go to x
    (
        aten.fmax.default,
        lambda g, x, y, o: g.masked_fill(_fmax_mask(x, y).logical_not_(), 0),
        lambda g, x, y, o: g.masked_fill(_fmax_mask(x, y), 0),
    ),
    (
        aten.fmin.default,
        lambda g, x, y, o: g.masked_fill(_fmin_mask(x, y).logical_not_(), 0),
        lambda g, x, y, o: g.masked_fill(_fmin_mask(x, y), 0),
    ),
    (
        aten.nextafter.default,
        lambda g, x, y, o: torch.where(x != y, g, torch.zeros_like(g)),
        _zero_partial,
    ),
):
    def_binary(_op, pullback(_px), pullback(_py))


# polygamma(n, x): the tensor is the second argument
@register_jvp_rule(aten.polygamma.default, aten.special_polygamma.default)
def polygamma_jvp_rule(primals, tangents, kwargs):
    """d/dx polygamma(n, x) = polygamma(n + 1, x)"""
    n, x = primals
    out = torch.polygamma(n, x)
    t = tangents[1]
    return out, None if t is None else t * torch.polygamma(n + 1, x)


@register_vjp_rule(aten.polygamma.default, aten.special_polygamma.default)
def polygamma_vjp_rule(ct, primals, kwargs, out, needs):
    n, x = primals
    return None, ct * torch.polygamma(n + 1, x)


@register_jvp_rule(aten.frexp.Tensor)
def frexp_jvp_rule(primals, tangents, kwargs):
    """x = mantissa 2^exponent with a piecewise-constant exponent: d mantissa = dx / 2^exponent"""
    out = aten.frexp.Tensor(*primals)
    t = tangents[0]
    return out, None if t is None else (t / out[1].exp2(), None)


@register_vjp_rule(aten.frexp.Tensor)
def frexp_vjp_rule(cts, primals, kwargs, out, needs):
    ct = cts[0]
    return (None if ct is None else ct / out[1].exp2(),)


# div with rounding: piecewise constant (torch: zero derivatives); rounding_mode=None is div
def _div_mode(op, plain):
    from ._registry import JVP_RULES, VJP_RULES

    def div_mode_jvp_rule(primals, tangents, kwargs):
        if kwargs.get("rounding_mode") is None:
            return JVP_RULES[plain](primals, tangents, {})
        return op(*primals, **kwargs), None

    def div_mode_vjp_rule(ct, primals, kwargs, out, needs):
        if kwargs.get("rounding_mode") is None:
            return VJP_RULES[plain](ct, primals, {}, out, needs)
        return (None,) * len(primals)

    register_jvp_rule(op)(div_mode_jvp_rule)
    register_vjp_rule(op)(div_mode_vjp_rule)


_div_mode(aten.div.Tensor_mode, aten.div.Tensor)
_div_mode(aten.div.Scalar_mode, aten.div.Scalar)
