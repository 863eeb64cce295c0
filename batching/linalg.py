"""Batching rules for matrix products. One idea: put batch dims in front and let
``torch.matmul`` broadcast; a product with both operands batched becomes a batched product."""

from __future__ import annotations

import torch

from ._registry import register_vmap_rule
from ._util import pad_to, to_front

aten = torch.ops.aten


def _fronts(args, bdims):
    a, b = args[0], args[1]
    ba, bb = bdims[0], bdims[1]
    return (a if ba is None else to_front(a, ba)), (b if bb is None else to_front(b, bb)), ba, bb


@register_vmap_rule(aten.mm.default, aten.bmm.default)
def mm_vmap_rule(interp, args, bdims, kwargs):
    a, b, ba, bb = _fronts(args, bdims)
    return torch.matmul(a, b), 0


@register_vmap_rule(aten.mv.default)
def mv_vmap_rule(interp, args, bdims, kwargs):
    A, x, bA, bx = _fronts(args, bdims)
    if bx is None:
        return torch.matmul(A, x), 0  # [B, n, k] @ [k] -> [B, n]
    if bA is None:
        return torch.matmul(x, A.mT), 0  # [B, k] @ [k, n] -> [B, n]
    return torch.matmul(A, x.unsqueeze(-1)).squeeze(-1), 0


@register_vmap_rule(aten.dot.default)
def dot_vmap_rule(interp, args, bdims, kwargs):
    a, b, ba, bb = _fronts(args, bdims)
    if ba is not None and bb is not None:
        return (a * b).sum(-1), 0
    return (torch.matmul(a, b) if bb is None else torch.matmul(b, a)), 0  # [B, k] @ [k] -> [B]


@register_vmap_rule(aten.vdot.default)
def vdot_vmap_rule(interp, args, bdims, kwargs):
    return dot_vmap_rule(interp, [args[0].conj(), args[1]], bdims, kwargs)


@register_vmap_rule(aten.addmm.default)
def addmm_vmap_rule(interp, args, bdims, kwargs):
    bias, (prod, _) = args[0], mm_vmap_rule(interp, args[1:], bdims[1:], {})
    beta = kwargs.get("beta", 1)
    alpha = kwargs.get("alpha", 1)
    if alpha != 1:
        prod = prod * alpha
    if bdims[0] is not None:
        bias = pad_to(to_front(bias, bdims[0]), 2)
    if beta == 0:
        return prod, 0
    return prod + (bias if beta == 1 else bias * beta), 0


@register_vmap_rule(aten.addmv.default)
def addmv_vmap_rule(interp, args, bdims, kwargs):
    bias, (prod, _) = args[0], mv_vmap_rule(interp, args[1:], bdims[1:], {})
    beta = kwargs.get("beta", 1)
    alpha = kwargs.get("alpha", 1)
    if alpha != 1:
        prod = prod * alpha
    if bdims[0] is not None:
        bias = pad_to(to_front(bias, bdims[0]), 1)
    if beta == 0:
        return prod, 0
    return prod + (bias if beta == 1 else bias * beta), 0


@register_vmap_rule(aten.baddbmm.default)
def baddbmm_vmap_rule(interp, args, bdims, kwargs):
    bias, (prod, _) = args[0], mm_vmap_rule(interp, args[1:], bdims[1:], {})
    beta = kwargs.get("beta", 1)
    alpha = kwargs.get("alpha", 1)
    if alpha != 1:
        prod = prod * alpha
    if bdims[0] is not None:
        bias = pad_to(to_front(bias, bdims[0]), 3)
    if beta == 0:
        return prod, 0
    return prod + (bias if beta == 1 else bias * beta), 0


@register_vmap_rule(aten.matmul.default)
def matmul_vmap_rule(interp, args, bdims, kwargs):
    """torch.matmul semantics: 1-D operands are promoted to matrices and the added dim removed."""
    a, b = args[0], args[1]
    ba, bb = bdims[0], bdims[1]
    a1 = a.dim() - (ba is not None) == 1
    b1 = b.dim() - (bb is not None) == 1
    if ba is not None:
        a = to_front(a, ba)
    if bb is not None:
        b = to_front(b, bb)
    if a1:
        a = a.unsqueeze(-2)
    if b1:
        b = b.unsqueeze(-1)
    nd = max(a.dim() - (ba is not None), b.dim() - (bb is not None))
    if ba is not None:
        a = pad_to(a, nd)
    if bb is not None:
        b = pad_to(b, nd)
    out = torch.matmul(a, b)
    if a1:
        out = out.squeeze(-2)
    if b1:
        out = out.squeeze(-1)
    return out, 0
