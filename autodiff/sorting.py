"""Derivative rules of sorting and selection ops (sort, topk, kthvalue, median, ...).

Each returns ``(values, indices)`` with ``values = gather(x, dim, indices)``: the values' jvp
gathers the tangent at the indices, their vjp scatters the cotangent back (a permutation's
transpose is a gather by the inverse permutation, which stays differentiable); the indices
carry no derivative.
"""

from __future__ import annotations

import torch

from functransforms.deterministic import _ops as _det

from ._registry import register_jvp_rule, register_vjp_rule

aten = torch.ops.aten


def def_selection(op, dim_of, keepdim_of=lambda *a, **k: True, permutation=False):
    """``op(x, ...) -> (values, indices)`` selecting along ``dim_of(*primals)``; the
    selected dim is dropped unless ``keepdim_of(*primals)``; ``permutation``: indices permute
    the whole dim (sort)."""

    def index(primals, kwargs, indices):
        d = dim_of(*primals, **kwargs) % max(primals[0].dim(), 1)
        if primals[0].dim() and not keepdim_of(*primals, **kwargs):
            indices = indices.unsqueeze(d)
        return d, indices

    def selection_jvp_rule(primals, tangents, kwargs):
        out = op(*primals, **kwargs)
        t = tangents[0]
        if t is None:
            return out, None
        if primals[0].dim() == 0:
            return out, (t, None)
        d, idx = index(primals, kwargs, out[1])
        return out, (t.gather(d, idx).reshape(out[0].shape), None)

    def selection_vjp_rule(cts, primals, kwargs, out, needs):
        x, ct = primals[0], cts[0]
        rest = (None,) * (len(primals) - 1)
        if ct is None:
            return (None,) + rest
        if x.dim() == 0:
            return (ct,) + rest
        d, idx = index(primals, kwargs, out[1])
        ct = ct.reshape(idx.shape)
        if permutation:
            return (ct.gather(d, torch.argsort(idx, d)),) + rest
        zeros = torch.zeros(x.shape, dtype=ct.dtype, device=ct.device)
        return (_det.det_call(aten.scatter_add.default, zeros, d, idx, ct),) + rest

    register_jvp_rule(op)(selection_jvp_rule)
    register_vjp_rule(op)(selection_vjp_rule)


def _dim(default):
    return lambda x, *a, dim=default, **k: dim


def_selection(aten.sort.default, lambda x, dim=-1, *a: dim, permutation=True)
def_selection(aten.sort.stable, _dim(-1), permutation=True)
def_selection(aten.topk.default, lambda x, k, dim=-1, *a: dim)
def_selection(
    aten.kthvalue.default, lambda x, k, dim=-1, *a: dim, lambda x, k, dim=-1, keepdim=False: keepdim
)
for _op in (aten.median.dim, aten.nanmedian.dim, aten.mode.default):
    def_selection(_op, lambda x, dim=-1, *a: dim, lambda x, dim=-1, keepdim=False: keepdim)


def def_select_all(op):
    """``op(x)`` one element of x (median of all elements): the derivative is shared evenly by
    the elements equal to the result, as torch does."""

    def weight(x, out):
        mask = (x == out).to(x.dtype)
        return mask / mask.sum()

    def select_all_jvp_rule(primals, tangents, kwargs):
        out = op(*primals, **kwargs)
        t = tangents[0]
        return out, None if t is None else (weight(primals[0], out) * t).sum()

    def select_all_vjp_rule(ct, primals, kwargs, out, needs):
        return (ct * weight(primals[0], out),)

    register_jvp_rule(op)(select_all_jvp_rule)
    register_vjp_rule(op)(select_all_vjp_rule)


def_select_all(aten.median.default)
def_select_all(aten.nanmedian.default)
