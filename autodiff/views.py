"""Derivative rules of linear data-movement ops (views, shape ops, copies, cat/stack/split).
Indexing ops are in autodiff/indexing.py, cumsum in autodiff/scans.py. For a linear op the jvp
is the op applied to the tangent and the vjp is its transpose, so each op is one line: its
transpose."""

from __future__ import annotations

import torch

from functransforms._core.levels import copy_as_torch_records

from ._registry import VJP_FORWARD, register_jvp_rule, register_vjp_rule
from ._util import select_scatter, slice_scatter, unbroadcast, zeros_shaped

aten = torch.ops.aten


def def_linear(op, transpose, on_tangent=None):
    """``op(x, *params)``, linear in ``x``, with adjoint ``transpose(ct, x, *params, **kwargs)``.
    ``on_tangent`` replaces ``op`` on the tangent where ``op`` depends on the layout
    (Note [Tangents have their own layout])."""
    tangent_op = op if on_tangent is None else on_tangent

    def linear_jvp_rule(primals, tangents, kwargs):
        out = op(*primals, **kwargs)
        t = tangents[0]
        return out, None if t is None else tangent_op(t, *primals[1:], **kwargs)

    def linear_vjp_rule(ct, primals, kwargs, out, needs):
        return (transpose(ct, *primals, **kwargs),) + (None,) * (len(primals) - 1)

    register_jvp_rule(op)(linear_jvp_rule)
    register_vjp_rule(op)(linear_vjp_rule)


def _inverse_perm(perm):
    n = len(perm)
    inv = [0] * n
    for i, p in enumerate(perm):
        inv[p % n] = i  # permute accepts negative dims
    return inv


def _expand_transpose(ct, x, size, implicit=False):
    return unbroadcast(ct, x.shape)


def _reshape_back(ct, x, *a, **k):
    return ct.reshape(x.shape)


# Note [Tangents have their own layout]
#     A Dual/GradTensor reports its primal's strides, and torch decides above the dispatcher from
#     them whether `reshape`, `contiguous()` or `movedim(...).contiguous()` is a view: a
#     transposed primal with a contiguous tangent (`jvp(f, (x.mT,), (t,))`, and every jacfwd of a
#     non-contiguous input, whose basis tangents are contiguous) reaches `aten.view` with a
#     tangent the view cannot take. The tangent of a view is the same reshape of the tangent,
#     copied when its layout needs it: a jvp rule never writes through a tangent (writes rebind,
#     Note [In-place ops and views under jvp and grad]), so aliasing is not lost.
def _reshape_tangent(t, size):
    return t.reshape(size)


def _view_as_complex_tangent(t):
    return torch.view_as_complex(t.contiguous())


def_linear(aten.view.default, _reshape_back, _reshape_tangent)
def_linear(aten._unsafe_view.default, _reshape_back, _reshape_tangent)
def_linear(
    aten.view_as_complex.default, lambda ct, x: torch.view_as_real(ct), _view_as_complex_tangent
)

for _op, _tr in (
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
    (
        aten.select.int,
        lambda ct, x, dim, i: select_scatter(zeros_shaped(x, ct), ct, dim, i),
    ),
    (
        aten.slice.Tensor,
        lambda ct, x, dim=0, start=None, end=None, step=1: slice_scatter(
            zeros_shaped(x, ct), ct, dim, start, end, step
        ),
    ),
    (
        aten.diagonal.default,
        lambda ct, x, offset=0, d1=0, d2=1: aten.diagonal_scatter.default(
            zeros_shaped(x, ct), ct, offset, d1, d2
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
    (aten.unfold.default, lambda ct, x, dim, size, step: _unfold_transpose(ct, x, dim, size, step)),
):
    def_linear(_op, _tr)


def _view_dtype_refused(call):
    # Note [x.view(dtype) is not differentiable]: torch's autograd detaches view.dtype's output
    # once the op returns (its derivative is declared absent), so a rule here could only yield
    # the zero gradient functorch silently returns; the refusal must come at the forward op
    # (a vjp rule alone would run in a backward pass that never reaches it). Between a complex
    # dtype and its real one the map is linear: view_as_real / view_as_complex carry it.
    raise NotImplementedError(
        f"{call}: x.view(dtype) cannot be differentiated (torch detaches its output, and "
        "functorch silently returns a zero gradient through it). Do: between complex and real "
        "of one precision use torch.view_as_real(z).flatten(-2) / "
        "torch.view_as_complex(x.unflatten(-1, (-1, 2))), otherwise x.to(dtype)."
    )


def _floating(dtype):
    return dtype.is_floating_point or dtype.is_complex


@register_jvp_rule(aten.view.dtype)
def view_dtype_jvp_rule(primals, tangents, kwargs):
    if _floating(primals[1]):
        _view_dtype_refused("jvp")
    return aten.view.dtype(*primals), None  # an integer view carries no derivative


@register_vjp_rule(aten.view.dtype)
def view_dtype_vjp_rule(ct, primals, kwargs, out, needs):
    return None, None  # reached for integer views only: floating ones refuse in the forward


def _view_dtype_forward(x, dtype):
    if _floating(dtype):
        _view_dtype_refused("grad/vjp")
    return aten.view.dtype(x, dtype)


VJP_FORWARD[aten.view.dtype] = _view_dtype_forward


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
def def_materialized(op, materialize):
    """``op`` is a lazy conj/neg view; its rules run ``materialize`` (the same linear map, on a
    copy) on the primal and on the tangent or cotangent."""

    def materialized_jvp_rule(primals, tangents, kwargs):
        t = tangents[0]
        return materialize(primals[0]), None if t is None else materialize(t)

    def materialized_vjp_rule(ct, primals, kwargs, out, needs):
        return (materialize(ct),)

    register_jvp_rule(op)(materialized_jvp_rule)
    register_vjp_rule(op)(materialized_vjp_rule)
    VJP_FORWARD[op] = materialize


for _op, _f in (
    (aten._conj.default, torch.conj_physical),  # d conj(z) = conj(dz): R-linear, its own adjoint
    (aten.conj_physical.default, torch.conj_physical),
    (aten._conj_physical.default, torch.conj_physical),
    (aten._neg_view.default, torch.neg),
):
    def_materialized(_op, _f)


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
    dim = dim % x.dim()  # ct has one dim more (the window's, last): -1 is not x's -1 there
    out = zeros_shaped(x, ct)
    n = ct.shape[dim] if ct.dim() > 0 else 1
    for i in range(n):
        piece = ct.select(dim, i).movedim(-1, dim)
        out = slice_scatter(
            out, out.narrow(dim, i * step, size) + piece, dim, i * step, i * step + size
        )
    return out


def def_multi_out_linear(op, transpose):
    """``op(x, *params)`` with several outputs, linear in ``x``; ``transpose(cts, x, *params)``
    gets every output's cotangent (zeros for the missing ones)."""

    def multi_jvp_rule(primals, tangents, kwargs):
        out = op(*primals, **kwargs)
        t = tangents[0]
        return out, None if t is None else op(t, *primals[1:], **kwargs)

    def multi_vjp_rule(cts, primals, kwargs, out, needs):
        cts = [c if c is not None else torch.zeros_like(o) for c, o in zip(cts, out)]
        return (transpose(cts, *primals, **kwargs),) + (None,) * (len(primals) - 1)

    register_jvp_rule(op)(multi_jvp_rule)
    register_vjp_rule(op)(multi_vjp_rule)


for _op, _tr in (
    (aten.split.Tensor, lambda cts, x, size, dim=0: torch.cat(cts, dim)),
    (aten.split_with_sizes.default, lambda cts, x, sizes, dim=0: torch.cat(cts, dim)),
    (aten.unbind.int, lambda cts, x, dim=0: torch.stack(cts, dim)),
):
    def_multi_out_linear(_op, _tr)


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
    out = copy_as_torch_records(x, src, *primals[2:])
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
