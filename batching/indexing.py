"""Batching rules for indexing: advanced indexing, index_put, gather/scatter, index_* ops,
``*_scatter`` ops, as_strided / as_strided_scatter, embedding and masked_fill.

Note [Batching advanced indexing]
    ``x[i0, ..., ik]`` (``aten.index.Tensor``) with indices that are all unbatched: prepend a
    full slice (``None``) for the batch dim. The index block then never starts at dim 0, so if
    the indices are adjacent it stays after the batch dim (bdim 0); if they are not adjacent
    torch moves the block to the front and the batch dim lands right after it.
    With a batched index, the batch dim itself is indexed by ``arange(B)`` broadcast against the
    other indices (batched ones with their batch dim in front), so example ``b`` only reads its
    own slice. The result starts with ``[B, *index_shape]``; when the logical indices were
    adjacent but did not start at dim 0, torch would have put the index block after the leading
    sliced dims, so the block is moved there. ``index_put`` lays out its ``values`` the same way.
    Boolean masks become long indices (``nonzero``) first; a batched mask has a different
    number of ``True`` per example, which is data dependent (DataDependentError).

Note [Batching index_* ops with a batched index]
    ``index_add(x, d, idx, src)`` with ``idx`` differing per example: move ``d`` next to the
    batch dim and merge the two (``[B, n, ...] -> [B * n, ...]``), offset example ``b``'s index
    by ``b * n`` and run the op once along dim 0 of the merged tensor.
"""

from __future__ import annotations

import torch

from functransforms.deterministic._ops import det_call
from functransforms.errors import raise_data_dependent

from ._registry import register_vmap_rule
from ._util import expand_front, flat_batch, pad_to, to_front, wrap_dim

aten = torch.ops.aten


def _arange_b(interp, device, rank):
    """``arange(B)`` shaped ``[B, 1, ..., 1]`` (``rank`` ones) to index the batch dim."""
    return torch.arange(interp.batch_size, device=device).view((-1,) + (1,) * rank)


def _index_rank(i):
    return 1 if i.dtype in (torch.bool, torch.uint8) else i.dim()


def _adjacent(positions):
    return positions[-1] - positions[0] == len(positions) - 1


def _long_indices(interp, func, indices, ibdims):
    """Expand boolean masks into long indices (one per mask dim); a batched mask is an error."""
    out, outb = [], []
    for i, b in zip(indices, ibdims):
        if i is not None and i.dtype in (torch.bool, torch.uint8):
            if b is not None:
                raise_data_dependent(interp, func)
            out.extend(i.nonzero().unbind(1))
            outb.extend([None] * i.dim())
        else:
            out.append(i)
            outb.append(b)
    return out, outb


def _batched_indices(interp, func, x, xb, indices, ibdims):
    """Physical self and index list for a batched index (Note [Batching advanced indexing]).

    Returns ``(x, new_indices, R, p)``: ``R`` the logical index rank, ``p`` the number of
    leading sliced dims that torch keeps before the index block (0 when it goes to the front).
    """
    indices, ibdims = _long_indices(interp, func, list(indices), list(ibdims))
    x = expand_front(x, xb, interp.batch_size)
    R = max(i.dim() - (b is not None) for i, b in zip(indices, ibdims) if i is not None)
    new = [_arange_b(interp, x.device, R)]
    for i, b in zip(indices, ibdims):
        new.append(i if b is None or i is None else pad_to(to_front(i, b), R))
    pos = [k for k, i in enumerate(indices) if i is not None]
    p = pos[0] if _adjacent(pos) else 0
    return x, new, R, p


def _move_block(out, R, p):
    """``[B, *index_shape(R), *pre(p), ...] -> [B, *pre, *index_shape, ...]``."""
    if p == 0:
        return out
    perm = [0, *range(R + 1, R + 1 + p), *range(1, R + 1), *range(R + 1 + p, out.dim())]
    return out.permute(perm)


@register_vmap_rule(aten.index.Tensor)
def index_vmap_rule(interp, args, bdims, kwargs):
    x, indices = args[0], args[1]
    ibdims = bdims[1]
    if ibdims is None:  # only self is batched
        x = to_front(x, bdims[0])
        out = aten.index.Tensor(x, [None, *indices])
        pos = [k for k, i in enumerate(indices) if i is not None]
        if _adjacent(pos):
            return out, 0
        return out, max(_index_rank(indices[k]) for k in pos)
    x, new, R, p = _batched_indices(interp, aten.index.Tensor, x, bdims[0], indices, ibdims)
    return _move_block(aten.index.Tensor(x, new), R, p), 0


def def_index_put(func):
    inplace = func in (aten.index_put_.default, aten._index_put_impl_.default)

    def index_put_vmap_rule(interp, args, bdims, kwargs):
        x, indices, values = args[0], args[1], args[2]
        ibdims = bdims[1] if bdims[1] is not None else [None] * len(indices)
        n = x.dim() - (bdims[0] is not None)
        x_phys, new, R, p = _batched_indices(interp, func, x, bdims[0], indices, ibdims)
        if inplace:
            x_phys = to_front(x, bdims[0])  # batched self (the interpreter checked it)
        # logical shape of x[indices]: the index block (rank R) plus the dims not indexed
        consumed = sum(i.dim() - (b is not None) for i, b in zip(indices, ibdims) if i is not None)
        res_rank = R + n - consumed
        v = expand_front(values, bdims[2], interp.batch_size)
        v = pad_to(v, res_rank)
        if p:
            perm = [0, *range(p + 1, p + 1 + R), *range(1, p + 1), *range(p + 1 + R, v.dim())]
            v = v.permute(perm)
        out = det_call(func, x_phys, new, v, *args[3:], **kwargs)
        return (x if inplace else out), (bdims[0] if inplace else 0)

    register_vmap_rule(func)(index_put_vmap_rule)


for _op in (aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default):
    def_index_put(_op)


def _both_front(interp, args, bdims, k):
    """Args 0 and ``k`` with the batch dim in front (an unbatched one expanded)."""
    return (
        expand_front(args[0], bdims[0], interp.batch_size),
        expand_front(args[k], bdims[k], interp.batch_size),
    )


@register_vmap_rule(aten.gather.default)
def gather_vmap_rule(interp, args, bdims, kwargs):
    """torch treats a 0-d self or index as 1-d of size 1, and the result has the index's shape:
    give 0-d logical values a unit dim, and drop it from the result if the index had none."""
    x, idx = _both_front(interp, args, bdims, 2)
    n, m = x.dim() - 1, idx.dim() - 1
    x = x[:, None] if n == 0 else x
    idx = idx[:, None] if m == 0 else idx
    out = aten.gather.default(x, wrap_dim(args[1], max(n, 1)) + 1, idx, *args[3:], **kwargs)
    return (out[:, 0] if m == 0 else out), 0


def def_scatter(func):
    """scatter / scatter_add / scatter_reduce and their in-place forms: (self, dim, index, src?)."""
    inplace = func._schema.name.endswith("_")

    def scatter_vmap_rule(interp, args, bdims, kwargs):
        B = interp.batch_size
        x = to_front(args[0], bdims[0]) if inplace else expand_front(args[0], bdims[0], B)
        n = x.dim() - 1
        idx = expand_front(args[2], bdims[2], B)
        a = list(args)
        has_src = len(args) > 3 and isinstance(args[3], torch.Tensor)
        if has_src:
            a[3] = expand_front(args[3], bdims[3], B)
        if n == 0:
            a[0], a[1], a[2] = x[:, None], 1, idx.reshape(-1, 1)
            if has_src:
                a[3] = a[3].reshape(-1, 1)
            out = det_call(func, *a, **kwargs)
            return (args[0] if inplace else out[:, 0]), (bdims[0] if inplace else 0)
        a[0], a[1], a[2] = x, wrap_dim(args[1], n) + 1, idx
        out = det_call(func, *a, **kwargs)
        return (args[0] if inplace else out), (bdims[0] if inplace else 0)

    register_vmap_rule(func)(scatter_vmap_rule)


for _op in (
    aten.scatter.src,
    aten.scatter.value,
    aten.scatter.reduce,
    aten.scatter.value_reduce,
    aten.scatter_.src,
    aten.scatter_.value,
    aten.scatter_.reduce,
    aten.scatter_.value_reduce,
    aten.scatter_add.default,
    aten.scatter_add_.default,
    aten.scatter_reduce.two,
    aten.scatter_reduce_.two,
):
    def_scatter(_op)


@register_vmap_rule(aten.index_select.default)
def index_select_vmap_rule(interp, args, bdims, kwargs):
    x, dim, idx = args[0], args[1], args[2]
    if bdims[2] is None:
        x = to_front(x, bdims[0])
        n = x.dim() - 1
        if n == 0:  # a 0-d example: select from a unit dim (torch checks the index) and drop it
            return x.unsqueeze(1).index_select(1, idx.reshape(-1)).squeeze(1), 0
        return aten.index_select.default(x, wrap_dim(dim, n) + 1, idx), 0
    n = x.dim() - (bdims[0] is not None)
    idx = flat_batch(to_front(idx, bdims[2]))  # a 0-d index selects one
    if n == 0:  # each example is 0-d: index i of example b reads example b's own value
        x = expand_front(x, bdims[0], interp.batch_size)
        return x.unsqueeze(1).gather(1, idx[:, :1]).squeeze(1), 0
    d = wrap_dim(dim, n)
    return index_vmap_rule(interp, [x, [None] * d + [idx]], [bdims[0], [None] * d + [0]], {})


def def_index_dim(func, src_pos):
    """index_add / index_copy / index_fill: ``(self, dim, index, source_or_value, ...)``
    (Note [Batching index_* ops with a batched index])."""
    inplace = func._schema.name.endswith("_")

    def index_dim_vmap_rule(interp, args, bdims, kwargs):
        B = interp.batch_size
        if func in _FILL_TENSOR and bdims[3] is not None:
            return _index_fill_batched_value(interp, func, args, bdims, inplace)
        x = to_front(args[0], bdims[0]) if inplace else expand_front(args[0], bdims[0], B)
        n = x.dim() - 1
        a = list(args)
        has_src = src_pos is not None
        if has_src:
            a[src_pos] = expand_front(args[src_pos], bdims[src_pos], B)
        if n == 0:  # 0-d logical self: work on a unit dim
            x = x[:, None]
            if has_src:
                a[src_pos] = flat_batch(a[src_pos])
            d = 0
        else:
            d = wrap_dim(args[1], n)
        if bdims[2] is None:
            a[0], a[1] = x, d + 1
            out = det_call(func, *a, **kwargs)
        else:
            xm = x.movedim(d + 1, 1)
            size = xm.shape[1]
            idx = flat_batch(to_front(args[2], bdims[2]))
            idx = (idx + torch.arange(B, device=idx.device)[:, None] * size).reshape(-1)
            a[0], a[1], a[2] = xm.reshape((-1,) + tuple(xm.shape[2:])), 0, idx
            if has_src:
                s = a[src_pos].movedim(d + 1, 1)
                a[src_pos] = s.reshape((-1,) + tuple(s.shape[2:]))
            out = det_call(func, *a, **kwargs).reshape(xm.shape).movedim(1, d + 1)
            if inplace:
                x.copy_(out)
        if inplace:
            return args[0], bdims[0]
        return (out[:, 0] if n == 0 else out), 0

    register_vmap_rule(func)(index_dim_vmap_rule)


_FILL_TENSOR = (aten.index_fill.int_Tensor, aten.index_fill_.int_Tensor)


def _index_fill_batched_value(interp, func, args, bdims, inplace):
    """index_fill with a batched 0-d value: ``where(mask_of_index, value, self)``."""
    B = interp.batch_size
    x = to_front(args[0], bdims[0]) if inplace else expand_front(args[0], bdims[0], B)
    n = x.dim() - 1
    xs = x if n else x[:, None]
    d = wrap_dim(args[1], n) if n else 0
    size = xs.shape[d + 1]
    mask = torch.zeros((B, size), dtype=torch.bool, device=x.device)
    idx = flat_batch(expand_front(args[2], bdims[2], B))
    mask.scatter_(1, idx % size, True)
    mask = mask.reshape((B,) + (1,) * d + (size,) + (1,) * (xs.dim() - d - 2))
    v = to_front(args[3], bdims[3]).reshape((B,) + (1,) * (xs.dim() - 1)).to(x.dtype)
    out = torch.where(mask, v, xs)
    if n == 0:
        out = out[:, 0]
    if inplace:
        x.copy_(out)
        return args[0], bdims[0]
    return out, 0


for _op, _src in (
    (aten.index_add.default, 3),
    (aten.index_add_.default, 3),
    (aten.index_copy.default, 3),
    (aten.index_copy_.default, 3),
    (aten.index_fill.int_Scalar, None),
    (aten.index_fill_.int_Scalar, None),
    (aten.index_fill.int_Tensor, None),
    (aten.index_fill_.int_Tensor, None),
):
    def_index_dim(_op, _src)


_SCATTER_DEFAULTS = {
    aten.slice_scatter.default: ((0, None, None, 1), (2,)),
    aten.select_scatter.default: ((), (2,)),
    aten.diagonal_scatter.default: ((0, 0, 1), (3, 4)),
}


def def_view_scatter(func):
    """slice_scatter / select_scatter / diagonal_scatter: ``(self, src, ...)`` with logical dim
    arguments at the positions listed in ``_SCATTER_DEFAULTS``."""
    defaults, dim_pos = _SCATTER_DEFAULTS[func]

    def scatter_like_vmap_rule(interp, args, bdims, kwargs):
        x, src = _both_front(interp, args, bdims, 1)
        n = x.dim() - 1
        a = [x, src, *args[2:]]
        a += list(defaults[len(a) - 2 :])
        for k in dim_pos:
            a[k] = wrap_dim(a[k], n) + 1
        return func(*a, **kwargs), 0

    register_vmap_rule(func)(scatter_like_vmap_rule)


for _op in _SCATTER_DEFAULTS:
    def_view_scatter(_op)


def def_masked_fill(func):
    """masked_fill(self, mask, value); a batched 0-d ``value`` becomes ``where``."""
    inplace = func._schema.name.endswith("_")

    def masked_fill_vmap_rule(interp, args, bdims, kwargs):
        x, mask, value = args[0], args[1], args[2]
        B = interp.batch_size
        nx = x.dim() - (bdims[0] is not None)
        nd = max(nx, mask.dim() - (bdims[1] is not None))
        if inplace:
            xf = to_front(x, bdims[0])
            xf = xf.view((B,) + (1,) * (nd - nx) + tuple(xf.shape[1:])) if nd > nx else xf
        else:
            xf = pad_to(expand_front(x, bdims[0], B), nd)
        m = mask if bdims[1] is None else pad_to(to_front(mask, bdims[1]), nd)
        if isinstance(value, torch.Tensor) and bdims[2] is not None:
            v = to_front(value, bdims[2]).reshape((B,) + (1,) * nd).to(x.dtype)
            out = torch.where(m, v, xf)
            if inplace:
                xf.copy_(out)
                return x, bdims[0]
            return out, 0
        if inplace:
            xf.masked_fill_(m, value)
            return x, bdims[0]
        return xf.masked_fill(m, value), 0

    register_vmap_rule(func)(masked_fill_vmap_rule)


for _op in (aten.masked_fill.Tensor, aten.masked_fill_.Scalar, aten.masked_fill_.Tensor):
    def_masked_fill(_op)


@register_vmap_rule(aten.take.default)
def take_vmap_rule(interp, args, bdims, kwargs):
    """take(x, idx) reads the flattened x: a gather along the flattened dims (negative indices
    count from the end, as in take); batched indices are values, not control flow."""
    B = interp.batch_size
    x = flat_batch(expand_front(args[0], bdims[0], B))  # flat_batch: also for B == 0
    idx = expand_front(args[1], bdims[1], B)
    flat = flat_batch(idx)
    flat = torch.where(flat < 0, flat + x.shape[1], flat)
    return torch.gather(x, 1, flat).reshape(idx.shape), 0


@register_vmap_rule(aten.masked_select.default)
def masked_select_vmap_rule(interp, args, bdims, kwargs):
    """An unbatched mask selects the same number of elements from every example; a batched
    one gives each example its own count (a data-dependent shape, as in PyTorch)."""
    x, mask = args[0], args[1]
    if bdims[1] is not None:
        raise_data_dependent(interp, aten.masked_select.default)
    xf = to_front(x, bdims[0])
    shape = torch.broadcast_shapes(tuple(xf.shape[1:]), tuple(mask.shape))
    # a mask of higher rank: pad x's logical dims, or the batch dim would align with one of the
    # mask's (silently wrong when the sizes agree, as under jacfwd with as many basis vectors)
    xf = pad_to(xf, len(shape)).expand((xf.shape[0],) + shape)
    return xf[:, mask.expand(shape)], 0


@register_vmap_rule(aten.embedding.default)
def embedding_vmap_rule(interp, args, bdims, kwargs):
    """embedding(weight, indices, ...): a batched table is flattened and indices offset.

    padding_idx and scale_grad_by_freq change only the derivative, which autograd or an outer
    grad level takes of this physical call. Counts over a shared table would span the batch,
    so scale_grad_by_freq batches a shared table too (each example counts its own indices, as
    a loop does; PyTorch's counts span the batch). In a flat table padding_idx would name
    batch 0's row only, and no combination of other ops has embedding's derivatives there
    (its vjp zeros the padding rows, its jvp does not): a flattened table with a padding row is
    looked up one example at a time."""
    weight, indices = args[0], args[1]
    padding_idx = args[2] if len(args) > 2 else kwargs.get("padding_idx", -1)
    scale = args[3] if len(args) > 3 else kwargs.get("scale_grad_by_freq", False)
    sparse = args[4] if len(args) > 4 else kwargs.get("sparse", False)
    if bdims[0] is None and not scale:
        return aten.embedding.default(weight, indices, *args[2:], **kwargs), bdims[1]
    B = interp.batch_size
    w = to_front(weight, bdims[0]) if bdims[0] is not None else weight.expand(B, *weight.shape)
    idx = expand_front(indices, bdims[1], B)
    if padding_idx is not None and padding_idx >= 0:
        outs = [aten.embedding.default(w[b], idx[b], padding_idx, scale, sparse) for b in range(B)]
        return torch.stack(outs), 0
    V = w.shape[1]
    flat = idx + _arange_b(interp, idx.device, idx.dim() - 1) * V
    return aten.embedding.default(w.reshape(B * V, -1), flat, padding_idx, scale, sparse), 0


@register_vmap_rule(aten.as_strided.default, aten.as_strided_.default)
def as_strided_vmap_rule(interp, args, bdims, kwargs):
    """as_strided(x, size, stride, offset) per example: the wrapper reports each example's
    strides and a storage offset of 0, so sizes, strides and offset are relative to where the
    example starts; the batch dim keeps its own physical stride."""
    x = to_front(args[0], bdims[0])
    size, stride = args[1], args[2]
    offset = args[3] if len(args) > 3 and args[3] is not None else kwargs.get("storage_offset")
    start = x.storage_offset() + (offset or 0)
    return x.as_strided((x.shape[0], *size), (x.stride(0), *stride), start), 0


@register_vmap_rule(aten.as_strided_scatter.default)
def as_strided_scatter_vmap_rule(interp, args, bdims, kwargs):
    """as_strided_scatter(x, src, size, stride, offset): per example, src goes into a
    contiguous copy of x at positions relative to that copy's start (as in a loop)."""
    B = interp.batch_size
    out = expand_front(args[0], bdims[0], B).clone(memory_format=torch.contiguous_format)
    src = expand_front(args[1], bdims[1], B)
    size, stride = args[2], args[3]
    offset = args[4] if len(args) > 4 and args[4] is not None else kwargs.get("storage_offset")
    per_example = out[0].numel() if B else 0
    out.as_strided((B, *size), (per_example, *stride), offset or 0).copy_(src)
    return out, 0
