"""Batching rules for reductions and other ops with a ``dim`` argument.

The batch dim goes to the front and every logical dim argument is shifted by one; "all dims"
(``dim=None`` or ``dim=[]``) becomes every dim but the batch dim.
"""

from __future__ import annotations

import torch

from ._registry import register_vmap_rule
from ._util import flat_batch, to_front, wrap_dim

aten = torch.ops.aten


def _shift(d, n):
    return wrap_dim(d, n) + 1


def def_dims(op, pos, *, all_if_empty=True):
    """``op(self, ..., dim: int[]?, ...)`` with the dim list at position ``pos``."""

    def dims_vmap_rule(interp, args, bdims, kwargs):
        x = to_front(args[0], bdims[0])
        n = x.dim() - 1
        dim = args[pos] if len(args) > pos else kwargs.get("dim")
        if dim is None or (all_if_empty and len(dim) == 0):
            new_dim = list(range(1, n + 1))
        elif isinstance(dim, int):
            new_dim = [_shift(dim, n)]
        else:
            new_dim = [_shift(d, n) for d in dim]
        if n == 0:  # 0-d logical: reduce a unit dim instead, and drop it (torch returns 0-d)
            x, new_dim = x.unsqueeze(1), [1]
        a = list(args)
        a[0] = x
        kw = kwargs
        if len(a) > pos:
            a[pos] = new_dim
        else:
            kw = dict(kwargs)
            kw["dim"] = new_dim
        return _outputs(op(*a, **kw), squeeze=n == 0)

    register_vmap_rule(op)(dims_vmap_rule)


def _outputs(out, squeeze):
    """(out, bdims) with the batch dim in front, for one or several outputs; ``squeeze`` drops
    the unit dim a 0-d logical input was given (when keepdim left it)."""
    if isinstance(out, torch.Tensor):
        return (out.squeeze(1) if squeeze and out.dim() > 1 else out), 0
    return tuple(o.squeeze(1) if squeeze and o.dim() > 1 else o for o in out), (0,) * len(out)


def def_dim(op, pos, *, default=None):
    """``op(self, ..., dim: int, ...)`` with one dim at position ``pos``; for ``int?`` dims
    ``None`` means "over the flattened tensor"."""

    def dim_vmap_rule(interp, args, bdims, kwargs):
        x = to_front(args[0], bdims[0])
        n = x.dim() - 1
        a = list(args)
        dim = args[pos] if len(args) > pos else kwargs.get("dim", default)
        if dim is None:
            x = flat_batch(x)
            new_dim = 1
        else:
            new_dim = _shift(dim, n) if n > 0 else None
            if new_dim is None:  # 0-d logical: add a unit dim, apply, drop it (torch: 0-d)
                x, new_dim = x.unsqueeze(1), 1
        a[0] = x
        if len(a) > pos:
            a[pos] = new_dim
        else:  # keyword (sort.stable's dim is keyword-only) or left to its default
            kwargs = {**kwargs, "dim": new_dim}
        return _outputs(op(*a, **kwargs), squeeze=n == 0 and dim is not None)

    register_vmap_rule(op)(dim_vmap_rule)


# dim lists: (op, position of dim)
for _op, _pos in (
    (aten.sum.dim_IntList, 1),
    (aten.mean.dim, 1),
    (aten.amax.default, 1),
    (aten.amin.default, 1),
    (aten.logsumexp.default, 1),
    (aten.var.correction, 1),
    (aten.std.correction, 1),
    (aten.var_mean.correction, 1),
    (aten.std_mean.correction, 1),
    (aten.linalg_vector_norm.default, 2),
    (aten.nansum.default, 1),
    (aten.any.dims, 1),
    (aten.all.dims, 1),
    (aten.count_nonzero.dim_IntList, 1),
):
    def_dims(_op, _pos)

# one dim: (op, position of dim)
for _op, _pos in (
    (aten.prod.dim_int, 1),
    (aten.max.dim, 1),
    (aten.min.dim, 1),
    (aten.argmax.default, 1),
    (aten.argmin.default, 1),
    (aten.any.dim, 1),
    (aten.all.dim, 1),
):
    def_dim(_op, _pos)


def def_full(op, via):
    """Full reductions (``x.sum()``) become the dim version over every logical dim."""

    def full_vmap_rule(interp, args, bdims, kwargs):
        x = to_front(args[0], bdims[0])
        return via(flat_batch(x), **kwargs), 0

    register_vmap_rule(op)(full_vmap_rule)


def_full(aten.sum.default, lambda x, **kw: aten.sum.dim_IntList(x, [1], False, **kw))
def_full(aten.mean.default, lambda x, **kw: aten.mean.dim(x, [1], False, **kw))
def_full(aten.prod.default, lambda x, **kw: aten.prod.dim_int(x, 1, False, **kw))
def_full(aten.max.default, lambda x: aten.amax.default(x, [1]))
def_full(aten.min.default, lambda x: aten.amin.default(x, [1]))
def_full(aten.any.default, lambda x: aten.any.dim(x, 1))
def_full(aten.all.default, lambda x: aten.all.dim(x, 1))


# torch.distributions' argument checks (`if not torch._is_all_true(valid): raise`) read one Python
# bool under vmap: as in PyTorch, the check spans the whole batch (every example valid) and
# its answer is not batched, so the bool can be read
def def_whole_batch(op):
    def whole_batch_vmap_rule(interp, args, bdims, kwargs):
        return op(args[0], **kwargs), None

    register_vmap_rule(op)(whole_batch_vmap_rule)


def_whole_batch(aten._is_all_true.default)
def_whole_batch(aten._is_any_true.default)
