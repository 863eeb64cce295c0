"""Derivative rules of matrix products (bilinear: each factor's vjp is the product with the
other's conjugate transpose)."""

from __future__ import annotations

import torch

from ._registry import register_jvp_rule, register_vjp_rule
from ._util import unbroadcast

aten = torch.ops.aten


def def_bilinear(op, vjp_a, vjp_b):
    def bilinear_jvp_rule(primals, tangents, kwargs):
        a, b = primals[0], primals[1]
        out = op(*primals, **kwargs)
        ta, tb = tangents[0], tangents[1]
        t = None
        if ta is not None:
            t = op(ta, b, **kwargs)
        if tb is not None:
            t2 = op(a, tb, **kwargs)
            t = t2 if t is None else t + t2
        return out, t

    def bilinear_vjp_rule(ct, primals, kwargs, out, needs):
        a, b = primals[0], primals[1]
        return (vjp_a(ct, a, b) if needs[0] else None, vjp_b(ct, a, b) if needs[1] else None)

    register_jvp_rule(op)(bilinear_jvp_rule)
    register_vjp_rule(op)(bilinear_vjp_rule)


def_bilinear(aten.mm.default, lambda ct, a, b: ct @ b.mH, lambda ct, a, b: a.mH @ ct)
def_bilinear(aten.bmm.default, lambda ct, a, b: ct @ b.mH, lambda ct, a, b: a.mH @ ct)
def_bilinear(aten.mv.default, lambda ct, a, b: ct.unsqueeze(-1) * b.conj(), lambda ct, a, b: a.mH @ ct)
def_bilinear(aten.dot.default, lambda ct, a, b: ct * b.conj(), lambda ct, a, b: ct * a.conj())
def_bilinear(aten.vdot.default, lambda ct, a, b: (ct * b.conj()).conj(), lambda ct, a, b: ct * a)


def _matmul_vjp(ct, a, b, which):
    a1, b1 = a.dim() == 1, b.dim() == 1
    a2 = a.unsqueeze(0) if a1 else a
    b2 = b.unsqueeze(-1) if b1 else b
    c2 = ct
    if a1:
        c2 = c2.unsqueeze(-2)
    if b1:
        c2 = c2.unsqueeze(-1)
    if which == 0:
        return unbroadcast(c2 @ b2.mH, a2.shape).reshape(a.shape)
    return unbroadcast(a2.mH @ c2, b2.shape).reshape(b.shape)


def_bilinear(
    aten.matmul.default,
    lambda ct, a, b: _matmul_vjp(ct, a, b, 0),
    lambda ct, a, b: _matmul_vjp(ct, a, b, 1),
)


def def_add_product(op, product, vjp_a, vjp_b):
    """``op(bias, a, b, beta, alpha) = beta * bias + alpha * product(a, b)``."""

    def add_product_jvp_rule(primals, tangents, kwargs):
        bias, a, b = primals[0], primals[1], primals[2]
        beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
        out = op(*primals, **kwargs)
        tc, ta, tb = tangents[0], tangents[1], tangents[2]
        t = None
        if ta is not None:
            t = product(ta, b)
        if tb is not None:
            t = product(a, tb) if t is None else t + product(a, tb)
        if t is not None and alpha != 1:
            t = t * alpha
        if tc is not None:
            tc = tc if beta == 1 else tc * beta
            t = tc.expand(out.shape) if t is None else t + tc
        return out, t

    def add_product_vjp_rule(ct, primals, kwargs, out, needs):
        bias, a, b = primals[0], primals[1], primals[2]
        beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
        ca = ct if alpha == 1 else ct * alpha
        return (
            unbroadcast(ct if beta == 1 else ct * beta, bias.shape) if needs[0] and beta != 0 else None,
            vjp_a(ca, a, b) if needs[1] else None,
            vjp_b(ca, a, b) if needs[2] else None,
        )

    register_jvp_rule(op)(add_product_jvp_rule)
    register_vjp_rule(op)(add_product_vjp_rule)


def_add_product(aten.addmm.default, torch.mm, lambda ct, a, b: ct @ b.mH, lambda ct, a, b: a.mH @ ct)
def_add_product(aten.baddbmm.default, torch.bmm, lambda ct, a, b: ct @ b.mH, lambda ct, a, b: a.mH @ ct)
def_add_product(
    aten.addmv.default, torch.mv, lambda ct, a, b: ct.unsqueeze(-1) * b.conj(), lambda ct, a, b: a.mH @ ct
)
