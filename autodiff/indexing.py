"""Derivative rules of indexing ops that select, scatter or reduce by an index or a mask: index
/ index_select / gather (linear, transposed by the matching accumulate), index_put, masked_fill,
the ``*_scatter`` ops, masked_select / masked_scatter, put, scatter_reduce and index_reduce
(every reduction, both ``include_self``), as_strided / as_strided_scatter (through flat storage
positions), segment_reduce and embedding_bag. Indices and masks are constants; every rule is
ordinary differentiable, batchable ops."""

from __future__ import annotations

import torch

from functransforms._core.metadata import dtype_of
from functransforms.deterministic import _ops as _det

from ._registry import register_jvp_rule, register_vjp_rule
from ._util import conj_if_complex, select_scatter, slice_scatter, unbroadcast, zeros_shaped
from .elementwise import _conj_scalar
from .views import def_linear

aten = torch.ops.aten


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
    if needs[2]:
        # The first k entries of source went to the k masked positions, in order: the masked
        # position with r masked positions before it sends its cotangent to source[r]. Sizes
        # stay fixed (unmasked positions send 0 to a slot past the end, dropped), unlike
        # masked_select's, so the vjp batches under vmap when the mask is batched.
        n = source.numel()
        m = mask.expand(ct.shape).reshape(-1)
        rank = torch.where(m, m.cumsum(0) - 1, n)
        sent = torch.where(m, ct.reshape(-1), 0)
        gs = sent.new_zeros(n + 1).scatter_add(0, rank, sent)[:n].reshape(source.shape)
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
        gx = ct if accumulate else aten.put.default(ct, index, zeros_shaped(source, ct))
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
#     members (with zeros: nonzero only for the one zero of a group that has one). The prod
#     weight is that product as a function of the other members, not only its value: in a
#     group with one zero, a nonzero member's weight is 0 and moves with the zero (its
#     derivative is the second derivative of out, which vjp(vjp) and torch's autograd over our
#     vjp read); so the nonzero members' product comes divided by the member itself, and the
#     other zero members' product is carried for up to two of them (by power sums), taken as 0
#     for more: exact at every order with at most two zeros in a group, to the third
#     derivative of out with more. So
#     jvp = w_x tx + scatter_add(w_src ts), and the vjp is w_x ct, gather(ct) w_src (conjugated
#     weights for complex). The weights are computed from the primal values with the same
#     scatter_reduce, so everything runs under vmap.
def _group_weights(x, dim, index, src, reduce, include_self, self_ties=True):
    """(w_x, w_src): the partials of out w.r.t. x and each src element. ``self_ties`` False:
    an x equal to out_i does not share the tie (segment_reduce's ``initial``: torch splits
    among the data only)."""
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
        ties = (x_tie & self_ties).to(x.dtype).scatter_add(dim, index, src_tie.to(x.dtype))
        ties = ties.clamp_min(1)  # a group where only x attains out: no src weight
        return x_tie / ties, src_tie / ties.gather(dim, index)
    if reduce == "prod":  # Note [Derivatives of scatter_reduce], prod
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        one = torch.ones((), dtype=x.dtype, device=x.device)
        x_zero = self_in & (x == 0)
        src_zero = src == 0
        x_live = torch.where(self_in, x, one)  # a group's members, x where it takes part
        nz_prod = torch.where(x_zero, one, x_live).scatter_reduce(
            dim, index, torch.where(src_zero, one, src), "prod", include_self=True
        )  # the product of a group's nonzero members
        zeros = x_zero.to(x.dtype).scatter_add(dim, index, src_zero.to(x.dtype))
        x_zeros, src_zeros = torch.where(x_zero, x, zero), torch.where(src_zero, src, zero)
        zero_sum = x_zeros.scatter_add(dim, index, src_zeros)
        zero_sq = (x_zeros * x_zeros).scatter_add(dim, index, src_zeros * src_zeros)
        # the sum and the sum of squares of a group's zero members: 0, with their derivatives

        def weight(v, v_zero, z, p, s, q):
            """The product of the group's other members: its nonzero members' product over v
            (v itself if nonzero), times the product of its m other zero members, as their
            elementary symmetric polynomial e_m from power sums (1; s; (s^2 - q) / 2), 0 for
            m > 2 (whose derivatives below order m vanish too)."""
            own = torch.where(v_zero, v, zero)
            others = z - v_zero.to(z.dtype)
            s, q = s - own, q - own * own
            rest = torch.where(others == 1, s, (s * s - q) / 2)
            rest = torch.where(others == 0, one, torch.where(others > 2, zero, rest))
            return p / torch.where(v_zero, one, v) * rest

        w_x = torch.where(self_in, weight(x, x_zero, zeros, nz_prod, zero_sum, zero_sq), zero)
        w_src = weight(
            src, src_zero, *(t.gather(dim, index) for t in (zeros, nz_prod, zero_sum, zero_sq))
        )
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
    gx = ct * conj_if_complex(w_x) if needs[0] else None
    gs = ct.gather(dim, index) * conj_if_complex(w_src) if needs[3] else None
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
    """Positions in x's row-major flattening of as_strided(x, size, stride, offset)'s elements:
    the storage element each one reads, mapped back to the element of x that lives there.
    Contiguous x: its storage from its own offset on is x.flatten(). Otherwise (transposed,
    sliced with steps) the map is built from x's strides; x must not overlap itself (an
    expanded x has several elements at one position, and the derivative would be ambiguous)."""
    base = (offset if offset is not None else x.storage_offset()) - x.storage_offset()
    pos = torch.full((), base, dtype=torch.long, device=x.device)
    for n, s in zip(size, stride):
        pos = pos.unsqueeze(-1) + torch.arange(n, device=x.device) * s
    if x.is_contiguous():
        span, owner = max(x.numel(), 1), None
    else:
        at = torch.zeros((), dtype=torch.long, device=x.device)  # x's own storage positions
        for n, s in zip(x.shape, x.stride()):
            at = at.unsqueeze(-1) + torch.arange(n, device=x.device) * s
        at = at.reshape(-1)
        span = int(at.max()) + 1 if at.numel() else 1
        owner = torch.full((span,), -1, dtype=torch.long, device=x.device)
        owner[at] = torch.arange(at.numel(), device=x.device)
        if int((owner >= 0).sum()) != at.numel():
            raise NotImplementedError(
                f"{call}(x, {list(size)}, {list(stride)}): x overlaps itself (an expanded "
                "tensor: several of its elements share one memory location), so the elements "
                "the view reads do not determine the derivative. Call x.contiguous() first."
            )
    outside = pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= span)
    if not outside and owner is not None and pos.numel():
        pos = owner[pos]
        outside = int(pos.min()) < 0
    if outside:
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
    w = _group_weights(base, axis, index, data, red, include_self, self_ties=False)[1]
    return out, torch.zeros_like(out).scatter_add(axis, index, t * w)


@register_vjp_rule(aten.segment_reduce.default)
def segment_reduce_vjp_rule(ct, primals, kwargs, out, needs):
    data, reduce = primals[:2]
    base, axis, index, red, include_self = _segment_as_scatter(data, reduce, kwargs)
    w = _group_weights(base, axis, index, data, red, include_self, self_ties=False)[1]
    return (ct.gather(axis, index) * conj_if_complex(w),) + (None,) * (len(primals) - 1)


# -- index_select / gather / index: linear in x, transposed by the matching accumulate -------
for _op, _tr in (
    (
        aten.index_select.default,
        lambda ct, x, dim, idx: _det.det_call(
            aten.index_add.default, zeros_shaped(x, ct), dim, idx, ct
        ),
    ),
    (
        aten.gather.default,
        lambda ct, x, dim, idx, **k: _det.det_call(
            aten.scatter_add.default, zeros_shaped(x, ct), dim, idx, ct
        ),
    ),
    (
        aten.index.Tensor,
        lambda ct, x, indices: _det.det_call(
            aten.index_put.default, zeros_shaped(x, ct), indices, ct, True
        ),
    ),
):
    def_linear(_op, _tr)


@register_jvp_rule(aten.masked_fill.Scalar)
def masked_fill_jvp_rule(primals, tangents, kwargs):
    out = aten.masked_fill.Scalar(*primals)
    t = tangents[0]
    return out, None if t is None else t.masked_fill(primals[1], 0).expand(out.shape)


@register_vjp_rule(aten.masked_fill.Scalar)
def masked_fill_vjp_rule(ct, primals, kwargs, out, needs):
    return unbroadcast(ct.masked_fill(primals[1], 0), primals[0].shape), None, None


# index_fill(x, dim, index, v): x with the places at ``index`` along ``dim`` set to v; linear in
# (x, v) jointly. Without these rules it decomposes, and a strided x (a diagonal view) reaches
# prims.copy_strided, which has no rule (found by the stack fuzzer).
@register_jvp_rule(aten.index_fill.int_Scalar)
def index_fill_jvp_rule(primals, tangents, kwargs):
    out = aten.index_fill.int_Scalar(*primals)
    t = tangents[0]
    return out, None if t is None else aten.index_fill.int_Scalar(t, *primals[1:3], 0)


@register_vjp_rule(aten.index_fill.int_Scalar)
def index_fill_vjp_rule(ct, primals, kwargs, out, needs):
    return aten.index_fill.int_Scalar(ct, *primals[1:3], 0), None, None, None


@register_jvp_rule(aten.index_fill.int_Tensor)
def index_fill_tensor_jvp_rule(primals, tangents, kwargs):
    x, dim, index, value = primals
    out = aten.index_fill.int_Tensor(x, dim, index, value)
    tx, tv = tangents[0], tangents[3]
    if tx is None and tv is None:
        return out, None
    tx = torch.zeros_like(out) if tx is None else tx
    tv = torch.zeros_like(value) if tv is None else tv.to(dtype_of(tx))
    return out, aten.index_fill.int_Tensor(tx, dim, index, tv)


@register_vjp_rule(aten.index_fill.int_Tensor)
def index_fill_tensor_vjp_rule(ct, primals, kwargs, out, needs):
    x, dim, index, value = primals
    kept = aten.index_fill.int_Scalar(ct, dim, index, 0)
    gv = None
    if needs[3]:
        gv = (ct - kept).sum()  # the filled places, each once even for a repeated index
        gv = gv.to(dtype_of(value)) if gv.is_complex() == value.is_complex() else gv.real
    return kept, None, None, gv


# scatter-style ops: linear in (base, src) jointly; the src cotangent is the matching view
def def_scatter(op, view):
    # Note [Complex scatters torch's autograd refuses] (_util.py)
    run = {
        aten.slice_scatter.default: slice_scatter,
        aten.select_scatter.default: select_scatter,
    }.get(op, op)

    def scatter_jvp_rule(primals, tangents, kwargs):
        base, src = primals[0], primals[1]
        out = run(*primals, **kwargs)
        tb, ts = tangents[0], tangents[1]
        if tb is None and ts is None:
            return out, None
        tb = tb if tb is not None else torch.zeros_like(base)
        ts = ts if ts is not None else torch.zeros_like(src)
        return out, run(tb, ts, *primals[2:], **kwargs)

    def scatter_vjp_rule(ct, primals, kwargs, out, needs):
        src = primals[1]
        gb = (
            run(ct, torch.zeros_like(src, dtype=ct.dtype), *primals[2:], **kwargs)
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
        gx = ct if accumulate else aten.index_put.default(ct, indices, zeros_shaped(v, ct))
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


# -- embedding_bag ---------------------------------------------------------------------------------
def _bags(indices, offsets, include_last_offset, n_bags):
    """The bag of each index (indices 1-d with offsets)."""
    pos = torch.arange(indices.shape[0], device=indices.device)
    starts = offsets[:n_bags]
    return (starts.unsqueeze(-1) <= pos).sum(0) - 1


def _embedding_bag_parts(primals):
    weight, indices, offsets = primals[:3]
    mode = primals[4] if len(primals) > 4 else 0
    psw = primals[6] if len(primals) > 6 else None
    include_last = primals[7] if len(primals) > 7 else False
    padding_idx = primals[8] if len(primals) > 8 else -1
    if indices.dim() == 2:  # fixed-size bags, no offsets
        n_bags, size = indices.shape
        bag = torch.arange(n_bags, device=indices.device).repeat_interleave(size)
        indices = indices.reshape(-1)
        if psw is not None:
            psw = psw.reshape(-1)
    else:
        n_bags = offsets.shape[0] - (1 if include_last else 0)
        bag = _bags(indices, offsets, include_last, n_bags)
    keep = indices != padding_idx if padding_idx is not None and padding_idx >= 0 else None
    return weight, indices, bag, n_bags, mode, psw, keep


def _bag_scale(bag, n_bags, keep, dtype):
    """1 / (members of each bag), for mode='mean' (empty bags: 0)."""
    ones = torch.ones(bag.shape, dtype=dtype, device=bag.device)
    if keep is not None:
        ones = ones * keep
    count = torch.zeros(n_bags, dtype=dtype, device=bag.device).index_add(0, bag, ones)
    return torch.where(count > 0, 1 / count.clamp_min(1), torch.zeros_like(count))


def _embedding_bag_linear(primals, out, tw, tpsw):
    """d out for weight tangent tw and per-sample-weights tangent tpsw (sum/mean: linear in
    weight and in psw; max: the selected rows)."""
    weight, indices, bag, n_bags, mode, psw, keep = _embedding_bag_parts(primals)
    if mode == 2:  # the selected rows; an empty bag's max_indices are filler (bag_size 0)
        if tw is None:
            return None
        return tw.gather(0, out[3]) * (out[2] > 0).unsqueeze(-1)
    rows = 0
    if tw is not None:
        rows = tw[indices] if psw is None else tw[indices] * psw.unsqueeze(-1)
    if tpsw is not None:
        rows = rows + weight[indices] * tpsw.unsqueeze(-1)
    if keep is not None:
        rows = rows * keep.unsqueeze(-1)
    res = torch.zeros((n_bags, weight.shape[1]), dtype=out[0].dtype, device=weight.device)
    res = res.index_add(0, bag, rows)
    if mode == 1:
        res = res * _bag_scale(bag, n_bags, keep, res.dtype).unsqueeze(-1)
    return res


def def_embedding_bag(op):
    def embedding_bag_jvp_rule(primals, tangents, kwargs):
        """Ours only."""
        out = op(*primals, **kwargs)
        tw = tangents[0]
        tpsw = tangents[6] if len(tangents) > 6 else None
        if tw is None and tpsw is None:
            return out, None
        return out, (_embedding_bag_linear(primals, out, tw, tpsw), None, None, None)

    def embedding_bag_vjp_rule(cts, primals, kwargs, out, needs):
        ct = cts[0]
        res = [None] * len(primals)
        if ct is None:
            return tuple(res)
        weight, indices, bag, n_bags, mode, psw, keep = _embedding_bag_parts(primals)
        if mode == 2:
            if needs[0]:
                g = torch.zeros(weight.shape, dtype=ct.dtype, device=ct.device)
                res[0] = g.scatter_add(0, out[3], ct * (out[2] > 0).unsqueeze(-1))
            return tuple(res)
        if mode == 1:
            ct = ct * _bag_scale(bag, n_bags, keep, ct.dtype).unsqueeze(-1)
        per_index = ct[bag]
        if keep is not None:
            per_index = per_index * keep.unsqueeze(-1)
        if needs[0]:
            rows = per_index if psw is None else per_index * psw.unsqueeze(-1)
            if len(primals) > 3 and primals[3]:  # scale_grad_by_freq, as torch's backward
                rows = rows / _index_counts(indices, weight.shape[0], rows.dtype).unsqueeze(-1)
            g = torch.zeros(weight.shape, dtype=ct.dtype, device=ct.device)
            res[0] = g.index_add(0, indices, rows)
        if len(primals) > 6 and psw is not None and needs[6]:
            res[6] = (per_index * weight[indices]).sum(-1).reshape(primals[6].shape)
        return tuple(res)

    register_jvp_rule(op)(embedding_bag_jvp_rule)
    register_vjp_rule(op)(embedding_bag_vjp_rule)


def_embedding_bag(aten._embedding_bag_forward_only.default)
def_embedding_bag(aten._embedding_bag.default)


# -- embedding ------------------------------------------------------------------------------------
def _index_counts(flat, n, dtype):
    """How often each entry of ``flat`` occurs in it (index_add, not bincount, so it batches)."""
    ones = torch.ones(flat.shape, dtype=dtype, device=flat.device)
    return torch.zeros(n, dtype=dtype, device=flat.device).index_add(0, flat, ones)[flat]


@register_vjp_rule(aten.embedding.default)
def embedding_vjp_rule(ct, primals, kwargs, out, needs):
    """torch's embedding_backward: the rows of ``padding_idx`` get no gradient and
    ``scale_grad_by_freq`` divides each row's cotangent by its index's count (the decomposition,
    ``weight[indices]``, knows neither). The jvp stays the decomposition's: torch's forward
    derivative is ``embedding`` of the tangent, which does not zero the padding rows either."""
    weight, indices = primals[:2]
    padding_idx = primals[2] if len(primals) > 2 else kwargs.get("padding_idx", -1)
    scale = primals[3] if len(primals) > 3 else kwargs.get("scale_grad_by_freq", False)
    res = [None] * len(primals)
    if not needs[0]:
        return tuple(res)
    flat = indices.reshape(-1)
    rows = ct.reshape(flat.shape + weight.shape[1:])
    if scale:
        rows = rows / _index_counts(flat, weight.shape[0], rows.dtype).unsqueeze(-1)
    if padding_idx is not None and padding_idx >= 0:
        rows = rows * (flat != padding_idx).unsqueeze(-1)
    g = torch.zeros(weight.shape, dtype=ct.dtype, device=ct.device)
    res[0] = g.index_add(0, flat, rows)
    return tuple(res)
