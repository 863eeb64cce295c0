"""Derivative rules of losses whose derivatives at the edges of their domain are torch's
conventions, not a decomposition's: binary_cross_entropy at probabilities 0 and 1.

Note [binary_cross_entropy at 0 and 1]
    torch clamps the log of the loss at -100 and divides its derivative by
    ``max(x (1 - x), 1e-12)``: at x = 0 or 1 (a float32 sigmoid saturates there) the gradient
    is finite, (x - target) / 1e-12. torch's decomposition, which ran before these rules,
    differentiates ``max(log x, -100)``: 0 * inf = nan. So the vjp is torch's kernel
    ``binary_cross_entropy_backward``, the target's derivative torch's ``-logit(x)``, and the
    jvp torch's forward formula, built from the same two."""

from __future__ import annotations

import torch

from ._registry import register_jvp_rule, register_vjp_rule
from ._util import unbroadcast

aten = torch.ops.aten


def _bce_args(primals):
    x, target = primals[0], primals[1]
    weight = primals[2] if len(primals) > 2 else None
    reduction = primals[3] if len(primals) > 3 else 1
    return x, target, weight, reduction


def _target_backward(g, x, target, weight, reduction):
    """torch's binary_cross_entropy_target_backward: d loss / d target = -logit(x)."""
    gt = -torch.logit(x) * g
    if weight is not None:
        gt = gt * weight
    return gt / max(target.numel(), 1) if reduction == 1 else gt


@register_jvp_rule(aten.binary_cross_entropy.default)
def binary_cross_entropy_jvp_rule(primals, tangents, kwargs):
    x, target, weight, reduction = _bce_args(primals)
    out = aten.binary_cross_entropy.default(*primals, **kwargs)
    tx, tt = tangents[0], tangents[1]
    if tx is None and tt is None:
        return out, None
    t = 0
    if tx is not None:
        t = aten.binary_cross_entropy_backward(tx, x, target, weight, 0)
    if tt is not None:
        t = t + _target_backward(tt, x, target, weight, 0)
    return out, t if reduction == 0 else (t.mean() if reduction == 1 else t.sum())


@register_vjp_rule(aten.binary_cross_entropy.default)
def binary_cross_entropy_vjp_rule(ct, primals, kwargs, out, needs):
    x, target, weight, reduction = _bce_args(primals)
    res = [None] * len(primals)
    if needs[0]:
        gx = aten.binary_cross_entropy_backward(ct, x, target, weight, reduction)
        res[0] = unbroadcast(gx, x.shape)
    if needs[1]:
        res[1] = unbroadcast(_target_backward(ct, x, target, weight, reduction), target.shape)
    return tuple(res)


_EPS = 1e-12  # torch's EPSILON of binary_cross_entropy's derivatives


def _weighted(v, x, weight, reduction):
    if weight is not None:
        v = v * weight
    return v / max(x.numel(), 1) if reduction == 1 else v


def _double_backward_self(g, ct, x, target, weight, reduction):
    """torch's binary_cross_entropy_double_backward (its eps, not the kernel's clamp)."""
    num = x * x - 2 * x * target + target
    gi = num / ((x + _EPS).pow(2) * (1 - x + _EPS).pow(2)) * (ct * g)
    return _weighted(gi, x, weight, reduction)


def _double_backward_target(g, ct, x, weight, reduction):
    """torch's binary_cross_entropy_double_backward_target."""
    gt = -ct * g / (x * (1 - x)).clamp_min(_EPS)
    return _weighted(gt, x, weight, reduction)


@register_jvp_rule(aten.binary_cross_entropy_backward.default)
def binary_cross_entropy_backward_jvp_rule(primals, tangents, kwargs):
    g, x, target = primals[:3]
    weight = primals[3] if len(primals) > 3 else None
    reduction = primals[4] if len(primals) > 4 else 1
    out = aten.binary_cross_entropy_backward.default(*primals, **kwargs)
    tg, tx, tt = tangents[:3]
    t = None
    for part in (
        None
        if tg is None
        else aten.binary_cross_entropy_backward(tg, x, target, weight, reduction),
        None if tx is None else _double_backward_self(g, tx, x, target, weight, reduction),
        None if tt is None else _double_backward_target(g, tt, x, weight, reduction),
    ):
        if part is not None:
            t = part if t is None else t + part
    return out, None if t is None else t.expand(out.shape)


@register_vjp_rule(aten.binary_cross_entropy_backward.default)
def binary_cross_entropy_backward_vjp_rule(ct, primals, kwargs, out, needs):
    g, x, target = primals[:3]
    weight = primals[3] if len(primals) > 3 else None
    reduction = primals[4] if len(primals) > 4 else 1
    res = [None] * len(primals)
    if needs[0]:
        gg = aten.binary_cross_entropy_backward(ct, x, target, weight, reduction)
        res[0] = unbroadcast(gg, g.shape)
    if needs[1]:
        res[1] = unbroadcast(_double_backward_self(g, ct, x, target, weight, reduction), x.shape)
    if needs[2]:
        gt = _double_backward_target(g, ct, x, weight, reduction)
        res[2] = unbroadcast(gt, target.shape)
    return tuple(res)
