"""Batching rules for sorting and selection (sort, argsort, topk, kthvalue, mode, median)
and for searching a sorted sequence (searchsorted, bucketize)."""

from __future__ import annotations

import torch

from ._registry import register_vmap_rule
from ._util import flat_batch, to_front
from .reductions import def_dim, def_full

aten = torch.ops.aten

# their schemas default dim to -1, where def_dim's None would mean the flattened tensor
_LAST_BY_DEFAULT = {
    aten.sort.default,
    aten.sort.stable,
    aten.argsort.default,
    aten.argsort.stable,
    aten.topk.default,
    aten.kthvalue.default,
    aten.mode.default,
}

# one dim: (op, position of dim)
for _op, _pos in (
    (aten.sort.default, 1),
    (aten.sort.stable, 2),
    (aten.argsort.default, 1),
    (aten.argsort.stable, 2),
    (aten.median.dim, 1),
    (aten.nanmedian.dim, 1),
    (aten.mode.default, 1),
    (aten.kthvalue.default, 2),
    (aten.topk.default, 2),
):
    def_dim(_op, _pos, default=-1 if _op in _LAST_BY_DEFAULT else None)

def_full(aten.median.default, lambda x: aten.median.dim(x, 1)[0])
def_full(aten.nanmedian.default, lambda x: aten.nanmedian.dim(x, 1)[0])


@register_vmap_rule(aten.searchsorted.Tensor)
def searchsorted_vmap_rule(interp, args, bdims, kwargs):
    """A 1-d sorted sequence is shared by every element of ``self``; an N-d one pairs its
    leading dims with ``self``'s, so the batch dim in front of both is one more leading dim."""
    B = interp.batch_size
    seq = args[0] if bdims[0] is None else to_front(args[0], bdims[0])
    x = args[1] if bdims[1] is None else to_front(args[1], bdims[1])
    kw = {k: v for k, v in kwargs.items() if k != "sorter" or v is None}
    if "sorter" in kwargs and kwargs["sorter"] is not None:
        raise NotImplementedError("vmap: searchsorted(..., sorter=...) has no batching rule")
    if seq.dim() - (bdims[0] is not None) == 1:
        if bdims[0] is None:
            return aten.searchsorted.Tensor(seq, x, *args[2:], **kw), 0
        xs = x.expand((B, *x.shape)) if bdims[1] is None else x
        shape = xs.shape
        out = aten.searchsorted.Tensor(seq, flat_batch(xs), *args[2:], **kw)
        return out.reshape(shape), 0
    seq = seq.expand((B, *seq.shape)) if bdims[0] is None else seq
    x = x.expand((B, *x.shape)) if bdims[1] is None else x
    return aten.searchsorted.Tensor(seq.contiguous(), x.contiguous(), *args[2:], **kw), 0


@register_vmap_rule(aten.bucketize.Tensor)
def bucketize_vmap_rule(interp, args, bdims, kwargs):
    """bucketize(x, boundaries) is searchsorted(boundaries, x): with shared boundaries it is
    elementwise in x; batched (1-d per example) boundaries search each example's own."""
    x, boundaries = args[0], args[1]
    if bdims[1] is None:
        return aten.bucketize.Tensor(x, boundaries, *args[2:], **kwargs), bdims[0]
    B = interp.batch_size
    seq = to_front(boundaries, bdims[1])
    xs = x.expand((B, *x.shape)) if bdims[0] is None else to_front(x, bdims[0])
    out = aten.searchsorted.Tensor(seq.contiguous(), xs.reshape(B, -1).contiguous(), **kwargs)
    return out.reshape(xs.shape), 0
