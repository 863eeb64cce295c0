"""Batching rules for matrix products. One idea: put batch dims in front and let
``torch.matmul`` broadcast; a product with both operands batched becomes a batched product."""

from __future__ import annotations

import torch

from ._registry import register_vmap_rule
from ._util import expand_front, pad_to, to_front

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


def def_add_product(op, product_rule, out_rank):
    """``op(bias, a, b, beta, alpha) = beta * bias + alpha * product(a, b)``."""

    def add_product_vmap_rule(interp, args, bdims, kwargs):
        prod, _ = product_rule(interp, args[1:], bdims[1:], {})
        beta = kwargs.get("beta", 1)
        alpha = kwargs.get("alpha", 1)
        if alpha != 1:
            prod = prod * alpha
        if beta == 0:
            return prod, 0
        bias = args[0]
        if bdims[0] is not None:
            bias = pad_to(to_front(bias, bdims[0]), out_rank)
        return prod + (bias if beta == 1 else bias * beta), 0

    register_vmap_rule(op)(add_product_vmap_rule)


def_add_product(aten.addmm.default, mm_vmap_rule, 2)
def_add_product(aten.addmv.default, mv_vmap_rule, 1)
def_add_product(aten.baddbmm.default, mm_vmap_rule, 3)


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


def def_batched_linalg(op, tensor_pos=(0,)):
    """Ops that already take leading batch dims (``[..., n, n]``): every tensor argument gets
    the batch dim in front (unbatched ones expanded); outputs keep it in front. Placeholder
    outputs (e.g. the empty eigenvectors of ``eigvalsh``) carry no batch dim."""

    def batched_linalg_vmap_rule(interp, args, bdims, kwargs):
        B = interp.batch_size
        a = list(args)
        for k in tensor_pos:
            if k < len(a) and isinstance(a[k], torch.Tensor):
                a[k] = expand_front(a[k], bdims[k], B)
        out = op(*a, **kwargs)
        if isinstance(out, torch.Tensor):
            return out, 0
        return out, tuple(0 if o.dim() > 0 and o.shape[0] == B else None for o in out)

    register_vmap_rule(op)(batched_linalg_vmap_rule)


for _op, _pos in (
    (aten._linalg_slogdet.default, (0,)),
    (aten._linalg_det.default, (0,)),
    (aten.linalg_inv_ex.default, (0,)),
    (aten.linalg_cholesky_ex.default, (0,)),
    (aten._linalg_eigh.default, (0,)),
    (aten.linalg_qr.default, (0,)),
    (aten._linalg_svd.default, (0,)),
    (aten.linalg_lu_factor_ex.default, (0,)),
    (aten.linalg_solve_triangular.default, (0, 1)),
    (aten.cholesky_solve.default, (0, 1)),
    (aten.triangular_solve.default, (0, 1)),
    (aten.linalg_householder_product.default, (0, 1)),
):
    def_batched_linalg(_op, _pos)


@register_vmap_rule(aten._linalg_solve_ex.default)
def linalg_solve_vmap_rule(interp, args, bdims, kwargs):
    """solve(A, b): a logically 1-d ``b`` is a vector; unsqueeze it so batching cannot make it
    look like a matrix."""
    A, b = args[0], args[1]
    B = interp.batch_size
    A = expand_front(A, bdims[0], B)
    left = args[2] if len(args) > 2 else kwargs.get("left", True)
    vec = b.dim() - (bdims[1] is not None) == 1
    b = expand_front(b, bdims[1], B)
    if vec:
        b = b.unsqueeze(-1) if left else b.unsqueeze(-2)
    out = aten._linalg_solve_ex.default(A, b, *args[2:], **kwargs)
    res = out[0].squeeze(-1 if left else -2) if vec else out[0]
    return (res, *out[1:]), (0, 0, 0, 0)


@register_vmap_rule(aten._cdist_forward.default)
def cdist_vmap_rule(interp, args, bdims, kwargs):
    x1, x2 = args[0], args[1]
    nd = max(x1.dim() - (bdims[0] is not None), x2.dim() - (bdims[1] is not None))
    x1 = pad_to(expand_front(x1, bdims[0], interp.batch_size), nd)
    x2 = pad_to(expand_front(x2, bdims[1], interp.batch_size), nd)
    return aten._cdist_forward.default(x1, x2, *args[2:], **kwargs), 0


@register_vmap_rule(aten._linalg_check_errors.default)
def linalg_check_errors_vmap_rule(interp, args, bdims, kwargs):
    """Checks every example's ``info`` at once (as one batch of matrices)."""
    info, api_name = args[0], args[1]
    aten._linalg_check_errors.default(to_front(info, bdims[0]), api_name, is_matrix=False)
    return None, None
