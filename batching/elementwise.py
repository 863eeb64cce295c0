"""Batching rules for pointwise ops (every op tagged ``torch.Tag.pointwise`` uses one rule).

Note [Batching pointwise ops]
    A pointwise op broadcasts its tensor arguments. With one batched argument and no other tensor
    argument the batch dim can stay where it is. Otherwise every batched argument gets its batch
    dim moved to the front and size-1 dims inserted after it up to the largest logical rank, so
    right-aligned broadcasting lines up logical dims with logical dims and the batch dim with
    the batch dim (unbatched arguments broadcast over it).
"""

from __future__ import annotations

import torch

from ._registry import register_vmap_rule
from ._util import pad_to, to_front

aten = torch.ops.aten


def make_pointwise_rule(func):
    def pointwise_vmap_rule(interp, args, bdims, kwargs):
        n_tensors = 0
        nd = 0
        for a, b in zip(args, bdims):
            if isinstance(a, torch.Tensor):
                n_tensors += 1
                d = a.dim() - (b is not None)
                if d > nd:
                    nd = d
        if n_tensors == 1:  # fast path: the batch dim stays where it is
            return func(*args, **kwargs), next(b for b in bdims if b is not None)
        new = list(args)
        for i, b in enumerate(bdims):
            if b is not None:
                new[i] = pad_to(to_front(args[i], b), nd)
        return func(*new, **kwargs), 0

    return pointwise_vmap_rule


def _same_bdim_rule(func):
    """Ops of one tensor argument that act per element or on metadata only."""

    def same_bdim_vmap_rule(interp, args, bdims, kwargs):
        return func(*args, **kwargs), bdims[0]

    return same_bdim_vmap_rule


for _op in (
    aten.clone.default,
    aten.alias.default,
    aten.detach.default,
    aten._to_copy.default,
    aten.lift_fresh.default,
    aten.empty_like.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.full_like.default,
    aten.resolve_conj.default,
    aten.resolve_neg.default,
    aten._conj.default,
    aten.view_as_real.default,
    aten.view_as_complex.default,
):
    register_vmap_rule(_op)(_same_bdim_rule(_op))


@register_vmap_rule(aten.copy_.default)
def copy__vmap_rule(interp, args, bdims, kwargs):
    """copy_(self, src): broadcast src into the (batched) self."""
    self_, src = args[0], args[1]
    sb = bdims[1]
    dst = to_front(self_, bdims[0])
    dst.copy_(src if sb is None else pad_to(to_front(src, sb), dst.dim() - 1), *args[2:])
    return self_, bdims[0]
