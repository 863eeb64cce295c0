"""Derivative rules of pointwise ops. Each derivative is defined once, as f'(x); the jvp
(``t * f'(x)``) and the vjp (``ct * conj(f'(x))``, docs/complex.md) both come from it."""

from __future__ import annotations

import math

import torch

from ._registry import VJP_RULES, register_jvp_rule, register_vjp_rule
from ._util import unbroadcast
from .reverse import NONDIFFERENTIABLE

aten = torch.ops.aten


def _conj(d):
    if isinstance(d, torch.Tensor):
        return d.conj() if d.is_complex() else d
    return d.conjugate() if isinstance(d, complex) else d


def _logit_deriv(x, o, eps=None):
    d = (x * (1 - x)).reciprocal()
    if eps is None:
        return d
    # logit clamps x to [eps, 1 - eps] first: zero derivative outside (torch's convention)
    return torch.where((x < eps) | (x > 1 - eps), torch.zeros_like(d), d)


def def_unary(op, deriv):
    """``op(x, *params)`` with d/dx op = ``deriv(x, out, *params)``."""

    def unary_jvp_rule(primals, tangents, kwargs):
        out = op(*primals, **kwargs)
        t = tangents[0]
        return out, None if t is None else t * deriv(primals[0], out, *primals[1:], **kwargs)

    def unary_vjp_rule(ct, primals, kwargs, out, needs):
        return (ct * _conj(deriv(primals[0], out, *primals[1:], **kwargs)),) + (None,) * (
            len(primals) - 1
        )

    register_jvp_rule(op)(unary_jvp_rule)
    register_vjp_rule(op)(unary_vjp_rule)


def def_binary(op, dx, dy):
    """``op(x, y)`` broadcasting, with partials ``dx(x, y, out)`` and ``dy(x, y, out)``."""

    def binary_jvp_rule(primals, tangents, kwargs):
        x, y = primals[0], primals[1]
        out = op(*primals, **kwargs)
        tx, ty = tangents[0], tangents[1]
        t = None
        if tx is not None:
            t = tx * dx(x, y, out)
        if ty is not None:
            t2 = ty * dy(x, y, out)
            t = t2 if t is None else t + t2
        if t is not None and t.shape != out.shape:
            t = t.expand(out.shape)
        return out, t

    def binary_vjp_rule(ct, primals, kwargs, out, needs):
        x, y = primals[0], primals[1]
        gx = unbroadcast(ct * _conj(dx(x, y, out)), x.shape) if needs[0] else None
        gy = unbroadcast(ct * _conj(dy(x, y, out)), y.shape) if needs[1] else None
        return (gx, gy) + (None,) * (len(primals) - 2)

    register_jvp_rule(op)(binary_jvp_rule)
    register_vjp_rule(op)(binary_vjp_rule)


def def_nondifferentiable(*ops):
    """Piecewise-constant ops (floor, sign, ...): zero derivative, outputs are constants."""
    for op in ops:
        register_jvp_rule(op)(
            lambda primals, tangents, kwargs, op=op: (op(*primals, **kwargs), None)
        )
        register_vjp_rule(op)(NONDIFFERENTIABLE)


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)


def _gelu_deriv(x, out, approximate="none"):
    if approximate == "tanh":
        inner = _SQRT_2_OVER_PI * (x + 0.044715 * x**3)
        th = torch.tanh(inner)
        return 0.5 * (1 + th) + 0.5 * x * (1 - th * th) * _SQRT_2_OVER_PI * (
            1 + 3 * 0.044715 * x * x
        )
    cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2.0)))
    return cdf + x * _INV_SQRT_2PI * torch.exp(-0.5 * x * x)


def _softplus_deriv(x, out, beta=1, threshold=20):
    z = torch.sigmoid(x * beta)
    return torch.where(x * beta > threshold, torch.ones_like(z), z)


def _silu_deriv(x, out):
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))


def _relu_mask(x, out):
    return (out > 0).to(out.dtype)


def _elu_deriv(x, out, alpha=1, scale=1, input_scale=1):
    return torch.where(
        x > 0, torch.full_like(x, scale), out * input_scale + alpha * scale * input_scale
    )


def _pow_scalar_deriv(x, out, p):
    if p == 0:
        return torch.zeros_like(x)
    return p * x.pow(p - 1)


def _clamp_mask(x, out, lo=None, hi=None):
    m = torch.ones_like(x, dtype=torch.bool)
    if lo is not None:
        m = m & (x >= lo)
    if hi is not None:
        m = m & (x <= hi)
    return m.to(x.dtype)


def _leaky_deriv(x, out, slope=0.01):
    return torch.where(x > 0, torch.ones_like(x), torch.full_like(x, slope))


def _hardtanh_deriv(x, out, lo=-1.0, hi=1.0):
    return ((x > lo) & (x < hi)).to(x.dtype)


def _abs_deriv(x, o):
    """d|x|/dx = sgn(x); complex: d|z| = Re(conj(sgn z) dz) (docs/complex.md)."""
    s = x.sgn()
    return torch.conj_physical(s) if x.is_complex() else s


def _angle_deriv(x, o):
    """d angle(z) = Im(conj(z) dz) / |z|^2 = Re(-i conj(z) dz) / |z|^2; 0 for real x and at 0."""
    if not x.is_complex():
        return torch.zeros_like(x)
    d = torch.conj_physical(x) * -1j / (x * torch.conj_physical(x)).real
    return torch.where(x == 0, torch.zeros_like(d), d)


# d/dx f(x), with `o` = f(x) where that is cheaper
for _op, _d in (
    (aten.exp.default, lambda x, o: o),
    (aten.exp2.default, lambda x, o: o * math.log(2.0)),
    (aten.expm1.default, lambda x, o: o + 1),
    (aten.log.default, lambda x, o: x.reciprocal()),
    (aten.log2.default, lambda x, o: (x * math.log(2.0)).reciprocal()),
    (aten.log10.default, lambda x, o: (x * math.log(10.0)).reciprocal()),
    (aten.log1p.default, lambda x, o: (x + 1).reciprocal()),
    (aten.sin.default, lambda x, o: torch.cos(x)),
    (aten.cos.default, lambda x, o: -torch.sin(x)),
    (aten.tan.default, lambda x, o: 1 + o * o),
    (aten.tanh.default, lambda x, o: 1 - o * o),
    (aten.sinh.default, lambda x, o: torch.cosh(x)),
    (aten.cosh.default, lambda x, o: torch.sinh(x)),
    (aten.asin.default, lambda x, o: torch.rsqrt(1 - x * x)),
    (aten.acos.default, lambda x, o: -torch.rsqrt(1 - x * x)),
    (aten.atan.default, lambda x, o: (1 + x * x).reciprocal()),
    (aten.asinh.default, lambda x, o: torch.rsqrt(x * x + 1)),
    (aten.acosh.default, lambda x, o: torch.rsqrt(x * x - 1)),
    (aten.atanh.default, lambda x, o: (1 - x * x).reciprocal()),
    (aten.sigmoid.default, lambda x, o: o * (1 - o)),
    (aten.relu.default, _relu_mask),
    (aten.sqrt.default, lambda x, o: 0.5 / o),
    (aten.rsqrt.default, lambda x, o: -0.5 * o * o * o),
    (aten.reciprocal.default, lambda x, o: -o * o),
    (aten.erf.default, lambda x, o: _TWO_OVER_SQRT_PI * torch.exp(-x * x)),
    (aten.erfc.default, lambda x, o: -_TWO_OVER_SQRT_PI * torch.exp(-x * x)),
    (aten.erfinv.default, lambda x, o: 0.5 * math.sqrt(math.pi) * torch.exp(o * o)),
    (aten.gelu.default, _gelu_deriv),
    (aten.silu.default, _silu_deriv),
    (aten.softplus.default, _softplus_deriv),
    (aten.elu.default, _elu_deriv),
    (aten.leaky_relu.default, _leaky_deriv),
    (aten.hardtanh.default, _hardtanh_deriv),
    (aten.pow.Tensor_Scalar, _pow_scalar_deriv),
    (aten.clamp.default, _clamp_mask),
    (aten.clamp_min.default, lambda x, o, lo: _clamp_mask(x, o, lo, None)),
    (aten.clamp_max.default, lambda x, o, hi: _clamp_mask(x, o, None, hi)),
    (aten.lgamma.default, lambda x, o: torch.digamma(x)),
    (aten.digamma.default, lambda x, o: torch.polygamma(1, x)),
    (aten.neg.default, lambda x, o: -torch.ones_like(x)),
    (aten.abs.default, _abs_deriv),
    (aten.angle.default, _angle_deriv),
    (aten.logit.default, _logit_deriv),
    (
        aten.sinc.default,
        lambda x, o: torch.where(x == 0, torch.zeros_like(x), (torch.cos(math.pi * x) - o) / x),
    ),
    (
        aten.mul.Scalar,
        lambda x, o, s: torch.full_like(o, s) if not isinstance(s, torch.Tensor) else s,
    ),
    (aten.div.Scalar, lambda x, o, s: torch.full_like(o, 1.0 / s)),
):
    def_unary(_op, _d)
# relu's derivative reads only its output: its input (often a convolution's output) need not
# stay alive until the backward pass (Note [What a vjp rule keeps], reverse.py)
VJP_RULES[aten.relu.default].keeps = ((), True)

def_nondifferentiable(
    aten.floor.default,
    aten.ceil.default,
    aten.round.default,
    aten.round.decimals,
    aten.trunc.default,
    aten.sign.default,
    aten.detach.default,
    aten.zero.default,
    aten.fill.Scalar,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
    aten.rand_like.default,
    aten.randn_like.default,
    aten.bernoulli.default,
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_empty.default,
    aten.new_full.default,
)


# partials (d/dx, d/dy) of binary ops
def _pow_dy(x, y, o):
    return torch.where(
        x == 0, torch.zeros_like(o), o * torch.log(x if not x.is_complex() else x + 0j)
    )


for _op, _dx, _dy in (
    (aten.mul.Tensor, lambda x, y, o: y, lambda x, y, o: x),
    (aten.div.Tensor, lambda x, y, o: 1 / y, lambda x, y, o: -o / y),
    (aten.pow.Tensor_Tensor, lambda x, y, o: y * x.pow(y - 1), _pow_dy),
    (
        aten.maximum.default,
        lambda x, y, o: _tie(x > y, x == y, o),
        lambda x, y, o: _tie(y > x, x == y, o),
    ),
    (
        aten.minimum.default,
        lambda x, y, o: _tie(x < y, x == y, o),
        lambda x, y, o: _tie(y < x, x == y, o),
    ),
    (aten.atan2.default, lambda x, y, o: y / (x * x + y * y), lambda x, y, o: -x / (x * x + y * y)),
    (aten.hypot.default, lambda x, y, o: x / o, lambda x, y, o: y / o),
    (
        aten.xlogy.Tensor,
        lambda x, y, o: torch.where(x == 0, torch.zeros_like(o), torch.log(y)),
        lambda x, y, o: x / y,
    ),
    (aten.fmod.Tensor, lambda x, y, o: torch.ones_like(o), lambda x, y, o: -torch.trunc(x / y)),
    (
        aten.remainder.Tensor,
        lambda x, y, o: torch.ones_like(o),
        lambda x, y, o: -torch.floor(x / y),
    ),
):
    def_binary(_op, _dx, _dy)


def _tie(win, tie, o):
    # ties split the derivative evenly, as torch does
    return win.to(o.dtype) + 0.5 * tie.to(o.dtype)


def _sgn_tangent(x, s, t):
    """d sgn(z) = (dz - sgn z Re(conj(sgn z) dz)) / |z|, 0 at z = 0; a self-adjoint map."""
    d = (t - s * (torch.conj_physical(s) * t).real) / x.abs()
    return torch.where(x == 0, torch.zeros_like(d), d)


@register_jvp_rule(aten.sgn.default)
def sgn_jvp_rule(primals, tangents, kwargs):
    """Real x: piecewise constant. Complex z: z / |z| (docs/complex.md)."""
    x, t = primals[0], tangents[0]
    out = torch.sgn(x)
    if t is None or not x.is_complex():
        return out, None
    return out, _sgn_tangent(x, out, t)


@register_vjp_rule(aten.sgn.default)
def sgn_vjp_rule(ct, primals, kwargs, out, needs):
    x = primals[0]
    return (_sgn_tangent(x, out, ct) if x.is_complex() else None,)


@register_jvp_rule(aten.pow.Scalar)
def pow_scalar_base_jvp_rule(primals, tangents, kwargs):
    """d/dy s**y = s**y log s"""
    s, y = primals
    out = aten.pow.Scalar(s, y)
    t = tangents[1]
    return out, None if t is None else t * out * math.log(s)


@register_vjp_rule(aten.pow.Scalar)
def pow_scalar_base_vjp_rule(ct, primals, kwargs, out, needs):
    s = primals[0]
    return None, ct * _conj(out * math.log(s))


# -- linear binary ops: add, sub, rsub --------------------------------------------------------
def _alpha(kwargs):
    return kwargs.get("alpha", 1)


def _scale(t, a):
    return t if a == 1 else t * a


def def_linear_binary(op, sx, sy):
    """``op(x, y, alpha) = sx * x + sy * alpha * y`` with constants ``sx``, ``sy``."""

    def linear_binary_jvp_rule(primals, tangents, kwargs):
        out = op(*primals, **kwargs)
        a = _alpha(kwargs)
        tx = tangents[0]
        ty = tangents[1] if len(tangents) > 1 else None
        t = None
        if tx is not None:
            t = _scale(tx, sx)
        if ty is not None:
            t2 = _scale(ty, sy * a)
            t = t2 if t is None else t + t2
        if t is not None and t.shape != out.shape:
            t = t.expand(out.shape)
        return out, t

    def linear_binary_vjp_rule(ct, primals, kwargs, out, needs):
        a = _alpha(kwargs)
        x, y = primals[0], primals[1]
        gx = unbroadcast(_scale(ct, sx), x.shape) if needs[0] else None
        gy = unbroadcast(_scale(ct, sy * _conj_scalar(a)), y.shape) if needs[1] else None
        return gx, gy

    register_jvp_rule(op)(linear_binary_jvp_rule)
    register_vjp_rule(op)(linear_binary_vjp_rule)


def _conj_scalar(a):
    return a.conjugate() if isinstance(a, complex) else a


def_linear_binary(aten.add.Tensor, 1, 1)
def_linear_binary(aten.sub.Tensor, 1, -1)
for _op, _s in ((aten.add.Scalar, 1), (aten.sub.Scalar, 1)):
    def_unary(_op, lambda x, o, *a, _s=_s, **k: torch.full_like(x, _s))


# -- complex construction: complex(re, im) and polar(abs, angle) (docs/complex.md) -------------
def _zero_or(t, like):
    return t if t is not None else torch.zeros((), dtype=like.dtype, device=like.device)


@register_jvp_rule(aten.complex.default)
def complex_jvp_rule(primals, tangents, kwargs):
    """complex(re, im) = re + i im is real-linear in (re, im)."""
    re, im = primals
    out = torch.complex(re, im)
    t_re, t_im = tangents
    if t_re is None and t_im is None:
        return out, None
    return out, torch.complex(_zero_or(t_re, re), _zero_or(t_im, im)).expand(out.shape)


@register_vjp_rule(aten.complex.default)
def complex_vjp_rule(ct, primals, kwargs, out, needs):
    re, im = primals
    g_re = unbroadcast(ct.real, re.shape) if needs[0] else None
    g_im = unbroadcast(ct.imag, im.shape) if needs[1] else None
    return g_re, g_im


@register_jvp_rule(aten.polar.default)
def polar_jvp_rule(primals, tangents, kwargs):
    """polar(r, a) = r e^{ia}: d out = e^{ia} dr + i out da."""
    r, a = primals
    out = torch.polar(r, a)
    t_r, t_a = tangents
    t = None
    if t_r is not None:
        t = t_r * torch.polar(torch.ones_like(r), a)
    if t_a is not None:
        t2 = t_a * out * 1j
        t = t2 if t is None else t + t2
    return out, None if t is None else t.expand(out.shape)


@register_vjp_rule(aten.polar.default)
def polar_vjp_rule(ct, primals, kwargs, out, needs):
    r, a = primals
    c = torch.conj_physical(ct)
    g_r = unbroadcast((c * torch.polar(torch.ones_like(r), a)).real, r.shape) if needs[0] else None
    g_a = unbroadcast((c * out * 1j).real, a.shape) if needs[1] else None
    return g_r, g_a
