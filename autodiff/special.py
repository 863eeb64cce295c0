"""Derivative rules of the special functions and the remaining pointwise ops (copysign,
fmax/fmin, nextafter, frexp, div with rounding modes, polygamma, Bessel functions, erfcx,
log_ndtr, ndtri), as table rows of the elementwise helpers. Each formula is torch's
(derivatives.yaml), in torch's order, so float32 results round as torch's do (Note [Rounding as
torch], autodiff/elementwise.py)."""

from __future__ import annotations

import math

import torch

from functransforms import _compat

from ._registry import register_jvp_rule, register_vjp_rule
from ._util import conj_if_complex, unbroadcast
from .elementwise import def_binary, def_unary, pullback

aten = torch.ops.aten

_SQRT_2PI = math.sqrt(2 * math.pi)
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)
# torch 2.15 writes 1/sqrt(2 pi) as M_2_SQRTPI * M_SQRT2 * 0.25 (the same double)
_INV_SQRT_2PI = _TWO_OVER_SQRT_PI * math.sqrt(2.0) * 0.25


def _log_ndtr_pullback(g, x, o):
    """d/dx log ndtr(x) = exp(-(log ndtr(x) + x^2 / 2)) / sqrt(2 pi), in the installed torch's
    order of operations (Note [Supported torch versions], functransforms/_compat.py)."""
    e = (o + x.pow(2) / 2).neg().exp()
    if _compat.LOG_NDTR_MULTIPLIES:
        return g * _INV_SQRT_2PI * e
    return g / _SQRT_2PI * e


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


def _j1_pullback(g, x, o):
    """d/dx J1(x) = J0(x) - J1(x) / x (1/2 at 0)"""
    safe, tiny = _safe_bessel_x(x)
    d = torch.special.bessel_j0(safe) - o * safe.reciprocal()
    return g * torch.where(tiny, torch.full_like(x, 0.5), d)


def _y1_pullback(g, x, o):
    """d/dx Y1(x) = Y0(x) - Y1(x) / x"""
    return g * (torch.special.bessel_y0(x) - o * x.reciprocal())


def _modified_i1_pullback(g, x, o):
    """d/dx I1(x) = I0(x) - I1(x) / x (1/2 at 0)"""
    safe, tiny = _safe_bessel_x(x)
    d = torch.special.modified_bessel_i0(safe) - o * safe.reciprocal()
    return g * torch.where(tiny, torch.full_like(x, 0.5), d)


# torch 2.15 differentiates the Bessel functions of torch.special (2.13: non-differentiable);
# the derivatives hold for every version, so the rules are registered on all of them
_BESSEL = (
    (aten.special_bessel_j0.default, lambda g, x, o: g * -torch.special.bessel_j1(x)),
    (aten.special_bessel_j1.default, _j1_pullback),
    (aten.special_bessel_y0.default, lambda g, x, o: g * -torch.special.bessel_y1(x)),
    (aten.special_bessel_y1.default, _y1_pullback),
    (
        aten.special_modified_bessel_i0.default,
        lambda g, x, o: g * torch.special.modified_bessel_i1(x),
    ),
    (aten.special_modified_bessel_i1.default, _modified_i1_pullback),
    (
        aten.special_modified_bessel_k0.default,
        lambda g, x, o: g * -torch.special.modified_bessel_k1(x),
    ),
    (
        aten.special_modified_bessel_k1.default,
        lambda g, x, o: g * -(torch.special.modified_bessel_k0(x) + o * x.reciprocal()),
    ),
)

for _op, _pb in (
    *_BESSEL,
    (aten.i0.default, lambda g, x, o: g * torch.special.i1(x)),
    (aten.special_i0e.default, lambda g, x, o: g * (torch.special.i1e(x) - x.sgn() * o)),
    (aten.special_i1.default, _i1_pullback),
    (aten.special_i1e.default, _i1e_pullback),
    (aten.special_erfcx.default, lambda g, x, o: (2.0 * x * o - _TWO_OVER_SQRT_PI) * g),
    (aten.special_log_ndtr.default, _log_ndtr_pullback),
    (aten.special_ndtri.default, lambda g, x, o: g * _SQRT_2PI * (o.square() / 2).exp()),
    (aten.copysign.Scalar, _copysign_pullback),
    # torch's formula, so entr'(0) = inf as in torch (its decomposition's where() gives nan)
    (aten.special_entr.default, lambda g, x, o: g * (-(1 + x.log()))),
):
    def_unary(_op, pullback(_pb))


def _log_add_partial(g, x, y, log_base=1.0):
    """d/dx log(b^x + b^y) = sigmoid((x - y) ln b), 0 at x = y = -inf (the output is a
    constant there). As a sigmoid, not torch's 1 / (1 + exp(y - x)): its derivative in y is
    exp(x - y) / (1 + exp(x - y))^2 = inf / inf at y = -inf (a masked-out input of
    masked.logaddexp), sigmoid's is s (1 - s) = 0; and the gap is cleaned before the sigmoid,
    since a where after it still sends nan into a second derivative."""
    dead = (x == -math.inf) & (y == -math.inf)
    gap = torch.where(dead, 0.0, x - y)
    s = torch.sigmoid(gap if log_base == 1.0 else gap * log_base)
    return torch.where(dead, 0.0, g * conj_if_complex(s))


def _zero_partial(g, x, y, o):
    return torch.zeros_like(g)


for _op, _px, _py in (
    (aten.copysign.Tensor, lambda g, x, y, o: _copysign_pullback(g, x, o), _zero_partial),
    # torch's derivatives, as sigmoids (_log_add_partial: its decomposition's jvp is finite at
    # x = y = +inf, torch's nan), except at x = y = -inf, where the output is a constant -inf
    # (masked.logaddexp's masked-out elements): 0, not torch's nan
    # (test_masked_logaddexp_jvp_is_finite)
    (
        aten.logaddexp.default,
        lambda g, x, y, o: _log_add_partial(g, x, y),
        lambda g, x, y, o: _log_add_partial(g, y, x),
    ),
    (
        aten.logaddexp2.default,
        lambda g, x, y, o: _log_add_partial(g, x, y, math.log(2.0)),
        lambda g, x, y, o: _log_add_partial(g, y, x, math.log(2.0)),
    ),
    (
        aten.nextafter.default,
        lambda g, x, y, o: torch.where(x != y, g, torch.zeros_like(g)),
        _zero_partial,
    ),
):
    def_binary(_op, pullback(_px), pullback(_py))


# Note [Selections as the installed torch]
#     maximum/minimum, fmax/fmin and clamp with Tensor bounds select one argument per element;
#     at ties, at inverted bounds and at NaNs torch's formulas decide where the derivative goes,
#     and torch 2.15 changed them (_compat.SPLIT_TIES_FMAX_CLAMP_TENSOR): fmax/fmin and the
#     Tensor-bound clamps split ties evenly (as maximum/minimum always did), the forward
#     formulas became `where` selections instead of `other_t + mask * (self_t - other_t)`, and
#     clamp's NaN routing changed. A different routing is a silently different derivative, so
#     each version gets its own torch's formulas, in torch's order (derivatives.yaml; for
#     clamp.Tensor, whose backward is C++, the formula fitted to and checked against torch on
#     every (x, min, max) in {0, 1, 2, inf, nan}^3: tests/autodiff/test_ad_rules.py,
#     test_ties_and_nans_route_like_the_installed_torch). NaN compares false throughout.
_SPLIT = _compat.SPLIT_TIES_FMAX_CLAMP_TENSOR


def _halve_ties(g, x, y):
    """torch's ``at::where(self == other, grad / 2, grad)``."""
    return torch.where(x == y, g / 2, g)


def _select_jvp(x_wins):
    """The forward formula of a selection whose ``x_wins(x, y)`` mask says where x is taken."""
    if _SPLIT:
        return lambda x, y, o, tx, ty: torch.where(
            x == y, (tx + ty) / 2, torch.where(x_wins(x, y), tx, ty)
        )
    return lambda x, y, o, tx, ty: ty + x_wins(x, y) * (tx - ty)


def _tie_weight_jvp(x_wins):
    """maximum/minimum up to torch 2.13: ``other_t + where(ties, 0.5, x wins) * (self_t -
    other_t)``; from 2.15 as the other selections."""
    if _SPLIT:
        return _select_jvp(x_wins)
    return lambda x, y, o, tx, ty: (
        ty + torch.where(x == y, 0.5, x_wins(x, y).to(o.dtype)) * (tx - ty)
    )


def _fmax_keeps_x(x, y):
    return (x >= y).logical_or_(y.isnan())


def _fmin_keeps_x(x, y):
    return (x <= y).logical_or_(y.isnan())


_h = _halve_ties if _SPLIT else (lambda g, x, y: g)
for _op, _px, _py, _jvp in (
    (
        aten.maximum.default,
        lambda g, x, y, o: _halve_ties(g, x, y).masked_fill(x < y, 0),
        lambda g, x, y, o: _halve_ties(g, x, y).masked_fill(x > y, 0),
        _tie_weight_jvp(lambda x, y: x > y),
    ),
    (
        aten.minimum.default,
        lambda g, x, y, o: _halve_ties(g, x, y).masked_fill(x > y, 0),
        lambda g, x, y, o: _halve_ties(g, x, y).masked_fill(x < y, 0),
        _tie_weight_jvp(lambda x, y: x < y),
    ),
    # fmax/fmin ignore a NaN operand: the derivative goes to the other one
    (
        aten.fmax.default,
        lambda g, x, y, o: _h(g, x, y).masked_fill(_fmax_keeps_x(x, y).logical_not_(), 0),
        lambda g, x, y, o: _h(g, x, y).masked_fill(
            (x > y if _SPLIT else x >= y).logical_or_(y.isnan()), 0
        ),
        _select_jvp(lambda x, y: (x > y).logical_or_(y.isnan())),
    ),
    (
        aten.fmin.default,
        lambda g, x, y, o: _h(g, x, y).masked_fill(_fmin_keeps_x(x, y).logical_not_(), 0),
        lambda g, x, y, o: _h(g, x, y).masked_fill(
            (x < y if _SPLIT else x <= y).logical_or_(y.isnan()), 0
        ),
        # torch 2.13's fmin jvp takes x at ties (`<=`), its fmax jvp takes y (`>`)
        _select_jvp(lambda x, y: (x < y if _SPLIT else x <= y).logical_or_(y.isnan())),
    ),
):
    def_binary(_op, pullback(_px), pullback(_py), jvp=_jvp)


# clamp with Tensor bounds (Note [Selections as the installed torch]). With one bound, torch
# uses clamp_min's / clamp_max's formulas.
def _clamp_min_vjp(g, x, lo):
    if _SPLIT:
        h = _halve_ties(g, x, lo)
        return h.masked_fill(x < lo, 0), h.masked_fill(x > lo, 0)
    return torch.where(x >= lo, g, 0.0), torch.where(x < lo, g, 0.0)


def _clamp_max_vjp(g, x, hi):
    if _SPLIT:
        h = _halve_ties(g, x, hi)
        return h.masked_fill(x > hi, 0), h.masked_fill(x < hi, 0)
    return torch.where(x <= hi, g, 0.0), torch.where(x > hi, g, 0.0)


def _clamp_vjp(g, x, lo, hi):
    """(d self, d min, d max) of clamp(x, min, max) for the cotangent g; None for no bound."""
    if hi is None:
        return (*_clamp_min_vjp(g, x, lo), None)
    if lo is None:
        gx, ghi = _clamp_max_vjp(g, x, hi)
        return gx, None, ghi
    below, above, inverted = x < lo, x > hi, lo > hi  # inverted bounds: the output is max
    if not _SPLIT:
        return (
            torch.where((x >= lo) & (x <= hi), g, 0.0),
            torch.where(below & (lo < hi), g, 0.0),
            torch.where(above | inverted, g, 0.0),
        )
    tie_lo, tie_hi = (x == lo) & (x < hi), (x == hi) & (x > lo)
    half, zero, ordered = g / 2, torch.zeros_like(g), lo <= hi
    return (
        torch.where(below | above, zero, torch.where(tie_lo | tie_hi, half, g)),
        torch.where(tie_lo, half, torch.where(below & ordered, g, zero)),
        torch.where(tie_hi, half, torch.where((above & ordered) | inverted, g, zero)),
    )


def _clamp_jvp(x, lo, hi, tx, tlo, thi, one_bound_op=True):
    if hi is None or lo is None:
        bound, t_bound = (lo, tlo) if hi is None else (hi, thi)
        x_wins = (lambda x, y: x > y) if hi is None else (lambda x, y: x < y)
        if _SPLIT:
            return _select_jvp(x_wins)(x, bound, None, tx, t_bound)
        # torch 2.13 takes x at ties in clamp_min/clamp_max.Tensor's formula (`where(self_p >=
        # min_p, ...)`) but the bound in clamp.Tensor's when only one bound is given
        wins = x_wins(x, bound) | (x == bound) if one_bound_op else x_wins(x, bound)
        return torch.where(wins, tx, t_bound)
    t = tx
    if _SPLIT:
        t = torch.where((x == hi) & (x > lo), (tx + thi) / 2, t)
        t = torch.where((x == lo) & (x < hi), (tx + tlo) / 2, t)
    t = torch.where(x > hi, thi, t)
    t = torch.where(x < lo, tlo, t)
    return torch.where(lo > hi, thi, t)


_CLAMP_BOUNDS = {  # op -> positions of (min, max) among its arguments
    aten.clamp.Tensor: (1, 2),
    aten.clamp_min.Tensor: (1, None),
    aten.clamp_max.Tensor: (None, 1),
}


def _bounds(op, args):
    return tuple(args[i] if i is not None and i < len(args) else None for i in _CLAMP_BOUNDS[op])


def _def_clamp_tensor(op):
    def clamp_tensor_jvp_rule(primals, tangents, kwargs):
        out = op(*primals, **kwargs)
        if all(t is None for t in tangents):
            return out, None
        zero = torch.zeros_like(out)
        fill = lambda t: zero if t is None else t  # noqa: E731
        t = _clamp_jvp(
            primals[0],
            *_bounds(op, primals),
            fill(tangents[0]),
            *map(fill, _bounds(op, tangents)),
            one_bound_op=op is not aten.clamp.Tensor,
        )
        return out, t.expand(out.shape) if t.shape != out.shape else t

    def clamp_tensor_vjp_rule(ct, primals, kwargs, out, needs):
        cts = [None] * len(primals)
        parts = _clamp_vjp(ct, primals[0], *_bounds(op, primals))
        for i, g in zip((0, *_CLAMP_BOUNDS[op]), parts):
            if i is not None and i < len(primals) and needs[i] and primals[i] is not None:
                cts[i] = unbroadcast(g, primals[i].shape)
        return tuple(cts)

    register_jvp_rule(op)(clamp_tensor_jvp_rule)
    register_vjp_rule(op)(clamp_tensor_vjp_rule)


for _op in _CLAMP_BOUNDS:
    _def_clamp_tensor(_op)


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


# -- Python-scalar overloads (x % 0.7, fmod(x, s), nan_to_num) and the Hurwitz zeta ------------
def _not_implemented(what):
    """A partial torch does not define either: asking for it raises (never a silent zero)."""

    def partial(*args):
        raise NotImplementedError(
            f"the derivative of {what} is not implemented (torch has none either). Expected: "
            "differentiate with respect to the other arguments only (detach this one)."
        )

    return partial


for _op, _d in (
    (aten.fmod.Scalar, lambda x, o, s: torch.ones_like(o)),
    (aten.remainder.Scalar, lambda x, o, s: torch.ones_like(o)),
    # torch's formula, grad * isfinite(x): a nan tangent stays nan (a where() would zero it)
    (aten.nan_to_num.default, lambda x, o, *params: torch.isfinite(x).to(o.dtype)),
):
    def_unary(_op, _d)


def _zeta_dq(x, q, o):
    """d/dq zeta(x, q) = -x zeta(x + 1, q)."""
    return -x * torch.special.zeta(x + 1.0, q)


def_binary(aten.special_zeta.default, _not_implemented("zeta(x, q) with respect to x"), _zeta_dq)


@register_jvp_rule(aten.special_zeta.self_scalar)
def zeta_self_scalar_jvp_rule(primals, tangents, kwargs):
    s, q = primals
    out = aten.special_zeta.self_scalar(s, q)
    t = tangents[1]
    return out, None if t is None else t * _zeta_dq(s, q, out)


@register_vjp_rule(aten.special_zeta.self_scalar)
def zeta_self_scalar_vjp_rule(ct, primals, kwargs, out, needs):
    s, q = primals
    return None, ct * _zeta_dq(s, q, out)


@register_jvp_rule(aten.special_zeta.other_scalar)
def zeta_other_scalar_jvp_rule(primals, tangents, kwargs):
    out = aten.special_zeta.other_scalar(*primals)
    if tangents[0] is not None:
        _not_implemented("zeta(x, q) with respect to x")()
    return out, None


@register_vjp_rule(aten.special_zeta.other_scalar)
def zeta_other_scalar_vjp_rule(ct, primals, kwargs, out, needs):
    _not_implemented("zeta(x, q) with respect to x")()


# s % q (torch has no derivative: ours only): s - floor(s / q) q, so d/dq = -floor(s / q)
@register_jvp_rule(aten.remainder.Scalar_Tensor)
def remainder_scalar_tensor_jvp_rule(primals, tangents, kwargs):
    s, q = primals
    out = aten.remainder.Scalar_Tensor(s, q)
    t = tangents[1]
    return out, None if t is None else t * -torch.floor(s / q)


@register_vjp_rule(aten.remainder.Scalar_Tensor)
def remainder_scalar_tensor_vjp_rule(ct, primals, kwargs, out, needs):
    s, q = primals
    return None, ct * -torch.floor(s / q)


# Special functions torch leaves underivable (PyTorch returns a silent zero gradient for them;
# ours only): j0(x) = sin x / x, and the exponentially scaled K0/K1 (k0e = e^x K0, k1e = e^x K1,
# with K0' = -K1 and K1' = -K0 - K1 / x)
def _sph_j0_deriv(x, o):
    d = (x * torch.cos(x) - torch.sin(x)) / (x * x)
    return torch.where(x == 0, torch.zeros_like(d), d)


for _op, _d in (
    (aten.special_spherical_bessel_j0.default, _sph_j0_deriv),
    (
        aten.special_scaled_modified_bessel_k0.default,
        lambda x, o: o - torch.special.scaled_modified_bessel_k1(x),
    ),
    (
        aten.special_scaled_modified_bessel_k1.default,
        lambda x, o: o - torch.special.scaled_modified_bessel_k0(x) - o / x,
    ),
):
    def_unary(_op, _d)


# addcdiv: torch's own formulas (derivatives.yaml), not its decomposition x + v t1 / t2 through
# div's: at t2 = 0 the inf and nan of the second derivative follow the expressions torch writes.
@register_jvp_rule(aten.addcdiv.default)
def addcdiv_jvp_rule(primals, tangents, kwargs):
    x, t1, t2 = primals[:3]
    value = kwargs.get("value", 1)
    out = aten.addcdiv.default(*primals, **kwargs)
    tx, tt1, tt2 = tangents[:3]
    t = tx
    if tt1 is not None:  # a missing tangent is torch's zero tensor: it adds nothing, not nan
        part = tt1 / t2 * value
        t = part if t is None else t + part
    if tt2 is not None:
        part = tt2 * (t1 / t2) / t2 * value
        t = -part if t is None else t - part
    return out, None if t is None else t.expand(out.shape)


@register_vjp_rule(aten.addcdiv.default)
def addcdiv_vjp_rule(ct, primals, kwargs, out, needs):
    x, t1, t2 = primals[:3]
    value = kwargs.get("value", 1)
    g1 = g2 = None
    if needs[1]:
        g1 = unbroadcast(ct * conj_if_complex(value / t2), t1.shape)
    if needs[2]:
        g2 = unbroadcast(-ct * conj_if_complex(value * t1 / (t2 * t2)), t2.shape)
    return (unbroadcast(ct, x.shape) if needs[0] else None, g1, g2)


# lerp: torch's formulas. Its decomposition x + w (end - x) gives nan tangents wherever x or end
# is infinite, though the derivative (1 - w, w) does not depend on them.
@register_jvp_rule(aten.lerp.Scalar, aten.lerp.Tensor)
def lerp_jvp_rule(primals, tangents, kwargs):
    x, end, w = primals[:3]
    out = torch.lerp(x, end, w)
    tx, te = tangents[0], tangents[1]
    tw = tangents[2] if isinstance(w, torch.Tensor) else None
    t = None
    if tx is not None or te is not None:  # a missing tangent is torch's zero tensor
        tx = torch.zeros_like(out) if tx is None else tx
        te = torch.zeros_like(out) if te is None else te
        t = torch.lerp(tx, te, w)
    if tw is not None:
        part = tw * (end - x)
        t = part if t is None else t + part
    return out, None if t is None else t.expand(out.shape)


@register_vjp_rule(aten.lerp.Scalar, aten.lerp.Tensor)
def lerp_vjp_rule(ct, primals, kwargs, out, needs):
    x, end, w = primals[:3]
    wc = conj_if_complex(w) if isinstance(w, torch.Tensor) else w.conjugate()
    gx = unbroadcast(ct * (1 - wc), x.shape) if needs[0] else None
    ge = unbroadcast(ct * wc, end.shape) if needs[1] else None
    gw = None
    if isinstance(w, torch.Tensor) and needs[2]:
        gw = unbroadcast(ct * conj_if_complex(end - x), w.shape)
    return (gx, ge, gw)
