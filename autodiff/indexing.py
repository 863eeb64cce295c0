"""Derivative rules of indexing ops that select, scatter or reduce by an index or a mask:
masked_select / masked_scatter, put, scatter_reduce and index_reduce (every reduction, both
``include_self``), as_strided / as_strided_scatter (through flat storage positions), and
addbmm. Indices and masks are constants; every rule is ordinary differentiable, batchable ops."""

from __future__ import annotations

import torch

from ._registry import register_jvp_rule, register_vjp_rule
from ._util import unbroadcast

aten = torch.ops.aten


def _cphys(t):
    return torch.conj_physical(t) if t.is_complex() else t


def _zeros_of(x, like):
    return torch.zeros(x.shape, dtype=like.dtype, device=like.device)


def _or_zeros(t, x, dtype):
    return t if t is not None else torch.zeros(x.shape, dtype=dtype, device=x.device)


# -- masked_select / masked_scatter -----------------------------------------------------------
@register_jvp_rule(aten.masked_select.default)
def masked_select_jvp_rule(primals, tangents, kwargs):
    x, mask = primals
    out = aten.masked_select.default(x, mask)
    t = tangents[0]
    return out, None if t is None else aten.masked_select.default(t, mask)


@register_vjp_rule(aten.masked_select.default)
def masked_select_vjp_rule(ct, primals, kwargs, out, needs):
    """The transpose scatters ct into the (broadcast) mask's positions."""
    x, mask = primals
    shape = torch.broadcast_shapes(x.shape, mask.shape)
    # flat positions of the (constant) mask, so the vjp batches as an index_put under vmap
    pos = mask.expand(shape).reshape(-1).nonzero().squeeze(-1)
    g = torch.zeros(max(x.numel(), 1) if shape == x.shape else torch.Size(shape).numel(),
                    dtype=ct.dtype, device=ct.device)  # fmt: skip
    g = g.index_put((pos,), ct).reshape(shape)
    return unbroadcast(g, x.shape), None


@register_jvp_rule(aten.masked_scatter.default)
def masked_scatter_jvp_rule(primals, tangents, kwargs):
    """masked_scatter(x, mask, source) is linear in (x, source) jointly."""
    x, mask, source = primals
    out = aten.masked_scatter.default(x, mask, source)
    tx, ts = tangents[0], tangents[2]
    if tx is None and ts is None:
        return out, None
    tx = _or_zeros(tx, out, out.dtype).expand(out.shape)
    ts = _or_zeros(ts, source, out.dtype)
    return out, aten.masked_scatter.default(tx, mask, ts)


@register_vjp_rule(aten.masked_scatter.default)
def masked_scatter_vjp_rule(ct, primals, kwargs, out, needs):
    x, mask, source = primals
    gx = gs = None
    if needs[0]:
        gx = unbroadcast(ct.masked_fill(mask, 0), x.shape)
    if needs[2]:  # the first k entries of source went to the k masked positions, in order
        picked = aten.masked_select.default(ct, mask)
        pad = source.numel() - picked.shape[0]
        if pad:
            picked = torch.cat([picked, picked.new_zeros(pad)])
        gs = picked.reshape(source.shape)
    return gx, None, gs


# -- put ----------------------------------------------------------------------------------------
@register_jvp_rule(aten.put.default)
def put_jvp_rule(primals, tangents, kwargs):
    """put(x, index, source, accumulate) is linear in (x, source) jointly."""
    x, index, source = primals[:3]
    out = aten.put.default(*primals, **kwargs)
    tx, ts = tangents[0], tangents[2]
    if tx is None and ts is None:
        return out, None
    tx = _or_zeros(tx, x, out.dtype)
    ts = _or_zeros(ts, source, out.dtype)
    return out, aten.put.default(tx, index, ts, *primals[3:], **kwargs)


@register_vjp_rule(aten.put.default)
def put_vjp_rule(ct, primals, kwargs, out, needs):
    x, index, source = primals[:3]
    accumulate = primals[3] if len(primals) > 3 else kwargs.get("accumulate", False)
    gx = gs = None
    if needs[0]:
        gx = ct if accumulate else aten.put.default(ct, index, _zeros_of(source, ct))
    if needs[2]:
        gs = ct.take(index).reshape(source.shape)
    return (gx, None, gs) + (None,) * (len(primals) - 3)


# -- index_add ----------------------------------------------------------------------------------
# A rule of its own rather than torch's decomposition: the decomposition (an index_put) breaks
# on a 0-d index, which index_select's transpose passes (index_select treats it as 1-d: the
# second derivative of embedding with one index).
def _index_add_args(primals, kwargs):
    x, dim, index, source = primals[:4]
    alpha = primals[4] if len(primals) > 4 else kwargs.get("alpha", 1)
    return x, dim, index, source, alpha


@register_jvp_rule(aten.index_add.default)
def index_add_jvp_rule(primals, tangents, kwargs):
    """index_add(x, dim, index, source, alpha) is linear in (x, source) jointly."""
    x, dim, index, source, alpha = _index_add_args(primals, kwargs)
    out = aten.index_add.default(*primals, **kwargs)
    tx, ts = tangents[0], tangents[3]
    if tx is None and ts is None:
        return out, None
    tx = _or_zeros(tx, x, out.dtype)
    ts = _or_zeros(ts, source, out.dtype)
    return out, aten.index_add.default(tx, dim, index, ts, alpha=alpha)


@register_vjp_rule(aten.index_add.default)
def index_add_vjp_rule(ct, primals, kwargs, out, needs):
    x, dim, index, source, alpha = _index_add_args(primals, kwargs)
    gs = None
    if needs[3]:
        gs = ct.index_select(dim, index.reshape(-1)).reshape(source.shape)
        gs = gs * _conj_scalar(alpha) if alpha != 1 else gs
    return (ct if needs[0] else None, None, None, gs) + (None,) * (len(primals) - 4)


# -- scatter_reduce / index_reduce ----------------------------------------------------------------
# Note [Derivatives of scatter_reduce]
#     out_i reduces a group: x_i (when include_self, or when nothing is scattered to i, where
#     out_i = x_i) and every src_k with index_k = i. For each member v of a group the partial
#     d out_i / d v is a weight w(v): sum: 1; mean: 1 / count; amax/amin: 1 / #ties for the
#     members equal to out_i, else 0 (torch splits ties evenly); prod: the product of the other
#     members (with zeros: nonzero only for the one zero of a group that has one). So
#     jvp = w_x tx + scatter_add(w_src ts), and the vjp is w_x ct, gather(ct) w_src (conjugated
#     weights for complex). The weights are computed from the primal values with the same
#     scatter_reduce, so everything runs under vmap.
def _group_weights(x, dim, index, src, reduce, include_self):
    """(w_x, w_src): the partials of out w.r.t. x and each src element."""
    ones_src = torch.ones(src.shape, dtype=x.dtype, device=x.device)
    scattered = torch.zeros_like(x).scatter_add(dim, index, ones_src)  # members from src
    self_in = scattered == 0 if not include_self else torch.ones_like(x, dtype=torch.bool)
    if reduce == "sum":
        return self_in.to(x.dtype), torch.ones_like(src)
    if reduce == "mean":
        count = scattered + self_in.to(x.dtype)
        return self_in.to(x.dtype) / count, (1 / count).gather(dim, index).expand(src.shape)
    out = x.scatter_reduce(dim, index, src, reduce, include_self=include_self)
    if reduce in ("amax", "amin"):
        x_tie = self_in & (x == out)
        src_tie = src == out.gather(dim, index)
        ties = x_tie.to(x.dtype).scatter_add(dim, index, src_tie.to(x.dtype))
        return x_tie / ties, src_tie / ties.gather(dim, index)
    if reduce == "prod":
        x_zero = self_in & (x == 0)
        src_zero = src == 0
        zeros = x_zero.to(torch.int64).scatter_add(dim, index, src_zero.to(torch.int64))
        one = torch.ones((), dtype=x.dtype, device=x.device)
        x_nz = torch.where(self_in & ~x_zero, x, one)
        nz_prod = x_nz.scatter_reduce(
            dim, index, torch.where(src_zero, one, src), "prod", include_self=True
        )  # the product of a group's nonzero members

        def weight(v, v_zero, z, p):
            w0 = p / torch.where(v_zero, one, v)  # no zero in the group
            w1 = torch.where(v_zero, p, torch.zeros_like(p))  # one zero: only it moves
            return torch.where(z == 0, w0, torch.where(z == 1, w1, torch.zeros_like(p)))

        w_x = torch.where(self_in, weight(x, x_zero, zeros, nz_prod), torch.zeros_like(x))
        w_src = weight(src, src_zero, zeros.gather(dim, index), nz_prod.gather(dim, index))
        return w_x, w_src
    raise NotImplementedError(f"scatter_reduce: no derivative for reduce={reduce!r}")


def _scatter_reduce_args(primals, kwargs):
    x, dim, index, src, reduce = primals[:5]
    include_self = primals[5] if len(primals) > 5 else kwargs.get("include_self", True)
    return x, dim, index, src, reduce, include_self


@register_jvp_rule(aten.scatter_reduce.two)
def scatter_reduce_jvp_rule(primals, tangents, kwargs):
    """Note [Derivatives of scatter_reduce]"""
    out = aten.scatter_reduce.two(*primals, **kwargs)
    x, dim, index, src, reduce, include_self = _scatter_reduce_args(primals, kwargs)
    tx, ts = tangents[0], tangents[3]
    if tx is None and ts is None:
        return out, None
    w_x, w_src = _group_weights(x, dim, index, src, reduce, include_self)
    t = torch.zeros_like(out) if tx is None else tx * w_x
    if ts is not None:
        t = t.scatter_add(dim, index, ts * w_src)
    return out, t


@register_vjp_rule(aten.scatter_reduce.two)
def scatter_reduce_vjp_rule(ct, primals, kwargs, out, needs):
    x, dim, index, src, reduce, include_self = _scatter_reduce_args(primals, kwargs)
    w_x, w_src = _group_weights(x, dim, index, src, reduce, include_self)
    gx = ct * _cphys(w_x) if needs[0] else None
    gs = ct.gather(dim, index) * _cphys(w_src) if needs[3] else None
    return (gx, None, None, gs) + (None,) * (len(primals) - 4)


def _index_as_scatter(x, dim, index, source):
    """index_reduce's index (one entry per slice of source along dim) as scatter's index."""
    dim = dim % max(x.dim(), 1)
    shape = [1] * source.dim()
    if source.dim():
        shape[dim] = -1
    return dim, index.reshape(shape).expand(source.shape)


@register_jvp_rule(aten.index_reduce.default)
def index_reduce_jvp_rule(primals, tangents, kwargs):
    """index_reduce(x, dim, index, source, reduce) is scatter_reduce with a broadcast index."""
    x, dim, index, source, reduce = primals[:5]
    include_self = primals[5] if len(primals) > 5 else kwargs.get("include_self", True)
    d, idx = _index_as_scatter(x, dim, index, source)
    out, t = scatter_reduce_jvp_rule(
        (x, d, idx, source, reduce),
        (tangents[0], None, None, tangents[3], None),
        {"include_self": include_self},
    )
    return aten.index_reduce.default(*primals, **kwargs), t


@register_vjp_rule(aten.index_reduce.default)
def index_reduce_vjp_rule(ct, primals, kwargs, out, needs):
    x, dim, index, source, reduce = primals[:5]
    include_self = primals[5] if len(primals) > 5 else kwargs.get("include_self", True)
    d, idx = _index_as_scatter(x, dim, index, source)
    g = scatter_reduce_vjp_rule(
        ct,
        (x, d, idx, source, reduce),
        {"include_self": include_self},
        out,
        (needs[0], False, False, needs[3]),
    )
    return (g[0], None, None, g[3]) + (None,) * (len(primals) - 4)


# -- as_strided ---------------------------------------------------------------------------------
def _strided_positions(x, size, stride, offset, call):
    """Flat positions in x (row-major) of as_strided(x, size, stride, offset)'s elements. Needs
    x contiguous: then its storage, from its own offset on, is x.flatten()."""
    if not x.is_contiguous():
        raise NotImplementedError(
            f"{call}(x, {list(size)}, {list(stride)}): the derivative of as_strided is defined "
            "through x's storage, which is only its flat order when x is contiguous. Call "
            "x.contiguous() first, or express the view with view ops (expand, unfold, diagonal)."
        )
    base = (offset if offset is not None else x.storage_offset()) - x.storage_offset()
    pos = torch.full((), base, dtype=torch.long, device=x.device)
    for n, s in zip(size, stride):
        pos = pos.unsqueeze(-1) + torch.arange(n, device=x.device) * s
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= max(x.numel(), 1)):
        raise NotImplementedError(
            f"{call}(x, {list(size)}, {list(stride)}): the view reaches outside x's elements "
            "(into storage x does not cover); there is no derivative for that."
        )
    return pos


def _as_strided_args(primals, kwargs):
    x, size, stride = primals[:3]
    offset = primals[3] if len(primals) > 3 else kwargs.get("storage_offset")
    return x, size, stride, offset


def _take_flat(t, pos):
    return t.reshape(-1)[pos] if t.dim() else t.reshape(1)[pos]


def def_as_strided(op):
    def as_strided_jvp_rule(primals, tangents, kwargs):
        out = op(*primals, **kwargs)
        t = tangents[0]
        if t is None:
            return out, None
        x, size, stride, offset = _as_strided_args(primals, kwargs)
        return out, _take_flat(t, _strided_positions(x, size, stride, offset, "as_strided"))

    def as_strided_vjp_rule(ct, primals, kwargs, out, needs):
        x, size, stride, offset = _as_strided_args(primals, kwargs)
        pos = _strided_positions(x, size, stride, offset, "as_strided")
        g = torch.zeros(max(x.numel(), 1), dtype=ct.dtype, device=ct.device)
        g = g.index_put((pos.reshape(-1),), ct.reshape(-1), accumulate=True)  # overlaps add
        return (g[: x.numel()].reshape(x.shape),) + (None,) * (len(primals) - 1)

    register_jvp_rule(op)(as_strided_jvp_rule)
    register_vjp_rule(op)(as_strided_vjp_rule)


def_as_strided(aten.as_strided.default)
def_as_strided(aten.as_strided_copy.default)


def _as_strided_scatter_pos(primals, kwargs):
    x, src, size, stride = primals[:4]
    offset = primals[4] if len(primals) > 4 else kwargs.get("storage_offset")
    return _strided_positions(x, size, stride, offset, "as_strided_scatter").reshape(-1)


@register_jvp_rule(aten.as_strided_scatter.default)
def as_strided_scatter_jvp_rule(primals, tangents, kwargs):
    """as_strided_scatter(x, src, ...) is linear in (x, src) jointly: x with src written at the
    view's positions."""
    out = aten.as_strided_scatter.default(*primals, **kwargs)
    x, src = primals[:2]
    tx, ts = tangents[0], tangents[1]
    if tx is None and ts is None:
        return out, None
    pos = _as_strided_scatter_pos(primals, kwargs)
    tx = _or_zeros(tx, x, out.dtype).reshape(-1)
    ts = _or_zeros(ts, src, out.dtype).reshape(-1)
    return out, tx.index_put((pos,), ts).reshape(x.shape)


@register_vjp_rule(aten.as_strided_scatter.default)
def as_strided_scatter_vjp_rule(ct, primals, kwargs, out, needs):
    x, src = primals[:2]
    pos = _as_strided_scatter_pos(primals, kwargs)
    flat = ct.reshape(-1)
    gx = flat.index_put((pos,), flat.new_zeros(())).reshape(x.shape) if needs[0] else None
    gs = flat[pos].reshape(src.shape) if needs[1] else None
    return (gx, gs) + (None,) * (len(primals) - 2)


# -- addbmm ---------------------------------------------------------------------------------------
def _scalars(primals, kwargs):
    beta = kwargs.get("beta", primals[3] if len(primals) > 3 else 1)
    alpha = kwargs.get("alpha", primals[4] if len(primals) > 4 else 1)
    return beta, alpha


def _conj_scalar(a):
    return a.conjugate() if isinstance(a, complex) else a


@register_jvp_rule(aten.addbmm.default)
def addbmm_jvp_rule(primals, tangents, kwargs):
    """addbmm(c, A, B) = beta c + alpha sum_b A_b B_b"""
    c, A, B = primals[:3]
    beta, alpha = _scalars(primals, kwargs)
    out = aten.addbmm.default(*primals, **kwargs)
    tc, tA, tB = tangents[:3]
    t = None
    if tc is not None and beta != 0:
        t = (tc * beta).expand(out.shape)
    for prod in (
        None if tA is None else torch.bmm(tA, B),
        None if tB is None else torch.bmm(A, tB),
    ):
        if prod is not None:
            p = prod.sum(0) * alpha
            t = p if t is None else t + p
    return out, t


@register_vjp_rule(aten.addbmm.default)
def addbmm_vjp_rule(ct, primals, kwargs, out, needs):
    c, A, B = primals[:3]
    beta, alpha = _scalars(primals, kwargs)
    a = _conj_scalar(alpha)
    gc = gA = gB = None
    if needs[0]:
        gc = unbroadcast(ct * _conj_scalar(beta), c.shape) if beta != 0 else torch.zeros_like(c)
    if needs[1]:
        gA = torch.matmul(ct.unsqueeze(0), _cphys(B).transpose(-1, -2)) * a
    if needs[2]:
        gB = torch.matmul(_cphys(A).transpose(-1, -2), ct.unsqueeze(0)) * a
    return (gc, gA, gB) + (None,) * (len(primals) - 3)


# -- segment_reduce -------------------------------------------------------------------------------
_SEGMENT_AS_SCATTER = {"sum": "sum", "mean": "mean", "max": "amax", "min": "amin", "prod": "prod"}


def _segment_as_scatter(data, reduce, kwargs):
    """segment_reduce as scatter_reduce: (base, axis, index, scatter reduce, include_self), with
    base the output filled with ``initial`` (reduced in when given)."""
    axis = kwargs.get("axis", 0) % data.dim()
    lengths, offsets = kwargs.get("lengths"), kwargs.get("offsets")
    if lengths is not None:
        ends = lengths.cumsum(-1)
    elif offsets is not None:
        ends = offsets[..., 1:] - offsets[..., :1]
    else:
        raise NotImplementedError("segment_reduce: a derivative needs lengths= or offsets=")
    n = data.shape[axis]
    pos = torch.arange(n, device=data.device)
    seg = (ends.unsqueeze(-1) <= pos).sum(-2)  # segment of each position: how many ended before
    index = seg.reshape(seg.shape + (1,) * (data.dim() - axis - 1)).expand(data.shape)
    shape = list(data.shape)
    shape[axis] = ends.shape[-1]
    initial = kwargs.get("initial")
    base = torch.full(
        shape, 0 if initial is None else initial, dtype=data.dtype, device=data.device
    )
    # initial is reduced in as one more member, except by mean: (initial + sum) / length
    include_self = initial is not None and reduce != "mean"
    return base, axis, index, _SEGMENT_AS_SCATTER[reduce], include_self


@register_jvp_rule(aten.segment_reduce.default)
def segment_reduce_jvp_rule(primals, tangents, kwargs):
    """Ours only (torch has no forward mode): Note [Derivatives of scatter_reduce], with each
    segment a group."""
    data, reduce = primals[:2]
    out = aten.segment_reduce.default(*primals, **kwargs)
    t = tangents[0]
    if t is None:
        return out, None
    base, axis, index, red, include_self = _segment_as_scatter(data, reduce, kwargs)
    w = _group_weights(base, axis, index, data, red, include_self)[1]
    return out, torch.zeros_like(out).scatter_add(axis, index, t * w)


@register_vjp_rule(aten.segment_reduce.default)
def segment_reduce_vjp_rule(ct, primals, kwargs, out, needs):
    data, reduce = primals[:2]
    base, axis, index, red, include_self = _segment_as_scatter(data, reduce, kwargs)
    w = _group_weights(base, axis, index, data, red, include_self)[1]
    return (ct.gather(axis, index) * _cphys(w),) + (None,) * (len(primals) - 1)
