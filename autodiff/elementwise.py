"""Derivative rules of pointwise ops. Each derivative is defined once, as f'(x); the jvp
(``t * f'(x)``) and the vjp (``ct * conj(f'(x))``, docs/complex.md) both come from it."""

from __future__ import annotations

import functools
import math
import operator

import torch

from functransforms import _compat

from ._registry import register_jvp_rule, register_vjp_rule
from ._util import conj_if_complex, unbroadcast
from .reverse import NONDIFFERENTIABLE, PHYSICAL_PULLBACKS

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


class pullback:
    """Marks a table entry written as torch's backward formula ``ct * conj(f'(x))`` (a function
    of ``(ct, x, out, *params)``) instead of as ``f'(x)``: the same operations in the same order
    as torch's derivatives.yaml, so float32 results round as torch's do (Note [Rounding as
    torch]). ``keeps``: what the formula reads, Note [What a vjp rule keeps]."""

    def __init__(self, fn, keeps=None):
        self.fn = fn
        self.keeps = keeps


_OUT_ONLY = ((), True)  # the formula reads only the op's output
_X_ONLY = (None, False)  # ... only its inputs


# Note [Rounding as torch]
#     ``ct * conj(f'(x))`` and torch's ``grad / (2 * result)`` (sqrt) are the same number in exact
#     arithmetic but not in float32: the product rounds differently, by one ulp, which fails the
#     allclose checks users copy from PyTorch tutorials. So where torch writes a pointwise
#     backward formula differently from ``ct * f'``, the table gives that formula (``pullback``),
#     in torch's order, and uses torch's fused backward kernels (``tanh_backward``,
#     ``sigmoid_backward``, ``gelu_backward``, ...) where torch does. The jvp is the formula
#     applied to the tangent, as torch's ``auto_element_wise`` forward formulas are:
#     ``t f'(x) = conj(pullback(conj t))`` (``pullback(t)`` for real x). The fused kernels get
#     their own rules (``def_backward_kernel``) so that second derivatives go through them.
#     tests/autodiff/test_ad_elementwise_more.py checks float32 results bitwise.


def def_unary(op, deriv):
    """``op(x, *params)`` with d/dx op = ``deriv(x, out, *params)``, or ``deriv`` a
    ``pullback(fn)``: fn(ct, x, out, *params) = ``ct * conj(d/dx op)``, Note [Rounding as
    torch]."""
    if isinstance(deriv, pullback):
        pb = deriv.fn

        def unary_pb_jvp_rule(primals, tangents, kwargs):
            out = op(*primals, **kwargs)
            t = tangents[0]
            if t is None:
                return out, None
            x = primals[0]
            if x.is_complex():
                t = conj_if_complex(pb(conj_if_complex(t), x, out, *primals[1:], **kwargs))
                return out, t
            return out, pb(t, x, out, *primals[1:], **kwargs)

        def unary_pb_vjp_rule(ct, primals, kwargs, out, needs):
            return (pb(ct, primals[0], out, *primals[1:], **kwargs),) + (None,) * (len(primals) - 1)

        if deriv.keeps is not None:
            unary_pb_vjp_rule.keeps = deriv.keeps
        register_jvp_rule(op)(unary_pb_jvp_rule)
        register_vjp_rule(op)(unary_pb_vjp_rule)
        PHYSICAL_PULLBACKS.add(unary_pb_vjp_rule)  # Note [Pointwise pullbacks on physical values]
        return

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
    PHYSICAL_PULLBACKS.add(unary_vjp_rule)  # Note [Pointwise pullbacks on physical values]


def _partial(d):
    """A binary table entry as (pullback, pushforward): ``ct -> ct * conj(partial)`` and
    ``t -> t * partial``."""
    if isinstance(d, pullback):
        pb = d.fn

        def push(t, x, y, o):
            if o.is_complex():
                return conj_if_complex(pb(conj_if_complex(t), x, y, o))
            return pb(t, x, y, o)

        return pb, push
    return (lambda ct, x, y, o: ct * _conj(d(x, y, o))), (lambda t, x, y, o: t * d(x, y, o))


def _broadcast_tangent(t, shape):
    """A tangent smaller than the output (the other operand's is a symbolic zero), made full
    as torch's forward AD makes it: its zero tensor plus ``t`` is ``_to_copy(t.expand(shape))``,
    a fresh tensor, not a stride-0 view (into which an in-place write would raise)."""
    return t.expand(shape).clone()


def def_binary(op, dx, dy, jvp=None, zeros=True):
    """``op(x, y)`` broadcasting, with partials ``dx(x, y, out)`` and ``dy(x, y, out)`` (or
    ``pullback``s ``(ct, x, y, out) -> ct * conj(partial)``, Note [Rounding as torch]).
    ``jvp(x, y, out, tx, ty)``: torch's forward formula where it is not the sum of the two
    pushforwards (selections: maximum, fmax; a missing tangent is passed as zeros, or as None
    with ``zeros=False``)."""
    (pbx, pushx), (pby, pushy) = _partial(dx), _partial(dy)

    def binary_jvp_rule(primals, tangents, kwargs):
        x, y = primals[0], primals[1]
        out = op(*primals, **kwargs)
        tx, ty = tangents[0], tangents[1]
        t = None
        if jvp is not None:
            if tx is not None or ty is not None:
                if zeros:
                    zero = torch.zeros_like(out)
                    tx, ty = (zero if t_ is None else t_ for t_ in (tx, ty))
                t = jvp(x, y, out, tx, ty)
        else:
            if tx is not None:
                t = pushx(tx, x, y, out)
            if ty is not None:
                t2 = pushy(ty, x, y, out)
                t = t2 if t is None else t + t2
        if t is not None and t.shape != out.shape:
            t = _broadcast_tangent(t, out.shape)
        return out, t

    def binary_vjp_rule(ct, primals, kwargs, out, needs):
        x, y = primals[0], primals[1]
        gx = unbroadcast(pbx(ct, x, y, out), x.shape) if needs[0] else None
        gy = unbroadcast(pby(ct, x, y, out), y.shape) if needs[1] else None
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


def _relu_pullback(g, x, out):
    # torch's kernel: exactly 0 where out <= 0, g elsewhere (a NaN output passes g), one pass
    # with no copy of the mask (a float mask's transient was a conv activation's size: 2% of
    # the per-sample-gradient CNN's peak memory); its own rules (def_mask_kernel) make the
    # second derivative torch's explicit zeros
    return aten.threshold_backward(g, out, 0)


def _pow_scalar_deriv(x, out, p):
    if p == 0:
        return torch.zeros_like(x)
    if p == 2 and type(p) in (int, float):
        # x.pow(1) is a copy of x (torch's pow kernel copies for exponent 1): the same bits
        # as torch's ``2 * x.pow(1)``, one op fewer for the square of every squared loss
        return p * x
    return p * x.pow(p - 1)


def _clamp_mask(x, out, lo=None, hi=None):
    """1 inside the bounds; at a bound as the installed torch (_compat.CLAMP_BOUNDS_EXCLUDED)."""
    m = torch.ones_like(x, dtype=torch.bool)
    strict = _compat.CLAMP_BOUNDS_EXCLUDED
    if lo is not None:
        m = m & ((x > lo) if strict else (x >= lo))
    if hi is not None:
        m = m & ((x < hi) if strict else (x <= hi))
    return m.to(x.dtype)


def _leaky_deriv(x, out, slope=0.01):
    return torch.where(x > 0, torch.ones_like(x), torch.full_like(x, slope))


def _rrelu_deriv(x, out, noise, lower=1.0 / 8, upper=1.0 / 3, training=False, generator=None):
    """rrelu_with_noise writes its draws into noise (1 where x > 0), which is then the slope, as
    torch's backward reads it; in eval (or a degenerate range) the slope is (lower + upper) / 2."""
    if training and upper - lower > 1e-6:
        return noise.to(x.dtype)
    return _leaky_deriv(x, out, (lower + upper) / 2)


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


_LN2 = math.log(2.0)
_LN10 = math.log(10.0)


def _gelu_pullback(g, x, o, approximate="none"):
    return aten.gelu_backward(g, x, approximate=approximate)


def _softplus_pullback(g, x, o, beta=1, threshold=20):
    return aten.softplus_backward(g, x, beta, threshold)


def _elu_pullback(g, x, o, alpha=1, scale=1, input_scale=1):
    return aten.elu_backward(g, alpha, scale, input_scale, False, x)


def _silu_pullback(g, x, o):
    s = torch.sigmoid(x)  # torch's infinitely_differentiable_silu_backward
    return g * s * (1.0 + x * (1.0 - s))


def _logit_pullback(g, x, o, eps=None):
    r = g / (x * (1.0 - x))
    if eps is None:  # outside [0, 1] logit is NaN, and so is its derivative (torch's choice)
        return torch.where((x >= 0) & (x <= 1), r, torch.full_like(r, math.nan))
    return torch.where((x >= eps) & (x <= 1 - eps), r, torch.zeros_like(r))


def _sinc_pullback(g, x, o):
    xp = x * math.pi
    den = x * x * math.pi
    num = xp * torch.cos(xp) - torch.sin(xp)
    out = g * conj_if_complex(num / den)
    return torch.where(den == 0, torch.zeros_like(out), out)


def _gelu_deriv2(x, approximate="none"):
    if approximate == "tanh":
        k, c = _SQRT_2_OVER_PI, 0.044715
        th = torch.tanh(k * (x + c * x**3))
        sech2 = 1 - th * th
        du = k * (1 + 3 * c * x * x)
        return sech2 * du + 0.5 * x * sech2 * (6 * k * c * x - 2 * th * du * du)
    return _INV_SQRT_2PI * torch.exp(-0.5 * x * x) * (2 - x * x)


def _softplus_deriv2(x, beta=1, threshold=20):
    # torch's softplus_double_backward masks with x * beta < threshold: 0 at the threshold,
    # where the first derivative still takes the sigmoid branch
    z = torch.sigmoid(x * beta)
    return torch.where(x * beta < threshold, beta * z * (1 - z), torch.zeros_like(z))


def _elu_derivs(s, alpha, scale, input_scale, is_result):
    """(d, d2) of elu at x (``is_result`` False) or as functions of its output (True). At the
    kink s = 0, d takes the negative branch but d2 the positive one (0): torch's
    elu_double_backward masks with ``s < 0`` where elu_backward tests ``s <= 0``."""
    pos, neg_side = s > 0, s < 0
    if is_result:
        d = torch.where(pos, torch.full_like(s, scale), input_scale * (s + alpha * scale))
        return d, torch.where(neg_side, torch.full_like(s, input_scale), torch.zeros_like(s))
    neg = alpha * scale * input_scale * torch.exp(s * input_scale)
    return (
        torch.where(pos, torch.full_like(s, scale), neg),
        torch.where(neg_side, neg * input_scale, torch.zeros_like(s)),
    )


def _logit_deriv2(x, eps=None):
    d = (2 * x - 1) / (x * (1 - x)).pow(2)
    if eps is None:
        return d
    return torch.where((x < eps) | (x > 1 - eps), torch.zeros_like(d), d)


def def_backward_kernel(op, d, d2, spos=1):
    """torch's fused pointwise backward kernels ``op(g, ..., s, ...) = g * conj(d(s, *params))``
    (``tanh_backward(g, y)``: d = 1 - y^2), with ``d2 = d/ds d``: linear in g, and what the
    second derivative of the forward op goes through (Note [Rounding as torch])."""

    def split(primals):
        params = [p for i, p in enumerate(primals) if i not in (0, spos)]
        return primals[0], primals[spos], params

    def backward_kernel_jvp_rule(primals, tangents, kwargs):
        out = op(*primals, **kwargs)
        g, s, params = split(primals)
        tg, ts = tangents[0], tangents[spos]
        t = None
        if tg is not None:
            t = op(tg, *primals[1:], **kwargs)
        if ts is not None:  # g conj(d(s)) is antiholomorphic in s
            t2 = g * conj_if_complex(d2(s, *params, **kwargs) * ts)
            t = t2 if t is None else t + t2
        return out, None if t is None else t.expand(out.shape)

    def backward_kernel_vjp_rule(ct, primals, kwargs, out, needs):
        g, s, params = split(primals)
        res = [None] * len(primals)
        if needs[0]:
            res[0] = unbroadcast(ct * d(s, *params, **kwargs), g.shape)
        if needs[spos]:
            a = g * conj_if_complex(d2(s, *params, **kwargs))
            res[spos] = unbroadcast(conj_if_complex(ct) * a, s.shape)
        return tuple(res)

    register_jvp_rule(op)(backward_kernel_jvp_rule)
    register_vjp_rule(op)(backward_kernel_vjp_rule)


def_backward_kernel(aten.tanh_backward.default, lambda y: 1 - y * y, lambda y: -2 * y)
def_backward_kernel(aten.sigmoid_backward.default, lambda y: y * (1 - y), lambda y: 1 - 2 * y)
def_backward_kernel(
    aten.gelu_backward.default,
    lambda x, approximate="none": _gelu_deriv(x, None, approximate),
    _gelu_deriv2,
)
def_backward_kernel(
    aten.softplus_backward.default,
    lambda x, b, th: _softplus_deriv(x, None, b, th),
    _softplus_deriv2,
)
def_backward_kernel(
    aten.elu_backward.default,
    lambda s, *p: _elu_derivs(s, *p)[0],
    lambda s, *p: _elu_derivs(s, *p)[1],
    spos=5,
)
def_backward_kernel(
    aten.logit_backward.default, lambda x, eps=None: _logit_deriv(x, None, eps), _logit_deriv2
)


def def_mask_kernel(op, spos=1):
    """torch's backward kernels that pass ``g`` where a mask of ``s`` holds, else 0
    (``threshold_backward(g, s, th)``): linear in g, piecewise constant in s. torch writes the
    derivative in s as explicit zeros (derivatives.yaml: ``self: zeros_like(grad)``, forward
    ``zeros_like(self_t) + op(grad_output_t, ...)``), so a second derivative through them is a
    fresh tensor batched like the cotangent (tangent), which vmap(hessian) of relu returns
    with torch's strides; a symbolic zero came back as a stride-0 expansion."""

    def mask_kernel_jvp_rule(primals, tangents, kwargs):
        out = op(*primals, **kwargs)
        tg, ts = tangents[0], tangents[spos]
        if tg is not None:
            return out, op(tg, *primals[1:], **kwargs)  # broadcasts as out does
        if ts is None:
            return out, None
        zero = torch.zeros_like(ts)
        return out, zero if zero.shape == out.shape else _broadcast_tangent(zero, out.shape)

    def mask_kernel_vjp_rule(ct, primals, kwargs, out, needs):
        g, s = primals[0], primals[spos]
        res = [None] * len(primals)
        if needs[0]:
            res[0] = unbroadcast(op(ct, *primals[1:], **kwargs), g.shape)
        if needs[spos]:
            res[spos] = unbroadcast(torch.zeros_like(ct), s.shape)
        return tuple(res)

    register_jvp_rule(op)(mask_kernel_jvp_rule)
    register_vjp_rule(op)(mask_kernel_vjp_rule)


def_mask_kernel(aten.threshold_backward.default)


# log_sigmoid_forward -> (out, buffer), only out differentiable. Without these rules it ran
# through torch's decomposition min(x, 0) - log1p(exp(-|x|)), whose second derivative at x = 0
# is 0 (|x|'s), not -1/4; torch's formula is its kernel log_sigmoid_backward(g, x, buffer).
def_backward_kernel(
    aten.log_sigmoid_backward.default,
    lambda x, buffer: torch.sigmoid(-x),
    lambda x, buffer: -torch.sigmoid(x) * torch.sigmoid(-x),
)


@register_jvp_rule(aten.log_sigmoid_forward.default)
def log_sigmoid_jvp_rule(primals, tangents, kwargs):
    x, t = primals[0], tangents[0]
    out, buffer = aten.log_sigmoid_forward.default(x)
    tangent = None if t is None else (aten.log_sigmoid_backward(t, x, buffer), None)
    return (out, buffer), tangent


@register_vjp_rule(aten.log_sigmoid_forward.default)
def log_sigmoid_vjp_rule(cts, primals, kwargs, out, needs):
    ct = cts[0]
    # the buffer is a workspace of the kernel: torch's double-backward formula of
    # log_sigmoid_backward takes it for a constant (and refuses one with a graph, which Note
    # [Outputs torch leaves without a graph] gives it when torch records)
    buffer = out[1].detach() if type(out[1]) is torch.Tensor else out[1]
    return (None if ct is None else aten.log_sigmoid_backward(ct, primals[0], buffer),)


def _mish_pullback(g, x, o):
    s = torch.sigmoid(x)  # torch's infinitely_differentiable_mish_backward
    th = torch.tanh(torch.nn.functional.softplus(x))
    return g * (th + x * s * (1.0 - th * th))


def _hardswish_derivs(x):
    # torch's kernel: 0 for x <= -3, x / 3 + 1/2 inside, 1 for x >= 3 (the ends were swapped
    # here: 1.5 at x = 3, -0.5 at -3, seen by reverse-over-reverse at the kinks)
    inner = (x > -3) & (x < 3)
    d = torch.where(x < 3, x / 3 + 0.5, torch.ones_like(x))
    d = torch.where(x <= -3, torch.zeros_like(x), d)
    return d, torch.where(inner, torch.full_like(x, 1 / 3), torch.zeros_like(x))


def_backward_kernel(
    aten.hardswish_backward.default,
    lambda x: _hardswish_derivs(x)[0],
    lambda x: _hardswish_derivs(x)[1],
)
def_backward_kernel(
    aten.hardsigmoid_backward.default,
    lambda x: torch.where((x > -3) & (x < 3), torch.full_like(x, 1 / 6), torch.zeros_like(x)),
    torch.zeros_like,
)


# d/dx f(x), with `o` = f(x) where that is cheaper
for _op, _d in (
    (aten.exp.default, lambda x, o: o),
    (aten.exp2.default, pullback(lambda g, x, o: g * conj_if_complex(o) * _LN2, _OUT_ONLY)),
    (aten.expm1.default, lambda x, o: o + 1),
    (aten.log.default, pullback(lambda g, x, o: g / conj_if_complex(x), _X_ONLY)),
    (aten.log2.default, pullback(lambda g, x, o: g / (conj_if_complex(x) * _LN2))),
    (aten.log10.default, pullback(lambda g, x, o: g / (conj_if_complex(x) * _LN10))),
    (aten.log1p.default, pullback(lambda g, x, o: g / conj_if_complex(x + 1))),
    (aten.sin.default, lambda x, o: torch.cos(x)),
    (aten.cos.default, lambda x, o: -torch.sin(x)),
    (aten.tan.default, lambda x, o: 1 + o * o),
    (aten.tanh.default, pullback(lambda g, x, o: aten.tanh_backward(g, o), _OUT_ONLY)),
    (aten.sinh.default, lambda x, o: torch.cosh(x)),
    (aten.cosh.default, lambda x, o: torch.sinh(x)),
    (aten.asin.default, lambda x, o: torch.rsqrt(1 - x * x)),
    (aten.acos.default, lambda x, o: -torch.rsqrt(1 - x * x)),
    (aten.atan.default, pullback(lambda g, x, o: g / conj_if_complex(x.pow(2) + 1))),
    (aten.asinh.default, lambda x, o: torch.rsqrt(x * x + 1)),
    # 1 / (sqrt(x - 1) sqrt(x + 1)), not rsqrt(x^2 - 1): complex x differ in sign for Re x < 0
    (aten.acosh.default, lambda x, o: torch.rsqrt(x - 1) * torch.rsqrt(x + 1)),
    (aten.atanh.default, pullback(lambda g, x, o: g / conj_if_complex(1 - x.pow(2)))),
    (aten.sigmoid.default, pullback(lambda g, x, o: aten.sigmoid_backward(g, o), _OUT_ONLY)),
    (aten.relu.default, pullback(_relu_pullback, _OUT_ONLY)),
    (aten.sqrt.default, pullback(lambda g, x, o: g / (2 * conj_if_complex(o)), _OUT_ONLY)),
    (aten.rsqrt.default, lambda x, o: -0.5 * o * o * o),
    (aten.reciprocal.default, lambda x, o: -o * o),
    (aten.erf.default, lambda x, o: _TWO_OVER_SQRT_PI * torch.exp(-x * x)),
    (aten.erfc.default, lambda x, o: -_TWO_OVER_SQRT_PI * torch.exp(-x * x)),
    (aten.erfinv.default, lambda x, o: 0.5 * math.sqrt(math.pi) * torch.exp(o * o)),
    (aten.gelu.default, pullback(_gelu_pullback, _X_ONLY)),
    (aten.silu.default, pullback(_silu_pullback, _X_ONLY)),
    (aten.mish.default, pullback(_mish_pullback)),
    (aten.hardswish.default, pullback(lambda g, x, o: aten.hardswish_backward(g, x))),
    (aten.hardsigmoid.default, pullback(lambda g, x, o: aten.hardsigmoid_backward(g, x))),
    (
        aten.celu.default,
        pullback(lambda g, x, o, alpha=1.0: aten.elu_backward(g, alpha, 1, 1.0 / alpha, False, x)),
    ),
    (aten.softplus.default, pullback(_softplus_pullback, _X_ONLY)),
    (aten.elu.default, pullback(_elu_pullback, _X_ONLY)),
    (aten.leaky_relu.default, _leaky_deriv),
    (aten.hardtanh.default, _hardtanh_deriv),
    (aten.rrelu_with_noise.default, _rrelu_deriv),
    (aten.pow.Tensor_Scalar, _pow_scalar_deriv),
    (aten.clamp.default, _clamp_mask),
    (aten.clamp_min.default, lambda x, o, lo: _clamp_mask(x, o, lo, None)),
    (aten.clamp_max.default, lambda x, o, hi: _clamp_mask(x, o, None, hi)),
    (aten.lgamma.default, lambda x, o: torch.digamma(x)),
    (aten.digamma.default, lambda x, o: torch.polygamma(1, x)),
    (aten.neg.default, lambda x, o: -torch.ones_like(x)),
    (aten.abs.default, _abs_deriv),
    (aten.angle.default, _angle_deriv),
    (aten.logit.default, pullback(_logit_pullback)),
    (aten.sinc.default, pullback(_sinc_pullback)),
    (
        aten.mul.Scalar,
        lambda x, o, s: torch.full_like(o, s) if not isinstance(s, torch.Tensor) else s,
    ),
    (aten.div.Scalar, pullback(lambda g, x, o, s: g / _conj_scalar(s))),
):
    def_unary(_op, _d)

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
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_empty.default,
    aten.new_full.default,
)


# partials (d/dx, d/dy) of binary ops
def _pow_dx(x, y, o):
    """torch's pow_backward_self: 0 where the exponent is 0 (also at x = 0, not 0 * inf)."""
    d = y * x.pow(y - 1)
    return torch.where(y == 0, torch.zeros_like(d), d)


def _pow_dy(x, y, o):
    """torch's pow_backward_exponent: out log x, 0 at x = 0 only for a real exponent >= 0
    (0^y = 0 there); a negative or complex exponent keeps inf * log 0."""
    d = o * torch.log(x if not x.is_complex() else x + 0j)
    nonneg = (y.real >= 0) & (y.imag == 0) if y.is_complex() else y >= 0
    return torch.where((x == 0) & nonneg, torch.zeros_like(d), d)


def _div_jvp(x, y, o, tx, ty):
    """torch's forward formula (tx - ty out) / y, one expression: at y = 0 the two partials'
    pushforwards would add inf - inf (nan) where it gives inf. A missing tangent is torch's
    zero tensor, whose product with out is 0 even where out is inf."""
    if ty is None:
        return tx / y
    return (-ty * o if tx is None else tx - ty * o) / y


def_binary(
    aten.div.Tensor,
    pullback(lambda g, x, y, o: g / conj_if_complex(y)),
    pullback(lambda g, x, y, o: -g * conj_if_complex(o / y)),
    jvp=_div_jvp,
    zeros=False,
)

for _op, _dx, _dy in (
    (aten.mul.Tensor, lambda x, y, o: y, lambda x, y, o: x),
    (aten.pow.Tensor_Tensor, _pow_dx, _pow_dy),
    (
        aten.hypot.default,
        pullback(lambda g, x, y, o: g * x / o),
        pullback(lambda g, x, y, o: g * y / o),
    ),
    (
        aten.xlogy.Tensor,
        # d/dx x log y = log y, also at x = 0; torch zeroes it only where log y is not finite
        pullback(lambda g, x, y, o: torch.xlogy(g, y).masked_fill((x == 0) & (y <= 0), 0.0)),
        pullback(lambda g, x, y, o: g * x / y),
    ),
    (  # as xlogy: torch zeroes d/dx only where log1p y is not finite
        aten.special_xlog1py.default,
        pullback(
            lambda g, x, y, o: torch.special.xlog1py(g, y).masked_fill((x == 0) & (y <= -1), 0.0)
        ),
        pullback(lambda g, x, y, o: g * x / (y + 1)),
    ),
    (aten.fmod.Tensor, lambda x, y, o: torch.ones_like(o), lambda x, y, o: -torch.trunc(x / y)),
    (
        aten.remainder.Tensor,
        lambda x, y, o: torch.ones_like(o),
        lambda x, y, o: -torch.floor(x / y),
    ),
):
    def_binary(_op, _dx, _dy)


def _atan2_recip(x, y):
    """torch's atan2_backward: 1 / (x^2 + y^2), and 0 at the origin (the zero subgradient)."""
    d = x * x + y * y
    return torch.where(d == 0, torch.zeros_like(d), d.reciprocal())


# torch's forward formula is not masked: its jvp at the origin is nan, as ours
def_binary(
    aten.atan2.default,
    pullback(lambda g, x, y, o: g * y * _atan2_recip(x, y)),
    pullback(lambda g, x, y, o: g * -x * _atan2_recip(x, y)),
    jvp=lambda x, y, o, tx, ty: (-x * ty + y * tx) / (x.pow(2) + y.pow(2)),
)


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
            t = _broadcast_tangent(t, out.shape)
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


# -- prelu: torch's formulas, whose masks differ at x = 0 ------------------------------------
# torch's jvp of _prelu_kernel takes slope 1 at x = 0 (x >= 0), its vjp (_prelu_kernel_backward)
# slope weight (x > 0), and the derivatives of that backward mask with x >= 0 again. PyTorch
# returns these one-sided choices, so we follow each formula (derivatives.yaml).
def _products(like, *pairs):
    """sum of a * t over the pairs whose tangent t is not None: a missing tangent is torch's
    zero tensor, whose product with inf is 0 (zeros_like would give nan)."""
    terms = [a * t for a, t in pairs if t is not None]
    if not terms:
        return torch.zeros_like(like)
    return functools.reduce(operator.add, terms)


@register_jvp_rule(aten._prelu_kernel.default)
def prelu_kernel_jvp_rule(primals, tangents, kwargs):
    x, w = primals
    out = aten._prelu_kernel.default(x, w)
    tx, tw = tangents
    if tx is None and tw is None:
        return out, None
    pos = _products(out, (1, tx))
    return out, torch.where(x >= 0, pos, _products(out, (w, tx), (x, tw))).expand(out.shape)


@register_vjp_rule(aten._prelu_kernel.default)
def prelu_kernel_vjp_rule(ct, primals, kwargs, out, needs):
    x, w = primals
    gx, gw = aten._prelu_kernel_backward.default(ct, x, w)
    return (gx if needs[0] else None, unbroadcast(gw, w.shape) if needs[1] else None)


@register_jvp_rule(aten._prelu_kernel_backward.default)
def prelu_kernel_backward_jvp_rule(primals, tangents, kwargs):
    g, x, w = primals
    out = aten._prelu_kernel_backward.default(g, x, w)
    tg, tx, tw = tangents
    nonneg = x >= 0
    t0 = torch.where(nonneg, _products(out[0], (1, tg)), _products(out[0], (w, tg), (g, tw)))
    t1 = torch.where(nonneg, torch.zeros_like(out[1]), _products(out[1], (g, tx), (x, tg)))
    return out, (t0.expand(out[0].shape), t1.expand(out[1].shape))


@register_vjp_rule(aten._prelu_kernel_backward.default)
def prelu_kernel_backward_vjp_rule(cts, primals, kwargs, out, needs):
    g, x, w = primals
    c0, c1 = cts
    nonneg, zero = x >= 0, torch.zeros((), dtype=x.dtype, device=x.device)
    gg = gx = gw = None
    if needs[0]:
        gg = torch.where(nonneg, _products(out[0], (1, c0)), _products(out[0], (w, c0), (x, c1)))
    if needs[1]:
        gx = torch.where(nonneg, zero, _products(out[1], (g, c1)))
    if needs[2]:
        gw = unbroadcast(torch.where(nonneg, zero, _products(out[0], (g, c0))), w.shape)
    return (gg, gx, gw)
