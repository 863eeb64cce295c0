"""Derivative rules of linear data-movement ops (views, shape ops, copies, cat/stack/split,
indexing). For a linear op the jvp is the op applied to the tangent and the vjp is its
transpose, so each op is one line: its transpose."""

from __future__ import annotations

import torch

from functransforms.deterministic import _ops as _det

from ._registry import VJP_FORWARD, register_jvp_rule, register_vjp_rule
from ._util import unbroadcast

aten = torch.ops.aten


def def_linear(op, transpose):
    """``op(x, *params)``, linear in ``x``, with adjoint ``transpose(ct, x, *params, **kwargs)``."""

    def linear_jvp_rule(primals, tangents, kwargs):
        out = op(*primals, **kwargs)
        t = tangents[0]
        return out, None if t is None else op(t, *primals[1:], **kwargs)

    def linear_vjp_rule(ct, primals, kwargs, out, needs):
        return (transpose(ct, *primals, **kwargs),) + (None,) * (len(primals) - 1)

    register_jvp_rule(op)(linear_jvp_rule)
    register_vjp_rule(op)(linear_vjp_rule)


def _wrap(d, n):
    return d + n if d < 0 else d


def _inverse_perm(perm):
    n = len(perm)
    inv = [0] * n
    for i, p in enumerate(perm):
        inv[_wrap(p, n)] = i
    return inv


def _zeros(x, ct):
    return torch.zeros(x.shape, dtype=ct.dtype, device=ct.device)


def _expand_transpose(ct, x, size, implicit=False):
    return unbroadcast(ct, x.shape)


def _reshape_back(ct, x, *a, **k):
    return ct.reshape(x.shape)


for _op, _tr in (
    (aten.view.default, _reshape_back),
    (aten._unsafe_view.default, _reshape_back),
    (aten.reshape.default, _reshape_back),
    (aten.squeeze.default, _reshape_back),
    (aten.squeeze.dim, _reshape_back),
    (aten.squeeze.dims, _reshape_back),
    (aten.unsqueeze.default, _reshape_back),
    (aten.flatten.using_ints, _reshape_back),
    (aten.expand.default, _expand_transpose),
    (aten.permute.default, lambda ct, x, dims: ct.permute(_inverse_perm(dims))),
    (aten.transpose.int, lambda ct, x, d0, d1: ct.transpose(d0, d1)),
    (aten.t.default, lambda ct, x: ct.t()),
    (aten.clone.default, lambda ct, x, **k: ct),
    (aten.alias.default, lambda ct, x: ct),
    (aten.lift_fresh.default, lambda ct, x: ct),
    (aten._to_copy.default, lambda ct, x, **k: ct),
    (aten.select.int, lambda ct, x, dim, i: aten.select_scatter.default(_zeros(x, ct), ct, dim, i)),
    (
        aten.slice.Tensor,
        lambda ct, x, dim=0, start=None, end=None, step=1: aten.slice_scatter.default(
            _zeros(x, ct), ct, dim, start, end, step
        ),
    ),
    (
        aten.diagonal.default,
        lambda ct, x, offset=0, d1=0, d2=1: aten.diagonal_scatter.default(
            _zeros(x, ct), ct, offset, d1, d2
        ),
    ),
    (aten.flip.default, lambda ct, x, dims: ct.flip(dims)),
    (
        aten.roll.default,
        lambda ct, x, shifts, dims=(): (
            ct.roll([-s for s in shifts], dims)
            if dims
            else ct.flatten().roll([-s for s in shifts]).reshape(x.shape)
        ),
    ),
    (aten.repeat.default, lambda ct, x, reps: _repeat_transpose(ct, x, reps)),
    (aten.resolve_conj.default, lambda ct, x: ct),
    (aten.resolve_neg.default, lambda ct, x: ct),
    (aten.real.default, lambda ct, x: ct + 0j if x.is_complex() else ct),
    (aten.imag.default, lambda ct, x: ct * 1j),
    (aten.view_as_real.default, lambda ct, x: torch.view_as_complex(ct.contiguous())),
    (aten.view_as_complex.default, lambda ct, x: torch.view_as_real(ct)),
    (
        aten.index_select.default,
        lambda ct, x, dim, idx: _det.det_call(aten.index_add.default, _zeros(x, ct), dim, idx, ct),
    ),
    (
        aten.gather.default,
        lambda ct, x, dim, idx, **k: _det.det_call(
            aten.scatter_add.default, _zeros(x, ct), dim, idx, ct
        ),
    ),
    (
        aten.index.Tensor,
        lambda ct, x, indices: _det.det_call(
            aten.index_put.default, _zeros(x, ct), indices, ct, True
        ),
    ),
    (aten.cumsum.default, lambda ct, x, dim, **k: _cumsum_transpose(ct, dim)),
    (aten.unfold.default, lambda ct, x, dim, size, step: _unfold_transpose(ct, x, dim, size, step)),
):
    def_linear(_op, _tr)


@register_vjp_rule(aten._to_sparse.default, aten._to_sparse.sparse_dim)
def to_sparse_vjp_rule(ct, primals, kwargs, out, needs):
    """to_sparse changes the layout, not the values: the cotangent goes back as a dense tensor
    (torch's to_dense of a sparse cotangent). No jvp: torch has none (sparse tangents)."""
    g = ct.to_dense() if ct.layout != torch.strided else ct
    return (g,) + (None,) * (len(primals) - 1)


# Note [No lazy conjugate inside wrappers]
#     Inside __torch_dispatch__ the dispatcher excludes every key above Python, Conjugate and
#     Negative included, so a kernel called from a rule ignores a tensor's lazy conj/neg bit
#     (`z * z.conj()` would compute z * z). Plain arguments arrive resolved (the Conjugate key runs
#     before Python), so the invariant is: a value held by a wrapper never carries the bits. The
#     conj/neg views below materialize (conj_physical), and the public entry points resolve the
#     user's inputs. Rules may still call .conj() on a value they pass straight to a wrapper op.
def _materialized(op):
    def materialized_jvp_rule(primals, tangents, kwargs):
        t = tangents[0]
        return op(primals[0]), None if t is None else op(t)

    def materialized_vjp_rule(ct, primals, kwargs, out, needs):
        return (op(ct),)

    return materialized_jvp_rule, materialized_vjp_rule


for _op, _f in (
    (aten._conj.default, torch.conj_physical),  # d conj(z) = conj(dz): R-linear, its own adjoint
    (aten.conj_physical.default, torch.conj_physical),
    (aten._conj_physical.default, torch.conj_physical),
    (aten._neg_view.default, torch.neg),
):
    _j, _v = _materialized(_f)
    register_jvp_rule(_op)(_j)
    register_vjp_rule(_op)(_v)
    VJP_FORWARD[_op] = _f


def _cumsum_transpose(ct, dim):
    if ct.dim() == 0:  # a 0-d cumsum is the identity (and flip of a 0-d batched value is not)
        return ct
    return ct.flip(dim).cumsum(dim).flip(dim)


def _repeat_transpose(ct, x, reps):
    lead = len(reps) - x.dim()
    shape = list(x.shape)
    split = []
    for i, r in enumerate(reps):
        n = shape[i - lead] if i >= lead else 1
        split += [r, n]
    ct = ct.reshape(split).sum(list(range(0, 2 * len(reps), 2)))
    return ct.reshape(x.shape)


def _unfold_transpose(ct, x, dim, size, step):
    if x.dim() == 0:  # a 0-d x unfolds to shape (1,)
        return ct.reshape(())
    out = _zeros(x, ct)
    n = ct.shape[dim] if ct.dim() > 0 else 1
    for i in range(n):
        piece = ct.select(dim, i).movedim(-1, dim)
        out = out.slice_scatter(
            out.narrow(dim, i * step, size) + piece, dim, i * step, i * step + size
        )
    return out


def _multi_out_linear(op, transpose):
    def multi_jvp_rule(primals, tangents, kwargs):
        out = op(*primals, **kwargs)
        t = tangents[0]
        return out, None if t is None else op(t, *primals[1:], **kwargs)

    def multi_vjp_rule(cts, primals, kwargs, out, needs):
        cts = [c if c is not None else torch.zeros_like(o) for c, o in zip(cts, out)]
        return (transpose(cts, *primals, **kwargs),) + (None,) * (len(primals) - 1)

    return multi_jvp_rule, multi_vjp_rule


for _op, _tr in (
    (aten.split.Tensor, lambda cts, x, size, dim=0: torch.cat(cts, dim)),
    (aten.split_with_sizes.default, lambda cts, x, sizes, dim=0: torch.cat(cts, dim)),
    (aten.unbind.int, lambda cts, x, dim=0: torch.stack(cts, dim)),
):
    _j, _v = _multi_out_linear(_op, _tr)
    register_jvp_rule(_op)(_j)
    register_vjp_rule(_op)(_v)


@register_jvp_rule(aten.cat.default)
def cat_jvp_rule(primals, tangents, kwargs):
    tensors = primals[0]
    dim = primals[1] if len(primals) > 1 else 0
    out = torch.cat(tensors, dim)
    ts = tangents[0]
    if ts is None:
        return out, None
    return out, torch.cat(
        [t if t is not None else torch.zeros_like(x) for t, x in zip(ts, tensors)], dim
    )


@register_vjp_rule(aten.cat.default)
def cat_vjp_rule(ct, primals, kwargs, out, needs):
    tensors = primals[0]
    dim = primals[1] if len(primals) > 1 else 0
    sizes = [
        t.shape[dim]
        if t.dim() > 0 and not (t.dim() == 1 and t.shape[0] == 0 and out.dim() > 1)
        else 0
        for t in tensors
    ]
    pieces = torch.split(ct, sizes, dim if ct.dim() else 0)
    return [p.reshape(t.shape) for p, t in zip(pieces, tensors)], None


@register_jvp_rule(aten.stack.default)
def stack_jvp_rule(primals, tangents, kwargs):
    tensors = primals[0]
    dim = primals[1] if len(primals) > 1 else 0
    out = torch.stack(tensors, dim)
    ts = tangents[0]
    if ts is None:
        return out, None
    return out, torch.stack(
        [t if t is not None else torch.zeros_like(x) for t, x in zip(ts, tensors)], dim
    )


@register_vjp_rule(aten.stack.default)
def stack_vjp_rule(ct, primals, kwargs, out, needs):
    dim = primals[1] if len(primals) > 1 else 0
    return list(ct.unbind(dim)), None


@register_jvp_rule(aten.copy.default)
def copy_jvp_rule(primals, tangents, kwargs):
    """copy(self, src): the value of src, broadcast to self's shape and dtype."""
    x, src = primals[0], primals[1]
    out = aten.copy.default(x, src, *primals[2:])
    t = tangents[1]
    return out, None if t is None else t.to(out.dtype).expand(out.shape)


@register_vjp_rule(aten.copy.default)
def copy_vjp_rule(ct, primals, kwargs, out, needs):
    return None, unbroadcast(ct, primals[1].shape) if needs[1] else None


@register_jvp_rule(aten.where.self)
def where_jvp_rule(primals, tangents, kwargs):
    c, x, y = primals
    out = torch.where(c, x, y)
    tx, ty = tangents[1], tangents[2]
    if tx is None and ty is None:
        return out, None
    zx = tx if tx is not None else torch.zeros((), dtype=out.dtype, device=out.device)
    zy = ty if ty is not None else torch.zeros((), dtype=out.dtype, device=out.device)
    return out, torch.where(c, zx, zy).expand(out.shape)


@register_vjp_rule(aten.where.self)
def where_vjp_rule(ct, primals, kwargs, out, needs):
    c, x, y = primals
    zero = torch.zeros((), dtype=ct.dtype, device=ct.device)
    gx = unbroadcast(torch.where(c, ct, zero), x.shape) if needs[1] else None
    gy = unbroadcast(torch.where(c, zero, ct), y.shape) if needs[2] else None
    return None, gx, gy


@register_jvp_rule(aten.masked_fill.Scalar)
def masked_fill_jvp_rule(primals, tangents, kwargs):
    out = aten.masked_fill.Scalar(*primals)
    t = tangents[0]
    return out, None if t is None else t.masked_fill(primals[1], 0).expand(out.shape)


@register_vjp_rule(aten.masked_fill.Scalar)
def masked_fill_vjp_rule(ct, primals, kwargs, out, needs):
    return unbroadcast(ct.masked_fill(primals[1], 0), primals[0].shape), None, None


# scatter-style ops: linear in (base, src) jointly; the src cotangent is the matching view
def def_scatter(op, view):
    def scatter_jvp_rule(primals, tangents, kwargs):
        base, src = primals[0], primals[1]
        out = op(*primals, **kwargs)
        tb, ts = tangents[0], tangents[1]
        if tb is None and ts is None:
            return out, None
        tb = tb if tb is not None else torch.zeros_like(base)
        ts = ts if ts is not None else torch.zeros_like(src)
        return out, op(tb, ts, *primals[2:], **kwargs)

    def scatter_vjp_rule(ct, primals, kwargs, out, needs):
        src = primals[1]
        gb = (
            op(ct, torch.zeros_like(src, dtype=ct.dtype), *primals[2:], **kwargs)
            if needs[0]
            else None
        )
        gs = view(ct, *primals[2:], **kwargs) if needs[1] else None
        return (gb, gs) + (None,) * (len(primals) - 2)

    register_jvp_rule(op)(scatter_jvp_rule)
    register_vjp_rule(op)(scatter_vjp_rule)


def_scatter(aten.select_scatter.default, lambda ct, dim, i: ct.select(dim, i))
def_scatter(
    aten.slice_scatter.default,
    lambda ct, dim=0, start=None, end=None, step=1: aten.slice.Tensor(ct, dim, start, end, step),
)
def_scatter(
    aten.diagonal_scatter.default, lambda ct, offset=0, d1=0, d2=1: ct.diagonal(offset, d1, d2)
)


@register_jvp_rule(aten.index_put.default)
def index_put_jvp_rule(primals, tangents, kwargs):
    """index_put(x, indices, v, accumulate) is linear in (x, v) jointly."""
    indices, v = primals[1], primals[2]
    out = aten.index_put.default(*primals, **kwargs)
    tx, tv = tangents[0], tangents[2]
    if tx is None and tv is None:
        return out, None
    tx = tx if tx is not None else torch.zeros_like(out)
    tv = tv if tv is not None else torch.zeros(v.shape, dtype=out.dtype, device=out.device)
    return out, _det.det_call(aten.index_put.default, tx, indices, tv, *primals[3:], **kwargs)


@register_vjp_rule(aten.index_put.default)
def index_put_vjp_rule(ct, primals, kwargs, out, needs):
    indices, v = primals[1], primals[2]
    accumulate = primals[3] if len(primals) > 3 else kwargs.get("accumulate", False)
    gx = gv = None
    if needs[0]:  # overwritten positions get no cotangent unless accumulating
        gx = ct if accumulate else aten.index_put.default(ct, indices, _zeros(v, ct))
    if needs[2]:
        gv = unbroadcast(aten.index.Tensor(ct, indices), v.shape)
    return (gx, None, gv) + (None,) * (len(primals) - 3)


def def_scatter_src(op, accumulate):
    """``op(x, dim, index, src)``, linear in (x, src) jointly: scatter_add adds src at index,
    scatter overwrites (then the overwritten entries of x get no cotangent)."""

    def scatter_src_jvp_rule(primals, tangents, kwargs):
        x, dim, index, src = primals[:4]
        out = op(*primals, **kwargs)
        tx, ts = tangents[0], tangents[3]
        if tx is None and ts is None:
            return out, None
        tx = tx if tx is not None else torch.zeros_like(out)
        ts = ts if ts is not None else torch.zeros(src.shape, dtype=out.dtype, device=out.device)
        return out, _det.det_call(op, tx, dim, index, ts, *primals[4:], **kwargs)

    def scatter_src_vjp_rule(ct, primals, kwargs, out, needs):
        x, dim, index, src = primals[:4]
        gx = gs = None
        if needs[0]:
            gx = ct if accumulate else ct.scatter(dim, index, 0.0)
        if needs[3]:
            gs = ct.gather(dim, index)
        return (gx, None, None, gs) + (None,) * (len(primals) - 4)

    register_jvp_rule(op)(scatter_src_jvp_rule)
    register_vjp_rule(op)(scatter_src_vjp_rule)


def_scatter_src(aten.scatter_add.default, accumulate=True)
def_scatter_src(aten.scatter.src, accumulate=False)


@register_jvp_rule(aten.scatter.value)
def scatter_value_jvp_rule(primals, tangents, kwargs):
    """scatter(x, dim, index, value): x with constants written at index."""
    out = aten.scatter.value(*primals, **kwargs)
    t = tangents[0]
    return out, None if t is None else t.scatter(primals[1], primals[2], 0.0)


@register_vjp_rule(aten.scatter.value)
def scatter_value_vjp_rule(ct, primals, kwargs, out, needs):
    return (ct.scatter(primals[1], primals[2], 0.0),) + (None,) * (len(primals) - 1)
